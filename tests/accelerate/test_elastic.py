"""Elastic resume (issue 9): a checkpoint saved on N ranks resumes on M ranks with ``allow_reshard=True``.

Chain per FSDP version (real gloo process groups of 1, 2 and 3 ranks): save A on 2 ranks; resume A on 1 rank
(first without the opt-in: refused before anything changes) and re-save B1; resume A on 3 ranks, re-save B3;
resume B1 (saved on 1 rank) on 2 ranks, re-save B2. Each re-save is the restored live state, so the consolidated
model and optimizer state of B1, B3 and B2 must equal A's exactly. Per-rank state follows the recorded policy
(``accelerate_txn.accelerate.elastic``): kept, derived for new ranks, dropped with a warning for ranks that are gone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.accelerate.elastic import POLICY
from accelerate_txn.accelerate.rng import derive_rng, derived_seed
from accelerate_txn.testing import launch

TIMEOUT = 240  # a hang guard per launch: each took about 25 s with 2 cores loaded 5 times over
pytestmark = pytest.mark.timeout(5 * TIMEOUT + 60)  # the chain fixture runs five launches in one test's setup


def _consolidated(checkpoint: Path) -> dict[str, Any]:
    """Every DCP entry of the model and optimizer directories as full tensors (offline, no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    result: dict[str, Any] = {}
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        target = checkpoint.parent / f"{checkpoint.name}.{folder}.pt"
        dcp_to_torch_save(checkpoint / folder, target)
        result[folder] = torch.load(target, weights_only=False)
    return result


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)) and not prefix.endswith("params."):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _same_state(a: Path, b: Path) -> list[str]:
    left, right = _flatten(_consolidated(a)), _flatten(_consolidated(b))
    problems = [f"keys differ: {sorted(set(left) ^ set(right))[:5]}"] if set(left) != set(right) else []
    for key in sorted(set(left) & set(right)):
        x, y = left[key], right[key]
        same = (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)) \
            if torch.is_tensor(x) or torch.is_tensor(y) else x == y
        if not same:
            problems.append(key)
    return problems


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def chain(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    version = request.param
    root = tmp_path_factory.mktemp(f"elastic_fsdp{version}")
    a, b1, b3, b2 = (str(root / name) for name in ("A", "B1", "B3", "B2"))
    saved = launch("tests.scenarios.elastic_scenarios:save", 2, args=(version, a), timeout=TIMEOUT)
    on1 = launch("tests.scenarios.elastic_scenarios:resume", 1, args=(version, a, b1, True), timeout=TIMEOUT)
    # rank 2 of 3 is mapped to saved rank 1 (reshard_rank_map); the 1 -> 2 resume below derives a new rank
    on3 = launch("tests.scenarios.elastic_scenarios:resume", 3, args=(version, a, b3, False, {2: 1}), timeout=TIMEOUT)
    on2 = launch("tests.scenarios.elastic_scenarios:resume", 2, args=(version, b1, b2, False), timeout=TIMEOUT)
    same = launch("tests.scenarios.elastic_scenarios:resume", 2, args=(version, a, str(root / "S"), False), timeout=TIMEOUT)
    return {"version": version, "paths": {"A": Path(a), "B1": Path(b1), "B3": Path(b3), "B2": Path(b2)},
            "saved": saved, "on1": on1, "on3": on3, "on2": on2, "same": same}


def test_without_the_opt_in_a_world_size_change_is_refused_before_anything_changes(chain: dict[str, Any]) -> None:
    (rank0,) = chain["on1"]
    name, message = rank0["refusal"]["type"], rank0["refusal"]["message"]
    assert name == "CheckpointConfigurationError"
    assert "saved on 2 ranks" in message and "allow_reshard=True" in message
    assert rank0["untouched"] and rank0["progress_untouched"]


@pytest.mark.parametrize("resharded", ["B1", "B3", "B2"])
def test_consolidated_model_and_optimizer_equal_the_saved_ones(chain: dict[str, Any], resharded: str) -> None:
    paths = chain["paths"]
    assert _same_state(paths["A"], paths[resharded]) == []


def test_shared_state_step_and_schedule_are_restored_on_every_world_size(chain: dict[str, Any]) -> None:
    step, lr = chain["saved"][0]["step"], chain["saved"][0]["lr"]
    for rank in chain["on1"] + chain["on3"] + chain["on2"]:
        assert rank["step"] == step and rank["lr"] == lr
        assert rank["finite_after_step"]


def test_ranks_present_in_both_runs_keep_their_rng_and_private_state(chain: dict[str, Any]) -> None:
    saved = {r["rank"]: r for r in chain["saved"]}
    for rank in chain["on1"] + chain["on3"][:2]:
        own = saved[rank["rank"]]
        assert torch.equal(rank["rng"], own["rng"])
        assert torch.equal(rank["noise"], own["noise"])
        assert rank["progress"] == own["progress"]


def test_a_new_rank_derives_its_generators_and_takes_its_source_ranks_progress(chain: dict[str, Any]) -> None:
    # B1 was saved on 1 rank (the resume on 1 rank seeds torch with 0 before re-saving); resumed on 2 ranks,
    # rank 1 is new: progress copied from saved rank 0, generators derived (not a copy of rank 0's streams)
    rank0, rank1 = chain["on2"]
    saved_rng = torch.manual_seed(0).get_state()
    assert torch.equal(rank0["rng"], saved_rng)
    expected = derive_rng({"torch_manual_seed": saved_rng, "step": 0}, 1)["torch_manual_seed"]
    assert torch.equal(rank1["rng"], expected) and not torch.equal(rank1["rng"], saved_rng)
    assert rank1["progress"] == rank0["progress"] == chain["saved"][0]["progress"]
    noise = torch.Generator().manual_seed(derived_seed(rank0["noise"], 1, "noise"))
    assert torch.equal(rank1["noise"], noise.get_state()) and not torch.equal(rank1["noise"], rank0["noise"])


def test_a_rank_map_gives_a_new_rank_a_saved_ranks_state_exactly(chain: dict[str, Any]) -> None:
    mapped, source = chain["on3"][2], chain["saved"][1]
    assert torch.equal(mapped["rng"], source["rng"]) and torch.equal(mapped["noise"], source["noise"])
    assert mapped["progress"] == source["progress"]


def test_the_policy_and_the_resharding_are_recorded_in_the_next_manifest(chain: dict[str, Any]) -> None:
    (rank0,) = chain["on1"]
    assert rank0["rank_state"]["policy"] == POLICY
    assert "dataloader_states_{rank}.pt" in rank0["rank_state"]["files"]
    record = rank0["resharded_from"][""]
    assert record["checkpoint"] == str(chain["paths"]["A"])
    assert (record["saved_world_size"], record["world_size"], record["dropped"]) == (2, 1, [1])
    three = chain["on3"][0]["resharded_from"][""]
    assert (three["sources"], three["derived"], three["dropped"]) == ([0, 1, 1], [], [])
    two = chain["on2"][0]["resharded_from"][""]
    assert (two["saved_world_size"], two["sources"], two["derived"]) == (1, [0, 0], [1])


def test_per_rank_data_loader_state_is_saved_per_rank_not_by_the_last_writer(chain: dict[str, Any]) -> None:
    paths = chain["paths"]
    files = sorted(p.name for p in paths["A"].glob("dataloader_states_*.pt"))
    assert files == ["dataloader_states_0.pt", "dataloader_states_1.pt"]
    states = [torch.load(paths["A"] / name, weights_only=True)["loaders"][0] for name in files]
    assert states[0] != states[1]  # rank 1 consumed one more batch than rank 0
    # Resumed on the same 2 ranks, each rank's loader goes on from its own position: rank r's k-th batch starts
    # at 4k + 2r, and rank 1 is one batch ahead of rank 0 (with one shared file both would be at one position).
    position = [resumed["next_batch"][0] // 4 for resumed in chain["same"]]
    assert position[1] - position[0] == 1
    assert all(resumed["resharded_from"] is None for resumed in chain["same"])
    from accelerate.data_loader import DataLoaderShard

    if "adjust_state_dict_for_prefetch" in vars(DataLoaderShard):
        # Accelerate releases that no longer shift a DataLoaderShard's saved position back by (ranks - 1)
        # batches (1.7 does, for native and protected saves alike) resume exactly where each rank stopped
        assert [r["next_batch"] for r in chain["same"]] == [r["next_batch"] for r in chain["saved"]]


def test_a_legacy_native_checkpoint_resumes_elastically_with_its_world_size_from_its_rng_files(
        tmp_path: Path) -> None:
    native, resumed = tmp_path / "native", tmp_path / "resumed"
    saved = launch("tests.scenarios.elastic_scenarios:save", 2, args=(1, str(native), True), timeout=TIMEOUT)
    assert not (native / "checkpoint_manifest.json").exists() and (native / "random_states_1.pkl").exists()
    (rank0,) = launch("tests.scenarios.elastic_scenarios:resume", 1, args=(1, str(native), str(resumed), True),
                      timeout=TIMEOUT)
    # without the opt-in the world-size change is refused, though native Accelerate would load it silently
    assert rank0["refusal"]["type"] == "CheckpointConfigurationError" and rank0["untouched"]
    assert "RNG state for 2 ranks" in rank0["refusal"]["message"] and "allow_reshard=True" in rank0["refusal"]["message"]
    assert torch.equal(rank0["rng"], saved[0]["rng"]) and rank0["progress"] == saved[0]["progress"]
    assert rank0["resharded_from"][""]["saved_world_size"] == 2
    assert _same_state(native, resumed) == []


def test_cli_inspect_shows_the_lineage_and_diff_allows_the_world_size_change_only_when_asked(
        chain: dict[str, Any]) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "accelerate_txn", *args], capture_output=True, text=True,
                              timeout=120)

    paths = chain["paths"]
    shown = cli("inspect", str(paths["B1"]))
    assert shown.returncode == 0, shown.stderr
    assert f"resumed elastically from {paths['A']}: 2 -> 1 ranks" in shown.stdout
    assert POLICY in shown.stdout
    refused = cli("diff", str(paths["A"]), str(paths["B3"]))
    assert refused.returncode == 1 and "world_size: 2 (saved) vs 3 (live)" in refused.stdout
    allowed = cli("diff", "--allow-reshard", str(paths["A"]), str(paths["B3"]))
    assert allowed.returncode == 0, allowed.stdout


def test_fsdp1_flat_parameters_and_another_optimizer_reshard_exactly_2_to_3(tmp_path: Path) -> None:
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    launch("tests.scenarios.elastic_scenarios:save", 2, args=(1, str(saved), False, "rmsprop-flat"), timeout=TIMEOUT)
    ranks = launch("tests.scenarios.elastic_scenarios:resume", 3, args=(1, str(saved), str(resumed), False, None,
                                                               "rmsprop-flat"), timeout=TIMEOUT)
    assert all(rank["finite_after_step"] for rank in ranks)
    flat = _flatten(_consolidated(saved))
    assert any(key.endswith("square_avg") for key in flat) and any(key.endswith("grad_avg") for key in flat)
    assert _same_state(saved, resumed) == []


@pytest.mark.parametrize("chain", [1], indirect=True, ids=["fsdp1"])  # selection reads no model state
def test_automatic_selection_resumes_a_checkpoint_of_another_world_size_only_with_the_opt_in(
        chain: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    project = tmp_path / "project"
    shutil.copytree(chain["paths"]["A"], project / "checkpoints" / "checkpoint_0")
    ranks = launch("tests.scenarios.elastic_scenarios:resume_automatic", 3, args=(1, str(project)), timeout=TIMEOUT)
    for rank in ranks:  # the candidate is not skipped as incomplete (no RNG file for rank 2): it is refused
        assert rank["refusal"]["type"] == "CheckpointConfigurationError"
        assert "allow_reshard=True" in rank["refusal"]["message"]
        assert rank["saved_to"] == "checkpoint_1"
    assert ranks[0]["resharded_from"][""]["checkpoint"] == str(project / "checkpoints" / "checkpoint_0")


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_an_asynchronous_checkpoint_reshards_exactly_2_to_3_and_2_to_1(tmp_path: Path, version: int) -> None:
    """Asynchronous saves stage each rank's own pieces (FSDP1: its boxes of every parameter, not native dim-0
    chunks): resharding reads them all the same."""
    saved, on3, on1 = tmp_path / "saved", tmp_path / "on3", tmp_path / "on1"
    launch("tests.scenarios.elastic_scenarios:save", 2, args=(version, str(saved), False, "adamw", True), timeout=TIMEOUT)
    launch("tests.scenarios.elastic_scenarios:resume", 3, args=(version, str(saved), str(on3), False), timeout=TIMEOUT)
    launch("tests.scenarios.elastic_scenarios:resume", 1, args=(version, str(saved), str(on1), False), timeout=TIMEOUT)
    assert _same_state(saved, on3) == [] and _same_state(saved, on1) == []
