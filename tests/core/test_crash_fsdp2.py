"""Crash consistency on FSDP2: a real ``kill -9`` at every named point, of one rank and of the whole job, then restart.

The FSDP1 suite (tests/core/test_crash.py) kills once per named point of ``accelerate_txn.core.faults.POINTS``; here every
point is killed twice on an FSDP2 model (``fsdp_version=2``, ``fully_shard``, DTensor parameters; ranks:
tests/scenarios/crash_fsdp2.py): once **one rank** dies by itself (``NAME@R``: the others must fail on their own, none may
hang; the harness SIGKILLs only what is left after SURVIVOR_TIMEOUT) and once the **whole job** dies (every rank that reaches
the point kills itself, and the harness kills the rest at once, as torchrun does). Points only rank 0 reaches
(``save:after-manifest``, ``save:during-retention``) kill rank 0 in both modes; the modes differ in what the
survivor does.

After each kill the checkpoint directory is checked at file level (every ``checkpoint_N`` present verifies with
every hash, no checkpoint that retention keeps is lost, automatic selection names the newest complete one, i.e.
the previous complete checkpoint stays selected unless the kill came after the rename); then a fresh 2-rank job
restarts: it must select that checkpoint, restore it exactly -- this rank's local shards of every parameter and
of the AdamW state, param groups, scheduler, Python/NumPy/torch RNG and ``accelerator.step``, bitwise against the
reference each rank recorded before that save -- publish the next save and leave no staging or retired leftover.

Amortised start-up (CI budget): the restart after one kill is the run killed at the next point, so the twelve
kills and their restarts take thirteen launches (:data:`CHAIN`). Each launch has the harness's hard deadline
(``LAUNCH_TIMEOUT``: a hung job is killed after its ranks dumped their stacks), the module a backstop pytest
timeout. About 47 s on 2 CPU cores (about 2 minutes while other jobs load them). The random-instant sweep on FSDP2:
``python -m tests.crash_sweep --fsdp-version 2``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.core.faults import POINTS
from accelerate_txn.core.manifest import read_manifest
from tests.scenarios.crash_fsdp2 import ENTRY
from tests.scenarios.crash_harness import (
    KILLED,
    LAUNCH_TIMEOUT,
    SURVIVOR_TIMEOUT,
    Link,
    Outcome,
    restart_problems,
    run_chain,
)
from tests.scenarios.crash_scenarios import ref_path

_NEXT = {"continue": True, "saves": 1, "kill_save": 1}  # restart, save once, be killed in the save after that
# Each restart restores the newest complete checkpoint and publishes the next (retention keeps two); the
# numbers below follow from that and from where each kill lands (``total_limit=2``).
CHAIN: tuple[Link, ...] = (
    # A fresh run saves checkpoint_0 and _1; rank 1 dies in the save of checkpoint_2 after its native save.
    Link("save:after-native-save@1", False, [0, 1], {"fresh": True, "saves": 3, "kill_save": 3}),
    Link("save:after-native-save", True, [1, 2], _NEXT),      # saves 2, killed in 3
    Link("save:during-flush@0", False, [2, 3], _NEXT),         # rank 0 (holding the lock) dies hashing
    Link("save:during-flush", True, [3, 4], _NEXT),
    Link("save:after-manifest@0", False, [4, 5], _NEXT),       # manifest staged, never renamed
    Link("save:after-manifest", True, [5, 6], _NEXT),
    # Rank 1 dies after checkpoint_8 is published; rank 0 still runs retention (checkpoint_6 goes), then fails.
    Link("save:after-rename@1", False, [7, 8], _NEXT),
    Link("save:after-rename", True, [8, 9, 10], _NEXT),        # published, retention not yet run
    # Restart: restores 10, saves 11 (retention removes 8 and 9); rank 0 dies after retiring checkpoint_10.
    Link("save:during-retention@0", False, [11, 12], _NEXT),
    Link("save:during-retention", True, [13, 14], _NEXT),      # retires checkpoint_12
    Link("load:during-restore@0", False, [13, 14]),            # a killed restore changes nothing on disk
    Link("load:during-restore", True, [13, 14]),
)
# The kill at each point before the rename leaves that save unpublished.
UNPUBLISHED_POINTS = ("save:after-native-save", "save:during-flush", "save:after-manifest")

# Thirteen launches, each with its own deadline (LAUNCH_TIMEOUT kills a hung job's ranks after dumping their
# stacks); the pytest timeout is only a backstop above them, so it never interrupts the harness's cleanup.
pytestmark = [pytest.mark.distributed,
              pytest.mark.timeout(int((len(CHAIN) + 1) * (LAUNCH_TIMEOUT + SURVIVOR_TIMEOUT)) + 60)]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: Any) -> tuple[Path, dict[str, Outcome | BaseException]]:
    """Run every kill and restart once (thirteen launches); each test asserts on its link's outcome."""
    directory = tmp_path_factory.mktemp("crash_fsdp2")
    return directory / "run", run_chain(CHAIN, directory, key=lambda link: link.id, entry=ENTRY)


def _outcome(chain: tuple[Path, dict[str, Outcome | BaseException]], link_id: str) -> Outcome:
    outcome = chain[1][link_id]
    if isinstance(outcome, BaseException):
        pytest.fail(f"the FSDP2 crash chain stopped before {link_id} was checked: {outcome}")
    return outcome


def test_every_named_point_is_killed_on_one_rank_and_on_the_whole_job() -> None:
    assert sorted((link.point, link.whole_job) for link in CHAIN) == sorted(
        (point, whole) for point in POINTS for whole in (False, True))
    assert len({link.id for link in CHAIN}) == len(CHAIN)


@pytest.mark.parametrize("link_id", [link.id for link in CHAIN])
def test_fsdp2_kill_9_then_restart_restores_newest_complete_exactly(
        chain: tuple[Path, dict[str, Outcome | BaseException]], link_id: str) -> None:
    _check_kill_and_restart(_outcome(chain, link_id))


def test_fsdp2_whole_job_kill_mid_flush_of_a_fresh_run_then_exact_restart(tmp_path: Path) -> None:
    """One link of :data:`CHAIN` on its own (two launches, not thirteen): the version matrix runs this on every
    FSDP2 row (MATRIX_FSDP2_TESTS) where the whole chain would cost a minute per row."""
    link = Link("save:during-flush", True, [0, 1], {"fresh": True, "saves": 3, "kill_save": 3})
    outcome = run_chain((link,), tmp_path, key=lambda link: link.id, entry=ENTRY)[link.id]
    if isinstance(outcome, BaseException):
        pytest.fail(f"the kill or the restart failed: {outcome}")
    _check_kill_and_restart(outcome)


def _check_kill_and_restart(outcome: Outcome) -> None:
    link, kill = outcome.link, outcome.kill
    # The kill happened where it was meant to: a rank died by SIGKILL at the armed point.
    assert kill.first_dead is not None and kill.returncodes[kill.first_dead] == KILLED, kill.describe()
    if link.killed_rank is not None:
        assert kill.first_dead == link.killed_rank, kill.describe()
        # No rank hangs: the survivor fails on its own (the harness kills only what is left after SURVIVOR_TIMEOUT).
        assert not kill.survivors_killed, f"rank(s) {kill.survivors_killed} hung\n{kill.describe()}"
        assert kill.survivors_exited and all(code != 0 for code in kill.survivors_exited.values()), kill.describe()
    # Right after the kill: nothing published is damaged or lost, selection names the newest complete one.
    assert outcome.problems == [], f"{outcome.problems}\n{kill.describe()}"
    assert outcome.report["complete"] == link.complete_after, outcome.report
    newest = f"checkpoint_{link.complete_after[-1]}"
    assert outcome.report["selected"] == newest, outcome.report
    # The restart selects it, restores it exactly, publishes the next save and removes every leftover.
    assert outcome.restart is not None
    assert restart_problems(outcome.restart.obs, newest) == [], outcome.restart.describe()
    after = outcome.restart.obs[0]["resume"]["after_next_save"]
    assert after["complete"] == [link.complete_after[-1], link.complete_after[-1] + 1], after
    assert after["leftovers"] == [], after


@pytest.mark.parametrize("link_id", [link.id for link in CHAIN if link.point in UNPUBLISHED_POINTS])
def test_fsdp2_save_killed_before_the_rename_is_never_published(
        chain: tuple[Path, dict[str, Outcome | BaseException]], link_id: str) -> None:
    outcome = _outcome(chain, link_id)
    unpublished = outcome.link.complete_after[-1] + 1
    assert unpublished not in outcome.report["complete"], outcome.report
    assert f"checkpoint_{unpublished}" not in outcome.report["broken"], outcome.report
    assert not (chain[0] / "checkpoints" / f"checkpoint_{unpublished}").exists()
    if outcome.link.point == "save:after-manifest":  # a complete-looking manifest, yet only the rename publishes
        staged = [n for n in outcome.report["staged_manifests"] if n.startswith(f".checkpoint_{unpublished}.staging-")]
        assert staged, outcome.report


def test_fsdp2_kill_mid_retention_leaves_a_retired_leftover_that_the_next_save_removes(
        chain: tuple[Path, dict[str, Outcome | BaseException]]) -> None:
    for link_id, retired in (("save:during-retention-rank0", 10), ("save:during-retention-whole-job", 12)):
        outcome = _outcome(chain, link_id)
        assert [n for n in outcome.report["leftovers"] if n.startswith(f".checkpoint_{retired}.deleting-")], \
            outcome.report
        assert f"checkpoint_{retired}" not in outcome.report["broken"]  # never a manifest-less checkpoint_N
    # The two killed restores saved nothing (the leftover is still there); the final restart's save removed it.
    for link_id in ("load:during-restore-rank0", "load:during-restore-whole-job"):
        outcome = _outcome(chain, link_id)
        assert [n for n in outcome.report["leftovers"] if ".deleting-" in n], outcome.report
        assert outcome.restart is not None and outcome.restart.obs[0]["resume"]["after_next_save"]["leftovers"] == []


def test_fsdp2_killed_restore_leaves_the_checkpoint_intact_and_restorable(
        chain: tuple[Path, dict[str, Outcome | BaseException]]) -> None:
    for link_id in ("load:during-restore-rank0", "load:during-restore-whole-job"):
        outcome = _outcome(chain, link_id)
        assert outcome.report["complete"] == [13, 14] and outcome.report["broken"] == {}  # every hash matches
        assert all(obs.get("resume") is None for obs in outcome.kill.obs)  # no rank completed its restore
        assert outcome.restart is not None
        for obs in outcome.restart.obs:
            assert obs["resume"]["selected"] == "checkpoint_14" and obs["resume"]["differences"] == []


def test_fsdp2_exactness_compared_local_shards_with_optimizer_state(
        chain: tuple[Path, dict[str, Outcome | BaseException]]) -> None:
    """The restarts compared something real: each reference holds this rank's plain local shards of every
    parameter (not DTensors) and AdamW state for each, and the restored state matched them on both ranks."""
    root, _outcomes = chain
    final = _outcome(chain, CHAIN[-1].id).restart
    assert final is not None and [obs["resume"]["differences"] for obs in final.obs] == [[], []]
    # The run was FSDP2 and protected: the published checkpoint's manifest describes an FSDP2 model on a 2-rank mesh.
    manifest = read_manifest(root / "checkpoints" / "checkpoint_14")
    assert manifest is not None
    assert [m["fsdp"] for m in manifest["components"][""]["models"]] == [[{"fsdp_version": 2, "mesh": [2]}]]
    for rank in (0, 1):
        reference = torch.load(ref_path(root, 14, rank), weights_only=False)  # our own test file
        params, optim = reference["local"]["params"], reference["local"]["optim"]
        assert params and all(type(t) is torch.Tensor and t.numel() > 0 for t in params.values()), params.keys()
        assert set(optim) == set(params) and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in optim.values())
