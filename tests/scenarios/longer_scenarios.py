"""Code that runs inside launched ranks for tests/accelerate/test_train_longer.py: train a 40-step schedule, save, resume with
an 80-step one (FSDP1 on CPU, gloo), against a run that was never interrupted."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from diffusers.optimization import get_scheduler

from accelerate_txn import configure_checkpointing
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error, _local_state, _same
from tests.support.log_records import WarningRecords

BASE_LR = 1e-2
WARMUP = 2
SAVED_STEPS = 4  # optimizer steps before the save (past the warmup: the two schedules differ there)
MORE_STEPS = 3  # optimizer steps after it
DATA_SEED = 21


def _build(seed: int, total: int, warmup: int = WARMUP) -> tuple[Any, Any, Any, Any]:
    accelerator = fsdp_accelerator()
    torch.manual_seed(seed)
    model = accelerator.prepare(TinyModel())  # FSDP1: build the optimizer on the wrapped model
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=total)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _schedule(total: int, warmup: int = WARMUP) -> Any:
    """The function diffusers' cosine schedule of that length follows (built on a throwaway optimizer)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    return get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=total).lr_lambdas[0]


def _train(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, steps: int,
           forced: list[float] | None = None) -> tuple[list[float], list[int]]:
    """``steps`` optimizer steps on this rank's fixed batches; returns the learning rate each step used and the
    scheduler step it started at. ``forced``: set those rates before each step instead of the scheduler's."""
    generator = torch.Generator().manual_seed(DATA_SEED + accelerator.process_index)
    used, epochs = [], []
    for index in range(steps):
        if forced is not None:
            for group in optimizer.param_groups:
                group["lr"] = forced[index]
        used.append(optimizer.param_groups[0]["lr"])
        epochs.append(scheduler.scheduler.last_epoch)
        loss = model(torch.randn(4, 16, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return used, epochs


def train_longer(root: str) -> dict[str, Any]:
    path = Path(root).absolute() / "ckpt"
    obs: dict[str, Any] = {"path": str(path)}
    records = WarningRecords()
    logging.getLogger("accelerate_txn").addHandler(records)

    # The run as first planned: a 40-step schedule, saved after SAVED_STEPS optimizer steps.
    accelerator, model, optimizer, scheduler = _build(0, total=40)
    _train(accelerator, model, optimizer, scheduler, SAVED_STEPS)
    accelerator.save_state(str(path))
    restored_epoch = scheduler.scheduler.last_epoch
    per_step = restored_epoch // SAVED_STEPS  # Accelerate steps the scheduler once per process per optimizer step
    epochs = [restored_epoch + per_step * index for index in range(MORE_STEPS)]
    longer = _schedule(80)
    obs["lrs_80"] = [BASE_LR * longer(epoch) for epoch in epochs]  # an 80-step schedule at those steps
    obs["lr_40_at_resume"] = BASE_LR * _schedule(40)(restored_epoch)
    # Reference: the same run, never interrupted, switched to the 80-step schedule's rates from here on.
    obs["reference_lrs"], _ = _train(accelerator, model, optimizer, scheduler, MORE_STEPS, forced=obs["lrs_80"])
    reference = _local_state(model, optimizer)

    # The resume with an 80-step schedule (other initial weights: the restore must bring everything back).
    records.messages.clear()
    accelerator, model, optimizer, scheduler = _build(7, total=80)
    accelerator.load_state(str(path))
    obs["change_lines"] = [line for line in records.messages if "with changes" in line]
    obs["resumed_lrs"], obs["resumed_epochs"] = _train(accelerator, model, optimizer, scheduler, MORE_STEPS)
    obs["epochs"] = epochs
    obs["differences"] = _same(reference, _local_state(model, optimizer))

    # A warmup change is refused on every rank and changes nothing; accepted by the name the refusal prints.
    accelerator, model, optimizer, scheduler = _build(11, total=80, warmup=3)
    before = (_local_state(model, optimizer), optimizer.param_groups[0]["lr"], scheduler.scheduler.last_epoch)
    obs["warmup_refusal"] = _error(lambda: accelerator.load_state(str(path)))
    after = (_local_state(model, optimizer), optimizer.param_groups[0]["lr"], scheduler.scheduler.last_epoch)
    obs["refusal_changed_nothing"] = _same(before[0], after[0]) == [] and before[1:] == after[1:]
    names = re.findall(r"accept_changes=(\[.*?\])\)", (obs["warmup_refusal"] or {}).get("message", ""))
    configure_checkpointing(accelerator, accept_changes=json.loads(names[0]) if names else [])
    accelerator.load_state(str(path))
    obs["accepted_warmup_lr"] = optimizer.param_groups[0]["lr"]
    obs["lr_warmup3_at_resume"] = BASE_LR * _schedule(80, warmup=3)(restored_epoch)
    logging.getLogger("accelerate_txn").removeHandler(records)
    return obs
