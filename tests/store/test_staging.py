"""The on-disk transaction: the directory lock (across real processes, including ``kill -9``), the staging
sibling and its publication, leftover cleanup and fsync of a tree."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.errors import CheckpointConfigurationError, CheckpointExistsError, CheckpointLockedError
from accelerate_txn.store.posix import (
    LOCK_NAME,
    DirectoryLock,
    StagedDirectory,
    fsync_path,
    fsync_tree,
    new_id,
    remove_leftovers,
    retire,
    retired_leftovers,
    staging_leftovers,
)

REPO = Path(__file__).resolve().parents[2]

# Holds DirectoryLock(argv[1]) until a line arrives on stdin (or until it is killed).
_HOLDER = """
import sys
from accelerate_txn.store.posix import DirectoryLock
lock = DirectoryLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock on ``tmp_path``; it has printed "locked" when the fixture yields."""
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=REPO, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the synchronisation point (pytest-timeout bounds a hang)
        if line.strip() != "locked":
            process.kill()
            _out, err = process.communicate(timeout=120)  # hang guards only: a killed process exits at once
            pytest.fail(f"lock holder did not start: {line!r} {err[-2000:]}")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=120)


# --- DirectoryLock ------------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_lock_held_by_another_process_raises_locked_error(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    with pytest.raises(CheckpointLockedError,
                       match=rf"Another writer holds the lock {tmp_path / LOCK_NAME}: a save into {tmp_path} is in"):
        DirectoryLock(tmp_path).acquire()
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "released"
    with DirectoryLock(tmp_path) as lock:  # free again once the other writer released it
        assert lock.path == tmp_path / LOCK_NAME


@pytest.mark.timeout(300)
def test_lock_of_writer_killed_by_sigkill_is_acquirable_immediately(tmp_path: Path,
                                                                     holder: subprocess.Popen[str]) -> None:
    # Regression: the reference design's O_EXCL lock file survived kill -9 and blocked every later save forever.
    with pytest.raises(CheckpointLockedError):
        DirectoryLock(tmp_path).acquire()  # really held
    holder.kill()  # SIGKILL: no cleanup code runs in the holder
    holder.wait(timeout=120)
    assert (tmp_path / LOCK_NAME).exists()  # the file stays; only the OS lock on it meant anything
    lock = DirectoryLock(tmp_path, timeout=0.0)
    lock.acquire()
    lock.release()


def test_two_locks_in_one_process_exclude_each_other(tmp_path: Path) -> None:
    first = DirectoryLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(CheckpointLockedError, match=r"Another writer holds the lock"):
            DirectoryLock(tmp_path).acquire()
    finally:
        first.release()
    with DirectoryLock(tmp_path):
        pass


def test_lock_release_keeps_the_lock_file_and_creates_missing_parent(tmp_path: Path) -> None:
    parent = tmp_path / "new" / "runs"
    with DirectoryLock(parent):
        assert (parent / LOCK_NAME).is_file()
    assert (parent / LOCK_NAME).is_file()
    DirectoryLock(parent).release()  # releasing a lock that is not held is harmless


def _release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "released"


class _Waiting(logging.Handler):
    """Sets ``event`` when DirectoryLock logs that it waits: proof that its first attempt found the lock held."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if record.getMessage().startswith("Waiting up to"):
            self.event.set()


@pytest.fixture
def waiting() -> Iterator[_Waiting]:
    handler = _Waiting()
    logger = logging.getLogger("accelerate_txn.store.posix")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.timeout(300)
def test_lock_waits_for_a_writer_that_releases_within_the_timeout(tmp_path: Path, holder: subprocess.Popen[str],
                                                                  waiting: _Waiting) -> None:
    # Regression (issue 7 item 14): the lock never waited, so a lock still held by a dead NFS/Lustre client
    # failed the save at once. Now acquire() polls up to its timeout. Synchronisation: the holder prints
    # "locked" before we start; our lock logs "Waiting up to" after its first attempt failed; only then does
    # the holder release. No sleep decides the order; the waits below are hang guards a correct run never nears.
    lock = DirectoryLock(tmp_path, timeout=120.0)
    outcome: list[BaseException | None] = []

    def take() -> None:
        try:
            lock.acquire()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert waiting.event.wait(timeout=120), f"acquire() never reported waiting: {waiting.messages} {outcome}"
    assert not lock.is_locked  # still held by the other process
    assert waiting.messages[0] == f"Waiting up to 120 s for the lock {tmp_path / LOCK_NAME}: another writer holds it"
    _release(holder)
    taker.join(timeout=120)
    assert outcome == [None] and lock.is_locked
    with pytest.raises(CheckpointLockedError):  # and it really holds it now
        DirectoryLock(tmp_path).acquire()
    lock.release()


@pytest.mark.timeout(300)
def test_lock_wait_is_bounded_and_the_error_names_lock_wait_and_fix(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    started = time.monotonic()
    with pytest.raises(CheckpointLockedError) as caught:
        DirectoryLock(tmp_path, timeout=0.3).acquire()
    assert time.monotonic() - started >= 0.3
    message = str(caught.value)
    assert message.startswith(f"Another writer holds the lock {tmp_path / LOCK_NAME}: a save into {tmp_path} is in")
    assert "(waited 0.3 s for it)" in message
    assert "configure_checkpointing(accelerator, lock_timeout=SECONDS)" in message
    assert "ACCELERATE_TXN_LOCK_TIMEOUT" in message and "NFS, Lustre" in message


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS])
def test_lock_on_a_filesystem_without_flock_is_an_explained_error(tmp_path: Path, monkeypatch: Any, code: int) -> None:
    # No filesystem here lacks flock (NFS mounted 'nolock', Lustre without '-o flock' do): the errno those
    # return is injected at the one system call.
    attempts: list[int] = []

    def no_flock(fd: int, operation: int) -> None:
        attempts.append(operation)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = DirectoryLock(tmp_path, timeout=3600.0)  # a wait no test run could sit out
    started = time.monotonic()
    with pytest.raises(CheckpointConfigurationError,
                       match=rf"Cannot lock {tmp_path / LOCK_NAME}: the filesystem of {tmp_path} does not support "
                             r"BSD/POSIX file locks") as caught:
        lock.acquire()
    assert attempts == [fcntl.LOCK_EX | fcntl.LOCK_NB]  # refused at the first attempt: never polled, never waited
    assert time.monotonic() - started < 1800  # and so long before the wait could have ended
    assert "Lustre with '-o flock'" in str(caught.value) and "local_lock=none" in str(caught.value)
    assert not lock.is_locked


def test_lock_constructor_never_raises_and_acquire_validates(tmp_path: Path) -> None:
    # Regression (issue 7 item 10): the constructor passed keyword arguments that older filelock releases
    # reject, raising TypeError on rank 0 outside any rank phase (the other ranks hung). Now construction only
    # records its arguments; every failure comes from acquire().
    for timeout in (-1.0, float("nan"), float("inf"), "soon", True):
        lock = DirectoryLock(tmp_path, timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(CheckpointConfigurationError, match=r"the wait must be a finite number of seconds >= 0"):
            lock.acquire()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointConfigurationError, match=rf"Cannot create the output directory {blocker / 'sub'}"):
        DirectoryLock(blocker / "sub").acquire()
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointConfigurationError, match=r"it is a symlink; remove it"):
        DirectoryLock(tmp_path / "linked").acquire()
    assert not (tmp_path / "elsewhere").exists()  # nothing was created through the planted link


@pytest.mark.timeout(300)
def test_lock_works_without_the_filelock_package(tmp_path: Path) -> None:
    # Regression (issue 7 item 10): the lock depended on keyword arguments of recent filelock releases only.
    # It now uses flock itself, so no filelock version (or none at all) can break it.
    script = (
        "import sys; sys.modules['filelock'] = None\n"
        "from accelerate_txn.store.posix import DirectoryLock\n"
        "with DirectoryLock(sys.argv[1], timeout=1.0) as lock: print(lock.is_locked)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=240)  # a hang guard only
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_lock_acquire_twice_on_one_object_is_one_hold(tmp_path: Path) -> None:
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    lock.acquire()
    lock.release()
    assert not lock.is_locked
    with DirectoryLock(tmp_path):  # one release freed it
        pass


# --- StagedDirectory ----------------------------------------------------------------------------------------

def test_staged_directory_is_a_hidden_sibling_named_after_run_and_transaction(tmp_path: Path) -> None:
    staged = StagedDirectory(tmp_path / "checkpoint_3", "abc123", "def456")
    assert staged.staging == tmp_path / ".checkpoint_3.staging-abc123-def456"
    assert staged.create() == staged.staging and staged.staging.is_dir()
    assert not staged.final.exists()


def test_staged_directory_publish_moves_content_onto_final(tmp_path: Path) -> None:
    staged = StagedDirectory(tmp_path / "checkpoint_1", new_id())
    staging = staged.create()
    (staging / "sub").mkdir()
    (staging / "sub" / "weights.bin").write_bytes(b"payload")
    assert staged.publish() == tmp_path / "checkpoint_1"
    assert (tmp_path / "checkpoint_1" / "sub" / "weights.bin").read_bytes() == b"payload"
    assert not staging.exists()


def test_staged_directory_discard_removes_staging_and_never_final(tmp_path: Path) -> None:
    staged = StagedDirectory(tmp_path / "checkpoint_1", new_id())
    (staged.create() / "partial.bin").write_bytes(b"x")
    staged.discard()
    assert not staged.staging.exists()
    staged.discard()  # nothing left: still fine

    published = StagedDirectory(tmp_path / "checkpoint_2", new_id())
    published.create()
    published.publish()
    published.discard()
    assert (tmp_path / "checkpoint_2").is_dir()


def test_staged_directory_refuses_existing_final(tmp_path: Path) -> None:
    (tmp_path / "checkpoint_1").mkdir()
    staged = StagedDirectory(tmp_path / "checkpoint_1", new_id())
    with pytest.raises(CheckpointExistsError, match=rf"Refusing to overwrite {tmp_path / 'checkpoint_1'}: it already"):
        staged.create()
    assert not staged.staging.exists()


def test_staged_directory_publish_refuses_final_that_appeared_meanwhile(tmp_path: Path) -> None:
    staged = StagedDirectory(tmp_path / "checkpoint_1", new_id())
    (staged.create() / "mine.bin").write_bytes(b"mine")
    (tmp_path / "checkpoint_1").mkdir()
    (tmp_path / "checkpoint_1" / "theirs.bin").write_bytes(b"theirs")
    with pytest.raises(CheckpointExistsError, match=r"checkpoint_1 appeared while saving; nothing was published"):
        staged.publish()
    assert sorted(p.name for p in (tmp_path / "checkpoint_1").iterdir()) == ["theirs.bin"]


def test_new_id_is_32_hex_digits_and_fresh() -> None:
    first, second = new_id(), new_id()
    assert len(first) == 32 and int(first, 16) >= 0 and first != second


# --- leftovers ----------------------------------------------------------------------------------------------

def test_remove_leftovers_removes_only_allowed_runs_staging_directories(tmp_path: Path) -> None:
    dead = StagedDirectory(tmp_path / "checkpoint_2", "aaaa", "0001")
    other = StagedDirectory(tmp_path / "checkpoint_3", "bbbb", "0002")
    for staged in (dead, other):
        (staged.create() / "file.bin").write_bytes(b"x")
    (tmp_path / "checkpoint_1").mkdir()
    (tmp_path / ".notes.staging-zz-yy").mkdir()  # not hex: not a staging directory of ours
    (tmp_path / ".checkpoint_4.staging-aaaa-0003").write_text("a file, not a directory")

    assert staging_leftovers(tmp_path) == [(dead.staging, "aaaa"), (other.staging, "bbbb")]
    assert remove_leftovers(tmp_path, {"aaaa"}) == [dead.staging]
    assert not dead.staging.exists()
    assert (other.staging / "file.bin").is_file()
    assert (tmp_path / "checkpoint_1").is_dir() and (tmp_path / ".notes.staging-zz-yy").is_dir()
    assert (tmp_path / ".checkpoint_4.staging-aaaa-0003").is_file()


def test_remove_leftovers_with_none_removes_every_staging_directory(tmp_path: Path) -> None:
    stagings = [StagedDirectory(tmp_path / f"checkpoint_{i}", run, "ff").create() for i, run in enumerate(("a1", "b2"))]
    assert remove_leftovers(tmp_path, None) == stagings
    assert list(tmp_path.iterdir()) == []


def test_remove_leftovers_of_missing_parent_is_empty(tmp_path: Path) -> None:
    assert remove_leftovers(tmp_path / "absent", None) == []


def test_retire_renames_aside_to_a_hidden_deleting_name(tmp_path: Path) -> None:
    (tmp_path / "checkpoint_3" / "sub").mkdir(parents=True)
    (tmp_path / "checkpoint_3" / "sub" / "weights.bin").write_bytes(b"w")
    aside = retire(tmp_path / "checkpoint_3", "Run42")
    assert aside.parent == tmp_path and aside.name.startswith(".checkpoint_3.deleting-Run42-")
    assert not (tmp_path / "checkpoint_3").exists()
    assert (aside / "sub" / "weights.bin").read_bytes() == b"w"
    assert retired_leftovers(tmp_path) == [aside]
    with pytest.raises(CheckpointConfigurationError, match=r"run id '\.\./x' is not letters and digits"):
        retire(tmp_path / "checkpoint_4", "../x")


def test_remove_leftovers_removes_retired_directories_of_any_run(tmp_path: Path) -> None:
    # Regression (issue 7 item 12): a retention interrupted mid-delete must be finished by the next cleanup,
    # whatever the run (a retired directory was already out of service).
    for name in ("checkpoint_1", "checkpoint_2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "part.bin").write_bytes(b"x")
    mine, theirs = retire(tmp_path / "checkpoint_1", "aaaa"), retire(tmp_path / "checkpoint_2", "bbbb")
    kept = StagedDirectory(tmp_path / "checkpoint_5", "bbbb", "0002").create()
    (tmp_path / ".notes.deleting-aaaa-zz").mkdir()  # not a transaction id: not ours
    (tmp_path / ".checkpoint_6.deleting-aaaa-0003").write_text("a file, not a directory")
    assert remove_leftovers(tmp_path, {"aaaa"}) == sorted([mine, theirs])
    assert not mine.exists() and not theirs.exists()
    assert kept.is_dir()  # another run's staging directory is still only reported
    assert (tmp_path / ".notes.deleting-aaaa-zz").is_dir() and (tmp_path / ".checkpoint_6.deleting-aaaa-0003").is_file()
    assert retired_leftovers(tmp_path) == []


# --- fsync --------------------------------------------------------------------------------------------------

def test_fsync_tree_runs_on_nested_tree_and_leaves_it_unchanged(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty").mkdir()
    files = {root / "top.bin": b"1", root / "a" / "mid.bin": b"22", root / "a" / "b" / "c" / "deep.bin": b"333"}
    for path, content in files.items():
        path.write_bytes(content)
    fsync_tree(root)
    assert all(path.read_bytes() == content for path, content in files.items())
    assert (root / "empty").is_dir()


def test_fsync_tree_opens_every_file_entry(tmp_path: Path) -> None:
    # A dangling link cannot be opened: fsync_tree visiting it proves it opens each file, not just directories.
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        fsync_tree(tmp_path)


def test_fsync_path_accepts_a_directory(tmp_path: Path) -> None:
    fsync_path(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "missing")


@pytest.mark.parametrize("frontend", ["accelerate", "trainer"])
def test_a_reservation_under_a_regular_file_fails_with_one_library_error_and_closes_without_raising(
        tmp_path: Path, frontend: str) -> None:
    # Regression (issue 34 item 6): the reservation's mkdir raised a raw FileExistsError, and the cleanup that follows
    # a failed reservation on rank 0 (outside any rank phase) raised NotADirectoryError from the staging path, so rank
    # 0 ended with a different error than the other ranks.
    from accelerate_txn.accelerate.save import transaction as accelerate_transaction
    from accelerate_txn.trainer.save import transaction as trainer_transaction

    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file")
    final = blocker / "run" / "checkpoint-2"
    reservation = (accelerate_transaction(final, "ab12", 0.0) if frontend == "accelerate"
                   else trainer_transaction(final, "ab12"))
    with pytest.raises(CheckpointConfigurationError) as caught:
        reservation.open()
    assert str(caught.value) == (
        f"Cannot create the output directory {final.parent}: {blocker} is not a directory (it is a file). Choose an "
        f"output directory whose parents are directories, or move {blocker} away.")
    reservation.close()  # never raises: it runs outside any rank phase
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"] and blocker.read_text() == "a regular file"
