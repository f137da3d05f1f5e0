"""Single-process checks of the save transaction (NO backend, explicit API): durability and retention."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import accelerate_txn
from accelerate_txn import MANIFEST, save_training_checkpoint
from accelerate_txn.store.posix import fsync_path
from tests.support.single import stepped_accelerator


def _accelerator(project_dir: Path | None = None, seed: int | None = None) -> tuple[Accelerator, Any, Any]:
    """A one-process Accelerator that took one optimizer step (automatic naming under ``project_dir`` if given)."""
    if project_dir is None:
        return stepped_accelerator(seed)
    return stepped_accelerator(seed, project_dir=str(project_dir), automatic_checkpoint_naming=True)


def test_every_staged_file_and_directory_is_fsynced_before_publish(tmp_path: Path, monkeypatch: Any) -> None:
    # Regression: the reference design published without fsyncing the staged payloads, so a power loss could
    # publish empty files. The spy records what the real os.fsync was called on, and when.
    synced: list[tuple[str, bool]] = []
    final = tmp_path / "ckpt"
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), final.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    accelerator, _, _ = _accelerator()
    save_training_checkpoint(accelerator, final)
    published = [p for p in final.rglob("*") if p.is_file()]
    assert {p.name for p in published} >= {MANIFEST, "model.safetensors", "optimizer.bin", "random_states_0.pkl"}
    # The manifest is fsynced under its temporary name, then renamed into place (and its directory fsynced).
    before_rename = {Path(path).name.removesuffix(".tmp") for path, existed in synced if not existed}
    for path in published:
        assert path.name in before_rename, f"{path.name} was not fsynced before the checkpoint was published"
    # The parent directory is fsynced after the rename, so the new name itself is durable.
    assert any(Path(path) == tmp_path and existed for path, existed in synced)


def test_fsync_path_accepts_directories(tmp_path: Path) -> None:
    fsync_path(tmp_path)  # POSIX allows fsync on a directory opened read-only; must not raise


def test_explicit_save_refuses_pending_gradients_and_publishes_nothing(tmp_path: Path) -> None:
    accelerator, model, _ = _accelerator()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(accelerate_txn.CheckpointConfigurationError, match=r"pending gradients \(e\.g\. weight\)"):
        save_training_checkpoint(accelerator, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if ".staging-" in p.name]


def test_checkpoint_limit_keeps_the_newest_of_the_same_run_only(tmp_path: Path) -> None:
    accelerator, _, _ = _accelerator()
    paths = [save_training_checkpoint(accelerator, tmp_path / f"checkpoint_{i}", checkpoint_limit=2) for i in range(3)]
    assert [p.name for p in paths] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["checkpoint_1", "checkpoint_2"]
    assert not (tmp_path / "checkpoint_0").exists()  # pruned only after checkpoint_2 was published


def test_directory_of_another_run_is_refused_with_overwrite_refuse(tmp_path: Path) -> None:
    first, _, _ = _accelerator()
    save_training_checkpoint(first, tmp_path / "checkpoint_0")
    second, _, _ = _accelerator()  # a new run: it never loaded from this directory
    accelerate_txn.configure_checkpointing(second, overwrite="refuse")
    with pytest.raises(accelerate_txn.CheckpointExistsError, match=r"holds checkpoints of another training run"):
        save_training_checkpoint(second, tmp_path / "checkpoint_1")
    assert not (tmp_path / "checkpoint_1").exists()


def test_non_finite_parameters_are_refused_when_check_finite(tmp_path: Path) -> None:
    accelerator, model, _ = _accelerator()
    accelerate_txn.configure_checkpointing(accelerator, check_finite=True)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(accelerate_txn.NonFiniteStateError, match=r"model parameters contains NaN or Inf"):
        save_training_checkpoint(accelerator, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_check_finite_training_value_names_the_value() -> None:
    accelerate_txn.check_finite_training_value(1.5, "loss")
    with pytest.raises(accelerate_txn.NonFiniteStateError, match=r"Training value 'loss' is not finite"):
        accelerate_txn.check_finite_training_value(float("inf"), "loss")


def test_checkpoint_source_identity_is_the_content_fingerprint(tmp_path: Path) -> None:
    from accelerate_txn.weights import checkpoint_fingerprint

    source = tmp_path / "weights.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0).reshape(2, 3)}, source)
    identity = accelerate_txn.checkpoint_source_identity(source)
    assert identity == checkpoint_fingerprint(source)
    assert identity[0]["size"] == source.stat().st_size and len(identity[0]["sha256"]) == 64
