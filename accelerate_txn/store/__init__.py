"""Where checkpoints live, behind one small interface (:class:`.base.Store`).

:mod:`.base` is the interface the transaction core is written against; :mod:`.posix` is the implementation for
a local or shared POSIX filesystem (atomic rename, fsync, ``flock``). :mod:`.s3` holds the operations on
S3-compatible object storage (create-only writes, no rename, listing by prefix) that the object-store
protocol is built from (docs/storage.md); :mod:`.azure` and :mod:`.gcs` the same on Azure Blob Storage and Google
Cloud Storage. This package imports no implementation on its own: the
core imports only :mod:`.base`, and a front end chooses the store.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .base import LocalStore, ObjectStore

_OBJECT_STORES: dict[str, ObjectStore] = {}


def local_store() -> LocalStore:
    """The store of local and shared POSIX directories (``store.posix``): what the front ends and the transaction
    (``core.transaction``) write checkpoints through, by the :class:`~.base.LocalStore` interface."""
    from .posix import POSIX

    return POSIX


def object_store(url: str) -> ObjectStore:
    """The client for ``url``'s scheme (one per process: ``s3://``, ``az://``, ``gs://``), configured from the client
    library's own environment; another scheme is a ``CheckpointConfigurationError``."""
    scheme = url.partition("://")[0]
    store = _OBJECT_STORES.get(scheme)
    if store is None:
        if scheme == "s3":
            from .s3 import S3Store

            store = S3Store()
        elif scheme == "az":
            from .azure import AzureStore

            store = AzureStore()
        elif scheme == "gs":
            from .gcs import GcsStore

            store = GcsStore()
        else:
            from ..errors import CheckpointConfigurationError

            raise CheckpointConfigurationError(f"{url}: accelerate-txn stores checkpoints in S3 (s3://), Azure Blob "
                                               f"(az://) and Google Cloud Storage (gs://) object storage; {scheme}:// "
                                               "is not supported")
        _OBJECT_STORES[scheme] = store
    return store
