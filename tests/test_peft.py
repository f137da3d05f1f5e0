"""LoRA fine-tuning (PEFT) under real 2-rank FSDP1 and FSDP2 on CPU: the transformers Trainer and an Accelerate loop.

Trainer (``peft.get_peft_model`` on a tiny Llama, ``force_fsdp_trainer``, ``save_steps=2``), per FSDP version:

* an uninterrupted run to step 6: each ``checkpoint-N`` has a manifest whose inventory lists every file of the model
  directory the resume reads, and the model directory holds the adapter's tensors (natively, FSDP1 saves none:
  ``accelerate_txn.trainer.adapters``);
* the whole job SIGKILLed in its second save (checkpoint-4's manifest written, not renamed): only checkpoint-2 is
  complete; ``resume_from_checkpoint=True`` takes it, restores the adapter weights, the frozen base weights and the
  optimizer state bitwise as saved, and ends with the uninterrupted run's weights and optimizer state, bitwise;
* FSDP2: a flipped byte in an adapter shard is refused on every rank before anything is restored.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.core.manifest import read_manifest, verify_manifest
from accelerate_txn.testing import launch
from tests._crash_harness import KILLED, run_to_completion, run_until_crash_point
from tests._trainer_kills import equal, observed, trainer_report

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
TIMEOUT = 300  # per launch: a hung group fails instead of stalling
ENTRY = "tests._peft_scenarios"
STEPS = 6


def _adapter_keys(metadata_dir: Path) -> list[str]:
    from accelerate_txn.core.manifest import read_dcp_metadata

    return sorted(key for key in read_dcp_metadata(metadata_dir).state_dict_metadata if "lora_" in key)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def trainer_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per FSDP version: the uninterrupted run to step 6, a run killed (whole job) in its second save, and its
    ``resume_from_checkpoint=True`` restart."""
    version = request.param
    directory = tmp_path_factory.mktemp(f"peft_trainer_fsdp{version}")
    reference_root = directory / "reference"
    reference = launch(f"{ENTRY}:trainer_train", 2, args=(str(reference_root), None, STEPS, version), timeout=TIMEOUT)
    root = directory / "run"
    spec = {"output_dir": str(root), "max_steps": STEPS, "fsdp_version": version}
    killed = run_until_crash_point({**spec, "kill": "save:after-manifest#2", "resume": None}, directory, "killed",
                                   True, entry=ENTRY)
    after_kill = trainer_report(root)
    run_to_completion({**spec, "resume": True}, directory, "restart", entry=ENTRY)
    final = [torch.load(directory / "obs" / "restart" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"version": version, "reference_root": reference_root, "reference": reference, "killed": killed,
            "after_kill": after_kill, "began": observed(directory, "restart", "began"), "final": final,
            "root": root}


def test_a_peft_trainer_checkpoint_lists_and_verifies_the_adapter_files(trainer_runs: dict[str, Any]) -> None:
    root = trainer_runs["reference_root"]
    for step in (2, 4, 6):
        path = root / f"checkpoint-{step}"
        manifest = read_manifest(path)
        assert manifest is not None and manifest["status"] == "complete"
        verify_manifest(path, manifest, full=True)
        on_disk = {str(p.relative_to(path)) for p in (path / "pytorch_model_fsdp_0").iterdir()}
        assert on_disk <= set(manifest["files"])  # every file of the model directory a resume reads is listed
        # The adapter's tensors are in the checkpoint (8: lora_A/B of q_proj/v_proj in 2 layers).
        assert len(_adapter_keys(path / "pytorch_model_fsdp_0")) == 8


def test_a_killed_peft_trainer_save_resumes_exactly(trainer_runs: dict[str, Any]) -> None:
    killed = trainer_runs["killed"]
    assert killed.returncodes == [KILLED, KILLED], killed.describe()
    report = trainer_runs["after_kill"]
    assert report["complete"] == [2] and not report["broken"], report
    reference, began, final = trainer_runs["reference"], trainer_runs["began"], trainer_runs["final"]
    for rank in range(2):
        start = began[rank]
        assert start is not None and start["step"] == 2
        # What the resume restored equals what the uninterrupted run had at its save of checkpoint-2, bitwise.
        assert equal(start["optimizer"], reference[rank]["optimizer_at_save"][2])
        assert start["optimizer"]  # the adapter's moments, not an empty optimizer
        fresh = reference[rank]["began"]["params"]
        assert equal(list(start["params"]["base"].values()), list(fresh["base"].values()))  # frozen: unchanged
        assert not equal(list(start["params"]["adapter"].values()), list(fresh["adapter"].values()))  # trained
        # The resumed run ends where the uninterrupted one did: adapter, frozen base and optimizer, bitwise.
        assert final[rank]["step"] == STEPS
        assert equal(list(final[rank]["params"]["adapter"].values()),
                     list(reference[rank]["params"]["adapter"].values()))
        assert equal(list(final[rank]["params"]["base"].values()), list(fresh["base"].values()))
        assert equal(final[rank]["optimizer"], reference[rank]["optimizer"])


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_an_accelerate_loop_with_a_lora_model_saves_and_restores_it_exactly(tmp_path: Path, version: int) -> None:
    results = launch(f"{ENTRY}:loop_roundtrip", 2, args=(str(tmp_path), version), timeout=TIMEOUT)
    manifest = read_manifest(tmp_path / "checkpoint")
    assert manifest is not None
    for result in results:
        # Every file save_state wrote (the model's and optimizer's shards included) is in the inventory.
        assert set(result["files"]) - {"checkpoint_manifest.json"} <= set(manifest["files"])
        assert result["adapter_restored"] and result["base_unchanged"] and result["optimizer_restored"]
        # The flipped byte: the same integrity error on every rank, nothing restored.
        assert result["corrupt"].startswith("CheckpointIntegrityError") and "__1_0.distcp" in result["corrupt"]
        assert result["corrupt_untouched"]
    assert results[0]["corrupt"] == results[1]["corrupt"]
    # (FSDP1 may shard the small adapter onto one rank only: the adapter's changes are checked over the ranks.)
    assert any(result["moved"] for result in results) and any(result["adapter_trained"] for result in results)
    assert any(result["optimizer_saved"] for result in results)


def test_a_flipped_byte_in_a_trainer_adapter_shard_is_refused_before_anything_loads(
        trainer_runs: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(trainer_runs["reference_root"], root)
    shard = root / "checkpoint-6" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    results = launch(f"{ENTRY}:trainer_refuse", 2, args=(str(root), str(root / "checkpoint-6"), trainer_runs["version"]),
                     timeout=TIMEOUT)
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["error"].startswith("CheckpointIntegrityError") and "__0_0.distcp" in results[0]["error"]
    assert all(result["untouched"] for result in results)
