"""The transaction on disk: lock, staging sibling, fsync, publish (rename), discard, leftover cleanup.

Pure file logic with no process group: the caller decides which rank runs it (rank 0 for training
checkpoints, the single process for weight exports).

Protocol (see docs/protocol.md):

* Writers of one parent directory serialise on an OS lock (BSD ``flock``) held on ``PARENT/.accelerate-txn.lock``.
  The kernel releases it when the holder dies, even by ``kill -9``, so a killed writer never blocks the next one.
  Two live writers never both hold it. A writer waits a bounded time for it: on NFS or Lustre a client that
  died keeps its lock until the server notices.
* Content is written into a hidden sibling ``PARENT/.NAME.staging-<run>-<txid>`` on the same filesystem (a
  rename across filesystems would be a copy, not a commit).
* Publish = fsync every file and directory of the staging tree, rename it onto ``NAME``, fsync ``PARENT``.
* A staging directory found while holding the lock belongs to a dead writer (a live one would hold the lock).
* Retention retires a published directory by renaming it to a hidden ``PARENT/.NAME.deleting-<run>-<txid>``
  (fsynced) before deleting it, so a crash mid-delete never leaves a manifest-less ``NAME`` behind; such a
  leftover was already retired and is always removed by the next cleanup.
* Replacing a published ``NAME`` (:func:`replace_directory`) swaps the complete staging tree and ``NAME`` with
  one ``renameat2(RENAME_EXCHANGE)`` (Linux), then deletes the old tree, which now sits under the staging name.
  Where the exchange is unsupported, ``NAME`` is first renamed aside to ``PARENT/.NAME.replaced-<txid>``, then
  the staging tree onto ``NAME``; a kill between the two renames leaves the complete old tree aside, which the
  next lock holder renames back (:func:`recover_replaced`).

Why ``fcntl.flock`` and not the ``filelock`` package: the keyword arguments this lock needs (no soft fallback,
keep the lock file, not thread-local) appeared across ``filelock`` releases (older ones raise ``TypeError``), and
on a filesystem without ``flock`` its Unix lock raises a generic error or, by default in 4.x, falls back to a soft
lock that ``kill -9`` leaves behind. ``flock`` is the system call ``filelock`` makes, with no version range to
track, and its errno tells us exactly why it failed.
The library is POSIX-only anyway (it fsyncs directories).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: acquire() explains
    fcntl = None  # type: ignore[assignment]

from ..errors import CheckpointConfigurationError, CheckpointExistsError, CheckpointLockedError
from .base import IN_USE as IN_USE  # re-exported: the in-use lock files' suffix
from .base import new_id as new_id  # re-exported: the ids of the writers' transactions
from .base import wait_seconds
from .mounts import refuse_object_store_mount

logger = logging.getLogger(__name__)

LOCK_NAME = ".accelerate-txn.lock"
STAGING_NAME = re.compile(r"\.(?P<name>.+)\.staging-(?P<run>[0-9a-f]+)-(?P<txid>[0-9a-f]+)\Z")
# Run ids are letters and digits (manifest rule); transaction ids are new_id() hex.
RETIRED_NAME = re.compile(r"\.(?P<name>.+)\.deleting-(?P<run>[0-9A-Za-z]+)-(?P<txid>[0-9a-f]+)\Z")
REPLACED_NAME = re.compile(r"\.(?P<name>.+)\.replaced-(?P<txid>[0-9a-f]+)\Z")
# flock errno meaning "this filesystem cannot lock" (ENOTSUP equals EOPNOTSUPP on Linux, not everywhere).
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
_FIRST_POLL, _LAST_POLL = 0.02, 0.5  # seconds between attempts while another writer holds the lock


def fsync_path(path: Path) -> None:
    """fsync one file or directory (directories are opened read-only, which POSIX allows). ``O_NONBLOCK``: a named
    pipe fails (fsync refuses it) instead of blocking the caller; no effect on files and directories."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def walk_tree(root: Path, *, strict: bool = True) -> Iterator[tuple[Path, list[os.DirEntry[str]]]]:
    """Every directory under ``root`` (``root`` first) with its entries, each directory before everything below it.

    Iterative, with an explicit stack: a tree nested deeper than the interpreter's recursion limit (``os.walk``
    recurses once per level on Python 3.10/3.11) is walked like any other. Never descends into a symbolic link (it is
    listed as an entry of its directory). ``strict``: a directory that cannot be listed raises ``OSError``;
    otherwise it is skipped, as ``os.walk`` does.
    """
    stack = [Path(root)]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError:
            if strict:
                raise
            continue
        yield directory, entries
        for entry in reversed(entries):
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
            except OSError:  # vanished meanwhile
                if strict:
                    raise


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so a published tree survives a power loss (iterative: any
    depth). Every entry that is not a directory is opened and flushed; a link to a directory is not followed."""
    for directory, entries in reversed(list(walk_tree(root))):
        for entry in entries:
            if not entry.is_dir():  # files, and links to anything but a directory (as os.walk lists them)
                fsync_path(Path(entry.path))
        fsync_path(directory)


def fsync_directories(root: Path) -> None:
    """fsync every directory of ``root`` (:func:`walk_tree`: iterative, never follows a symbolic link,
    raises a listing error instead of skipping it), concurrently: the file system can commit them together (one
    journal commit rather than one per directory). Every one has completed, or raised, when this returns: before
    the manifest is written."""
    directories = [directory for directory, _entries in reversed(list(walk_tree(root)))]
    if len(directories) < 2:
        for directory in directories:
            fsync_path(directory)
        return
    with ThreadPoolExecutor(max_workers=min(8, len(directories)), thread_name_prefix="accelerate-txn-fsync") as pool:
        list(pool.map(fsync_path, directories))


_DIRECTORY_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                    | getattr(os, "O_CLOEXEC", 0))


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _clear_entries(fd: int) -> list[str]:
    """Unlink every entry of the directory ``fd`` that is not a directory (files, symbolic links: the link itself,
    never its target); return the names of its subdirectories."""
    subdirectories = []
    with os.scandir(fd) as listing:
        for entry in listing:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subdirectories.append(entry.name)
                    continue
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:  # vanished meanwhile
                continue
    return subdirectories


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything below it (nothing to do if it does not exist).

    Iterative, for any depth: ``shutil.rmtree`` recurses once per level before Python 3.12 and raises
    ``RecursionError`` on a deeply nested tree, which would let one hostile leftover block every save. One directory
    descriptor is open at a time and every name is resolved relative to it, so no path grows past ``PATH_MAX``. Never
    follows a symbolic link: ``path`` itself, or any entry below it, that is a link is unlinked and its target left
    alone; a directory is entered only with ``O_NOFOLLOW``, and each climb back (``..``) is checked against the
    directory it came from.
    """
    path = Path(path)
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (NotADirectoryError: a parent is a file)
        return
    if not stat.S_ISDIR(info.st_mode):  # a file, or a link (to a directory or not): remove the entry itself
        os.unlink(path)
        return
    try:
        fd = os.open(path, _DIRECTORY_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(path)  # replaced by a link or a file since the lstat
        return
    # One frame per directory from ``path`` down to the current one: its name in its parent, its identity, and the
    # subdirectories still to remove (empty: list the directory again; nothing left in it means it is empty).
    stack: list[tuple[str, tuple[int, int], list[str]]] = [("", _identity(fd), [])]
    try:
        while True:
            pending = stack[-1][2]
            if not pending:
                pending.extend(reversed(_clear_entries(fd)))
            if pending:
                name = pending.pop()
                try:
                    child = os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    os.unlink(name, dir_fd=fd)  # replaced by a link or a file meanwhile: remove the entry itself
                    continue
                os.close(fd)
                fd = child
                stack.append((name, _identity(fd), []))
                continue
            # The current directory is empty: climb back to its parent and remove it from there.
            name = stack.pop()[0]
            if not stack:
                os.close(fd)
                fd = -1
                os.rmdir(path)
                return
            parent = os.open("..", _DIRECTORY_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(fd) != stack[-1][1]:
                raise OSError(errno.ESTALE, f"{path} was moved while it was being removed (stopped; nothing outside it "
                              "was touched)")
            os.rmdir(name, dir_fd=fd)
    finally:
        if fd >= 0:
            os.close(fd)


def in_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its parents, from the root down, that exists and is not a directory (a file, a
    link to one, or a dangling link: what stops ``path`` from being created), or ``None``."""
    path = Path(path)
    for candidate in (*reversed(path.parents), path):
        if candidate.is_symlink() and not candidate.is_dir():
            return candidate
        try:
            if not stat.S_ISDIR(os.stat(candidate).st_mode):
                return candidate
        except FileNotFoundError:
            return None
        except OSError:  # unreadable: the mkdir error says why
            return None
    return None


def create_directory(path: Path) -> None:
    """Create the directory ``path`` and its parents (if missing). Raises :class:`CheckpointConfigurationError`
    saying what is in the way (a parent that is a file: ``ENOTDIR``/``EEXIST``) or why it cannot be created, and,
    creating nothing, for a directory on a FUSE mount of an object store (``store.mounts``: no atomic rename there).
    Every writer of checkpoint directories, and :class:`DirectoryLock`, create their directory through here."""
    path = Path(path)
    refuse_object_store_mount(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = in_the_way(path)
        if blocker is not None:
            what = "a symbolic link" if blocker.is_symlink() else "a file"
            raise CheckpointConfigurationError(
                f"Cannot create the output directory {path}: {blocker} is not a directory (it is {what}). Choose an "
                f"output directory whose parents are directories, or move {blocker} away."
            ) from None
        raise CheckpointConfigurationError(
            f"Cannot create the output directory {path} ({exc.strerror}): choose a writable directory."
        ) from None


class DirectoryLock:
    """Exclusive, crash-safe lock on one parent directory (BSD ``flock`` on ``PARENT/.accelerate-txn.lock``).

    ``acquire`` waits up to ``timeout`` seconds while another live writer holds it (logging once that it
    waits), then raises :class:`CheckpointLockedError`; on a filesystem that cannot ``flock`` it raises
    :class:`CheckpointConfigurationError` at once. The constructor only records its arguments (it cannot
    fail, so building the lock on one rank outside a rank phase is safe); every check and every failure is in
    ``acquire``. The lock file is left in place: only the OS lock on it means anything. Not reentrant:
    ``acquire`` on a lock this object already holds does nothing, and one ``release`` frees it.
    """

    def __init__(self, parent: Path, timeout: float = 0.0) -> None:
        self._parent = parent
        self._timeout = timeout
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return Path(self._parent) / LOCK_NAME

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        timeout = self._checked_timeout()
        if fcntl is None:
            raise CheckpointConfigurationError(
                f"Cannot lock {self.path}: accelerate-txn's directory lock needs POSIX flock (Linux, macOS); this "
                "platform has no fcntl module."
            )
        path = self.path
        create_directory(path.parent)
        deadline = time.monotonic() + timeout
        poll = _FIRST_POLL
        while True:
            fd = _open_lock_file(path)
            try:
                if _try_flock(fd, path):
                    if _same_file(fd, path):
                        self._fd, fd = fd, None
                        return
                    continue  # the lock file was deleted or replaced meanwhile: lock the one that is there now
            finally:
                if fd is not None:
                    os.close(fd)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckpointLockedError(self._held_message(timeout))
            if poll == _FIRST_POLL:
                logger.warning("Waiting up to %g s for the lock %s: another writer holds it", timeout, path)
            time.sleep(min(poll, remaining))
            poll = min(poll * 2, _LAST_POLL)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # Unlock explicitly: a child forked while we held it shares the open file description.
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            logger.warning("Unlocking %s failed (%s); closing it releases the lock", self.path, exc)
        finally:
            os.close(fd)

    def _checked_timeout(self) -> float:
        seconds = wait_seconds(self._timeout)
        if seconds is None:
            raise CheckpointConfigurationError(
                f"DirectoryLock({self._parent}, timeout={self._timeout!r}): the wait must be a finite number of "
                "seconds >= 0"
            )
        return seconds

    def _held_message(self, timeout: float) -> str:
        return (
            f"Another writer holds the lock {self.path}: a save into {self.path.parent} is in progress in another "
            f"process (waited {timeout:g} s for it). Wait for that save to finish, or use another output directory. "
            "A writer killed on this machine releases the lock at once; one that died on another node of a shared "
            "filesystem (NFS, Lustre) holds it until the server notices, often tens of seconds: retry, or wait "
            "longer with configure_checkpointing(accelerator, lock_timeout=SECONDS) or "
            "ACCELERATE_TXN_LOCK_TIMEOUT. (The lock file itself is harmless; do not delete it.)"
        )

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open_lock_file(path: Path) -> int:
    # O_RDWR: NFSv4 emulates flock with byte-range locks, and an exclusive one needs a writable descriptor.
    # O_NOFOLLOW: never create or lock a file somewhere else through a planted symlink.
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, flags, 0o666)
    except OSError as exc:
        reason = "it is a symlink; remove it" if exc.errno == errno.ELOOP else "the output directory must be writable"
        raise CheckpointConfigurationError(f"Cannot open the lock file {path} ({exc.strerror}): {reason}.") from None


def _try_flock(fd: int, path: Path) -> bool:
    """Take the exclusive lock without blocking: True if taken, False if another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        if exc.errno in _NO_FLOCK:
            raise CheckpointConfigurationError(
                f"Cannot lock {path}: the filesystem of {path.parent} does not support BSD/POSIX file locks "
                f"(flock failed: {exc.strerror}), so concurrent writers could not be kept apart. Save to a local or "
                "lock-capable filesystem: e.g. mount NFS with working locks (lockd/NLM for NFSv3, i.e. not 'nolock'; "
                "local_lock=none) or Lustre with '-o flock'."
            ) from None
        raise CheckpointConfigurationError(f"Cannot lock {path}: flock failed ({exc.strerror}).") from None
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` locked (a lock on an unlinked inode excludes nobody)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


#: Seconds :meth:`InUse.acquire` waits while a removal or a replacement holds the directory (each is brief).
IN_USE_WAIT = 120.0
#: Seconds :func:`replace_directory` waits for the restores holding a directory in use to end before it refuses.
REPLACE_WAIT = 600.0


def in_use_file(path: Path) -> Path:
    """The lock file of the directory ``path``: ``PARENT/.NAME.in-use`` (beside it, never inside: a checkpoint's
    file set is exactly its inventory)."""
    path = Path(path)
    return path.parent / f".{path.name}{IN_USE}"


def _lock_nb(fd: int, operation: int) -> bool | None:
    """``flock(fd, operation | LOCK_NB)``: True if taken, False if another open file holds it, None if this
    filesystem cannot lock."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        if exc.errno in _NO_FLOCK:
            return None
        raise
    return True


class InUse:
    """A shared hold on the directory ``path`` (a checkpoint being restored, a cached copy, a download in progress):
    BSD ``flock(LOCK_SH)`` on :func:`in_use_file`. While any process holds it, :func:`claim` (the only way this
    library removes or replaces such a directory outside the writers' lock) refuses, so the directory is never
    removed under its user; the kernel releases it when the holder dies (``kill -9`` included), so an abandoned
    directory is never kept forever. Several holders (every rank of every job using it) share it.

    :meth:`acquire` returns ``False`` without holding anything where the lock cannot be taken at all (a read-only
    parent directory, a filesystem without ``flock``): the caller proceeds unprotected, as before this lock existed.
    Not reentrant; one :meth:`release` frees it. The lock file is left in place (:func:`claim` removes it with the
    directory)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = IN_USE_WAIT) -> bool:
        if self._fd is not None:
            return True
        if fcntl is None:
            return False
        lock = in_use_file(self.path)
        deadline = time.monotonic() + timeout
        poll = _FIRST_POLL
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
                             0o666)
            except OSError as exc:
                logger.debug("Cannot open %s (%s): %s is used without an in-use lock", lock, exc.strerror, self.path)
                return False
            try:
                taken = _lock_nb(fd, fcntl.LOCK_SH)
                if taken is None:
                    logger.debug("%s cannot be locked here: %s is used without an in-use lock", lock, self.path)
                    return False
                if taken and _same_file(fd, lock):
                    self._fd, fd = fd, None
                    return True
                if taken:
                    continue  # claimed and removed meanwhile: lock the file that is there now
            finally:
                if fd is not None:
                    os.close(fd)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckpointLockedError(
                    f"{self.path} is being removed or replaced by another process (it holds {lock} exclusively) and "
                    f"did not finish within {timeout:g} s. If no other job uses this directory, remove {lock} and "
                    "retry; give concurrent jobs separate cache directories "
                    "(configure_checkpointing(accelerator, cache_dir=...)).")
            time.sleep(min(poll, remaining))
            poll = min(poll * 2, _LAST_POLL)

    def release(self) -> None:
        """Stop holding it; the lock file is removed too when no one else holds it (nothing is left beside a
        directory no one uses)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        lock = in_use_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
            # Removed only while held exclusively: a process that opened it meanwhile finds it replaced and retries.
            if _lock_nb(fd, fcntl.LOCK_EX) and _same_file(fd, lock):
                lock.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("Unlocking %s failed (%s); closing it releases the lock", lock, exc)
        finally:
            os.close(fd)

    def __enter__(self) -> InUse:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def claim(path: Path) -> Iterator[bool]:
    """Claim the directory ``path`` for removal or replacement, without waiting: yields ``True`` when no process
    holds it in use (:class:`InUse`), holding it exclusively until the block ends (no one can start using it
    meanwhile), and ``False`` when it is in use (the caller must leave it alone). On leaving a claimed block the
    lock file is removed too when ``path`` no longer exists. Where the lock cannot be taken at all (read-only
    directory, no ``flock``) it yields ``True``: nothing here could have marked it in use either."""
    path = Path(path)
    lock = in_use_file(path)
    if fcntl is None:
        yield True
        return
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
                         0o666)
        except OSError:
            yield True
            return
        try:
            taken = _lock_nb(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if taken and not _same_file(fd, lock):
            os.close(fd)
            continue  # removed and created again meanwhile: claim the file that is there now
        break
    try:
        yield taken is not False
    finally:
        try:
            if taken and not path.exists() and not path.is_symlink():
                lock.unlink(missing_ok=True)  # while still held: a holder that opened it sees it replaced and retries
        finally:
            os.close(fd)


def held_in_use(lock: Path) -> bool:
    """Whether some process holds the in-use lock file ``lock`` (a probe: takes and drops it at once)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(lock, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        return _lock_nb(fd, fcntl.LOCK_EX) is False
    finally:
        os.close(fd)


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

    def create_beside(self) -> Path:
        """Create the staging directory while ``final`` exists and stays in service until a replacing
        :meth:`publish` (the caller holds the parent's lock and decided ``final`` may be replaced)."""
        self.staging.mkdir(parents=False, exist_ok=False)
        return self.staging

    def publish(self, *, synced: bool = False, replace: bool = False, between: Callable[[], None] | None = None,
                committed: Callable[[], None] | None = None, tree: Path | None = None) -> Path:
        """fsync the staged tree (unless the caller did: ``synced``), rename it onto ``final`` and fsync the
        parent. Atomic on POSIX. The rename is the commit point: a failure after it is logged, not raised, since
        the directory is published and complete.

        ``tree``: the directory inside ``staging`` that is published (the Trainer's ``checkpoint-N``, written there
        by the native save); default ``staging`` itself. ``replace``: an existing ``final`` is replaced by
        :func:`replace_directory` (``between`` and ``committed`` are its callbacks); without it an existing
        ``final`` is refused."""
        tree = self.staging if tree is None else tree
        if not synced:
            fsync_tree(tree)
        if replace and (self.final.exists() or self.final.is_symlink()):
            replace_directory(tree, self.final, self.txid, between=between, committed=committed)
            return self.final
        if self.final.exists() or self.final.is_symlink():
            raise CheckpointExistsError(f"Checkpoint destination {self.final} appeared while saving; nothing was published.")
        os.rename(tree, self.final)
        try:
            fsync_path(self.final.parent)
        except OSError as exc:
            logger.warning("Published %s, but fsync of %s failed (%s): the new name may not survive a power loss",
                           self.final, self.final.parent, exc)
        return self.final

    def discard(self) -> None:
        """Remove the staging directory if it still exists (never touches ``final``)."""
        remove_tree(self.staging)

    def discard_quietly(self) -> None:
        """:meth:`discard` for a ``finally`` outside any rank phase (rank 0 ending a transaction, after the ranks
        already agreed on its outcome): a failure is logged, never raised, so that it cannot replace the error every
        rank raised, nor fail rank 0 alone after a success. Nothing is lost: a staging directory is never loadable,
        and the next writer under the lock removes it as a dead writer's leftover."""
        try:
            self.discard()
        except OSError as exc:
            logger.warning("Could not remove the staging directory %s (%s): the next save into %s removes it",
                           self.staging, exc, self.final.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def exchange(first: Path, second: Path) -> bool:
    """Atomically swap two existing paths with Linux ``renameat2(RENAME_EXCHANGE)``; ``False`` where that is
    unsupported (another OS, an old libc or kernel, a filesystem without exchange: NFS, some FUSE filesystems),
    so the caller falls back to two renames. Any other failure raises ``OSError``."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # on first use: the offline CLI imports this module

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(code)}", str(first), None, str(second))


def replace_directory(staging: Path, final: Path, txid: str, *, between: Callable[[], None] | None = None,
                      committed: Callable[[], None] | None = None, wait: float | None = None) -> None:
    """Replace the directory ``final`` by the complete, fsynced ``staging`` (same parent; the caller holds the
    parent's lock), then delete the old tree.

    One atomic exchange where supported: afterwards ``staging`` holds the old tree. Elsewhere ``final`` is renamed
    aside to ``.NAME.replaced-<txid>`` (parent fsynced; then ``between()`` runs: a crash point for the tests), and
    ``staging`` onto ``final``; a kill between the two leaves the complete old tree aside, which
    :func:`recover_replaced` puts back. Either way the parent is fsynced before the old tree is deleted (and
    ``committed()`` runs, a crash point too): the replacement is durable first. After the commit nothing raises: a
    failure to fsync the parent or to delete the old tree is logged (the new tree is published).

    ``final`` is replaced only while no process holds it in use (:class:`InUse`: a restore reading it, in this job or
    another): the replacement claims it (:func:`claim`), waiting up to ``wait`` seconds (default
    :data:`REPLACE_WAIT`) for the restores holding it to end, then raises :class:`CheckpointLockedError` with nothing
    changed; the staged tree stays for the caller to discard. A restore never reads a tree swapped under it."""
    final = Path(final)
    limit = REPLACE_WAIT if wait is None else wait
    deadline = time.monotonic() + limit
    poll = _FIRST_POLL
    warned = False
    while True:
        with claim(final) as free:
            if free:
                _replace_claimed(Path(staging), final, txid, between, committed)
                return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CheckpointLockedError(
                f"Cannot replace {final}: a restore in another process holds it in use ({in_use_file(final)}) and "
                f"did not finish within {limit:g} s. Nothing was replaced: {final} is unchanged. Save again when that "
                "restore is over, or save under another name.")
        if not warned:
            logger.warning("Waiting up to %g s to replace %s: a restore in another process reads it", limit, final)
            warned = True
        time.sleep(min(poll, remaining))  # a poll inside the deadline: the holder releases when its restore ends
        poll = min(poll * 2, _LAST_POLL)


def _replace_claimed(staging: Path, final: Path, txid: str, between: Callable[[], None] | None,
                     committed: Callable[[], None] | None) -> None:
    """:func:`replace_directory`'s swap, while ``final`` is claimed (no restore holds it, none can start)."""
    parent = final.parent
    in_use_file(final).unlink(missing_ok=True)  # while claimed: a process opening it meanwhile sees it replaced
    if exchange(staging, final):
        old = Path(staging)
    else:
        old = parent / f".{final.name}.replaced-{txid}"
        os.rename(final, old)
        fsync_path(parent)
        if between is not None:
            between()
        try:
            os.rename(staging, final)
        except BaseException:
            os.rename(old, final)  # put the old tree back before reporting the failure
            raise
    try:
        fsync_path(parent)
    except OSError as exc:
        logger.warning("Published %s, but fsync of %s failed (%s): the replacement may not survive a power loss",
                       final, parent, exc)
    if committed is not None:
        committed()
    try:
        remove_tree(old)
    except OSError as exc:
        logger.warning("Published %s but could not remove the tree it replaced, %s: %s", final, old, exc)


def carry_files(source: Path, target: Path, names: Iterable[str]) -> None:
    """Put the regular files ``names`` (relative) of ``source`` into ``target`` at the same relative paths, durably:
    each is hard-linked where the filesystem allows it (no copy; ``source`` keeps its own link, so the old tree stays
    complete until it is deleted after the replacement commits), else copied; every carried file and every
    directory created for one is fsynced. ``source`` is never changed. Call while holding the parent's lock, before
    the manifest of ``target`` is written."""
    source, target = Path(source), Path(target)
    created: list[Path] = []
    for name in names:
        destination = target / name
        for parent in reversed(destination.relative_to(target).parents[:-1]):
            folder = target / parent
            if not folder.is_dir():
                folder.mkdir()
                created.append(folder)
        origin = source / name
        if not stat.S_ISREG(os.lstat(origin).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (changed while the save ran)", str(origin))
        try:
            os.link(origin, destination, follow_symlinks=False)
        except OSError:  # another filesystem, no hard links, or not allowed (protected_hardlinks): copy it
            shutil.copy2(origin, destination, follow_symlinks=False)
        fsync_path(destination)
    for folder in reversed(created):
        fsync_path(folder)
    if created:
        fsync_path(target)


def replaced_leftovers(parent: Path, name: str | None = None) -> list[Path]:
    """The ``.NAME.replaced-<txid>`` directories under ``parent`` (of ``name`` only, if given), oldest name first."""
    if not Path(parent).is_dir():
        return []
    found = []
    for entry in sorted(Path(parent).iterdir()):
        match = REPLACED_NAME.fullmatch(entry.name)
        if match and (name is None or match.group("name") == name) and entry.is_dir() and not entry.is_symlink():
            found.append(entry)
    return found


def recover_replaced(parent: Path, name: str | None = None) -> list[Path]:
    """Finish what a killed :func:`replace_directory` fallback left under ``parent`` (of ``name`` only, if given).
    Call only while holding ``DirectoryLock(parent)``.

    A ``.NAME.replaced-*`` whose ``NAME`` is missing is the complete old tree of a replacement that never
    committed: it is renamed back (the newest if several). Every other one was replaced already: deleted. Returns
    the paths put back."""
    restored = []
    by_name: dict[str, list[Path]] = {}
    for path in replaced_leftovers(parent, name):
        match = REPLACED_NAME.fullmatch(path.name)
        assert match is not None
        by_name.setdefault(match.group("name"), []).append(path)
    for entry, asides in by_name.items():
        final = Path(parent) / entry
        if not final.exists() and not final.is_symlink():
            aside = asides.pop()  # one at most: the lock holder that found it missing put it back
            logger.warning("Restoring %s from %s: a replacement of it was killed between its two renames", final,
                           aside)
            os.rename(aside, final)
            fsync_path(Path(parent))
            restored.append(final)
        for leftover in asides:
            logger.warning("Removing %s: the tree a completed replacement of %s left behind", leftover, final)
            remove_tree(leftover)
    return restored


def retire(path: Path, run_id: str, *, keep_if: Callable[[Path], str | None] | None = None) -> Path:
    """Take a published directory out of service before deleting it: rename it to the hidden
    ``.NAME.deleting-<run>-<txid>`` in the same parent and fsync the parent; returns the new path.

    After this returns, ``NAME`` no longer exists (durably), so a crash while the caller deletes the returned
    directory leaves only a leftover that :func:`remove_leftovers` removes, never a half-deleted ``NAME``.
    A directory a restore holds in use (:class:`InUse`) is refused with :class:`CheckpointLockedError`, unchanged;
    so is one for which ``keep_if(path)``, asked while it is claimed (no one can start holding it), gives a reason.
    A quarantine writes its mark while holding the directory in use, so either retire finds it held, or it finds
    the mark here, or the quarantine finds the directory gone.
    """
    aside = path.parent / f".{path.name}.deleting-{run_id}-{new_id()}"
    if not RETIRED_NAME.fullmatch(aside.name):
        raise CheckpointConfigurationError(f"Cannot retire {path}: run id {run_id!r} is not letters and digits")
    with claim(path) as free:  # a restore holding it in use (InUse) reads its files until it ends
        if not free:
            raise CheckpointLockedError(f"{path} is in use: a restore in another process holds "
                                        f"{in_use_file(path)}. It was not retired; the next retention retires it.")
        why = keep_if(path) if keep_if is not None else None
        if why is not None:
            raise CheckpointLockedError(f"{path} is kept: {why}. It was not retired.")
        os.rename(path, aside)
        fsync_path(path.parent)
    return aside


def retired_leftovers(parent: Path) -> list[Path]:
    """Every directory under ``parent`` that :func:`retire` renamed aside and nobody finished deleting."""
    if not parent.is_dir():
        return []
    return [entry for entry in sorted(parent.iterdir()) if RETIRED_NAME.fullmatch(entry.name) and entry.is_dir()
            and not entry.is_symlink()]


def staging_leftovers(parent: Path) -> list[tuple[Path, str]]:
    """``(path, run_id)`` of every staging directory under ``parent``."""
    if not parent.is_dir():
        return []
    found = []
    for entry in sorted(parent.iterdir()):
        match = STAGING_NAME.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((entry, match.group("run")))
    return found


def remove_leftovers(parent: Path, removable_runs: Iterable[str] | None) -> list[Path]:
    """Delete dead writers' staging directories and every retired directory whose deletion was interrupted.
    Call only while holding ``DirectoryLock(parent)``.

    ``removable_runs``: the run ids whose staging leftovers may go (``None`` = all). Others are logged and kept.
    Retired directories always go, whatever their run: retention had already taken them out of service.
    Returns the removed paths.
    """
    allowed = None if removable_runs is None else set(removable_runs)
    removed = []
    for path in retired_leftovers(parent):
        logger.warning("Removing %s: a checkpoint retired by retention whose deletion was interrupted", path)
        remove_tree(path)
        removed.append(path)
    for path, run in staging_leftovers(parent):
        if allowed is None or run in allowed:
            logger.warning("Removing %s: staging directory left by a writer that did not finish", path)
            remove_tree(path)
            removed.append(path)
        else:
            logger.warning(
                "Keeping %s: staging leftover of another run (%s) that owns checkpoints here; delete it by hand "
                "once that run is finished", path, run,
            )
    return removed


def write_replacing(path: Path, data: bytes) -> None:
    """Make ``path`` hold exactly ``data``, durably, replacing what it held (``base.LocalStore.write_replacing``):
    written to ``NAME.<id>.tmp`` beside it (create-only, this writer's own), fsynced, renamed onto ``path`` (a link
    there is replaced, never followed), the parent fsynced. A failed write removes its temporary."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{new_id()}.tmp")
    try:
        with temporary.open("xb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class PosixStore:
    """The :class:`~.base.Store` of a local or shared POSIX filesystem: rename is atomic, fsync makes data and
    names durable, ``flock`` serialises writers of one parent directory (:class:`DirectoryLock`)."""

    name = "posix"

    def write_atomic(self, path: Path, data: bytes) -> None:
        """Write ``data`` to ``path + ".tmp"`` (create-only), fsync it, rename it onto ``path`` and fsync the
        parent directory."""
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        with temporary.open("xb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.rename(temporary, path)
        fsync_path(path.parent)

    def retire(self, path: Path, run_id: str, *, keep_if: Callable[[Path], str | None] | None = None) -> Path:
        return retire(path, run_id, keep_if=keep_if)

    def remove_tree(self, path: Path) -> None:
        remove_tree(path)

    # --- What the transaction needs beyond :class:`~.base.Store` (:class:`~.base.LocalStore`) -----------------

    def lock(self, parent: Path, timeout: float) -> DirectoryLock:
        return DirectoryLock(parent, timeout)

    def staged(self, final: Path, run_id: str) -> StagedDirectory:
        return StagedDirectory(final, run_id)

    def create_directory(self, path: Path) -> None:
        create_directory(path)

    def recover_replaced(self, parent: Path) -> list[Path]:
        return recover_replaced(parent)

    def staging_leftovers(self, parent: Path) -> list[tuple[Path, str]]:
        return staging_leftovers(parent)

    def remove_leftovers(self, parent: Path, removable_runs: Iterable[str] | None) -> list[Path]:
        return remove_leftovers(parent, removable_runs)

    def fsync_directories(self, root: Path) -> None:
        fsync_directories(root)

    def carry_files(self, source: Path, target: Path, names: Iterable[str]) -> None:
        carry_files(source, target, names)

    def write_replacing(self, path: Path, data: bytes) -> None:
        write_replacing(path, data)

    def hold(self, path: Path) -> InUse:
        return InUse(path)

    def claim(self, path: Path) -> contextlib.AbstractContextManager[bool]:
        return claim(path)

    def held(self, lock: Path) -> bool:
        return held_in_use(lock)

    def hold_file(self, path: Path) -> Path:
        return in_use_file(path)


#: The one POSIX store (it holds no state).
POSIX = PosixStore()


def _sync_file_range() -> Any:
    """libc ``sync_file_range`` (Linux), or None where there is none."""
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE: list[Any] = []  # resolved on first use (ctypes stays out of import time)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start the kernel's write-back of ``length`` bytes at ``offset`` of the open file ``fd``
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux): asynchronous, it neither waits nor makes anything durable
    (only fsync does); elsewhere, or where the call fails, nothing happens."""
    if not _SYNC_FILE_RANGE:
        _SYNC_FILE_RANGE.append(_sync_file_range())
    if _SYNC_FILE_RANGE[0] is not None:
        _SYNC_FILE_RANGE[0](fd, offset, length, _SYNC_FILE_RANGE_WRITE)
