"""Rank functions of tests/trainer/test_peft.py: LoRA fine-tuning (``peft.get_peft_model`` on a tiny Llama built from a
config, no download) under real 2-rank FSDP1 and FSDP2 on CPU (gloo), through the transformers Trainer
(``force_fsdp_trainer``) and through an Accelerate loop (``save_state``/``load_state``).

* :func:`trainer_train` trains with ``save_steps=2`` (optionally resuming) and returns this rank's parameter shards
  (adapter and frozen base apart), its optimizer state when training began, at each save and at the end;
* :func:`main` is the entry of a crash-harness job (``tests.scenarios.crash_harness.Job``) running :func:`trainer_train`;
* :func:`trainer_refuse` resumes from a named (damaged) checkpoint and reports the error and whether the model is
  untouched;
* :func:`loop_roundtrip` trains an Accelerate loop, ``save_state``, trains on, ``load_state`` into a fresh model and
  optimizer, and compares.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from tests.scenarios.trainer_scenarios import crash_entry, optimizer_state

LORA_TARGETS = ["q_proj", "v_proj"]


def tiny_peft(samples: int) -> tuple[Any, list[dict[str, Any]]]:
    """A tiny Llama (seeded) wrapped with a LoRA adapter on ``q_proj``/``v_proj`` (both LoRA matrices initialised
    non-zero, so the adapter changes the outputs from the start), and ``samples`` token sequences."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                                lora_dropout=0.0, init_lora_weights="gaussian"))
    generator = torch.Generator().manual_seed(1)
    return model, [{"input_ids": ids, "labels": ids}
                   for ids in torch.randint(0, 128, (samples, 16), generator=generator)]


def _split(model: Any) -> dict[str, dict[str, Any]]:
    """This rank's local parameter shards, adapter (trainable) and base (frozen) apart, keyed by name."""
    parts: dict[str, dict[str, Any]] = {"adapter": {}, "base": {}}
    for name, parameter in model.named_parameters():
        local = getattr(parameter, "_local_tensor", parameter).detach().clone()
        parts["adapter" if parameter.requires_grad else "base"][name] = local
    return parts


def build_trainer(output_dir: str, max_steps: int, fsdp_version: int) -> Any:
    from transformers import Trainer, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import accelerate_txn  # noqa: F401  (the import protects Trainer checkpoints)
    from accelerate_txn.testing import force_fsdp_trainer

    model, data = tiny_peft(64)
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=max_steps,
                             save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-2)
    return force_fsdp_trainer(Trainer(model=model, args=args, train_dataset=data), fsdp_version=fsdp_version,
                              auto_wrap=LlamaDecoderLayer)


def trainer_train(output_dir: str, resume: Any, max_steps: int, fsdp_version: int,
                  began_file: str | None = None) -> dict[str, Any]:
    """Train to ``max_steps`` (saving every 2 steps; ``resume``: ``train(resume_from_checkpoint=...)``); returns this
    rank's parameters (adapter and base apart) when training began and at the end, its optimizer state when training
    began, at each save and at the end, the global steps and the output directory's entries."""
    import torch
    from transformers import TrainerCallback

    trainer = build_trainer(output_dir, max_steps, fsdp_version)
    began: dict[str, Any] = {}
    saved: dict[int, Any] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # after a restore
            began.update(step=state.global_step, optimizer=optimizer_state(trainer.optimizer),
                         params=_split(trainer.model))
            if began_file:
                torch.save(began, began_file)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            saved[state.global_step] = optimizer_state(trainer.optimizer)

    trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=resume)
    return {"params": _split(trainer.model), "step": trainer.state.global_step, "began": began,
            "optimizer": optimizer_state(trainer.optimizer), "optimizer_at_save": saved,
            "entries": sorted(os.listdir(output_dir))}


def trainer_refuse(output_dir: str, checkpoint: str, fsdp_version: int) -> dict[str, Any]:
    """Resume from ``checkpoint`` (damaged by the test); returns this rank's error (``type: message``, or
    ``"loaded"``) and whether the model kept every local parameter shard and Trainer its step."""
    import torch

    trainer = build_trainer(output_dir, 6, fsdp_version)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
        error = "loaded"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    untouched = trainer.state.global_step == 0 and all(
        torch.equal(a, getattr(b, "_local_tensor", b).detach()) for a, b in zip(before, trainer.model.parameters()))
    return {"error": error, "untouched": untouched}


def main(spec_path: str) -> None:
    """Entry of one rank of a crash-harness job (``tests.scenarios.trainer_scenarios.crash_entry``): ``spec`` =
    ``{"output_dir", "resume", "max_steps", "fsdp_version", "kill", "obs"}``; writes ``obs/rank{R}.began.pt`` when
    training begins."""
    crash_entry(spec_path, lambda spec, obs, rank: trainer_train(
        spec["output_dir"], spec.get("resume"), spec["max_steps"], spec["fsdp_version"],
        began_file=str(obs / f"rank{rank}.began.pt")))


def _loop_build(version: int) -> tuple[Any, Any, Any, list[dict[str, Any]]]:
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import accelerate_txn  # noqa: F401  (the import protects save_state/load_state)
    from accelerate_txn.testing import fsdp_accelerator

    accelerator = fsdp_accelerator(fsdp_version=version, auto_wrap=LlamaDecoderLayer)
    model, data = tiny_peft(16)
    if version == 1:  # FSDP1: the optimizer over the wrapped model's (original, use_orig_params) parameters
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                          lr=1e-2))
    else:  # FSDP2: prepared together
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, data


def _loop_steps(accelerator: Any, model: Any, optimizer: Any, data: list[dict[str, Any]], start: int,
                count: int) -> None:
    import torch

    for step in range(start, start + count):
        rows = [data[(2 * step + accelerator.process_index + 4 * i) % len(data)]["input_ids"] for i in range(2)]
        batch = torch.stack(rows)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def loop_roundtrip(root: str, version: int) -> dict[str, Any]:
    """An Accelerate loop fine-tuning the LoRA model: 3 steps, ``save_state``, 2 more steps, ``load_state`` (the
    trained adapter, the frozen base and the optimizer must come back bitwise), then a flipped byte in the checkpoint's
    model shard: ``load_state`` must refuse it on every rank with the model untouched. Returns this rank's findings."""
    import torch.distributed as dist

    from accelerate_txn import CheckpointError

    accelerator, model, optimizer, data = _loop_build(version)
    fresh = _split(model)
    _loop_steps(accelerator, model, optimizer, data, 0, 3)
    checkpoint = Path(root) / "checkpoint"
    accelerator.save_state(str(checkpoint))
    saved = {"params": _split(model), "optimizer": optimizer_state(optimizer)}
    _loop_steps(accelerator, model, optimizer, data, 3, 2)
    moved = not _equal_parts(_split(model)["adapter"], saved["params"]["adapter"])
    accelerator.load_state(str(checkpoint))
    restored = {"params": _split(model), "optimizer": optimizer_state(optimizer)}
    result = {"moved": moved, "files": sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*")
                                              if p.is_file()),
              "adapter_restored": _equal_parts(restored["params"]["adapter"], saved["params"]["adapter"]),
              "base_unchanged": _equal_parts(restored["params"]["base"], fresh["base"]),
              "adapter_trained": not _equal_parts(restored["params"]["adapter"], fresh["adapter"]),
              "optimizer_saved": bool(saved["optimizer"]),
              "optimizer_restored": _equal_rows(restored["optimizer"], saved["optimizer"])}
    # A flipped byte in rank 1's model shard: refused on every rank before anything is restored.
    _loop_steps(accelerator, model, optimizer, data, 3, 1)
    before = {"params": _split(model), "optimizer": optimizer_state(optimizer)}
    if accelerator.process_index == 0:
        shard = checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
    dist.barrier()
    try:
        accelerator.load_state(str(checkpoint))
        result["corrupt"] = "loaded"
    except CheckpointError as exc:
        result["corrupt"] = f"{type(exc).__name__}: {exc}"
    after = {"params": _split(model), "optimizer": optimizer_state(optimizer)}
    result["corrupt_untouched"] = (_equal_parts(after["params"]["adapter"], before["params"]["adapter"])
                                   and _equal_parts(after["params"]["base"], before["params"]["base"])
                                   and _equal_rows(after["optimizer"], before["optimizer"]))
    if version == 2:  # (FSDP1: torch 2.13's own FULL_STATE_DICT gather of this LoRA model segfaults on CPU, natively)
        result.update(_full_state_dict_save(accelerator, Path(root) / "full"))
    return result


def _full_state_dict_save(accelerator: Any, directory: Path) -> dict[str, Any]:
    """The final full save LoRA scripts make (``set_state_dict_type("FULL_STATE_DICT")`` after sharded training),
    which the protected path takes. Returns the library's warnings and notices, the error (``None``) and the
    files written."""
    import logging

    class Notices(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    plugin = accelerator.state.fsdp_plugin
    plugin.state_dict_config = plugin.optim_state_dict_config = None  # the FULL configs, as Accelerate sets them
    plugin.set_state_dict_type("FULL_STATE_DICT")
    notices, logger = Notices(), logging.getLogger("accelerate_txn")
    level = logger.level
    logger.addHandler(notices)
    logger.setLevel(logging.INFO)
    error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                accelerator.save_state(str(directory))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
    finally:
        logger.removeHandler(notices)
        logger.setLevel(level)
    accelerator.wait_for_everyone()
    return {"full_warnings": [str(w.message) for w in caught if "accelerate-txn" in str(w.message)],
            "full_notices": [line for line in notices.lines if "NOT protected" in line], "full_error": error,
            "full_files": sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []}


def _equal_parts(one: dict[str, Any], other: dict[str, Any]) -> bool:
    import torch

    return set(one) == set(other) and all(torch.equal(one[name], other[name]) for name in one)


def _equal_rows(one: list[Any], other: list[Any]) -> bool:
    from tests.scenarios.trainer_kills import equal

    return equal(one, other)
