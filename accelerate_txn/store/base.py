"""The store interface: what the transaction core needs from the place checkpoints live.

The core (``accelerate_txn.core``) decides *what* happens (which files a checkpoint holds, what the manifest
says, which checkpoint is selected, which ones retention removes) and asks a :class:`Store` to make it durable.
Every method is a step of the on-disk protocol (docs/protocol.md) that a store without rename must rebuild
from its own primitives:

* :meth:`Store.write_atomic` is the commit of a manifest: after it returns the file exists completely and
  durably; if it fails, the file is as it was (POSIX: temporary name, fsync, rename, directory fsync; an object store: one
  create-only conditional write, ``If-None-Match: *``).
* :meth:`Store.retire` takes a published checkpoint out of service before it is deleted, so a crash mid-delete
  never leaves a half-deleted checkpoint under its published name (POSIX: rename aside; an object store:
  delete the manifest first).
* :meth:`Store.remove_tree` deletes what was retired or abandoned, at any depth, never following links.

Reads (manifests, inventories, hashes) go through local paths today; the object-store implementation adds
``open``/``list`` here and the core reads through them. Staging, locking and publishing are used by the front
ends directly from the implementation (``store.posix``: ``StagedDirectory``, ``DirectoryLock``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Store(Protocol):
    """Durable operations on one kind of storage; see the module docstring for the contract of each."""

    #: Short name for messages and the manifest ("posix").
    name: str

    def write_atomic(self, path: Path, data: bytes) -> None:
        """Make ``path`` hold exactly ``data``, durably, or raise leaving ``path`` as it was. Refuses
        (``FileExistsError``) while another write of ``path`` is in progress (POSIX: its temporary exists)."""
        ...

    def retire(self, path: Path, run_id: str) -> Path:
        """Take the published directory ``path`` of run ``run_id`` out of service (durably); returns where its
        content now is, for :meth:`remove_tree`."""
        ...

    def remove_tree(self, path: Path) -> None:
        """Delete ``path`` and everything under it (a link is removed itself, never followed); nothing to do if
        it does not exist."""
        ...
