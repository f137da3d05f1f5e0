"""The command line as a new user meets it, round 3 (issue 46, items 2 to 5).

Regressions:

* ``verify`` (``inspect``, ``diff``) of an exported PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
  exited 1 calling it "a legacy (native Accelerate) checkpoint" that ``load_state()`` would resume: any directory of
  model weights alone (an adapter, a model directory for ``from_pretrained``, bare weight files) is now a usage error
  (exit 2) saying what it is and what to run instead; so is a directory inside a checkpoint.
* A missing or too-short ``--key`` file exited 1: it is a bad option value, exit 2, on every command with ``--key``,
  the message naming the file and the fix.
* ``prune`` had no ``--key`` (keys only through the environment).
* ``diff`` of a Trainer checkpoint and an Accelerate one printed ``components: [] (saved) vs [''] (live)``.

Every directory is real: protected one-process saves (Accelerate, and a real transformers Trainer for ``diff``), a
model and an adapter written by transformers' and PEFT's own ``save_pretrained``.
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from accelerate_txn import MANIFEST, configure_checkpointing, save_training_checkpoint
from accelerate_txn.core import signing
from tests.cli.test_cli import accelerator, save

pytestmark = pytest.mark.timeout(300)


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))


@pytest.fixture(scope="module")
def not_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Directories that are no checkpoint: a PEFT adapter (PEFT's save_pretrained), a model directory
    (transformers' save_pretrained), bare weight files; and a real checkpoint, for a directory inside it."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("not_checkpoints")
    model = _tiny_llama()
    model.save_pretrained(root / "model")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(root / "adapter")
    (root / "weights").mkdir()
    save_file({"layer.weight": torch.zeros(2, 2)}, root / "weights" / "weights.safetensors")
    checkpoint = save(root / "run" / "checkpoint_0")
    (checkpoint / "part").mkdir()  # a directory inside a checkpoint (as a component's or an FSDP directory would be)
    return {"adapter": root / "adapter", "model": root / "model", "weights": root / "weights",
            "checkpoint": checkpoint}


# --------------------------------------------------------------------------------------------- item 2

KINDS = {
    "adapter": "is not a checkpoint: it is a PEFT adapter (adapter_config.json, adapter_model.safetensors)",
    "model": "is not a checkpoint: it is a model directory (config.json, model.safetensors)",
    "weights": "is not a checkpoint: it is a directory of model weights only (weights.safetensors)",
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_directory_of_model_weights_is_a_usage_error_saying_what_it_is_not_a_legacy_checkpoint(
        cli: Any, not_checkpoints: dict[str, Path], kind: str) -> None:
    path = not_checkpoints[kind]
    before = sorted(p.name for p in path.iterdir())
    for args in (["verify", path], ["verify", path, "--json"], ["inspect", path],
                 ["diff", path, not_checkpoints["checkpoint"]]):
        result = cli(*args)
        assert result.code == 2, (args, result.code, result.err)
        assert result.out == ""  # --json too: a usage error prints nothing on stdout
        assert f"{path} {KINDS[kind]}" in result.err, result.err
        assert "legacy" not in result.err and "would resume from it" not in result.err
        assert "holds none of the training state a checkpoint holds" in result.err
        assert "'accelerate-txn list RUN_DIR' lists a run's" in result.err
    if kind == "adapter":
        assert "PeftModel.from_pretrained(base_model, DIR)" in result.err
    if kind == "model":
        assert "from_pretrained(DIR)" in result.err
    assert sorted(p.name for p in path.iterdir()) == before  # nothing written


def test_a_directory_inside_a_checkpoint_names_the_checkpoint_to_pass(cli: Any,
                                                                      not_checkpoints: dict[str, Path]) -> None:
    checkpoint = not_checkpoints["checkpoint"]
    result = cli("verify", checkpoint / "part")
    assert result.code == 2 and result.out == ""
    assert (f"{checkpoint / 'part'} is inside the checkpoint {checkpoint}, not a checkpoint itself: pass the "
            f"checkpoint, 'accelerate-txn verify {checkpoint}'") in result.err
    assert cli("verify", checkpoint).code == 0


def test_a_manifest_less_checkpoint_n_of_weights_alone_stays_legacy_as_list_shows_it(
        cli: Any, not_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # Named checkpoint_N in a run directory, model weights alone are an unfinished native save (list: legacy; load_state()
    # may select it): verify says so, exit 1, as before.
    run = tmp_path / "run"
    shutil.copytree(not_checkpoints["weights"], run / "checkpoint_3")
    verify = cli("verify", run / "checkpoint_3")
    assert verify.code == 1 and "a legacy (native Accelerate) checkpoint or an unfinished native save" in verify.err
    listed = cli("list", run, "--json")
    assert [row["status"] for row in listed.json()["checkpoints"]] == ["legacy"]


# --------------------------------------------------------------------------------------------- items 3 and 4


def _hmac_key(path: Path) -> Path:
    path.write_text(secrets.token_hex(32) + "\n")
    return path


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """checkpoint_0..2 of one run, saved under an HMAC signing key (pristine: tests copy it), and the key file."""
    root = tmp_path_factory.mktemp("signed")
    key = _hmac_key(root / "signing.hex")
    trainer = configure_checkpointing(accelerator(), signing_key=key)
    for number in range(3):
        trainer.step = number
        save_training_checkpoint(trainer, root / "run" / f"checkpoint_{number}")
    return root / "run", key


KEY_COMMANDS = {
    "verify": lambda run: ["verify", run / "checkpoint_0"],
    "list": lambda run: ["list", run],
    "latest": lambda run: ["latest", run],
    "prune": lambda run: ["prune", run, "--keep", "1"],
}


@pytest.mark.parametrize("command", sorted(KEY_COMMANDS))
def test_a_missing_or_short_key_file_is_a_usage_error_naming_the_file(cli: Any, signed_run: tuple[Path, Path],
                                                                      tmp_path: Path, command: str) -> None:
    source, _key = signed_run
    run = shutil.copytree(source, tmp_path / "run")
    short = tmp_path / "short.hex"
    short.write_text("abcd\n")
    for key, says in ((tmp_path / "missing.hex", f"Cannot read the key file {tmp_path / 'missing.hex'}: No such file"),
                      (short, f"The HMAC key file {short} holds 4 hex digits: use an even number, at least 64")):
        result = cli(*KEY_COMMANDS[command](run), "--key", key, "--json")
        assert result.code == 2, (command, key, result.code, result.err)
        assert result.out == "" and "Invalid value for '--key'" in result.err and says in result.err, result.err
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in source.iterdir())  # prune deleted nothing


def test_prune_takes_key_as_verify_list_and_latest_do(cli: Any, signed_run: tuple[Path, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    source, key = signed_run
    run = shutil.copytree(source, tmp_path / "run")
    other = _hmac_key(tmp_path / "other.hex")
    # The environment names a key that signed none of them: not one checkpoint is complete, so prune deletes nothing.
    monkeypatch.setenv(signing.VERIFY_KEYS_ENV, str(other))
    refused = cli("prune", run, "--keep", "1", "--json")
    assert refused.code == 0 and refused.json()["deleted"] == [] and refused.json()["run_id"] is None, refused.err
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    # --key names the signing key instead of the environment's: the rule applies as without keys.
    dry = cli("prune", run, "--keep", "1", "--dry-run", "--key", key, "--json")
    assert dry.code == 0 and dry.json()["would_delete"] == [str(run / "checkpoint_0"), str(run / "checkpoint_1")]
    pruned = cli("prune", run, "--keep", "1", "--key", key, "--json")
    assert pruned.code == 0 and pruned.json()["deleted"] == [str(run / "checkpoint_0"), str(run / "checkpoint_1")]
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_2"]
    assert "--key FILE" in cli("prune", "--help").out


# --------------------------------------------------------------------------------------------- item 5


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 of a real one-process transformers Trainer (protected: the library is imported)."""
    from transformers import Trainer, TrainingArguments

    import accelerate_txn  # noqa: F401  (protects Trainer checkpoints)

    root = tmp_path_factory.mktemp("trainer")
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(root), use_cpu=True, per_device_train_batch_size=4, max_steps=2,
                             save_strategy="steps", save_steps=2, report_to=[], seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    Trainer(model=_tiny_llama(), args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids]).train()
    checkpoint = root / "checkpoint-2"
    assert json.loads((checkpoint / MANIFEST).read_text())["frontend"] == "transformers.Trainer"
    return checkpoint


def test_diff_of_a_trainer_and_an_accelerate_checkpoint_names_both_front_ends(cli: Any, trainer_checkpoint: Path,
                                                                              not_checkpoints: dict[str, Path]) -> None:
    accelerate = not_checkpoints["checkpoint"]
    result = cli("diff", trainer_checkpoint, accelerate)
    assert result.code == 1
    assert ("  components: a Trainer checkpoint (no named components) (saved) vs an Accelerate checkpoint (the default "
            "component: one Accelerator) (live)") in result.out.splitlines()
    assert "[]" not in result.out and "['']" not in result.out
    reverse = cli("diff", accelerate, trainer_checkpoint, "--json")
    assert reverse.code == 1
    (blocker,) = reverse.json()["blockers"]
    assert blocker["message"] == (
        "A is an Accelerate checkpoint (the default component: one Accelerator), B is a Trainer checkpoint (no named "
        "components): a checkpoint is resumed by the front end that saved it: Trainer's "
        "train(resume_from_checkpoint=...) or Accelerate's load_state()")


def test_diff_of_accelerate_checkpoints_with_other_components_names_them() -> None:
    from accelerate_txn.cli._describe import resume_blockers

    (blocker,) = resume_blockers({"components": {"": {}}}, {"components": {"gen": {}, "disc": {}}})
    assert blocker["differences"] == [
        "components: an Accelerate checkpoint (the default component: one Accelerator) (saved) vs an Accelerate "
        "checkpoint with components 'disc', 'gen' (live)"]
    assert blocker["message"].endswith(": load_state() needs the same components")
