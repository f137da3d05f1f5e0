"""The on-disk transaction: the directory lock (across real processes, including ``kill -9``), the staging
sibling and its publication, leftover cleanup and fsync of a tree."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from accelerate_txn._staging import (
    LOCK_NAME,
    DirectoryLock,
    StagedDirectory,
    fsync_path,
    fsync_tree,
    new_id,
    remove_leftovers,
    staging_leftovers,
)
from accelerate_txn.errors import CheckpointExistsError, CheckpointLockedError

REPO = Path(__file__).resolve().parents[1]

# Holds DirectoryLock(argv[1]) until a line arrives on stdin (or until it is killed).
_HOLDER = """
import sys
from accelerate_txn._staging import DirectoryLock
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
            _out, err = process.communicate(timeout=30)
            pytest.fail(f"lock holder did not start: {line!r} {err[-2000:]}")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


# --- DirectoryLock ------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
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


@pytest.mark.timeout(120)
def test_lock_of_writer_killed_by_sigkill_is_acquirable_immediately(tmp_path: Path,
                                                                     holder: subprocess.Popen[str]) -> None:
    # Regression: the reference design's O_EXCL lock file survived kill -9 and blocked every later save forever.
    with pytest.raises(CheckpointLockedError):
        DirectoryLock(tmp_path).acquire()  # really held
    holder.kill()  # SIGKILL: no cleanup code runs in the holder
    holder.wait(timeout=30)
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
