"""Retention (``prune``) retires a checkpoint by renaming it aside before deleting it, so a crash mid-delete
(a real ``kill -9``) never leaves a manifest-less ``checkpoint_N``; the next save's cleanup finishes the job.

Checkpoints are real: published by ``save_training_checkpoint`` from a single-process Accelerator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from accelerate import Accelerator

from accelerate_txn import MANIFEST, latest_training_checkpoint, save_training_checkpoint
from accelerate_txn.core import faults as _faults
from accelerate_txn.core.select import complete_run_id, numbered_checkpoints, prune, retention_victims
from accelerate_txn.store.posix import POSIX, retire, retired_leftovers
from tests.accelerate.test_save_single import _accelerator as _stepped_accelerator

REPO = Path(__file__).resolve().parents[2]

_PRUNE = """
import sys
from pathlib import Path
from accelerate_txn.core.select import prune
from accelerate_txn.store.posix import POSIX
root = Path(sys.argv[1])
prune(root, sys.argv[2], 1, root / sys.argv[3], store=POSIX)
print("pruned", flush=True)
"""


def _accelerator() -> Accelerator:
    return _stepped_accelerator()[0]  # one stepped single-process Accelerator, as the single-process save tests use


def _published(root: Path, count: int) -> tuple[Accelerator, str]:
    accelerator = _accelerator()
    for number in range(count):
        save_training_checkpoint(accelerator, root / f"checkpoint_{number}")
    run_id = complete_run_id(root / "checkpoint_0")
    assert run_id is not None
    return accelerator, run_id


def _visible(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if not path.name.startswith("."))


def test_retention_renames_aside_before_it_deletes(tmp_path: Path, monkeypatch: Any) -> None:
    # Regression (issue 7 item 12): retention ran rmtree on checkpoint_N in place. The spy sits at the crash
    # point between the rename and the delete and records what a crash there would leave.
    _, run_id = _published(tmp_path, 3)
    seen: list[tuple[list[str], list[Path], bool]] = []

    def spy(name: str) -> None:
        if name == "save:during-retention":
            leftovers = retired_leftovers(tmp_path)
            seen.append((_visible(tmp_path), leftovers, all((path / MANIFEST).is_file() for path in leftovers)))

    monkeypatch.setattr(_faults, "point", spy)
    deleted = prune(tmp_path, run_id, 1, tmp_path / "checkpoint_2", store=POSIX)
    assert deleted == [tmp_path / "checkpoint_0", tmp_path / "checkpoint_1"]
    first, second = seen
    assert first[0] == ["checkpoint_1", "checkpoint_2"]  # checkpoint_0 is gone by name
    assert [path.name.split(".deleting-")[0] for path in first[1]] == [".checkpoint_0"]
    assert first[1][0].name.startswith(f".checkpoint_0.deleting-{run_id}-") and first[2]  # moved whole, not deleted
    assert second[0] == ["checkpoint_2"] and [p.name.split(".deleting-")[0] for p in second[1]] == [".checkpoint_1"]
    assert _visible(tmp_path) == ["checkpoint_2"] and retired_leftovers(tmp_path) == []


@pytest.mark.timeout(300)
def test_kill_during_retention_leaves_no_manifestless_checkpoint_and_next_save_cleans_up(tmp_path: Path) -> None:
    # A real kill -9 (ACCELERATE_TXN_KILL_AT) in the middle of retention: before the fix the directory being
    # deleted kept its checkpoint_N name, lost its manifest first or last, and was skipped and never pruned.
    accelerator, run_id = _published(tmp_path, 3)
    env = {**os.environ, _faults.KILL_ENV: "save:during-retention"}
    done = subprocess.run([sys.executable, "-c", _PRUNE, str(tmp_path), run_id, "checkpoint_2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "pruned" not in done.stdout
    # Every checkpoint_N left is complete; the one being retired is only a hidden leftover.
    remaining = numbered_checkpoints(tmp_path)
    assert [path.name for _, path in remaining] == ["checkpoint_1", "checkpoint_2"]
    assert all(complete_run_id(path) == run_id for _, path in remaining)
    leftovers = retired_leftovers(tmp_path)
    assert [path.name.split(".deleting-")[0] for path in leftovers] == [".checkpoint_0"]
    assert latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint_2")

    # The next save (same run) removes the leftover under the lock and prunes normally.
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_3", checkpoint_limit=2)
    assert retired_leftovers(tmp_path) == []
    assert _visible(tmp_path) == ["checkpoint_2", "checkpoint_3"]


def test_next_save_removes_a_retired_leftover_of_any_run(tmp_path: Path) -> None:
    accelerator, run_id = _published(tmp_path, 2)
    # A leftover as an interrupted retention leaves it, whichever run's (it was already out of service).
    foreign = tmp_path / "checkpoint_9"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "sub" / "shard.bin").write_bytes(b"x" * 100)
    leftovers = [retire(tmp_path / "checkpoint_0", run_id), retire(foreign, "0123abcdOTHERrun")]
    assert sorted(retired_leftovers(tmp_path)) == sorted(leftovers)
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_2")
    assert retired_leftovers(tmp_path) == []
    assert _visible(tmp_path) == ["checkpoint_1", "checkpoint_2"]


def test_the_end_of_a_trainer_run_may_delete_the_newest_only_when_the_kept_best_is_one_of_the_listed(
        tmp_path: Path) -> None:
    # Trainer's end-of-training removal (save_total_limit=1 with a best model) keeps only the best: keep_newest=False.
    listed = [tmp_path / f"checkpoint-{n}" for n in (2, 4, 6)]
    best = listed[0]
    assert retention_victims(listed, 1, keep=[best]) == [listed[1]]  # during training: the newest stays too
    assert retention_victims(listed, 1, keep=[best], keep_newest=False) == listed[1:]
    # A best that is not one of the run's complete, intact checkpoints never costs the run its newest one.
    assert retention_victims(listed, 1, keep=[tmp_path / "elsewhere"], keep_newest=False) == listed[:2]
    assert retention_victims(listed[1:], 1, keep=[best], keep_newest=False) == [listed[1]]
