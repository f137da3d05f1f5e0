"""Protected FSDP1 hybrid sharding (issue 33): HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 4 real gloo ranks on CPU.

The ranks are 2 replicas x 2 shards (``fsdp_accelerator(sharding_strategy=...)``: emulated nodes of 2 ranks; shard
groups {0, 1} and {2, 3}, replica groups {0, 2} and {1, 3}); scenarios in tests/scenarios/hsdp_fsdp1_scenarios.py.

* Same mesh (one launch): a protected save A (and the same state saved asynchronously); DCP writes each replicated
  chunk once (the stored elements add up to one copy of the state); the manifest records the strategy and the grid;
  a copy of A with a damaged payload of a rank of the second replica is refused on every rank before anything
  changes; A restores exactly (parameters, optimizer state, RNG, scheduler).
* Elastic (three launches): A (HYBRID 2x2) -> FULL_SHARD on 4 ranks (re-saved as B) -> _HYBRID_SHARD_ZERO2 2x2
  (re-saved as C); A -> FULL_SHARD on 2 ranks (re-saved as E). A sharding change is refused without
  ``allow_reshard`` (naming it), accepted with it; each re-save is the restored live state, so its consolidated
  model and optimizer equal A's exactly; per-rank state follows the recorded policy.
* kill -9 (two launches): every rank of a HYBRID 2x2 run saving each step is killed mid-save (hashing its files);
  the newest complete checkpoint stays selected, and a restart restores it exactly and saves on.

About 3 to 4 minutes on 2 shared CPU cores (six 4-rank or 2-rank launches, about 30 s each).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn import MANIFEST
from accelerate_txn.core.manifest import read_dcp_metadata
from accelerate_txn.testing import TinyModel, launch
from tests.accelerate.test_elastic import _same_state
from tests.scenarios import crash_harness
from tests.scenarios.crash_harness import KILLED, LAUNCH_TIMEOUT, SURVIVOR_TIMEOUT, Link, restart_problems, run_chain

TIMEOUT = 300  # a hang guard per launch: each took about 30 s on 2 loaded cores
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(4 * TIMEOUT + 60)]
SCENARIOS = "tests.scenarios.hsdp_fsdp1_scenarios"


@pytest.fixture(scope="module")
def same_mesh(tmp_path_factory: Any) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hsdp_fsdp1")
    observed = launch(f"{SCENARIOS}:same_mesh", 4, args=(str(root), "HYBRID_SHARD"), timeout=TIMEOUT)
    return {"root": root, "A": root / "A", "ranks": observed}


@pytest.fixture(scope="module")
def elastic(same_mesh: dict[str, Any]) -> dict[str, Any]:
    root, a = same_mesh["root"], str(same_mesh["A"])
    b, c, e = (str(root / name) for name in ("B", "C", "E"))
    to_full = launch(f"{SCENARIOS}:resume", 4, args=(a, b, None, True), timeout=TIMEOUT)
    to_zero2 = launch(f"{SCENARIOS}:resume", 4, args=(b, c, "_HYBRID_SHARD_ZERO2", True), timeout=TIMEOUT)
    to_two = launch(f"{SCENARIOS}:resume", 2, args=(a, e, None, False), timeout=TIMEOUT)
    return {"to_full": to_full, "to_zero2": to_zero2, "to_two": to_two,
            "paths": {"A": Path(a), "B": Path(b), "C": Path(c), "E": Path(e)}}


def _units(checkpoint: Path) -> list[dict[str, Any]]:
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    return manifest["components"][""]["models"][0]["fsdp"]


def test_hybrid_shard_runs_on_cpu_as_two_replicas_of_two_shards(same_mesh: dict[str, Any]) -> None:
    groups = [obs["groups"] for obs in same_mesh["ranks"]]
    assert [g["shard"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["replicate"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["strategies"] == ["HYBRID_SHARD"] for g in groups)


def test_hybrid_save_is_protected_and_the_manifest_records_strategy_and_grid(same_mesh: dict[str, Any]) -> None:
    assert all(obs["save_error"] is None for obs in same_mesh["ranks"])
    units = _units(same_mesh["A"])
    assert units and all(unit["sharding"] == "HYBRID_SHARD" and unit["hybrid"] == {"replicate": 2, "shard": 2}
                         for unit in units)
    assert json.loads((same_mesh["A"] / MANIFEST).read_text())["components"][""]["world_size"] == 4


def test_an_asynchronous_hybrid_save_holds_the_same_state(same_mesh: dict[str, Any]) -> None:
    assert all(obs["async_error"] is None for obs in same_mesh["ranks"]), [o["async_error"] for o in same_mesh["ranks"]]
    asynchronous = same_mesh["root"] / "A_async"
    assert _units(asynchronous) == _units(same_mesh["A"])
    assert _same_state(same_mesh["A"], asynchronous) == []


def test_a_replicated_chunk_is_written_once(same_mesh: dict[str, Any]) -> None:
    """DCP deduplicates the replicas' identical chunks: the stored elements of every tensor add up to one copy of
    it, every stored byte is a listed item, and both replicas' ranks write payload (the writes are balanced)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    one_copy = sum(p.numel() for p in TinyModel().parameters())
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        directory = same_mesh["A"] / folder
        metadata = read_dcp_metadata(directory)
        tensors = {fqn: entry for fqn, entry in metadata.state_dict_metadata.items()
                   if isinstance(entry, TensorStorageMetadata)}
        stored = {index.fqn: 0 for index in metadata.storage_data}
        for index in metadata.storage_data:
            if index.fqn in tensors:
                chunk = next(c for c in tensors[index.fqn].chunks if list(c.offsets) == list(index.offset))
                stored[index.fqn] += math.prod(chunk.sizes)
        assert all(stored[fqn] == math.prod(entry.size) for fqn, entry in tensors.items()), folder
        files = {path.name: path.stat().st_size for path in directory.glob("*.distcp")}
        assert sum(info.length for info in metadata.storage_data.values()) == sum(files.values())
        assert sorted(files) == [f"__{rank}_0.distcp" for rank in range(4)]
        assert files["__2_0.distcp"] + files["__3_0.distcp"] > 0 and files["__0_0.distcp"] + files["__1_0.distcp"] > 0
        if folder == "pytorch_model_fsdp_0":
            assert sum(math.prod(entry.size) for entry in tensors.values()) == one_copy


def test_a_damaged_payload_of_the_second_replica_is_refused_on_every_rank_before_anything_changes(
        same_mesh: dict[str, Any]) -> None:
    ranks = same_mesh["ranks"]
    damaged = ranks[0]["damaged_file"]
    assert damaged.rsplit("/", 1)[-1].startswith(("__2_", "__3_"))  # written by a rank of the second replica
    for obs in ranks:
        refusal = obs["damaged_refusal"]
        assert refusal is not None and refusal["type"] == "CheckpointIntegrityError", refusal
        assert damaged in refusal["message"] and "does not match its xxh3_128" in refusal["message"]
        assert obs["damaged_changed"] == [] and obs["damaged_rng_untouched"] and obs["damaged_step_untouched"]


def test_a_hybrid_checkpoint_restores_exactly_on_the_same_mesh(same_mesh: dict[str, Any]) -> None:
    ranks = same_mesh["ranks"]
    for obs in ranks:
        assert obs["load_error"] is None, obs["load_error"]
        assert obs["differences"] == [] and obs["optimizer_entries"] > 0
        assert obs["rng_exact"] and obs["step_exact"] and obs["lr_exact"]
    # Each rank restored its own RNG stream (they differ), and training on from the restore keeps replicas equal.
    assert not torch.equal(ranks[0]["rng"], ranks[2]["rng"])
    for left, right in ((0, 2), (1, 3)):
        after = ranks[left]["after_step"], ranks[right]["after_step"]
        assert all(torch.equal(after[0][name], after[1][name]) for name in after[0])


def test_a_sharding_change_is_refused_without_allow_reshard_and_names_it(elastic: dict[str, Any]) -> None:
    for key, saved, live in (("to_full", "HYBRID_SHARD (2 replicas x 2 ranks)", "FULL_SHARD"),
                             ("to_zero2", "FULL_SHARD", "_HYBRID_SHARD_ZERO2 (2 replicas x 2 ranks)")):
        for obs in elastic[key]:
            refusal = obs["refusal"]
            assert refusal["type"] == "CheckpointConfigurationError" and sorted(refusal["failures"]) == [0, 1, 2, 3]
            assert f"saved with FSDP1 sharding {saved} and this run shards with {live}" in refusal["message"]
            assert "allow_reshard=True" in refusal["message"]
            assert obs["untouched"]


@pytest.mark.parametrize("resaved", ["B", "C", "E"])
def test_elastic_resume_across_hybrid_and_full_sharding_restores_exactly(elastic: dict[str, Any], resaved: str) -> None:
    key = {"B": "to_full", "C": "to_zero2", "E": "to_two"}[resaved]
    for obs in elastic[key]:
        assert obs["load_error"] is None and obs["save_error"] is None and obs["finite_after_step"], obs
    assert _same_state(elastic["paths"]["A"], elastic["paths"][resaved]) == []
    expected = {"B": "FULL_SHARD", "C": "_HYBRID_SHARD_ZERO2", "E": "FULL_SHARD"}[resaved]
    assert {unit["sharding"] for unit in _units(elastic["paths"][resaved])} == {expected}
    assert [obs["groups"]["replicate"] for obs in elastic["to_zero2"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_elastic_per_rank_state_follows_the_recorded_policy(same_mesh: dict[str, Any], elastic: dict[str, Any]) -> None:
    saved = same_mesh["ranks"]
    # Same world size (4 -> 4, twice): every rank keeps its own saved RNG; nothing is recorded as resharded.
    for key in ("to_full", "to_zero2"):
        for rank, obs in enumerate(elastic[key]):
            assert torch.equal(obs["rng"], saved[rank]["rng"]) and obs["resharded_from"] is None
    # 4 -> 2: ranks 0 and 1 keep theirs, saved ranks 2 and 3 are dropped, and the next manifest says so.
    for rank, obs in enumerate(elastic["to_two"]):
        assert torch.equal(obs["rng"], saved[rank]["rng"])
    record = elastic["to_two"][0]["resharded_from"][""]
    assert (record["saved_world_size"], record["world_size"], record["sources"], record["dropped"]) == (4, 2, [0, 1],
                                                                                                      [2, 3])


@pytest.mark.timeout(int(2 * (LAUNCH_TIMEOUT + SURVIVOR_TIMEOUT)) + 60)  # two jobs, each with its own deadline
def test_kill_9_mid_save_of_a_hybrid_run_keeps_the_newest_complete_checkpoint_selected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh HYBRID 2x2 run saves checkpoint_0 and _1; every rank is killed while hashing its files of
    checkpoint_2. checkpoint_1 stays the newest complete one and is selected; a restart restores it exactly
    (every rank's shards, optimizer state, scheduler, RNG, step) and publishes the next save."""
    monkeypatch.setattr(crash_harness, "WORLD", 4)
    link = Link("save:during-flush", True, [0, 1], {"fresh": True, "saves": 3, "kill_save": 3})
    outcome = run_chain((link,), tmp_path, key=lambda link: link.id, entry=SCENARIOS)[link.id]
    if isinstance(outcome, BaseException):
        pytest.fail(f"the kill or the restart failed: {outcome}")
    kill = outcome.kill
    assert kill.first_dead is not None and kill.returncodes[kill.first_dead] == KILLED, kill.describe()
    assert outcome.problems == [], f"{outcome.problems}\n{kill.describe()}"
    assert outcome.report["complete"] == [0, 1] and outcome.report["selected"] == "checkpoint_1", outcome.report
    assert outcome.restart is not None and len(outcome.restart.obs) == 4
    assert restart_problems(outcome.restart.obs, "checkpoint_1") == [], outcome.restart.describe()
    after = outcome.restart.obs[0]["resume"]["after_next_save"]
    assert after["complete"] == [1, 2] and after["leftovers"] == [], after
    assert {unit["sharding"] for unit in _units(tmp_path / "run" / "checkpoints" / "checkpoint_2")} == {"HYBRID_SHARD"}
