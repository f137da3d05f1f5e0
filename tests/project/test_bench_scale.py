"""The protocol at scale (``benchmarks/bench_scale.py``): what each rank sends and receives, counted on simulated ranks.

The ranks are threads over the benchmark's simulated process group, running the library's own ``run_phase``,
``agree``, ``on_main`` and ``gather_rows``; every assertion is on counts and sizes, none on time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from accelerate_txn.core.manifest import list_tree
from accelerate_txn.core.ranks import agree, gather_rows, merge_row_payloads, row_payload
from accelerate_txn.errors import CheckpointConfigurationError, CheckpointRankError
from benchmarks.bench_scale import SimulatedProcessGroup, model_point, simulated


def _rows(rank: int) -> dict[str, dict[str, object]]:
    return {f"pytorch_model_fsdp_0/__{rank}_0.distcp": {"size": 4096, "xxh3_128": f"{rank:032x}"},
            f"random_states_{rank}.pkl": {"size": 14497, "xxh3_128": f"{rank + 1:032x}"}}


def _gather(world: int) -> tuple[SimulatedProcessGroup, dict[str, dict[str, object]]]:
    with simulated(world) as group:
        merged = group.run(lambda me: gather_rows(_rows(me), world))
    return group, merged[0]


def test_gather_rows_brings_every_rank_s_rows_to_rank_0_only() -> None:
    group, merged = _gather(16)
    assert merged == {name: row for r in range(16) for name, row in _rows(r).items()}
    assert [sum(calls.values()) for calls in group.calls] == [2] * 16  # an all-reduce and a gather, on every rank


def test_rank_0_receives_linear_bytes_and_no_other_rank_receives_per_rank_bytes() -> None:
    """Doubling the world doubles what rank 0 receives (within the padding of longer rank numbers) and leaves what
    every other rank sends and receives unchanged: no rank is sent a list with one entry per rank."""
    counted = {world: _gather(world)[0] for world in (32, 64, 128)}
    for world in (32, 64):
        small, large = counted[world], counted[2 * world]
        ratio = large.received[0] / small.received[0]
        assert 1.9 <= ratio <= 2.2, ratio
        assert max(large.received[1:]) == max(small.received[1:]) == 8  # the longest payload's length
        assert max(large.sent[1:]) - max(small.sent[1:]) <= 4  # one more digit in a rank number, at most
    payload = max(len(row_payload(r, _rows(r))) for r in range(1, 128))
    assert counted[128].received[0] == 127 * payload + 8


def test_agree_sends_every_rank_the_same_fixed_bytes_at_any_world_size() -> None:
    def received(world: int) -> list[int]:
        with simulated(world) as group:
            group.run(lambda me: agree({"path": "/a", "world": world}, "the path"))
        return group.received

    assert set(received(8)) == set(received(64)) == {64}


def test_agree_still_raises_the_same_error_everywhere_when_one_rank_differs() -> None:
    errors: list[str] = []

    def call(me: int) -> None:
        try:
            agree({"path": "/b" if me == 5 else "/a"}, "the checkpoint path")
        except CheckpointConfigurationError as exc:
            errors.append(str(exc))

    with simulated(8) as group:
        group.run(call)
    assert len(errors) == 8 and len(set(errors)) == 1 and "rank(s) [5]" in errors[0]


def test_merge_refuses_rows_from_a_rank_outside_the_world() -> None:
    payloads = [row_payload(r, _rows(r)) for r in (1, 2, 7)]
    with pytest.raises(CheckpointRankError, match=r"ranks \[0, 1, 2, 7\] contributed"):
        merge_row_payloads(_rows(0), payloads, 4)
    padded = [payload.ljust(200, b" ") for payload in payloads[:2]]  # the gather's padding is blanks
    assert len(merge_row_payloads(_rows(0), padded, 3)) == 6


def test_list_tree_keeps_only_the_selected_files(tmp_path: Path) -> None:
    for name in ("__0_0.distcp", "__1_0.distcp", "random_states_1.pkl"):
        (tmp_path / name).write_bytes(b"x" * 3)
    assert list_tree(tmp_path, keep=lambda name: "1" in name) == {"__1_0.distcp": 3, "random_states_1.pkl": 3}
    assert len(list_tree(tmp_path)) == 3


def test_the_model_grows_linearly_in_the_world_size(tmp_path: Path) -> None:
    """The benchmark's model at W and 2W: manifest and rank 0's bytes double; messages per rank and every other
    rank's bytes stay the same."""
    small, large = (model_point(world, tmp_path / str(world), cli=False) for world in (48, 96))
    assert large["files"] == 2 * small["files"] - 2  # 3 files per rank, 2 DCP .metadata
    assert 1.8 <= large["manifest_bytes"] / small["manifest_bytes"] <= 2.1
    for phase in ("save", "load"):
        assert large[phase]["messages_other"] == small[phase]["messages_other"]
        assert large[phase]["messages_rank0"] == small[phase]["messages_rank0"]
        assert abs(large[phase]["received_other_max"] - small[phase]["received_other_max"]) <= 8
        assert abs(large[phase]["sent_other_max"] - small[phase]["sent_other_max"]) <= 8
    assert 1.9 <= large["save"]["received_rank0"] / small["save"]["received_rank0"] <= 2.2
    assert small["save"]["calls_rank0"] == {"all_reduce": 19, "broadcast_object_list": 3, "gather": 1}
