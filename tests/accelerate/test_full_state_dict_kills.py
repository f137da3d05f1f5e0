"""FSDP ``FULL_STATE_DICT`` (Accelerate's FSDP1 default) killed mid-save: protected, a restart resumes the newest
complete checkpoint bitwise; native (``ACCELERATE_TXN_PATCHES=0``), a restart resumes the half-written one.

* The random-instant sweep (tests/scenarios/crash_harness.py ``sweep``, the invariants of tests/core/test_crash.py) with
  every save an FSDP1 ``FULL_STATE_DICT`` one (3 trials): whole-job ``kill -9`` at seeded instants, then a restart that must
  select the newest complete checkpoint, restore it exactly (each rank's local shards, optimizer state and
  param_groups, scheduler, RNG, step), publish the next save and remove the leftovers. ``python -m tests.crash_sweep
  --state-dict-type FULL_STATE_DICT [--fsdp-version 2]`` draws many.
* FSDP1 and FSDP2 killed at one fixed instant (after the rename), the same exact restart (FSDP2's full restore gives
  ``param_groups``' ``betas`` back as the tuple it saved: torch's restore rebuilds it as a list, the library gives the
  tuple back).
* The same FSDP1 ``FULL_STATE_DICT`` run killed at two fixed instants inside native Accelerate's own writes
  (tests/scenarios/crash_native_full.py: deterministic kill points, no timing), once native and once protected, each
  followed by ``load_state()`` in a fresh run: rank 0 killed halfway through writing ``optimizer.bin`` of the second
  checkpoint, and every rank killed before writing its ``random_states_<rank>.pkl``. Native writes into
  ``checkpoint_1`` itself, so its automatic selection takes the half-written directory: with the torn
  ``optimizer.bin`` it loads that checkpoint's model and then raises, the live model already overwritten; without the
  RNG files it raises nothing and resumes ``checkpoint_1`` without its RNG state (Accelerate skips RNG files it
  cannot read, with an INFO line). Protected, the same kills leave only a hidden staging directory, and the restart
  restores ``checkpoint_0`` exactly.

Real Accelerate, two gloo ranks on CPU (FSDP1's full gather with the harness's fix of torch's CPU-only bugs). Every
launch has the crash harness's deadlines; the pytest timeout is a backstop above them. Cost on 2 idle CPU cores: about
55 s (the 3-trial sweep about 13 s, the fixed kills 12 s, the native/protected contrast 26 s in 8 launches); about
three times that under load.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios.crash_harness import (
    LAUNCH_TIMEOUT,
    POLL,
    SURVIVOR_TIMEOUT,
    Job,
    JobResult,
    Link,
    restart_problems,
    run_chain,
    run_until_crash_point,
    summary,
    sweep,
)
from tests.scenarios.crash_native_full import COMPONENTS, ENTRY
from tests.scenarios.crash_scenarios import STATE_DICT_TYPE_ENV

#: Trials of each FULL_STATE_DICT sweep here (``CRASH_SWEEP_TRIALS`` overrides, as for tests/core/test_crash.py).
SWEEP_TRIALS = int(os.environ.get("CRASH_SWEEP_TRIALS", "3"))
ENTRIES = {1: "tests.scenarios.crash_scenarios", 2: "tests.scenarios.crash_fsdp2"}
#: The kill points of the contrast (tests/scenarios/crash_native_full.py), both in the save of ``checkpoint_1``.
TORN_OPTIMIZER = "native-write:torn:optimizer.bin@0"
BEFORE_RNG = "native-write:before:random_states"
LAUNCHES = 8

pytestmark = [pytest.mark.distributed,
              pytest.mark.timeout(int((max(SWEEP_TRIALS + 1, LAUNCHES)) * (LAUNCH_TIMEOUT + SURVIVOR_TIMEOUT)) + 60)]


def test_full_state_dict_kill_9_of_the_whole_job_at_random_instants(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_DICT_TYPE_ENV, "FULL_STATE_DICT")  # the ranks inherit it
    trials = sweep(tmp_path, SWEEP_TRIALS, 20261208, entry=ENTRIES[1])  # one line per trial: shown on failure
    assert len(trials) == SWEEP_TRIALS
    assert [t for t in trials if t.problems] == [], summary(trials)
    manifest = next((tmp_path / "trial0" / "checkpoints").glob("checkpoint_*/checkpoint_manifest.json"))
    assert '"state_dict_type": "FULL_STATE_DICT"' in manifest.read_text()  # the sweep saved FULL checkpoints



@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_full_state_dict_whole_job_killed_after_the_rename_restarts_from_it_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    # A fixed instant: the whole job killed right after checkpoint_1 was published, before retention. The restart
    # selects it and must restore every part of it bitwise (each rank's shards, optimizer state and param_groups,
    # scheduler, RNG, step), then publish checkpoint_2 and leave nothing behind.
    monkeypatch.setenv(STATE_DICT_TYPE_ENV, "FULL_STATE_DICT")
    link = Link("save:after-rename", True, [0, 1], {"fresh": True, "saves": 2, "kill_save": 2})
    outcome = run_chain((link,), tmp_path, key=lambda link: link.point, entry=ENTRIES[version])[link.point]
    if isinstance(outcome, BaseException):
        pytest.fail(f"the job failed: {outcome}")
    assert outcome.problems == [] and outcome.report["complete"] == link.complete_after, outcome.report
    assert outcome.restart is not None
    assert restart_problems(outcome.restart.obs, "checkpoint_1") == []


# --- native and protected killed at the same instants -----------------------------------------------------------

def _observe(root: Path, directory: Path) -> JobResult:
    """A fresh 2-rank run calls ``load_state()`` on ``root`` and records what it restored
    (``crash_native_full.observe_restart``). A restore that raised on rank 0 leaves rank 1 waiting in a collective
    for it: the job is then killed, as torchrun does when a worker fails."""
    job = Job({"observe": str(root)}, directory, "restart", ENTRY)
    while job.processes[0].poll() is None:
        if time.monotonic() > job.deadline:
            job.kill_all(dump_stacks=True)
            raise AssertionError(f"the restart did not end within {LAUNCH_TIMEOUT:.0f}s\n{job.result().describe()}")
        time.sleep(POLL)
    if job.processes[0].returncode == 0:
        job.wait_all()
    else:
        job.kill_all()
    return job.result()


@pytest.fixture(scope="module")
def contrast(tmp_path_factory: Any) -> dict[tuple[str, str], tuple[JobResult, JobResult]]:
    """For each mode (native, protected) and kill: the killed job and the restart's observations. The run saves
    ``checkpoint_0``, trains a step and is killed in the save of ``checkpoint_1``; every rank ends on its own (killed
    at its point, or failing, or done), so what is on disk is the same on every run."""
    outcomes = {}
    for mode in ("native", "protected"):
        for kill in (TORN_OPTIMIZER, BEFORE_RNG):
            directory = tmp_path_factory.mktemp(f"{mode}-{kill.split(':')[1]}")
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(STATE_DICT_TYPE_ENV, "FULL_STATE_DICT")
                if mode == "native":
                    patch.setenv("ACCELERATE_TXN_PATCHES", "0")
                spec = {"fresh": str(directory / "run"), "seed": 0, "saves": 2, "kill_save": 2, "kill_spec": kill}
                killed = run_until_crash_point(spec, directory, "killed", False, ENTRY)
                outcomes[mode, kill] = killed, _observe(directory / "run", directory)
    return outcomes


def _restart(contrast: dict[tuple[str, str], tuple[JobResult, JobResult]], mode: str, kill: str) -> list[dict]:
    killed, restart = contrast[mode, kill]
    assert killed.returncodes[0] == -9, killed.describe()  # rank 0 died at the kill point, not otherwise
    return restart.obs


def test_native_resumes_the_half_written_checkpoint_and_fails_after_loading_its_model(
        contrast: dict[tuple[str, str], tuple[JobResult, JobResult]]) -> None:
    obs = _restart(contrast, "native", TORN_OPTIMIZER)[0]  # rank 1 waited for rank 0 and was killed
    assert obs["protection"].startswith("NOT protected"), obs["protection"]
    # Native's own directory, under the final name: the model, half of optimizer.bin, rank 1's RNG file (rank 1 went on
    # while rank 0 wrote), no scheduler.bin and no random_states_0.pkl.
    assert obs["entries"]["checkpoint_1"] == ["optimizer.bin", "pytorch_model_fsdp.bin", "random_states_1.pkl"]
    assert obs["error"] is not None  # the torn optimizer.bin
    assert "model" in obs["matches"]["checkpoint_1"]  # ... read after the model of the half-written checkpoint
    assert "optimizer" not in obs["matches"]["checkpoint_0"] + obs["matches"]["checkpoint_1"]


def test_native_silently_resumes_a_checkpoint_killed_before_its_rng_files_without_them(
        contrast: dict[tuple[str, str], tuple[JobResult, JobResult]]) -> None:
    for obs in _restart(contrast, "native", BEFORE_RNG):
        assert obs["entries"]["checkpoint_1"] == ["optimizer.bin", "pytorch_model_fsdp.bin", "scheduler.bin"]
        assert obs["error"] is None  # no error: training would go on
        # Model, optimizer and scheduler of the half-written checkpoint_1, RNG of none: an inexact resume.
        assert {"model", "optimizer", "scheduler"} <= set(obs["matches"]["checkpoint_1"])
        assert "rng" not in obs["matches"]["checkpoint_1"] + obs["matches"]["checkpoint_0"]


@pytest.mark.parametrize("kill", [TORN_OPTIMIZER, BEFORE_RNG], ids=["torn-optimizer", "before-rng"])
def test_protected_the_same_kill_leaves_no_checkpoint_1_and_the_restart_restores_checkpoint_0_exactly(
        contrast: dict[tuple[str, str], tuple[JobResult, JobResult]], kill: str) -> None:
    restart = contrast["protected", kill][1]
    assert restart.returncodes == [0, 0], restart.describe()
    for obs in _restart(contrast, "protected", kill):
        assert obs["protection"] == "protected (accelerate, fsdp1 path)"
        names = sorted(obs["entries"])
        assert len(names) == 2 and names[0].startswith(".checkpoint_1.staging-") and names[1] == "checkpoint_0", names
        assert "checkpoint_manifest.json" in obs["entries"]["checkpoint_0"]
        assert obs["error"] is None
        assert obs["matches"]["checkpoint_0"] == list(COMPONENTS)  # every part, bitwise
