"""Crash consistency: real ``kill -9`` at every named phase of a protected save and of a restore, then restart.

Each kill is a real ``SIGKILL`` (``accelerate_txn.core.faults``: the rank kills itself at the named point, so no
``finally`` runs) of one rank or of the whole job, in a real 2-rank FSDP1 training loop on CPU (gloo) with
automatic checkpoint naming and ``total_limit=2`` (retention runs), saving every step. After each kill the
checkpoint directory is checked at file level (every ``checkpoint_N`` present verifies with every hash, no
checkpoint that retention keeps is lost, automatic selection names the newest complete one), then a fresh
2-rank job restarts: it must select that checkpoint, restore parameters, optimizer state, scheduler, RNG and
``accelerator.step`` exactly (against the reference state the killed run recorded before that save), publish
the next save, and leave no staging or retired leftovers after it.

Amortised start-up (CI budget): the restart after one kill is also the run killed at the next point, so the
six kills and their restarts take seven launches (:data:`CHAIN`); the random-instant sweep chains the same way
(``CRASH_SWEEP_TRIALS`` trials, default 3, cost that many launches plus one). Kill modes, one per point:

* ``save:after-native-save@1`` -- one rank (rank 1) dies after its native save into staging; rank 0 must fail
  on its own (no hang) and discards the staging directory;
* ``save:during-flush`` -- the whole job: every rank kills itself after hashing its first file (and the
  harness kills whichever is left, as torchrun does);
* ``save:after-manifest@0`` -- one rank: rank 0 (the only one that writes the manifest) dies between the
  manifest and the rename; the staging directory, manifest included, stays behind and is never selected;
* ``save:after-rename`` -- the whole job, just after the publication: the new checkpoint is selected;
* ``save:during-retention@0`` -- one rank: rank 0 dies after retention renamed the oldest checkpoint aside;
* ``load:during-restore@1`` -- one rank dies mid-restore (models and optimizers loaded, RNG not yet): the
  next job restores the same checkpoint exactly; a killed restore damages nothing.

``make crash-sweep`` runs the random-instant sweep with 50 trials (tests/crash_sweep.py). Cost of this module
on 2 shared CPU cores: about 2 minutes (chain about 1, 3-trial sweep about 1); 3.7 minutes under heavy load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.core.faults import POINTS
from tests.scenarios.crash_harness import (
    KILLED,
    LAUNCH_TIMEOUT,
    SURVIVOR_TIMEOUT,
    Link,
    Outcome,
    restart_problems,
    run_chain,
    summary,
    sweep,
)
from tests.scenarios.crash_scenarios import ASYNC_ENV

_CONTINUE = {"continue": True, "saves": 1, "kill_save": 1}
CHAIN = (
    # A fresh run saves checkpoint_0 and _1; rank 1 dies in the save of checkpoint_2.
    Link("save:after-native-save@1", False, [0, 1], {"fresh": True, "saves": 3, "kill_save": 3}),
    # Each later job restarts (restores, saves the next checkpoint) and is killed in the save after that.
    Link("save:during-flush", True, [1, 2], _CONTINUE),
    Link("save:after-manifest@0", False, [2, 3], _CONTINUE),
    Link("save:after-rename", True, [3, 4, 5], _CONTINUE),
    Link("save:during-retention@0", False, [6, 7], _CONTINUE),
    Link("load:during-restore@1", False, [6, 7], {}),
)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: Any) -> dict[str, Outcome | BaseException]:
    """Run every kill and restart once; each test asserts on its point's outcome."""
    return run_chain(CHAIN, tmp_path_factory.mktemp("crash_chain"), key=lambda link: link.point)


def _outcome(chain: dict[str, Outcome | BaseException], point: str) -> Outcome:
    outcome = chain[point]
    if isinstance(outcome, BaseException):
        pytest.fail(f"the crash chain stopped before {point} was checked: {outcome}")
    return outcome


def test_every_named_crash_point_is_covered() -> None:
    assert sorted(link.point for link in CHAIN) == sorted(POINTS)


@pytest.mark.parametrize("point", [link.point for link in CHAIN])
def test_kill_9_at_named_point_then_restart_restores_newest_complete_exactly(
        chain: dict[str, Outcome | BaseException], point: str) -> None:
    outcome = _outcome(chain, point)
    link, kill = outcome.link, outcome.kill
    # The kill happened where it was meant to: the rank died by SIGKILL at the armed point.
    assert kill.returncodes[kill.first_dead] == KILLED, kill.describe()
    if link.killed_rank is not None:
        assert kill.first_dead == link.killed_rank, kill.describe()
        # No rank hangs: the survivors fail on their own (the harness kills only what is left after SURVIVOR_TIMEOUT).
        assert not kill.survivors_killed, f"rank(s) {kill.survivors_killed} hung\n{kill.describe()}"
        assert all(code != 0 for code in kill.survivors_exited.values()), kill.describe()
    # Right after the kill: nothing published is damaged or lost, selection names the newest complete one.
    assert outcome.problems == [], f"{outcome.problems}\n{kill.describe()}"
    assert outcome.report["complete"] == link.complete_after, outcome.report
    newest = f"checkpoint_{link.complete_after[-1]}"
    assert outcome.report["selected"] == newest
    # The restart selects it, restores it exactly, publishes the next save and removes every leftover.
    assert outcome.restart is not None
    assert restart_problems(outcome.restart.obs, newest) == [], outcome.restart.describe()
    after = outcome.restart.obs[0]["resume"]["after_next_save"]
    assert after["complete"] == [link.complete_after[-1], link.complete_after[-1] + 1], after


def test_killed_save_before_the_rename_is_never_published(chain: dict[str, Outcome | BaseException]) -> None:
    manifest_written = _outcome(chain, "save:after-manifest")
    # The staged directory holds a complete-looking manifest, yet only the rename publishes.
    assert any(".checkpoint_4.staging-" in name for name in manifest_written.report["staged_manifests"])
    for point in ("save:after-native-save", "save:during-flush", "save:after-manifest"):
        outcome = _outcome(chain, point)
        unpublished = outcome.link.complete_after[-1] + 1
        assert unpublished not in outcome.report["complete"]
        assert f"checkpoint_{unpublished}" not in outcome.report["broken"]


def test_kill_mid_retention_leaves_a_retired_leftover_that_the_next_save_removes(
        chain: dict[str, Outcome | BaseException]) -> None:
    outcome = _outcome(chain, "save:during-retention")
    assert [n for n in outcome.report["leftovers"] if n.startswith(".checkpoint_5.deleting-")], outcome.report
    assert "checkpoint_5" not in outcome.report["broken"]  # renamed aside, never a manifest-less checkpoint_5
    restore = _outcome(chain, "load:during-restore")  # nothing was saved by the killed restore
    assert restore.report["leftovers"] == outcome.report["leftovers"]
    assert restore.restart is not None and restore.restart.obs[0]["resume"]["after_next_save"]["leftovers"] == []


def test_killed_restore_leaves_the_checkpoint_intact_and_restorable(chain: dict[str, Outcome | BaseException]) -> None:
    outcome = _outcome(chain, "load:during-restore")
    assert outcome.report["complete"] == [6, 7] and outcome.report["broken"] == {}  # every hash still matches
    assert outcome.kill.obs[0].get("resume") is None  # the killed job never completed a restore
    assert outcome.restart is not None
    for obs in outcome.restart.obs:
        assert obs["resume"]["selected"] == "checkpoint_7" and obs["resume"]["differences"] == []


SWEEP_TRIALS = int(os.environ.get("CRASH_SWEEP_TRIALS", "3"))

# The chain runs every launch in one test's setup, a sweep its trials + 1 launches in one test: each launch has the
# harness's hard deadline (LAUNCH_TIMEOUT, then SURVIVOR_TIMEOUT after a kill), so the pytest timeout is only a
# backstop above them all; it never cuts a slow but progressing run short.
pytestmark = [pytest.mark.distributed,
              pytest.mark.timeout(int((max(len(CHAIN), SWEEP_TRIALS) + 1) * (LAUNCH_TIMEOUT + SURVIVOR_TIMEOUT)) + 60)]


@pytest.mark.parametrize("seed", [20261130])
def test_kill_9_of_the_whole_job_at_random_instants(tmp_path: Path, seed: int) -> None:
    trials = sweep(tmp_path, SWEEP_TRIALS, seed)  # one line per trial: shown if the test fails
    assert len(trials) == SWEEP_TRIALS
    assert [t for t in trials if t.problems] == [], summary(trials)


def test_kill_9_of_the_whole_job_at_random_instants_with_asynchronous_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save asynchronous: kills land in background writes, hashes, publishes and retention too. The newest
    complete checkpoint is still selected and restored exactly; a returned save proves the previous one
    published (crash_invariants), and nothing published is lost."""
    monkeypatch.setenv(ASYNC_ENV, "1")  # the ranks inherit it; the invariants of this process read it
    trials = sweep(tmp_path, SWEEP_TRIALS, 20261201)
    assert len(trials) == SWEEP_TRIALS
    assert [t for t in trials if t.problems] == [], summary(trials)
