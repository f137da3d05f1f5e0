"""``accelerate-txn export`` of a transformers model (issue 35, item 6.4): the file names transformers loads.

Regression: ``export`` wrote Diffusers names only (``diffusion_pytorch_model-*``), which
``AutoModelForCausalLM.from_pretrained`` does not find. Now ``--format auto`` (the default) writes transformers names
for a transformers config (``model_type``, no ``_class_name``): ``model.safetensors``, or numbered shards with
``model.safetensors.index.json``; Diffusers names stay for a Diffusers config.

The checkpoint is a real protected save of a tiny Llama trained one AdamW step under FSDP1 on two gloo ranks
(``accelerate_txn.testing.launch``); the export is loaded with the real ``from_pretrained``, offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn import MANIFEST
from accelerate_txn.testing import launch

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


def _assert_loads_the_trained_weights(export: Path, root: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).state_dict()
    trained = torch.load(root / "trained.pt", weights_only=True)
    assert set(loaded) == set(trained)
    different = [key for key in trained if not torch.equal(loaded[key], trained[key])]
    assert different == []
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
    assert missing.code == 2 and "carries no config.json" in missing.err
    assert f"accelerate-txn export {checkpoint} CONFIG OUTPUT" in missing.err and not (tmp_path / "out").exists()
    # A Trainer checkpoint carries config.json beside its model state: export takes it (an unlisted file no loader
    # reads, which verification accepts).
    shutil.copy(trained / "config" / "config.json", checkpoint / "config.json")
    carried = cli("export", checkpoint, tmp_path / "out", "--json")
    assert carried.code == 0, carried.err
    assert carried.json()["config"] == f"{checkpoint}/config.json" and carried.json()["format"] == "transformers"
    _assert_loads_the_trained_weights(tmp_path / "out", trained)
