"""FSDP2 ranks of the corruption suite: tests/scenarios/corruption_scenarios.py's matrix on Accelerate's FSDP2.

Launched by tests/core/test_corruption_fsdp2.py as ``tests.scenarios.corruption_fsdp2:corruption_matrix``. Everything (the save,
every file class x every damage, the crafted pickles, the unlisted files, the before/after comparison of every
piece of live state) is tests/scenarios/corruption_scenarios.py's; this module only chooses, for this rank process, an
FSDP2 run (``fsdp_version=2``: ``fully_shard`` per ``Linear``, DTensor parameters; model, optimizer and scheduler
prepared together) with the same scheduler, gradient scaler, custom object and registered private state (the shared
snapshot compares the DTensors' local shards: what this rank saves and must leave unchanged, or restore, bitwise).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import register_checkpoint_state
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios import corruption_scenarios as scenarios


def build(seed: int, *, width: int = 16, project_dir: Path | None = None, auto: bool = False) -> scenarios.Run:
    """``corruption_scenarios._build`` on FSDP2: scheduler, CPU gradient scaler, custom object, private state."""
    acc = fsdp_accelerator(fsdp_version=2, project_dir=project_dir, automatic_checkpoint_naming=auto)
    torch.manual_seed(seed)
    raw = TinyModel(width=width)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(scenarios.warmup, steps=3))
    model, opt, sched = acc.prepare(raw, opt, sched)  # FSDP2: prepared together
    noise = torch.Generator().manual_seed(100 + 10 * seed + scenarios._rank())
    progress = {"batches": 0}
    register_checkpoint_state(acc, {"noise": noise}, progress)
    counter = scenarios.Counter(seed)
    acc.register_for_checkpointing(counter)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (4 + seed % 7))  # as in _build: scaler.pt on CPU
    return scenarios.Run(acc, model, opt, sched, noise, progress, counter, width)


def corruption_matrix(root: str) -> dict[str, Any]:
    """``corruption_scenarios.corruption_matrix`` on FSDP2, plus what shows the run was FSDP2 and protected.

    The module-level builder is rebound in this rank process only (it runs nothing else), before the run.
    """
    scenarios._build = build
    obs = scenarios.corruption_matrix(root)
    probe = build(3)
    obs["dtensor"] = [type(p).__name__ for p in probe.model.parameters()]
    return obs
