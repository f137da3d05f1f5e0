"""LoRA fine-tuning (PEFT) under real 2-rank FSDP1 and FSDP2 on CPU: the transformers Trainer and an Accelerate loop.

Trainer (``peft.get_peft_model`` on a tiny Llama, ``force_fsdp_trainer``, ``save_steps=2``), per FSDP version:

* an uninterrupted run to step 6: each ``checkpoint-N`` has a manifest whose inventory lists every file of the model
  directory the resume reads, and the model directory holds the adapter's tensors (natively, FSDP1 saves none:
  ``accelerate_txn.trainer.adapters``);
* the whole job SIGKILLed in its second save (checkpoint-4's manifest written, not renamed): only checkpoint-2 is
  complete; ``resume_from_checkpoint=True`` takes it, restores the adapter weights, the frozen base weights and the
  optimizer state bitwise as saved, and ends with the uninterrupted run's weights and optimizer state, bitwise;
* a flipped byte in an adapter shard is refused on every rank before anything is restored;
* ``accelerate-txn export`` of a checkpoint (the adapter alone under PEFT's names with FSDP2, the whole PEFT model under
  its live names with FSDP1) writes the adapter as PEFT's ``save_pretrained`` does (``--format peft``, chosen from the
  ``adapter_config.json`` the protected save adds): ``PeftModel.from_pretrained`` loads the trained adapter exactly;
  what cannot be exported by name is refused before anything is written. No training of its own: the fixture's run.

Accelerate loop (``loop_roundtrip``, one job per FSDP version): ``save_state``/``load_state`` of the LoRA model restore
it exactly, a flipped byte is refused on every rank; then (FSDP2) the final ``FULL_STATE_DICT`` save many LoRA scripts
make runs native Accelerate, with the library's one "not protected" notice and no error.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.core.manifest import read_manifest, verify_manifest
from accelerate_txn.testing import launch
from tests.scenarios.crash_harness import KILLED, run_to_completion, run_until_crash_point
from tests.scenarios.peft_scenarios import tiny_peft
from tests.scenarios.trainer_kills import equal, observed, trainer_report

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
TIMEOUT = 300  # per launch: a hung group fails instead of stalling
ENTRY = "tests.scenarios.peft_scenarios"
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


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, list[dict[str, Any]]]]:
    """The Accelerate loop job (``loop_roundtrip``) of an FSDP version, run once for every test reading it."""
    done: dict[int, tuple[Path, list[dict[str, Any]]]] = {}

    def run(version: int) -> tuple[Path, list[dict[str, Any]]]:
        if version not in done:
            root = tmp_path_factory.mktemp(f"peft_loop_fsdp{version}")
            done[version] = root, launch(f"{ENTRY}:loop_roundtrip", 2, args=(str(root), version), timeout=TIMEOUT)
        return done[version]

    return run


@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_an_accelerate_loop_with_a_lora_model_saves_and_restores_it_exactly(
        loop_runs: Callable[[int], tuple[Path, list[dict[str, Any]]]], version: int) -> None:
    root, results = loop_runs(version)
    manifest = read_manifest(root / "checkpoint")
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


def test_a_lora_loop_switched_to_a_full_state_dict_save_is_protected(
        loop_runs: Callable[[int], tuple[Path, list[dict[str, Any]]]]) -> None:
    # The final FULL_STATE_DICT save after sharded LoRA training (FSDP2; under FSDP1 torch 2.13's own full gather of
    # this model segfaults on CPU, natively): the protected path takes it, with native's full files.
    root, results = loop_runs(2)
    assert [result["full_error"] for result in results] == [None, None]
    assert [result["full_warnings"] for result in results] == [[], []]  # no RuntimeWarning, ...
    assert [result["full_notices"] for result in results] == [[], []]  # ... and no "not protected" line
    manifest = read_manifest(root / "full")
    assert manifest is not None and manifest["status"] == "complete"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(manifest["files"])
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(results[0]["full_files"])


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


def _full_adapter(reference: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The trained adapter, whole, from the ranks' local shards (FSDP2: rows, FSDP1: pieces of the flat parameter;
    either way rank 0's elements then rank 1's), flattened, under the live names without FSDP1's wrapper prefix."""
    names = reference[0]["params"]["adapter"]
    return {name.replace("_fsdp_wrapped_module.", ""): torch.cat([rank["params"]["adapter"][name].flatten()
                                                                  for rank in reference]) for name in names}


def test_a_peft_trainer_checkpoint_exports_the_adapter_peft_from_pretrained_loads(
        trainer_runs: dict[str, Any], cli: Any, tmp_path: Path) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    checkpoint = trainer_runs["reference_root"] / "checkpoint-6"
    manifest = read_manifest(checkpoint)
    assert manifest is not None and "adapter_config.json" in manifest["files"]  # carried, listed and verified
    result = cli("export", checkpoint, tmp_path / "adapter", "--json")
    assert result.code == 0, result.err
    assert result.json()["format"] == "peft"  # auto: the checkpoint carries adapter_config.json
    assert result.json()["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    # PEFT's own names and shapes: exactly what get_peft_model_state_dict (save_pretrained) gives for this model.
    fresh = tiny_peft(0)[0]
    expected = {key: tuple(value.shape) for key, value in get_peft_model_state_dict(fresh).items()}
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {key: tuple(value.shape) for key, value in exported.items()} == expected
    # PEFT loads it over a base model: its adapter is the trained one, tensor by tensor.
    loaded = PeftModel.from_pretrained(LlamaForCausalLM(fresh.get_base_model().config), tmp_path / "adapter")
    parameters = dict(loaded.named_parameters())
    trained = _full_adapter(trainer_runs["reference"])
    assert len(trained) == 8
    assert [name for name, value in trained.items() if not torch.equal(parameters[name].detach().flatten(), value)] == []
    initial = dict(fresh.named_parameters())
    assert all(not torch.equal(initial[name].detach().flatten(), value) for name, value in trained.items())
    # The Python API, with the PEFT model as the configuration's source: the same adapter.
    from accelerate_txn.weights import export_dcp_to_peft

    export_dcp_to_peft(checkpoint, fresh, tmp_path / "api")
    again = load_file(tmp_path / "api" / "adapter_model.safetensors")
    assert set(again) == set(exported) and all(torch.equal(again[key], exported[key]) for key in exported)
    assert json.loads((tmp_path / "api" / "adapter_config.json").read_text())["r"] == 4


def test_what_cannot_be_exported_as_a_peft_adapter_is_refused_before_anything_is_written(
        trainer_runs: dict[str, Any], cli: Any, tmp_path: Path) -> None:
    checkpoint = trainer_runs["reference_root"] / "checkpoint-6"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    for name, change, message in [("ia3", {"peft_type": "IA3"}, "only LoRA adapters"),
                                  ("bias", {"bias": "all"}, "trains biases")]:
        (tmp_path / f"{name}.json").write_text(json.dumps({**config, **change}))
        refused = cli("export", checkpoint, tmp_path / f"{name}.json", tmp_path / name)
        assert refused.code == 1 and message in refused.err, refused.err
        assert not (tmp_path / name).exists()
    # The PEFT model's state is no transformers model: refused, not exported under names from_pretrained ignores.
    (tmp_path / "base").mkdir()
    tiny_peft(0)[0].get_base_model().config.save_pretrained(tmp_path / "base")
    model = cli("export", checkpoint, tmp_path / "base", tmp_path / "model", "--format", "transformers")
    assert model.code == 1 and "holds a PEFT model's state" in model.err and "--format peft" in model.err
    assert not (tmp_path / "model").exists()
    other = cli("export", checkpoint, tmp_path / "other", "--adapter-name", "other")
    if trainer_runs["version"] == 1:  # the whole model under live names: the adapter is chosen by its name
        assert other.code == 1 and "holds the adapter(s) ['default'], not the adapter 'other'" in other.err
        assert not (tmp_path / "other").exists()
    else:  # the adapter alone, saved under PEFT's names, which carry no adapter name
        assert other.code == 0, other.err
