"""Where checkpoints live, behind one small interface (:class:`.base.Store`).

:mod:`.base` is the interface the transaction core is written against; :mod:`.posix` is the implementation for
a local or shared POSIX filesystem (atomic rename, fsync, ``flock``). An object store (create-only writes, no
rename, listing by prefix) is the next implementation. This package imports no implementation on its own: the
core imports only :mod:`.base`, and a front end chooses the store.
"""
