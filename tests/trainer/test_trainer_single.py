"""The Trainer front end without FSDP: a one-process Trainer (the "other checkpoint kinds" of issue 18: Trainer's
full state dict layout, ``model.safetensors`` + ``optimizer.pt``) gets the same transaction and verification. Real
Trainer, tiny Llama built from a config, in this process (no process group)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_txn  # noqa: F401  (the import protects Trainer checkpoints)
from accelerate_txn import MANIFEST
from accelerate_txn.errors import CheckpointIntegrityError
from tests.scenarios.trainer_scenarios import tiny_llama

pytestmark = pytest.mark.timeout(300)


def _trainer(output_dir: Path, max_steps: int) -> Any:
    from transformers import Trainer, TrainingArguments

    model, data = tiny_llama(32)
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=4,
                             max_steps=max_steps, save_strategy="steps", save_steps=2, save_total_limit=2,
                             lr_scheduler_type="constant",  # a shorter run is then an interrupted one
                             report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data)


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def test_a_one_process_trainer_checkpoint_is_a_transaction_and_resumes_exactly(tmp_path: Path) -> None:
    reference = _trainer(tmp_path / "reference", 6)
    reference.train()
    expected = _weights(reference)

    run = tmp_path / "run"
    _trainer(run, 4).train()
    names = sorted(p.name for p in run.iterdir() if p.name != ".accelerate-txn.lock")  # the directory lock stays
    assert names == ["checkpoint-2", "checkpoint-4"], names  # save_total_limit=2, no staging leftover
    for name in names:
        manifest = json.loads((run / name / MANIFEST).read_text())
        assert manifest["status"] == "complete"
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(manifest["files"])

    resumed = _trainer(run, 6)
    resumed.train(resume_from_checkpoint=True)
    assert all(torch.equal(expected[name], value) for name, value in _weights(resumed).items())


def test_a_damaged_one_process_checkpoint_is_refused_before_anything_loads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _trainer(run, 4).train()
    damaged = run / "checkpoint-4" / "optimizer.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    named = _trainer(run, 6)
    before = _weights(named)
    with pytest.raises(CheckpointIntegrityError, match=r"optimizer\.pt"):
        named.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    assert all(torch.equal(before[name], value) for name, value in _weights(named).items())
    # Automatic: the damaged newest is skipped for checkpoint-2, and training goes on from there.
    automatic = _trainer(run, 6)
    automatic.train(resume_from_checkpoint=True)
    assert automatic.state.global_step == 6


def ddp_run(output_dir: str, steps: int, resume: bool) -> dict[str, Any]:
    """Rank function: a DDP Trainer on CPU (gloo; ``use_cpu=True`` in a torchrun-like environment)."""
    trainer = _trainer(Path(output_dir), steps)
    trainer.train(resume_from_checkpoint=True if resume else None)
    return {"weights": {name: value.tolist() for name, value in _weights(trainer).items()},
            "backend": trainer.accelerator.distributed_type.name}


@pytest.mark.distributed
def test_a_ddp_trainer_checkpoint_is_a_transaction_and_resumes_exactly(tmp_path: Path) -> None:
    from accelerate_txn.testing import launch

    reference = launch("tests.trainer.test_trainer_single:ddp_run", 2, args=(str(tmp_path / "reference"), 6, False),
                       timeout=240)
    launch("tests.trainer.test_trainer_single:ddp_run", 2, args=(str(tmp_path / "run"), 4, False), timeout=240)
    for name in ("checkpoint-2", "checkpoint-4"):
        manifest = json.loads((tmp_path / "run" / name / MANIFEST).read_text())
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= set(manifest["files"])
    resumed = launch("tests.trainer.test_trainer_single:ddp_run", 2, args=(str(tmp_path / "run"), 6, True), timeout=240)
    assert [obs["backend"] for obs in resumed] == ["MULTI_CPU", "MULTI_CPU"]
    assert [obs["weights"] for obs in resumed] == [obs["weights"] for obs in reference]


def test_a_trainer_save_that_replaces_checkpoint_n_carries_the_users_own_files(tmp_path: Path) -> None:
    # Regression (issue 34 item 4): Trainer's native save writes into an existing checkpoint-N and keeps what the user
    # added there; the protected save replaced the directory as a whole and lost those files.
    run = tmp_path / "run"
    _trainer(run, 2).train()
    checkpoint = run / "checkpoint-2"
    (checkpoint / "NOTES.md").write_text("my notes")
    (checkpoint / "eval_samples").mkdir()
    (checkpoint / "eval_samples" / "sample_0.txt").write_text("sample 0")
    (checkpoint / "rng_state_7.pth").write_bytes(b"stale")  # Trainer's layout: the old checkpoint's, never carried
    before = json.loads((checkpoint / MANIFEST).read_text())["transaction_id"]
    _trainer(run, 2).train()  # a new run into the same output_dir saves checkpoint-2 again: it is replaced
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["transaction_id"] != before
    assert (checkpoint / "NOTES.md").read_text() == "my notes"
    assert (checkpoint / "eval_samples" / "sample_0.txt").read_text() == "sample 0"
    assert not (checkpoint / "rng_state_7.pth").exists()
    assert manifest["user_files"] == {"NOTES.md": {"size": 8}, "eval_samples/sample_0.txt": {"size": 8}}
    assert not {"NOTES.md", "eval_samples/sample_0.txt"} & set(manifest["files"])
    resumed = _trainer(run, 4)
    resumed.train(resume_from_checkpoint=str(checkpoint))  # the replaced checkpoint verifies and resumes
    assert resumed.state.global_step == 4


def test_prune_of_the_checkpoint_a_trainer_resumes_from_keeps_it_until_trainer_has_read_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression (issue 34): the Trainer resume did not hold its checkpoint in use (store.posix.InUse), so a concurrent
    # `accelerate-txn prune` (or another job's retention) deleted it after the verification, under Trainer's load.
    import subprocess
    import sys

    from transformers import TrainerCallback

    from accelerate_txn.store.posix import held_in_use, in_use_file
    from accelerate_txn.trainer import resume as resume_module

    def prune() -> dict[str, Any]:  # another process, as another job's or the user's prune is
        done = subprocess.run([sys.executable, "-m", "accelerate_txn", "prune", str(run), "--keep", "1", "--json"],
                              capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    reference = _trainer(tmp_path / "reference", 4)
    reference.train()
    run = tmp_path / "run"
    _trainer(run, 4).train()
    oldest, lock = run / "checkpoint-2", in_use_file(run / "checkpoint-2")
    seen: dict[str, Any] = {}
    real_verify = resume_module._verify

    def verify(*args: Any, **kwargs: Any) -> Any:  # the pause: verified, nothing loaded yet; the prune runs meanwhile
        verified = real_verify(*args, **kwargs)
        seen["pruned"] = prune()["deleted"]
        return verified

    class Probe(TrainerCallback):  # after the model, optimizer, scheduler and state loaded; then after the RNG
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            seen["held after the loads"] = held_in_use(lock)

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            seen.setdefault("held at the first step", held_in_use(lock))

    monkeypatch.setattr(resume_module, "_verify", verify)
    resumed = _trainer(run, 4)
    resumed.add_callback(Probe())
    resumed.train(resume_from_checkpoint=str(oldest))
    assert seen["pruned"] == [] and oldest.is_dir()  # in use: kept this time
    assert seen["held after the loads"] and not seen["held at the first step"]  # released once the RNG file was read
    assert resumed.state.global_step == 4
    assert all(torch.equal(value, _weights(reference)[name]) for name, value in _weights(resumed).items())
    assert not lock.exists()
    assert prune()["deleted"] == [str(oldest)]  # the resume is over: the next prune deletes it
