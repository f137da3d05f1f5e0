"""``benchmarks/bench_full_state_dict.py`` (issue 45): the bytes each rank's ``dd`` baseline writes are what that rank
wrote of a full checkpoint, and the tables docs/benchmarks.md records are printed from the result the benchmark
writes. No timing, no distributed run: a checkpoint's files on disk and the recorded result file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_full_state_dict import report, written_bytes

REPO = Path(__file__).resolve().parents[2]


def test_rank_0_wrote_the_full_files_and_each_rank_its_own_rng_state(tmp_path: Path) -> None:
    files = {"pytorch_model_fsdp.bin": 1000, "optimizer.bin": 2000, "checkpoint_manifest.json": 30,
             "random_states_0.pkl": 7, "random_states_1.pkl": 11}
    for name, size in files.items():
        (tmp_path / name).write_bytes(b"x" * size)
    total = sum(files.values())
    assert written_bytes(str(tmp_path), 0) == (total, 1000 + 2000 + 30 + 7)
    assert written_bytes(str(tmp_path), 1) == (total, 11)
    # The ranks' shares add up to the checkpoint: the dd baseline writes exactly its bytes.
    assert written_bytes(str(tmp_path), 0)[1] + written_bytes(str(tmp_path), 1)[1] == total


def test_the_recorded_result_prints_every_rank_of_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    result = json.loads((REPO / "benchmarks" / "results" / "full_state_dict.json").read_text())
    report(result["rows"])
    printed = capsys.readouterr().out
    for row in result["rows"]:
        assert [rank["rank"] for rank in row["ranks"]] == [0, 1]
        rank0 = row["ranks"][0]
        assert f"| {row['fsdp_version']} | {rank0['parameters'] / 1e6:.0f}M | {rank0['ratios']['save_time']:.2f} (" \
            in printed
        for rank in row["ranks"]:
            assert f"| {row['fsdp_version']} | {rank['parameters'] / 1e6:.0f}M | {rank['rank']} |" in printed
