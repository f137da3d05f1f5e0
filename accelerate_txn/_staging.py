"""The transaction on disk: lock, staging sibling, fsync, publish (rename), discard, leftover cleanup.

Pure file logic with no process group: the caller decides which rank runs it (rank 0 for training
checkpoints, the single process for weight exports).

Protocol (see docs/protocol.md):

* Writers of one parent directory serialise on an OS lock (``filelock``; ``flock`` on POSIX) held on
  ``PARENT/.accelerate-txn.lock``. The kernel releases it when the holder dies, even by ``kill -9``, so a
  killed writer never blocks the next one. Two live writers never both hold it.
* Content is written into a hidden sibling ``PARENT/.NAME.staging-<run>-<txid>`` on the same filesystem (a
  rename across filesystems would be a copy, not a commit).
* Publish = fsync every file and directory of the staging tree, rename it onto ``NAME``, fsync ``PARENT``.
* A staging directory found while holding the lock belongs to a dead writer (a live one would hold the lock).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from .errors import CheckpointExistsError, CheckpointLockedError

logger = logging.getLogger(__name__)

LOCK_NAME = ".accelerate-txn.lock"
_STAGING = re.compile(r"\.(?P<name>.+)\.staging-(?P<run>[0-9a-f]+)-(?P<txid>[0-9a-f]+)\Z")


def new_id() -> str:
    """A fresh random identifier (32 hex digits) for runs and transactions."""
    return uuid.uuid4().hex


def fsync_path(path: Path) -> None:
    """fsync one file or directory (directories are opened read-only, which POSIX allows)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so a published tree survives a power loss."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(directory, name))
        fsync_path(Path(directory))


class DirectoryLock:
    """Exclusive, non-blocking, crash-safe lock on one parent directory.

    ``acquire`` raises :class:`CheckpointLockedError` if another live writer holds it (after waiting
    ``timeout`` seconds). The lock file itself is left in place: only the OS lock on it means anything.
    """

    def __init__(self, parent: Path, timeout: float = 0.0) -> None:
        self.path = Path(parent) / LOCK_NAME
        self._timeout = timeout
        # No soft (existence-based) fallback: a soft lock survives kill -9, the defect this replaces. Keep the
        # file: deleting it on release would let a waiter lock an unlinked inode while a newcomer locks a new one.
        self._lock = filelock.FileLock(
            str(self.path), timeout=timeout, thread_local=False, fallback_to_soft=False, preserve_lock_file=True
        )

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise CheckpointLockedError(
                f"Another writer holds the lock {self.path}: a save into {self.path.parent} is in progress in "
                "another process. Wait for it to finish or use another output directory. (A writer that was "
                "killed releases this lock automatically; the file itself is harmless.)"
            ) from None

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class StagedDirectory:
    """One transaction: content is written into ``staging``, then published atomically onto ``final``."""

    final: Path
    run_id: str
    txid: str = field(default_factory=new_id)

    @property
    def staging(self) -> Path:
        return self.final.parent / f".{self.final.name}.staging-{self.run_id}-{self.txid}"

    def create(self) -> Path:
        """Create the staging directory (the caller holds the parent's lock)."""
        if self.final.exists():
            raise CheckpointExistsError(
                f"Refusing to overwrite {self.final}: it already exists. Choose a new directory, or delete it "
                "yourself if it is truly unwanted."
            )
        self.staging.mkdir(parents=False, exist_ok=False)
        return self.staging

    def publish(self, *, synced: bool = False) -> Path:
        """fsync the staged tree (unless the caller did: ``synced``), rename it onto ``final`` and fsync the
        parent. Atomic on POSIX. The rename is the commit point: a failure after it is logged, not raised, since
        the directory is published and complete."""
        if not synced:
            fsync_tree(self.staging)
        if self.final.exists():
            raise CheckpointExistsError(f"Checkpoint destination {self.final} appeared while saving; nothing was published.")
        os.rename(self.staging, self.final)
        try:
            fsync_path(self.final.parent)
        except OSError as exc:
            logger.warning("Published %s, but fsync of %s failed (%s): the new name may not survive a power loss",
                           self.final, self.final.parent, exc)
        return self.final

    def discard(self) -> None:
        """Remove the staging directory if it still exists (never touches ``final``)."""
        if self.staging.exists():
            shutil.rmtree(self.staging)


def staging_leftovers(parent: Path) -> list[tuple[Path, str]]:
    """``(path, run_id)`` of every staging directory under ``parent``."""
    if not parent.is_dir():
        return []
    found = []
    for entry in sorted(parent.iterdir()):
        match = _STAGING.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((entry, match.group("run")))
    return found


def remove_leftovers(parent: Path, removable_runs: Iterable[str] | None) -> list[Path]:
    """Delete dead writers' staging directories. Call only while holding ``DirectoryLock(parent)``.

    ``removable_runs``: the run ids whose leftovers may go (``None`` = all). Others are logged and kept.
    Returns the removed paths.
    """
    allowed = None if removable_runs is None else set(removable_runs)
    removed = []
    for path, run in staging_leftovers(parent):
        if allowed is None or run in allowed:
            logger.warning("Removing %s: staging directory left by a writer that did not finish", path)
            shutil.rmtree(path)
            removed.append(path)
        else:
            logger.warning(
                "Keeping %s: staging leftover of another run (%s) that owns checkpoints here; delete it by hand "
                "once that run is finished", path, run,
            )
    return removed
