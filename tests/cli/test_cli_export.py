"""``accelerate-txn export`` of a transformers model (issue 35, item 6.4): the file names transformers loads.

Regression: ``export`` wrote Diffusers names only (``diffusion_pytorch_model-*``), which
``AutoModelForCausalLM.from_pretrained`` does not find. Now ``--format auto`` (the default) writes transformers names
for a transformers config (``model_type``, no ``_class_name``): ``model.safetensors``, or numbered shards with
``model.safetensors.index.json``; Diffusers names stay for a Diffusers config.

Regression (issue 46, item 1): without a config, ``export`` said "a Trainer checkpoint does [carry config.json]"; a
Trainer checkpoint saved under FSDP with ``SHARDED_STATE_DICT`` carries none. The message now says so and names
``--config`` (a config.json, a model directory, or a model id of the local Hugging Face cache).

The checkpoints are real protected saves of a tiny Llama: one AdamW step under FSDP1 on two gloo ranks
(``accelerate_txn.testing.launch``), and a real transformers Trainer's ``checkpoint-2`` under FSDP2; the exports are
loaded with the real ``from_pretrained``, offline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn import MANIFEST
from accelerate_txn.testing import launch

REPO = Path(__file__).resolve().parents[2]
TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def train_one_step_and_save(root: str) -> dict[str, Any]:
    """In each of 2 ranks: a tiny Llama under FSDP1, one real AdamW step on a language-modelling loss, a protected
    save_state(); rank 0 also keeps the trained full weights (gathered) and the model's config."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import accelerate_txn  # noqa: F401  (installs the patch)
    from accelerate_txn.testing import fsdp_accelerator

    accelerator = fsdp_accelerator()
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    accelerator.save_state(f"{root}/checkpoints/checkpoint_0")
    # The trained weights, gathered by FSDP itself (not through a state dict): what the export must hold.
    with FSDP.summon_full_params(model, writeback=False):
        full = {name.replace("_fsdp_wrapped_module.", ""): value.detach().clone()
                for name, value in accelerator.unwrap_model(model).named_parameters()}
    if accelerator.is_main_process:
        torch.save(full, f"{root}/trained.pt")
        accelerator.unwrap_model(model).config.save_pretrained(f"{root}/config")
    accelerator.wait_for_everyone()
    return {"rank": accelerator.process_index}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llama")
    launch(train_one_step_and_save, 2, args=(str(root),), timeout=300)
    assert (root / "checkpoints" / "checkpoint_0" / MANIFEST).is_file()  # a protected save
    return root


def _assert_loads(export: Path, trained: dict[str, torch.Tensor]) -> None:
    """``export`` loads with the real ``from_pretrained`` (offline) and holds exactly ``trained``."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).state_dict()
    assert set(loaded) == set(trained)
    different = [key for key in trained if not torch.equal(loaded[key], trained[key])]
    assert different == []


def _assert_loads_the_trained_weights(export: Path, root: Path) -> None:
    trained = torch.load(root / "trained.pt", weights_only=True)
    _assert_loads(export, trained)
    initial = _tiny_llama().state_dict()  # the step changed the weights: the export is of the trained model
    assert any(not torch.equal(initial[key], trained[key]) for key in trained)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_export_of_a_transformers_model_loads_with_from_pretrained(cli: Any, trained: Path, tmp_path: Path) -> None:
    checkpoint = trained / "checkpoints" / "checkpoint_0"
    single = cli("export", checkpoint, trained / "config", tmp_path / "single", "--json")
    assert single.code == 0, single.err
    assert single.json()["format"] == "transformers"  # auto: the config has model_type
    assert single.json()["files"] == ["config.json", "model.safetensors"]
    _assert_loads_the_trained_weights(tmp_path / "single", trained)

    sharded = cli("export", checkpoint, trained / "config" / "config.json", tmp_path / "sharded",
                  "--max-shard-size", "8KiB", "--json")
    assert sharded.code == 0, sharded.err
    shards = [name for name in sharded.json()["files"] if name.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    _assert_loads_the_trained_weights(tmp_path / "sharded", trained)

    # --format diffusers keeps Diffusers' names, which transformers does not load.
    diffusers = cli("export", checkpoint, trained / "config", tmp_path / "diffusers", "--format", "diffusers", "--json")
    assert diffusers.code == 0 and diffusers.json()["format"] == "diffusers"
    assert "diffusion_pytorch_model.safetensors.index.json" in diffusers.json()["files"]
    assert not any(name.startswith("model") for name in diffusers.json()["files"])


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_export_without_config_takes_the_one_the_checkpoint_carries_or_says_what_to_pass(
        cli: Any, trained: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint_0"
    shutil.copytree(trained / "checkpoints" / "checkpoint_0", checkpoint)
    missing = cli("export", checkpoint, tmp_path / "out")
    assert missing.code == 2 and f"{checkpoint} carries no config.json: an Accelerate save_state() checkpoint" in missing.err
    assert f"'accelerate-txn export {checkpoint} {tmp_path / 'out'} --config MODEL'" in missing.err
    assert not (tmp_path / "out").exists()
    # --config: a config.json, or the directory holding it (the same as CONFIG); both at once, or neither a path nor a
    # cached model id, is a usage error before anything is read.
    option = cli("export", checkpoint, tmp_path / "option", "--config", trained / "config", "--json")
    assert option.code == 0, option.err
    assert option.json()["config"] == str(trained / "config" / "config.json") and option.json()["format"] == "transformers"
    _assert_loads_the_trained_weights(tmp_path / "option", trained)
    twice = cli("export", checkpoint, trained / "config", tmp_path / "twice", "--config", trained / "config")
    assert twice.code == 2 and "the config is given twice" in twice.err
    absent = cli("export", checkpoint, tmp_path / "absent", "--config", "no-such/model")
    assert absent.code == 2 and "--config no-such/model: no such file or directory, and no model 'no-such/model'" in \
        absent.err and "'hf download no-such/model config.json'" in absent.err
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = cli("export", checkpoint, tmp_path / "nothing", "--config", empty)
    assert nothing.code == 2 and f"--config {empty}: the directory holds no config.json" in nothing.err
    assert not any((tmp_path / name).exists() for name in ("twice", "absent", "nothing"))
    # A Trainer checkpoint carries config.json beside its model state: export takes it (an unlisted file no loader
    # reads, which verification accepts).
    shutil.copy(trained / "config" / "config.json", checkpoint / "config.json")
    carried = cli("export", checkpoint, tmp_path / "out", "--json")
    assert carried.code == 0, carried.err
    assert carried.json()["config"] == f"{checkpoint}/config.json" and carried.json()["format"] == "transformers"
    _assert_loads_the_trained_weights(tmp_path / "out", trained)


# --------------------------------------------------------------------------------------------- a Trainer checkpoint


def train_with_trainer_and_save(root: str) -> dict[str, Any]:
    """In each of 2 ranks: a real transformers Trainer on FSDP2 (SHARDED_STATE_DICT) trains 2 steps and saves
    checkpoint-2 (protected); rank 0 also keeps the trained full weights (gathered by DCP's get_model_state_dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.scenarios.trainer_scenarios import build

    trainer = build(f"{root}/run", 2, fsdp_version=2)
    trainer.train()
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.accelerator.is_main_process:
        torch.save(full, f"{root}/trained.pt")
    return {"rank": trainer.accelerator.process_index}


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 of a real Trainer run under FSDP2 (no config.json in it), the trained weights, and ``base/``: the
    model directory the training started from (save_pretrained of the same tiny Llama), as a user has one."""
    from tests.scenarios.trainer_scenarios import tiny_llama

    root = tmp_path_factory.mktemp("trainer_fsdp2")
    launch(train_with_trainer_and_save, 2, args=(str(root),), timeout=300)
    tiny_llama(1)[0].save_pretrained(root / "base")
    return root


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_export_of_a_trainer_fsdp_checkpoint_says_to_pass_config_and_loads_with_it(cli: Any, trainer_run: Path,
                                                                                    tmp_path: Path) -> None:
    # Regression (issue 46, item 1): the message said a Trainer checkpoint carries config.json; under FSDP with
    # SHARDED_STATE_DICT it does not (Trainer writes it only with a full-model save).
    checkpoint = trainer_run / "run" / "checkpoint-2"
    assert (checkpoint / MANIFEST).is_file() and (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert not (checkpoint / "config.json").exists()
    missing = cli("export", checkpoint, tmp_path / "out", "--json")
    assert missing.code == 2 and missing.out == ""
    assert f"{checkpoint} carries no config.json" in missing.err
    assert "nor does a Trainer checkpoint saved under FSDP with SHARDED_STATE_DICT" in missing.err
    assert f"'accelerate-txn export {checkpoint} {tmp_path / 'out'} --config MODEL'" in missing.err
    assert not (tmp_path / "out").exists()

    exported = cli("export", checkpoint, tmp_path / "out", "--config", trainer_run / "base", "--json")
    assert exported.code == 0, exported.err
    assert exported.json()["format"] == "transformers" and exported.json()["files"] == ["config.json",
                                                                                      "model.safetensors"]
    assert exported.json()["config"] == str(trainer_run / "base" / "config.json")
    _assert_loads(tmp_path / "out", torch.load(trainer_run / "trained.pt", weights_only=True))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_export_config_may_be_a_model_id_of_the_local_hugging_face_cache(trainer_run: Path, tmp_path: Path) -> None:
    """``--config ORG/NAME`` finds the config where from_pretrained finds it offline (``HF_HUB_CACHE``), as a real
    ``python -m accelerate_txn`` reads it from its environment; nothing is downloaded."""
    revision = "0" * 40
    snapshot = tmp_path / "hub" / "models--tiny--llama" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    shutil.copy(trainer_run / "base" / "config.json", snapshot / "config.json")
    (tmp_path / "hub" / "models--tiny--llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--llama" / "refs" / "main").write_text(revision)
    environment = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    checkpoint = trainer_run / "run" / "checkpoint-2"

    def export(model_id: str, output: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "accelerate_txn", "export", str(checkpoint), str(output),
                               "--config", model_id, "--json"], capture_output=True, text=True, timeout=300,
                              env=environment, cwd=REPO)

    done = export("tiny/llama", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["config"] == str(snapshot / "config.json")
    _assert_loads(tmp_path / "out", torch.load(trainer_run / "trained.pt", weights_only=True))
    absent = export("tiny/other", tmp_path / "other")
    assert absent.returncode == 2 and "no model 'tiny/other' with a config.json in the local Hugging Face cache" in \
        absent.stderr and "Traceback" not in absent.stderr and not (tmp_path / "other").exists()
