"""The transformers Trainer front end (``accelerate_txn.trainer``) with a real Trainer, real 2-rank FSDP2 on CPU
(gloo), real ``kill -9``: a protected save publishes ``checkpoint-N`` with a manifest and leaves nothing behind; a job
killed mid-save resumes with ``resume_from_checkpoint=True`` from the previous complete checkpoint and ends with the
weights of an uninterrupted run; a corrupt newest checkpoint is skipped by ``True`` and refused on every rank, before
anything is loaded, when named explicitly.

FSDP2 is used where weights are compared: with FSDP1, native Trainer restores no optimizer state into its fresh
optimizer (the defect of issue 18 not fixed yet: docs/trainer.md), so an exact resume is not possible there.
Cost on 2 shared CPU cores: about 8 launches of a few seconds each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.core.faults import KILL_ENV
from accelerate_txn.core.manifest import MANIFEST, read_manifest, verify_manifest
from accelerate_txn.testing import LaunchError, launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
TIMEOUT = 240  # per launch: a hung group fails instead of stalling
TRAIN = "tests._trainer_scenarios:train"


def _run(output: Path, resume: Any, max_steps: int, **kwargs: Any) -> list[dict[str, Any]]:
    return launch(TRAIN, 2, args=(str(output), resume, max_steps, kwargs.pop("fsdp_version", 2),
                                  kwargs.pop("save_total_limit", None)), timeout=TIMEOUT, env=kwargs.pop("env", None))


def _same_weights(one: list[dict[str, Any]], other: list[dict[str, Any]]) -> bool:
    return all(len(a["weights"]) == len(b["weights"]) and all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
               for a, b in zip(one, other))


def test_a_protected_trainer_save_publishes_a_checkpoint_with_a_manifest_and_no_staging_leftovers(tmp_path: Path) -> None:
    results = _run(tmp_path, None, 6, fsdp_version=1, save_total_limit=2)
    assert results[0]["step"] == 6
    # Retention ran after each publish: the two newest complete checkpoints remain, nothing hidden but the lock.
    assert results[0]["entries"] == [".accelerate-txn.lock", "checkpoint-4", "checkpoint-6"]
    for name in ("checkpoint-4", "checkpoint-6"):
        path = tmp_path / name
        manifest = read_manifest(path)
        assert manifest is not None and manifest["status"] == "complete"
        assert manifest["trainer"]["world_size"] == 2 and manifest["trainer"]["backend"] == "FSDP1"
        assert manifest["trainer"]["global_step"] == int(name.split("-")[1])
        assert {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json",
                "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= set(manifest["files"])
        verify_manifest(path, manifest, full=True)  # every file, every hash
        state = json.loads((path / "trainer_state.json").read_text())
        assert state["global_step"] == int(name.split("-")[1])
    # Both checkpoints belong to one run (retention prunes that run's checkpoints only).
    assert read_manifest(tmp_path / "checkpoint-4")["run_id"] == read_manifest(tmp_path / "checkpoint-6")["run_id"]


def test_kill_9_of_the_whole_job_mid_save_resumes_from_the_previous_complete_checkpoint_exactly(tmp_path: Path) -> None:
    reference = _run(tmp_path / "reference", None, 6)
    killed = tmp_path / "killed"
    # Every rank kills itself (SIGKILL, no cleanup) in the save of checkpoint-4, after hashing its first file.
    with pytest.raises(LaunchError, match="died with exit codes"):
        _run(killed, None, 6, env={KILL_ENV: "save:during-flush#2"})
    entries = sorted(entry.name for entry in killed.iterdir())
    assert "checkpoint-2" in entries and "checkpoint-4" not in entries
    assert any(name.startswith(".checkpoint-4.staging-") for name in entries), entries  # the dead writer's leftover
    resumed = _run(killed, True, 6)
    assert resumed[0]["step"] == 6
    assert _same_weights(resumed, reference), "the resumed run's final weights differ from the uninterrupted run's"
    assert not [name for name in resumed[0]["entries"] if ".staging-" in name]  # the next save removed the leftover
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        verify_manifest(killed / name, read_manifest(killed / name), full=True)


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the content hash can tell
    path.write_bytes(bytes(data))


def test_a_corrupt_newest_checkpoint_is_skipped_by_resume_true_and_refused_when_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reference = _run(run, None, 6)  # checkpoint-2, -4, -6; the final weights are the reference
    newest = run / "checkpoint-6"
    _corrupt(newest / "rng_state_1.pth")  # rank 1's file: Trainer would read it, and treats it as optional
    with pytest.raises(LaunchError) as refused:
        _run(run, str(newest), 6)
    text = str(refused.value)
    for rank in (0, 1):  # the same error on every rank, raised before Trainer loaded anything
        part = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "CheckpointIntegrityError" in part and "rng_state_1.pth does not match its xxh3_128" in part, part
        assert "_load_from_checkpoint" not in part and "_prepare_for_training" not in part
    resumed = _run(run, True, 6)  # skips checkpoint-6 (logged), resumes from checkpoint-4
    assert resumed[0]["step"] == 6
    assert _same_weights(resumed, reference)
    # checkpoint-6 was saved again by the resumed run: replaced atomically by a complete, verified one.
    verify_manifest(newest, read_manifest(newest), full=True)
    assert (newest / MANIFEST).is_file()


_UNVALIDATED = """\
import os, sys, warnings
import torch
import accelerate_txn
from accelerate_txn.trainer import versions
versions.VALIDATED = frozenset()  # as on a transformers release outside validated.json
versions.installed_validated.cache_clear()
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 8))]
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, per_device_train_batch_size=4, max_steps=4, save_steps=2,
                         report_to=[], disable_tqdm=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Trainer(model=model, args=args, train_dataset=data).train()
notes = [str(w.message) for w in caught if "NOT protected" in str(w.message)]
print("WARNINGS", len(notes), notes[:1])
"""


def test_an_unvalidated_transformers_runs_native_trainer_with_one_warning(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _UNVALIDATED, str(tmp_path)], capture_output=True, text=True,
                            timeout=TIMEOUT, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNINGS 1 " in result.stdout and "has not validated its Trainer front end" in result.stdout, result.stdout
    # Native Trainer saved as it does without the library: no manifest, no lock, no staging.
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not (tmp_path / "checkpoint-4" / MANIFEST).exists()
