"""Crash consistency on FSDP2: real ``kill -9`` at two named points of a protected save, then restart.

The FSDP1 suite (tests/test_crash.py) kills at every named point; FSDP2 shares the same transaction code
(staging, per-rank hash and fsync, manifest, rename, retention), so this short chain covers its two kill modes
on an FSDP2 model (``fsdp_version=2``, DTensor parameters; ranks: tests/_crash_fsdp2.py), with the same harness
and invariants:

* ``save:during-flush`` -- the whole job, every rank after hashing its first file (the harness kills what is
  left, as torchrun does) while saving ``checkpoint_2`` of a fresh run;
* ``save:after-manifest@0`` -- only rank 0, between the manifest and the rename of ``checkpoint_3``; rank 1 must
  fail on its own, without hanging; the staged directory, manifest included, is never selected.

After each kill every ``checkpoint_N`` present verifies with every hash and automatic selection names the
newest complete one; the next job restores it exactly (parameter and optimizer shards, param groups,
scheduler, RNG, ``accelerator.step``, against the reference recorded before that save), publishes the next
save, and leaves no staging leftover. Three launches; each has the harness's hard deadline
(``LAUNCH_TIMEOUT``, which kills the ranks of a hung job), the module a backstop pytest timeout. About 12-20 s
on 2 shared CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn._manifest import read_manifest
from tests._crash_fsdp2 import ENTRY
from tests._crash_harness import (
    KILLED,
    JobResult,
    crash_invariants,
    restart_problems,
    run_to_completion,
    run_until_crash_point,
)
from tests._crash_scenarios import ref_path

# Each launch's own deadline (LAUNCH_TIMEOUT, 240 s) kills its ranks after dumping their stacks; the pytest
# timeout is only a backstop above three of them, so it never interrupts the harness before it cleans up.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(3 * 240 + 60)]

# (kill spec, whole job, spec, complete checkpoints right after the kill)
CHAIN: tuple[tuple[str, bool, dict[str, Any], list[int]], ...] = (
    # A fresh run saves checkpoint_0 and _1; every rank dies in the save of checkpoint_2.
    ("save:during-flush", True, {"fresh": True, "seed": 0, "saves": 3, "kill_save": 3}, [0, 1]),
    # The restart restores checkpoint_1, saves checkpoint_2 (retention keeps 1 and 2); rank 0 dies in the
    # save of checkpoint_3 after writing its manifest.
    ("save:after-manifest@0", False, {"continue": True, "saves": 1, "kill_save": 1}, [1, 2]),
)


@dataclass
class Link:
    kill: JobResult          # the job killed at the armed point
    report: dict[str, Any]   # the checkpoint directory right after the kill (tests/_crash_scenarios.directory_report)
    problems: list[str]      # crash_invariants' violations
    restart: JobResult       # the next job, which restarts from this kill


@pytest.fixture(scope="module")
def chain(tmp_path_factory: Any) -> tuple[Path, list[Link]]:
    """Run both kills and the final restart once (three launches); the run directory and each link's outcome."""
    directory = tmp_path_factory.mktemp("crash_fsdp2")
    root = directory / "run"
    kills = []
    for index, (kill_spec, whole_job, link_spec, _complete) in enumerate(CHAIN):
        spec = {key: value for key, value in link_spec.items() if key != "fresh"}
        spec["kill_spec"] = kill_spec
        spec["fresh" if link_spec.get("fresh") else "resume"] = str(root)
        kill = run_until_crash_point(spec, directory, f"link{index}", whole_job, entry=ENTRY)
        kills.append((kill, *crash_invariants(root)))
    final = run_to_completion({"resume": str(root)}, directory, "final", entry=ENTRY)
    restarts = [kill for kill, _report, _problems in kills[1:]] + [final]
    return root, [Link(*kill, restart) for kill, restart in zip(kills, restarts)]


@pytest.mark.parametrize("index", range(len(CHAIN)), ids=[link[0] for link in CHAIN])
def test_fsdp2_kill_9_then_restart_restores_newest_complete_exactly(chain: tuple[Path, list[Link]],
                                                                    index: int) -> None:
    kill_spec, whole_job, _spec, complete_after = CHAIN[index]
    link = chain[1][index]
    kill, report = link.kill, link.report
    # The kill happened where it was meant to: the rank died by SIGKILL at the armed point.
    assert kill.first_dead is not None and kill.returncodes[kill.first_dead] == KILLED, kill.describe()
    if not whole_job:
        assert kill.first_dead == int(kill_spec.split("@")[1]), kill.describe()
        # No rank hangs: the survivor fails on its own (the harness kills only what is left after 60 s).
        assert not kill.survivors_killed, f"rank(s) {kill.survivors_killed} hung\n{kill.describe()}"
        assert all(code != 0 for code in kill.survivors_exited.values()), kill.describe()
    # Right after the kill: nothing published is damaged or lost, selection names the newest complete one.
    assert link.problems == [], f"{link.problems}\n{kill.describe()}"
    assert report["complete"] == complete_after, report
    newest = f"checkpoint_{complete_after[-1]}"
    assert report["selected"] == newest, report
    unpublished = complete_after[-1] + 1
    assert f"checkpoint_{unpublished}" not in report["broken"], report
    if kill_spec.startswith("save:after-manifest"):  # a complete-looking manifest, yet only the rename publishes
        assert any(n.startswith(f".checkpoint_{unpublished}.staging-") for n in report["staged_manifests"]), report
    # The restart selects it, restores it exactly, publishes the next save and removes every leftover.
    assert restart_problems(link.restart.obs, newest) == [], link.restart.describe()
    after = link.restart.obs[0]["resume"]["after_next_save"]
    assert after["complete"] == [complete_after[-1], unpublished] and after["leftovers"] == [], after


def test_fsdp2_exactness_compared_local_shards_with_optimizer_state(chain: tuple[Path, list[Link]]) -> None:
    """The restarts compared something real: each reference holds this rank's plain local shards of every
    parameter (not DTensors) and AdamW state for each, and the restored state matched them on both ranks."""
    root, links = chain
    # The run was FSDP2 and protected: the published checkpoint's manifest describes an FSDP2 model on a 2-rank mesh.
    manifest = read_manifest(root / "checkpoints" / "checkpoint_3")
    assert manifest is not None
    assert [m["fsdp"] for m in manifest["components"][""]["models"]] == [[{"fsdp_version": 2, "mesh": [2]}]]
    for link in links:
        assert [obs["resume"]["differences"] for obs in link.restart.obs] == [[], []]
    for rank in (0, 1):
        reference = torch.load(ref_path(root, 2, rank), weights_only=False)  # our own test file
        params, optim = reference["local"]["params"], reference["local"]["optim"]
        assert params and all(type(t) is torch.Tensor and t.numel() > 0 for t in params.values()), params.keys()
        assert set(optim) == set(params) and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in optim.values())
