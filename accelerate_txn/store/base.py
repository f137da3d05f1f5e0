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

Reads (manifests, inventories, hashes) go through local paths. A :class:`LocalStore` adds what the transaction
(``core.transaction``) needs of a local tree beyond that: the writers' lock of a parent directory, the staged
directory of one transaction and its publish, the recovery and cleanup of what a killed writer left, the carry of a
user's files, and the in-use holds of a restore. The front ends get one from ``store.local_store()`` and never import
an implementation (tests/project/test_layout.py).

An object store (no rename, no directory, no lock) is behind :class:`ObjectStore`, addressed by URL: the
checkpoint protocol on it (``core.remote``) is written against this interface, and ``store.s3`` implements it.

The content hash every store computes over the bytes it moves (XXH3-128; :func:`hash_file`, :func:`new_hasher`)
lives here, below the core and every store implementation, so that a store verifies what it uploads and
downloads with exactly the function the manifest was written with. So does the table of the optional clients'
floors (:data:`CLIENT_FLOORS`), which the stores, ``core.signing``, the exports and ``accelerate-txn doctor`` share.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import CheckpointConfigurationError, CheckpointIntegrityError

#: The content hash of new manifests (fast, non-cryptographic: it detects corruption, not a forger).
HASH = "xxh3_128"
#: Every content hash a manifest may name (``sha256``: older manifests).
HASHES = ("xxh3_128", "sha256")
_CHUNK = 8 * 1024 * 1024


def new_hasher(algorithm: str = HASH) -> Any:
    """A fresh incremental hasher (``update``, ``hexdigest``) of ``algorithm``."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise CheckpointIntegrityError(f"Unknown content hash {algorithm!r}; this accelerate-txn knows {list(HASHES)}")


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``, never following a symbolic link."""
    try:
        # O_NONBLOCK: a named pipe in a checkpoint must be refused, not block every reader (no effect on files).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CheckpointIntegrityError(f"Checkpoint file {path} is missing") from None
    except OSError as exc:
        raise CheckpointIntegrityError(f"Cannot open checkpoint file {path} ({exc.strerror}): a symbolic link or "
                                       "unreadable entry is not part of a checkpoint") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointIntegrityError(f"Checkpoint entry {path} is not a regular file")
    return fd


def hash_file(path: Path, algorithm: str = HASH, *, flush: bool = False) -> tuple[int, str]:
    """``(size, hex digest)`` of ``path``; with ``flush`` the file is also fsynced (its writer calls this), in a
    second thread while the hash reads it from the page cache, so the pass costs about the slower of the two."""
    digest = new_hasher(algorithm)
    fd = open_regular(Path(path))
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    flushing = ThreadPoolExecutor(max_workers=1) if flush else None
    try:
        synced = flushing.submit(os.fsync, fd) if flushing is not None else None
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as stream:
            while count := stream.readinto(view):
                digest.update(view[:count])
                size += count
        if synced is not None:
            synced.result()  # an fsync failure is raised here
    finally:
        if flushing is not None:
            flushing.shutdown(wait=True)
        os.close(fd)
    return size, digest.hexdigest()


@runtime_checkable
class Store(Protocol):
    """Durable operations on one kind of storage; see the module docstring for the contract of each."""

    #: Short name for messages and the manifest ("posix").
    name: str

    def write_atomic(self, path: Path, data: bytes) -> None:
        """Make ``path`` hold exactly ``data``, durably, or raise leaving ``path`` as it was. Refuses
        (``FileExistsError``) while another write of ``path`` is in progress (POSIX: its temporary exists)."""
        ...

    def retire(self, path: Path, run_id: str, *, keep_if: Callable[[Path], str | None] | None = None) -> Path:
        """Take the published directory ``path`` of run ``run_id`` out of service (durably); returns where its
        content now is, for :meth:`remove_tree`. Refuses with ``CheckpointLockedError``, changing nothing, while a
        restore uses it (POSIX: ``store.posix.InUse``): retention keeps it for the next time. ``keep_if(path)`` is
        asked while nothing can start using it (a reason returned refuses the same way: a quarantine mark written
        after retention listed the directory, ``core.quarantine``)."""
        ...

    def remove_tree(self, path: Path) -> None:
        """Delete ``path`` and everything under it (a link is removed itself, never followed); nothing to do if
        it does not exist."""
        ...


#: The suffix of a directory's in-use lock file (``PARENT/.NAME.in-use``: :meth:`LocalStore.hold_file`).
IN_USE = ".in-use"


def new_id() -> str:
    """A fresh random identifier (32 hex digits) for runs and transactions."""
    return uuid.uuid4().hex


def wait_seconds(value: Any) -> float | None:
    """``value`` as a lock wait in seconds (a finite number >= 0, not a bool), or ``None`` if it is not one."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return None if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0 else seconds


class Lock(Protocol):
    """The writers' lock of one parent directory: at most one live holder; released by the kernel when its holder
    dies (``kill -9`` included)."""

    def acquire(self) -> None:
        """Take it, waiting at most the lock's timeout; ``CheckpointLockedError`` naming the holder's file else."""
        ...

    def release(self) -> None:
        """Let it go (nothing to do if not held)."""
        ...


class Staged(Protocol):
    """One transaction's staging directory ``staging`` (a hidden sibling of ``final``), published atomically."""

    final: Path
    run_id: str
    txid: str

    @property
    def staging(self) -> Path: ...

    def create(self) -> Path:
        """Create ``staging`` while ``final`` does not exist (the caller holds the lock)."""
        ...

    def create_beside(self) -> Path:
        """Create ``staging`` while ``final`` exists and stays in service until a replacing publish."""
        ...

    def publish(self, *, synced: bool = False, replace: bool = False, between: Callable[[], None] | None = None,
                committed: Callable[[], None] | None = None, tree: Path | None = None) -> Path:
        """Rename the staged tree (``tree``: a directory inside ``staging``; default ``staging`` itself) onto
        ``final`` (replacing it as a whole with ``replace``), durably; the commit point."""
        ...

    def discard(self) -> None: ...

    def discard_quietly(self) -> None: ...


class Hold(Protocol):
    """A shared hold on a directory in use (a restore's checkpoint, a cached copy): nothing of this library removes
    or replaces it while held."""

    @property
    def held(self) -> bool: ...

    def acquire(self, timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


@runtime_checkable
class LocalStore(Store, Protocol):
    """A :class:`Store` of local (or shared) directories with what the transaction needs beyond it; see the module
    docstring. ``store.posix.PosixStore`` implements it."""

    def lock(self, parent: Path, timeout: float) -> Lock:
        """The writers' lock of ``parent`` (not yet taken)."""
        ...

    def staged(self, final: Path, run_id: str) -> Staged:
        """A new transaction of run ``run_id`` publishing ``final`` (nothing created yet)."""
        ...

    def create_directory(self, path: Path) -> None:
        """Create ``path`` and its parents; refuse (one library error) a file in the way or a refused mount."""
        ...

    def recover_replaced(self, parent: Path) -> list[Path]:
        """Put back the checkpoints of ``parent`` whose replacement was killed between its two renames."""
        ...

    def staging_leftovers(self, parent: Path) -> list[tuple[Path, str]]:
        """``(path, run id)`` of every staging directory in ``parent``."""
        ...

    def remove_leftovers(self, parent: Path, removable_runs: Iterable[str] | None) -> list[Path]:
        """Remove the staging directories of ``removable_runs`` and every retired leftover in ``parent``."""
        ...

    def fsync_directories(self, root: Path) -> None:
        """fsync every directory of the tree ``root`` (its files were fsynced by their writers)."""
        ...

    def carry_files(self, source: Path, target: Path, names: Iterable[str]) -> None:
        """Put the files ``names`` of ``source`` at the same paths under ``target``, durably."""
        ...

    def write_replacing(self, path: Path, data: bytes) -> None:
        """Make ``path`` hold exactly ``data``, durably, replacing what it held: a temporary name of this writer's
        own, fsynced, renamed onto ``path``, the parent fsynced. Writers racing each other never share a temporary
        (the last rename wins; each leaves a whole file); a killed writer never leaves a partial ``path`` (a
        quarantine mark, ``core.quarantine``)."""
        ...

    def hold(self, path: Path) -> Hold:
        """A hold on the directory ``path`` (not yet taken)."""
        ...

    def claim(self, path: Path) -> AbstractContextManager[bool]:
        """Claim ``path`` for removal without waiting: ``True`` inside the block when no one holds it."""
        ...

    def held(self, lock: Path) -> bool:
        """Whether some process holds the in-use lock file ``lock``."""
        ...

    def hold_file(self, path: Path) -> Path:
        """The in-use lock file of the directory ``path``."""
        ...


#: ``progress(bytes_so_far)``: called after each part an object store acknowledged.
Progress = Callable[[int], None]


@runtime_checkable
class ObjectStore(Protocol):
    """Operations on an object store, by URL (``s3://bucket/key``); see ``store.s3`` for each one's guarantee.
    Keys are "directories" only by convention: ``list(url)`` returns the objects under ``url/``."""

    name: str

    def write_new(self, url: str, data: bytes) -> None:
        """Create ``url`` holding ``data`` only if no object of that key exists (the commit of a manifest);
        ``CheckpointExistsError`` otherwise."""
        ...

    def upload_file(self, local: str | os.PathLike[str], url: str, *, create_only: bool = False,
                    progress: Progress | None = None) -> tuple[int, str]:
        """Upload a local file; ``(size, XXH3-128)`` of exactly the bytes sent."""
        ...

    def download_file(self, url: str, local: str | os.PathLike[str], *, size: int, digest: str | None,
                      sync: bool = True, listed: bool = False) -> None:
        """Download ``url`` onto ``local`` only if it holds ``size`` bytes hashing to ``digest`` (None: size only);
        fsynced unless ``sync=False``; ``listed``: the caller just checked its size in a listing."""
        ...

    def size(self, url: str) -> int | None:
        """The size of the object ``url``; ``None`` if there is none."""
        ...

    def read_bytes(self, url: str, *, limit: int) -> bytes:
        """The content of ``url``, refused if missing or over ``limit`` bytes."""
        ...

    def list(self, url: str) -> dict[str, int]:
        """Every object under ``url/``: key relative to ``url`` -> size."""
        ...

    def delete(self, url: str) -> None:
        """Delete the object ``url`` (acknowledged by the store); nothing to do if there is none."""
        ...

    def delete_prefix(self, url: str, *, first: Sequence[str] = ()) -> int:
        """Delete every object under ``url/``, the keys of ``first`` before the others."""
        ...

    def incomplete_uploads(self, url: str) -> list[str]:
        """Keys under ``url/`` (relative to it) with an upload started and never completed nor aborted."""
        ...

    def abort_incomplete_uploads(self, url: str) -> list[Any]:
        """Abort every incomplete upload under ``url/`` (leftovers of a killed writer)."""
        ...


# --- Optional clients ---------------------------------------------------------------------------------------------

#: The oldest release of each optional client that accelerate-txn runs with, by the extra that installs it: the
#: floors of pyproject.toml's extras (tests/project/test_dependency_floors.py checks that they agree). An older client fails
#: deep inside a call (``'S3FileSystem' object has no attribute 'call_s3'``), so each user checks at first use
#: (:func:`require_clients`) and ``accelerate-txn doctor`` lists each one as missing, too old or ok.
CLIENT_FLOORS: dict[str, dict[str, str]] = {
    "s3": {"s3fs": "2024.12.0", "botocore": "1.35.16"},
    "azure": {"azure-storage-blob": "12.31.1", "azure-core": "1.41.0"},
    "gcs": {"google-cloud-storage": "3.17.1", "google-api-core": "2.44.0", "google-auth": "2.63.0"},
    "signing": {"cryptography": "50.0.2"},
    "model-signing": {"model-signing": "1.1.1", "pyOpenSSL": "26.4.0"},
}


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its metadata, first on ``sys.path``); ``None``: not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def older_than(version: str, floor: str) -> bool:
    """Whether ``version`` is an older release than ``floor`` (a version packaging cannot read is not: the client's
    import and calls then decide)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) < Version(floor)
    except InvalidVersion:
        return False


def require_clients(extra: str, user: str) -> None:
    """Refuse, naming each one, the installed clients of ``extra`` older than their floors (:data:`CLIENT_FLOORS`):
    a ``CheckpointConfigurationError`` saying which release ``user`` (e.g. "the S3 store") needs and how to install
    it. A client that is not installed is the caller's to report, where it imports it."""
    old = {name: (version, floor) for name, floor in CLIENT_FLOORS[extra].items()
           if (version := installed_version(name)) is not None and older_than(version, floor)}
    if old:
        found = "; ".join(f"{name} {version} is older than {floor}" for name, (version, floor) in old.items())
        pins = " ".join(f"'{name}>={floor}'" for name, (_version, floor) in old.items())
        raise CheckpointConfigurationError(
            f"{found}, required by {user}: pip install 'accelerate-txn[{extra}]' (or pip install -U {pins})")
