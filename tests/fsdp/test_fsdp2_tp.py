"""FSDP2 + tensor parallelism (Accelerate ``ParallelismConfig(dp_shard_size=2, tp_size=2)``, the model
tensor-parallelised with ``parallelize_module`` before ``prepare``) through the protected transaction, in real
4-process gloo runs: the protected path is taken; every rank's DCP chunk is exactly its shard of the tensor (the
strided shards ``fully_shard`` makes over TP included, uneven ones too); save, train on, restore (same objects and
fresh ones) bitwise for model, optimizer, scheduler and RNG, and the next step equal; each tensor's chunks cover it
once, a replicated shard stored once; layers a TP plan leaves alone; an asynchronous save; a damaged payload of
rank 3 refused on every rank before anything changes; native Accelerate loads the protected checkpoint; elastic
resume onto dp_shard 4 (no TP, 4 ranks) and dp_shard 2 (2 ranks) under ``allow_reshard``; a 3-D mesh (dp_replicate 2
x dp_shard 2 x tp 2) on 8 real ranks. Placements the protected
path cannot store exactly are refused (unit tests)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from accelerate_txn.testing import launch

TIMEOUT = 300


@pytest.fixture(scope="module")
def tp(tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fsdp2_tp")
    observed = launch("tests.scenarios.fsdp2_tp_scenarios:tp_roundtrip", 4, args=(str(root),), timeout=TIMEOUT)
    observed[0]["root"] = str(root)
    return observed


@pytest.mark.distributed
def test_fsdp2_tp_is_protected_and_every_dcp_chunk_is_exactly_its_ranks_shard(tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        assert obs["mesh"] == [[2, 2], ["dp_shard", "tp"]]
        assert obs["parameter_mesh"] == ["dp_shard_cp", "tp"]  # fully_shard's mesh: dp_shard (and cp) flattened
        assert obs["unsupported"] is None and obs["protected"] is True
        assert obs["save_error"] is None
        placements = {name: entry["placements"] for name, entry in obs["boxes"].items()}
        # Colwise weights and biases: TP splits rows, fully_shard splits each TP shard again (strided).
        assert placements["body.0.weight"] == placements["body.6.bias"] == ["_S(0, 2)", "S(0)"]
        assert placements["head.weight"] == ["S(0)", "S(1)"] and placements["head.bias"] == ["S(0)", "R"]
        assert all(entry["boxes_exact"] == [True] for entry in obs["boxes"].values()), obs["boxes"]
    assert tp[0]["manifest"] is True


@pytest.mark.distributed
def test_fsdp2_tp_chunks_cover_every_tensor_once_and_replicas_are_stored_once(tp: list[dict[str, Any]]) -> None:
    chunks = tp[0]["chunks"]
    assert set(chunks) == {"model", "optimizer"} and chunks["model"] and chunks["optimizer"]
    for part, report in chunks.items():
        for key, entry in report.items():
            assert entry["covered"] == entry["numel"] and entry["overlaps"] == 0, (part, key, entry)
            assert all(len(files) == 1 for files in entry["payloads"]), (part, key, entry)  # no duplicate payload
    # Row-parallel biases are replicated over TP: 2 data-parallel shards, each written by one rank of its TP pair.
    for key in ("model.head.bias", "model.body.3.bias"):
        assert chunks["model"][key]["chunks"] == 2
        assert len({files[0] for files in chunks["model"][key]["payloads"]}) == 2
    assert chunks["model"]["model.body.0.weight"]["chunks"] == 4


@pytest.mark.distributed
def test_fsdp2_tp_save_train_on_restore_is_bitwise_exact_and_continues_identically(tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        assert {"params.head.weight", "optim.body.0.weight", "rng", "scheduler"} <= set(obs["trained_on_differences"])
        assert obs["same_error"] is None and obs["same_differences"] == []
        assert obs["same_direct"] > 0  # the direct reader read into the 2-D shards (and exactly: no differences)
        assert obs["fresh_error"] is None and obs["fresh_differences"] == []  # params, optimizer, groups, sched, RNG
        assert obs["next_step_differences"] == []


@pytest.mark.distributed
def test_layers_a_tp_plan_leaves_alone_are_replicated_over_tp_and_round_trip_exactly(
        tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        placements = obs["half_placements"]
        assert placements["body.0.weight"] == ["_S(0, 2)", "S(0)"]
        assert placements["body.6.weight"] == placements["head.bias"] == ["S(0)", "R"]  # Accelerate's Replicate
        assert obs["half_save_error"] is None and obs["half_load_error"] is None
        assert obs["half_differences"] == []


@pytest.mark.distributed
def test_an_async_fsdp2_tp_save_written_while_training_goes_on_restores_exactly(tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        assert obs["async_save_error"] is None and obs["async_wait_error"] is None
        assert obs["async_load_error"] is None and obs["async_differences"] == []


@pytest.mark.distributed
def test_fsdp2_tp_damaged_payload_of_rank_3_is_refused_on_every_rank_before_anything_changes(
        tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        error = obs["corrupt_error"]
        assert error is not None and error["type"] == "CheckpointIntegrityError", error
        assert error["failures"] == [3] and "pytorch_model_fsdp_0/__3_0.distcp" in error["message"]
        assert obs["corrupt_unchanged"] == []


@pytest.mark.distributed
def test_native_accelerate_loads_a_protected_fsdp2_tp_checkpoint(tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        assert obs["native_error"] is None
        assert obs["native_differences"] == []


@pytest.mark.distributed
def test_fsdp2_tp_resumes_exactly_onto_dp_shard_4_without_tp(tp: list[dict[str, Any]]) -> None:
    for obs in tp:
        assert obs["dp4_placements"] == ["(Shard(dim=0),)"]
        assert obs["dp4_error"] is None, obs["dp4_error"]["message"][:600]
        assert obs["dp4_differences"] == []  # every parameter and optimizer tensor gathered whole, the scheduler


@pytest.mark.distributed
def test_fsdp2_tp_resumes_exactly_onto_2_ranks_without_tp(tp: list[dict[str, Any]]) -> None:
    observed = launch("tests.scenarios.fsdp2_tp_scenarios:elastic_tp1", 2, args=(tp[0]["root"],), timeout=TIMEOUT)
    for obs in observed:
        assert obs["dp2_placements"] == ["(Shard(dim=0),)"]
        assert obs["dp2_error"] is None, obs["dp2_error"]["message"][:600]
        assert obs["dp2_differences"] == []


@pytest.mark.distributed
def test_fsdp2_tp_on_a_3d_mesh_dp_replicate_dp_shard_tp_round_trips_exactly(tmp_path: Any) -> None:
    observed = launch("tests.scenarios.fsdp2_tp_scenarios:tp_3d", 8, args=(str(tmp_path),), timeout=600)
    for obs in observed:
        assert obs["mesh"] == [[2, 2, 2], ["dp_replicate", "dp_shard", "tp"]]
        assert obs["protected"] is True and obs["save_error"] is None
        assert all(entry["boxes_exact"] == [True] for entry in obs["boxes"].values()), obs["boxes"]
        assert obs["fresh_error"] is None and obs["fresh_differences"] == []
        assert obs["corrupt_error"]["type"] == "CheckpointIntegrityError" and obs["corrupt_unchanged"] == []


# --- placements the protected path refuses (no processes: placements on a stand-in mesh) ------------------------


def _parameter(placements: tuple[Any, ...], mesh: tuple[int, ...]) -> Any:
    def size(dim: int | None = None) -> int:
        return mesh[dim] if dim is not None else math.prod(mesh)

    return SimpleNamespace(placements=placements, device_mesh=SimpleNamespace(shape=mesh, size=size))


def _strided(dim: int, factor: int) -> Any:
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=factor)


def test_shard_replicate_and_fully_shards_strided_sharding_over_tp_are_supported() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from accelerate_txn.fsdp.fsdp2 import unsupported_placements

    for placements, mesh in [((Shard(0),), (4,)), ((Replicate(), Shard(0)), (2, 2)), ((Shard(0), Shard(1)), (2, 2)),
                             ((Shard(0), Replicate()), (2, 2)), ((_strided(0, 2), Shard(0)), (2, 2)),
                             ((Replicate(), _strided(0, 2), Shard(0)), (2, 2, 2)),
                             ((_strided(1, 4), Shard(1)), (2, 4))]:
        assert unsupported_placements("w", _parameter(placements, mesh)) is None, placements


def test_partial_and_other_strided_placements_are_refused_with_the_reason() -> None:
    from torch.distributed.tensor import Partial, Shard

    from accelerate_txn.fsdp.fsdp2 import unsupported_placements

    partial = unsupported_placements("body.0.weight", _parameter((Shard(0), Partial()), (2, 2)))
    assert partial is not None and "body.0.weight" in partial and "Partial" in partial
    for placements in [(_strided(0, 3), Shard(0)),  # the split factor is not the TP degree
                       (_strided(0, 2), Shard(1)),  # no later shard of the same dimension
                       (Shard(0), _strided(0, 2))]:  # strided on the last dimension
        reason = unsupported_placements("head.weight", _parameter(placements, (2, 2)))
        assert reason is not None and "head.weight" in reason and "FSDP2 + TP" in reason, placements
    reason = unsupported_placements("w", _parameter((Shard(0), _strided(0, 2), Shard(0)), (2, 2, 2)))
    assert reason is not None  # a dimension already sharded before the strided shard
