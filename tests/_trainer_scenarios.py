"""Rank functions of tests/test_trainer.py: a real transformers Trainer (a tiny Llama built from a config, no
download) training with FSDP on CPU (gloo) through ``accelerate_txn.testing.force_fsdp_trainer``."""

from __future__ import annotations

import os
from typing import Any


def train(output_dir: str, resume: Any, max_steps: int, fsdp_version: int = 2,
          save_total_limit: int | None = None) -> dict[str, Any]:
    """Train to ``max_steps`` saving every 2 steps (``resume``: ``train(resume_from_checkpoint=...)``); returns this
    rank's local parameter shards, the global step and the output directory's entries."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import accelerate_txn  # noqa: F401  (the import protects Trainer checkpoints)
    from accelerate_txn.testing import force_fsdp_trainer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (64, 16), generator=generator)]
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=max_steps,
                             save_strategy="steps", save_steps=2, save_total_limit=save_total_limit, logging_steps=1,
                             report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = force_fsdp_trainer(Trainer(model=model, args=args, train_dataset=data), fsdp_version=fsdp_version,
                                 auto_wrap=LlamaDecoderLayer)
    trainer.train(resume_from_checkpoint=resume)
    local = [getattr(p, "_local_tensor", p).detach().clone() for p in trainer.model.parameters()]
    return {"weights": local, "step": trainer.state.global_step, "entries": sorted(os.listdir(output_dir)),
            "best": trainer.state.best_model_checkpoint}
