"""The transformers Trainer with its default FSDP ``FULL_STATE_DICT`` (FSDP1) killed mid-save: protected,
``resume_from_checkpoint=True`` takes the newest complete checkpoint and ends bitwise equal to the uninterrupted run;
native (``ACCELERATE_TXN_PATCHES=0``), it takes the half-written one.

* One seeded random-instant whole-job ``kill -9`` (tests/scenarios/trainer_kills.py, as the SHARDED draw of
  tests/trainer/test_trainer.py): every ``checkpoint-N`` present complete, every returned save kept, the restart's
  weights, optimizer state and its final checkpoint's whole ``model.safetensors``, ``pytorch_model_fsdp.bin`` and
  ``optimizer.bin`` bitwise those of the uninterrupted run. ``python -m tests.crash_sweep --trainer --state-dict-type
  FULL_STATE_DICT`` draws many.
* A fixed instant inside Trainer's own save of ``checkpoint-4`` (every rank killed right after its model, optimizer
  and scheduler files, before the RNG files and ``trainer_state.json``: the instrumentation point
  ``trainer:after-optimizer`` of tests/scenarios/trainer_scenarios.py), once native and once protected. Native writes
  into ``checkpoint-4`` itself, and ``resume_from_checkpoint=True`` (``get_last_checkpoint``: the highest number)
  takes it and fails on every rank; protected, nothing is published under that name, and the resume from
  ``checkpoint-2`` ends bitwise equal to the uninterrupted run.

Real transformers Trainer, two gloo ranks on CPU (FSDP1's full gather with the harness's fix of torch's CPU-only bugs).
Cost on 2 idle CPU cores: about 45 s (7 launches); about three times that under load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.scenarios.crash_harness import KILLED, Job, run_to_completion, run_until_crash_point
from tests.scenarios.trainer_kills import ENTRY, STEPS, random_kill_trial, reference_run, restart_problems

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]
FULL = "FULL_STATE_DICT"
#: The seed of the random-instant draw (``python -m tests.crash_sweep --trainer --state-dict-type FULL_STATE_DICT
#: --seed S`` replays others).
RANDOM_KILL_SEED = 45
#: Every rank kills itself right after writing its part of checkpoint-4's model, optimizer and scheduler files.
AFTER_OPTIMIZER = "trainer:after-optimizer#2"


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory: Any) -> list[dict[str, Any]]:
    """The uninterrupted FULL_STATE_DICT run to step 8 (checkpoint-6 and -8 kept)."""
    return reference_run(tmp_path_factory.mktemp("full_reference") / "run", FULL)


def test_full_state_dict_trainer_killed_at_a_random_instant_resumes_and_ends_exactly(
        tmp_path: Path, full_reference: list[dict[str, Any]]) -> None:
    where, problems = random_kill_trial(tmp_path, full_reference, RANDOM_KILL_SEED, FULL)
    assert problems == [], where


def _killed_in_checkpoint_4(directory: Path) -> Path:
    """The run to step 8 killed at :data:`AFTER_OPTIMIZER` (each rank at its own point: what is on disk is the same
    on every run); its output directory."""
    root = directory / "run"
    spec = {"output_dir": str(root), "max_steps": STEPS, "fsdp_version": 1, "save_total_limit": 2, "resume": None,
            "state_dict_type": FULL, "kill": AFTER_OPTIMIZER}
    killed = run_until_crash_point(spec, directory, "killed", False, ENTRY)
    assert killed.returncodes == [KILLED, KILLED], killed.describe()
    return root


def test_native_resume_true_takes_the_half_written_checkpoint_and_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "0")  # the ranks inherit it: native Trainer
    root = _killed_in_checkpoint_4(tmp_path)
    # Native's half-written checkpoint-4 under its final name: no RNG files, no trainer_state.json.
    files = sorted(p.name for p in (root / "checkpoint-4").iterdir())
    assert "optimizer.bin" in files and "pytorch_model_fsdp.bin" in files, files
    assert not [name for name in files if name.startswith("rng_state") or name == "trainer_state.json"], files
    spec = {"output_dir": str(root), "max_steps": STEPS, "fsdp_version": 1, "save_total_limit": 2, "resume": True,
            "state_dict_type": FULL}
    job = Job(spec, tmp_path, "restart", ENTRY)
    job.wait_all()
    restart = job.result()
    assert restart.returncodes == [1, 1], restart.describe()  # every rank fails on its own
    missing = f"No such file or directory: '{root / 'checkpoint-4' / 'trainer_state.json'}'"
    assert all(missing in log for log in restart.logs), restart.describe()


def test_protected_the_same_kill_publishes_nothing_and_the_resume_ends_exactly(
        tmp_path: Path, full_reference: list[dict[str, Any]]) -> None:
    root = _killed_in_checkpoint_4(tmp_path)
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert [name for name in names if not name.startswith(".")] == ["checkpoint-2"], names
    spec = {"output_dir": str(root), "max_steps": STEPS, "fsdp_version": 1, "save_total_limit": 2, "resume": True,
            "state_dict_type": FULL}
    restart = run_to_completion(spec, tmp_path, "restart", entry=ENTRY)
    # Began at checkpoint-2 with its optimizer state bitwise; ended with the uninterrupted run's weights, optimizer
    # state and whole FULL files of checkpoint-8; checkpoint-6 and -8 kept, no leftover.
    assert restart_problems(tmp_path, restart, full_reference, [2]) == []
