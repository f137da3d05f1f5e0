"""Where checkpoints live, behind one small interface (:class:`.base.Store`).

:mod:`.base` is the interface the transaction core is written against; :mod:`.posix` is the implementation for
a local or shared POSIX filesystem (atomic rename, fsync, ``flock``). :mod:`.s3` holds the operations on
S3-compatible object storage (create-only writes, no rename, listing by prefix) that the object-store
protocol is built from (docs/storage.md); :mod:`.azure` and :mod:`.gcs` the same on Azure Blob Storage and Google
Cloud Storage. This package imports no implementation on its own: the
core imports only :mod:`.base`, and a front end chooses the store.
"""
