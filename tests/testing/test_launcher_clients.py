"""Real public clients under the launcher (``accelerate_txn.testing.run_script``): scripts nobody wrote for
accelerate-txn run as 2-process FSDP jobs on CPU, are killed with ``SIGKILL`` mid-save, resume with their own
``--resume_from_checkpoint``, and end bitwise equal to the uninterrupted run.

* TRL's SFT script (``trl/scripts/sft.py``, the ``SFTTrainer`` a ``transformers.Trainer`` subclass): the file that
  ships in the installed ``trl`` package, copied into the test's directory with one line added,
  ``import accelerate_txn``. It runs with its defaults (``bf16``, no ``use_cpu``) and, for FSDP1, with its own
  ``--fsdp``/``--fsdp_config``: the launcher makes ``TrainingArguments`` join its gloo job and forces FSDP.

Everything is local and tiny: a 2-layer Llama and a word-level tokenizer built into the module's directory, 32 lines
of text as a ``json`` dataset directory, ``HF_HUB_OFFLINE``. One uninterrupted run per FSDP version is shared by the
tests (module-scoped fixture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.testing import ScriptResult, run_script

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600.0  # a hang guard per job (a job takes about 15 s on 2 loaded cores)
MAX_STEPS, SAVE_STEPS = 6, 2
WORDS = "the a cat dog sat ran on mat log big small red blue fast slow".split()

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]


def _build_assets(root: Path) -> None:
    """A tiny Llama with its tokenizer in ``root/model`` and a ``json`` dataset in ``root/data``: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(root / "model")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    generator = torch.Generator().manual_seed(1)
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as lines:
        for _ in range(32):
            length = int(torch.randint(4, 12, (1,), generator=generator))
            words = torch.randint(0, len(WORDS), (length,), generator=generator)
            lines.write(json.dumps({"text": " ".join(WORDS[int(i)] for i in words)}) + "\n")
    (root / "fsdp1.json").write_text(json.dumps({  # the script's own FSDP configuration (FSDP1 runs)
        "version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "SHARDED_STATE_DICT"}))
    (root / "fsdp1_full.json").write_text(json.dumps({  # the same with the Trainer's default state dict type
        "version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}))


def _sft_script(root: Path) -> Path:
    """The installed TRL's ``trl/scripts/sft.py``, unchanged but for ``import accelerate_txn`` on top."""
    trl = pytest.importorskip("trl")
    source = Path(trl.__file__).with_name("scripts") / "sft.py"
    script = root / "sft.py"
    script.write_text(f"# {source} (huggingface/trl, trl {trl.__version__}), with one line added:\n"
                      "import accelerate_txn  # noqa: F401\n" + source.read_text())
    return script


@pytest.fixture(scope="module")
def assets(tmp_path_factory: Any) -> Path:
    root = tmp_path_factory.mktemp("clients")
    _build_assets(root)
    _sft_script(root)
    return root


def _environment(assets: Path, directory: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(directory / "hf"), "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}


def _sft(assets: Path, directory: Path, fsdp: int, *args: str, env: dict[str, str] | None = None) -> ScriptResult:
    own_fsdp = ["--fsdp", "full_shard auto_wrap", "--fsdp_config", str(assets / "fsdp1.json")] if fsdp == 1 else []
    return run_script(assets / "sft.py", [
        "--model_name_or_path", str(assets / "model"), "--dataset_name", str(assets / "data"),
        "--output_dir", str(directory / "out"), "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS),
        "--per_device_train_batch_size", "2", "--max_length", "16", "--report_to", "none", "--seed", "0",
        "--logging_steps", "1", "--disable_tqdm", "true", *own_fsdp, *args],
        num_processes=2, fsdp_version=fsdp, timeout=TIMEOUT, cwd=directory,
        env={**_environment(assets, directory), **(env or {})})


def _published(directory: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (directory / "out").iterdir() if p.name.startswith("checkpoint-"))


def _dcp(path: Path, into: Path) -> dict[str, Any]:
    """A DCP directory's tensors, read in this process (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, into)
    return torch.load(into, weights_only=False)


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {key: value for name, item in state.items() for key, value in _flat(item, f"{prefix}{name}.").items()}
    return {prefix.rstrip("."): state}


def _differences(expected: Path, got: Path, scratch: Path) -> list[str]:
    """What differs between the last checkpoints of two runs: model and optimizer state, bitwise."""
    found = []
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        reference = _flat(_dcp(expected / "out" / f"checkpoint-{MAX_STEPS}" / part, scratch / f"reference-{part}.pt"))
        final = _flat(_dcp(got / "out" / f"checkpoint-{MAX_STEPS}" / part, scratch / f"final-{part}.pt"))
        assert reference.keys() == final.keys() and reference, (sorted(reference), sorted(final))
        found += [f"{part}: {name}" for name, value in reference.items()
                  if not (torch.equal(value, final[name]) if isinstance(value, torch.Tensor) else value == final[name])]
    return found


@pytest.fixture(scope="module")
def sft_reference(assets: Path, tmp_path_factory: Any) -> dict[int, Path]:
    """The uninterrupted SFT run, FSDP1 and FSDP2."""
    runs = {}
    for fsdp in (1, 2):
        directory = tmp_path_factory.mktemp(f"sft_uninterrupted_fsdp{fsdp}")
        _sft(assets, directory, fsdp).check()
        assert _published(directory) == list(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS))
        runs[fsdp] = directory
    return runs


@pytest.mark.parametrize("fsdp", [1, 2])
def test_sft_runs_at_world_size_2(sft_reference: dict[int, Path], fsdp: int) -> None:
    manifest = json.loads((sft_reference[fsdp] / "out" / f"checkpoint-{MAX_STEPS}" / "checkpoint_manifest.json")
                          .read_text())
    assert manifest["frontend"] == "transformers.Trainer"
    assert manifest["trainer"]["world_size"] == 2 and manifest["trainer"]["backend"] == f"FSDP{fsdp}"
    assert "rng_state_1.pth" in manifest["trainer"]["required"]
    state = json.loads((sft_reference[fsdp] / "out" / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    # 32 samples, 2 per rank and step, 2 ranks: 8 steps an epoch (a 1-process job would count 16)
    assert state["epoch"] == MAX_STEPS / 8


@pytest.mark.parametrize("fsdp", [1, 2])
def test_sft_killed_mid_save_resumes_and_ends_bitwise_equal(assets: Path, sft_reference: dict[int, Path],
                                                           tmp_path: Path, fsdp: int) -> None:
    # Every rank kills itself (SIGKILL) while hashing and flushing its files of the second save, checkpoint-4.
    killed = _sft(assets, tmp_path, fsdp, env={"ACCELERATE_TXN_KILL_AT": "save:during-flush#2"})
    assert killed.returncode != 0 and not killed.timed_out, killed.describe()
    assert _published(tmp_path) == [2]  # checkpoint-4 never appeared: only a hidden staging directory
    resumed = _sft(assets, tmp_path, fsdp, "--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-2")).check()
    assert _published(tmp_path) == [2, 4, 6], resumed.describe()
    assert _differences(sft_reference[fsdp], tmp_path, tmp_path) == []


def _full_differences(expected: Path, got: Path) -> list[str]:
    """What differs between the last FULL_STATE_DICT checkpoints of two runs: the whole model (``model.safetensors``,
    ``pytorch_model_fsdp.bin``) and optimizer (``optimizer.bin``), bitwise."""
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict[str, Any]:
        found = {f"model.safetensors: {k}": v for k, v in load_file(directory / "model.safetensors").items()}
        found.update({f"pytorch_model_fsdp.bin: {k}": v
                      for k, v in torch.load(directory / "pytorch_model_fsdp.bin", weights_only=True).items()})
        optimizer = torch.load(directory / "optimizer.bin", weights_only=True)
        found.update({f"optimizer.bin: {k}": v for k, v in _flat(optimizer["state"]).items()})
        # param_groups as saved, tuples included (a restore that gave betas back as a list would save a list)
        found["optimizer.bin: param_groups"] = optimizer["param_groups"]
        return found

    reference = tensors(expected / "out" / f"checkpoint-{MAX_STEPS}")
    final = tensors(got / "out" / f"checkpoint-{MAX_STEPS}")
    assert reference.keys() == final.keys() and reference, (sorted(reference), sorted(final))
    return [name for name, value in reference.items()
            if not (torch.equal(value, final[name]) if isinstance(value, torch.Tensor) else value == final[name])]


@pytest.mark.parametrize("fsdp", [1, 2])
def test_sft_with_the_trainers_default_full_state_dict_is_protected_and_resumes_bitwise_after_a_kill(
        assets: Path, tmp_path: Path, fsdp: int) -> None:
    # The Trainer's plugin with its default FULL_STATE_DICT: FSDP2 from `--fsdp full_shard` alone, FSDP1 from an
    # --fsdp_config that names no state_dict_type (FSDP1's full gather on CPU: the harness's fix of torch's CPU bugs).
    full = ["--fsdp", "full_shard"] if fsdp == 2 else ["--fsdp_config", str(assets / "fsdp1_full.json")]
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    _sft(assets, reference, fsdp, *full).check()
    manifest = json.loads((reference / "out" / "checkpoint-2" / "checkpoint_manifest.json").read_text())
    assert manifest["trainer"]["state_dict_type"] == "FULL_STATE_DICT"
    assert {"model.safetensors", "optimizer.bin", "rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"])
    # what a resume reads, which every save must have written before it is published
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(manifest["trainer"]["required"])
    # Every rank kills itself while hashing and flushing checkpoint-4: only checkpoint-2 is published.
    result = _sft(assets, killed, fsdp, *full, env={"ACCELERATE_TXN_KILL_AT": "save:during-flush#2"})
    assert result.returncode != 0 and not result.timed_out, result.describe()
    assert _published(killed) == [2]
    resumed = _sft(assets, killed, fsdp, *full, "--resume_from_checkpoint", str(killed / "out" / "checkpoint-2")).check()
    assert _published(killed) == [2, 4, 6], resumed.describe()
    assert _full_differences(reference, killed) == []
    assert not [p.name for p in (killed / "out").iterdir() if ".staging-" in p.name]
