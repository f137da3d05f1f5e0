"""Code that runs inside launched ranks for tests/accelerate/test_loader_changes.py: save mid-epoch (64 samples, batch 4, after 3
batches, FSDP1 on CPU, gloo), then resume with another batch size and another dataset length in the same process
group, each in a fresh Accelerator; then accept the change by the name the refusal printed, and resume unchanged."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import configure_checkpointing
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error, _local_state, _same
from tests.support.log_records import WarningRecords

SAMPLES = 64
BATCH = 4
SAVED_BATCHES = 3
WIDTH = 16


def _build(samples: int, batch: int, seed: int) -> tuple[Any, Any, Any, Any]:
    accelerator = fsdp_accelerator()
    torch.manual_seed(seed)
    raw = TinyModel(width=WIDTH)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.arange(samples))
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(raw, optimizer, loader)
    return accelerator, model, optimizer, loader


def _step(accelerator: Any, model: Any, optimizer: Any, indices: torch.Tensor) -> None:
    features = torch.sin(indices.float()[:, None] * torch.linspace(0.1, 1.6, WIDTH)[None, :])
    accelerator.backward(model(features).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _snapshot(model: Any, optimizer: Any, loader: Any) -> tuple[Any, ...]:
    generator = loader.synchronized_generator
    return (_local_state(model, optimizer), loader.iteration, torch.get_rng_state().clone(),
            generator.get_state().clone() if generator is not None else None)


def _unchanged(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    return (_same(before[0], after[0]) == [] and before[1] == after[1] and torch.equal(before[2], after[2])
            and (before[3] is None) == (after[3] is None) and (before[3] is None or torch.equal(before[3], after[3])))


def resume_with_other_loaders(root: str) -> dict[str, Any]:
    path = Path(root).absolute() / "step_3"
    records = WarningRecords()
    logging.getLogger("accelerate_txn").addHandler(records)
    accelerator, model, optimizer, loader = _build(SAMPLES, BATCH, seed=0)
    for index, (indices,) in enumerate(loader):
        _step(accelerator, model, optimizer, indices)
        if index + 1 == SAVED_BATCHES:
            accelerator.save_state(str(path))  # mid-epoch: 3 of 8 batches per rank
            break
    obs: dict[str, Any] = {"path": str(path)}
    for name, samples, batch in (("batch", SAMPLES, 2 * BATCH), ("length", 80, BATCH)):
        accelerator, model, optimizer, loader = _build(samples, batch, seed=7)
        before = _snapshot(model, optimizer, loader)
        obs[name] = _error(lambda accelerator=accelerator: accelerator.load_state(str(path)))
        obs[f"{name}_changed_nothing"] = _unchanged(before, _snapshot(model, optimizer, loader))
    # Accepted by the name the refusal printed (the 80-sample run): it resumes, with one line saying so.
    names = re.findall(r"accept_changes=(\[.*?\])\)", (obs["length"] or {}).get("message", ""))
    configure_checkpointing(accelerator, accept_changes=json.loads(names[0]) if names else [])
    records.messages.clear()
    obs["accepted"] = _error(lambda: accelerator.load_state(str(path)))
    obs["accepted_lines"] = [line for line in records.messages if "with changes" in line]
    # The loader it was saved with resumes as before (every recorded setting agrees between the ranks).
    accelerator, model, optimizer, loader = _build(SAMPLES, BATCH, seed=7)
    records.messages.clear()
    obs["same"] = _error(lambda: accelerator.load_state(str(path)))
    obs["same_lines"] = [line for line in records.messages if "with changes" in line]
    logging.getLogger("accelerate_txn").removeHandler(records)
    return obs
