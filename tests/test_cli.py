"""The ``accelerate-txn`` command line, run as a real subprocess on real checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from accelerate_txn import save_training_checkpoint


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelerate_txn.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _checkpoint(tmp_path: Path, name: str) -> Path:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return save_training_checkpoint(accelerator, tmp_path / name)


def test_verify_accepts_a_complete_checkpoint_and_rejects_a_damaged_one(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "checkpoint_0")
    ok = _cli("verify", str(path), "--full", "--json")
    assert ok.returncode == 0, ok.stderr
    assert "complete (run" in ok.stdout
    assert json.loads(ok.stdout.splitlines()[-1])["components"] == [""]
    rng = path / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:-1])
    bad = _cli("verify", str(path))
    assert bad.returncode == 1
    assert "random_states_0.pkl has" in bad.stderr and "truncated or changed" in bad.stderr


def test_verify_refuses_a_directory_without_manifest(tmp_path: Path) -> None:
    result = _cli("verify", str(tmp_path))
    assert result.returncode == 1
    assert "no checkpoint_manifest.json" in result.stderr


def test_latest_skips_incomplete_checkpoints_and_says_why(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "checkpoint_3")
    (tmp_path / "checkpoint_9").mkdir()  # newer, but incomplete: no manifest
    result = _cli("latest", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "checkpoint_3")
    assert "Skipping checkpoint" in result.stderr and "checkpoint_9" in result.stderr


def test_latest_fails_when_no_candidate_is_complete(tmp_path: Path) -> None:
    (tmp_path / "checkpoint_1").mkdir()
    result = _cli("latest", str(tmp_path))
    assert result.returncode == 1
    assert "No complete checkpoint" in result.stderr and "checkpoint_1: it has no completion manifest" in result.stderr


def test_export_writes_diffusers_shards_from_a_dcp_directory(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    weights = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4)}
    dcp.save({"model": weights}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "Tiny", "width": 3}))
    result = _cli("export", str(tmp_path / "dcp"), str(tmp_path / "config.json"), str(tmp_path / "out"),
                  "--max-shard-size", "64", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / "out" / shard))
    assert set(loaded) == set(weights)
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], weights[k].bfloat16()) for k in weights)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["width"] == 3
