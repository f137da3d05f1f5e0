"""Data-order scenarios run inside launched gloo ranks (FSDP1 or FSDP2 on CPU): an example-style training loop.

The loop is the one Diffusers' and Accelerate's example scripts use: a shuffled ``DataLoader`` prepared with the
model, global-RNG noise drawn every step (and dropout in the model), ``save_state`` every few steps, and on resume
``first_epoch = global_step // steps_per_epoch`` and ``resume_step = global_step % steps_per_epoch``, the partial
epoch skipped with ``accelerator.skip_first_batches`` (Accelerate's examples) or by ``continue`` over its first
batches (older Diffusers scripts); a stateful loader resumes by itself. Each rank records the sample indices of every
batch it trained on and returns them with its final parameter and optimizer shards, for tests/accelerate/test_data_order.py to
compare bitwise with the uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed

from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _local_state

SEED = 1234
SAMPLES = 24  # 2 ranks x batch 2: 6 steps per epoch
BATCH = 2
EPOCHS = 3
WIDTH = 16


def _build(fsdp_version: int, *, seedable: bool = False, stateful: bool = False,
           sampler: Any = None) -> tuple[Any, Any, Any, Any]:
    config = DataLoaderConfiguration(use_seedable_sampler=seedable, use_stateful_dataloader=stateful)
    accelerator = fsdp_accelerator(fsdp_version=fsdp_version, dataloader_config=config)
    set_seed(SEED)  # as the example scripts: the same initial weights and loader seed on every rank and every run
    raw = TinyModel(width=WIDTH)  # dropout: the model draws from the global RNG too
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.arange(SAMPLES))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=sampler is None, sampler=sampler)
    model, optimizer, loader = accelerator.prepare(raw, optimizer, loader)
    return accelerator, model, optimizer, loader


def _train_step(accelerator: Any, model: Any, optimizer: Any, indices: torch.Tensor) -> None:
    features = torch.sin(indices.float()[:, None] * torch.linspace(0.1, 1.6, WIDTH)[None, :])
    noise = torch.randn(features.shape)  # like Diffusers' noise: a global-RNG draw every step
    loss = model(features + noise).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(fsdp_version: int, *, seedable: bool = False, stateful: bool = False, save_at: tuple[int, ...] = (),
        out: str | None = None, epoch_end_save: bool = False, resume: str | None = None,
        style: str = "skip", kill_at: int | None = None) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs, from ``resume`` (a ``step_<N>`` checkpoint) if given, skipping the resumed epoch's
    consumed batches by ``style`` ("skip": ``skip_first_batches``, "continue", or "none": a stateful loader resumes
    by itself). Saves ``out/step_<N>`` after the steps in ``save_at``, and ``out/epoch_<e>`` after each epoch's loop
    with ``epoch_end_save``. With ``kill_at`` every rank kills itself with ``SIGKILL`` after that step (training
    went on past its last checkpoint). Returns the batches trained on (global step -> sample indices) and the final
    local state."""
    accelerator, model, optimizer, loader = _build(fsdp_version, seedable=seedable, stateful=stateful)
    steps_per_epoch = len(loader)
    global_step = first_epoch = resume_step = 0
    if resume is not None:
        accelerator.load_state(resume)
        global_step = int(Path(resume).name.split("_")[1])
        first_epoch, resume_step = divmod(global_step, steps_per_epoch)
    seen: dict[int, list[int]] = {}
    order_warnings: list[str] = []
    for epoch in range(first_epoch, EPOCHS):
        model.train()
        active = loader
        if resume is not None and epoch == first_epoch and style == "skip":
            active = accelerator.skip_first_batches(loader, resume_step)
        for step, (indices,) in enumerate(active):
            if resume is not None and epoch == first_epoch and style == "continue" and step < resume_step:
                continue
            _train_step(accelerator, model, optimizer, indices)
            global_step += 1
            seen[global_step] = indices.tolist()
            if global_step in save_at:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    accelerator.save_state(str(Path(str(out)) / f"step_{global_step}"))
                order_warnings += [str(w.message) for w in caught if "data order" in str(w.message)]
            if global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        if epoch_end_save:
            accelerator.save_state(str(Path(str(out)) / f"epoch_{epoch}"))
    return {"rank": accelerator.process_index, "seen": seen, "state": _plain(_local_state(model, optimizer)),
            "order_warnings": order_warnings}


def _plain(value: Any) -> Any:
    """``value`` with FSDP2's DTensors replaced by this rank's local shards (comparable outside the process group)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value.to_local() if hasattr(value, "to_local") else value


class ShuffledEveryTime(torch.utils.data.Sampler):
    """A sampler with randomness of its own (not one accelerate-txn can restore)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.size).tolist())

    def __len__(self) -> int:
        return self.size


def reference(fsdp_version: int, out: str, variants: bool) -> dict[str, Any]:
    """The uninterrupted run, then the same run saving at an epoch's last batch (step 6), after that epoch's loop
    (``epoch_0``, ...) and mid-epoch (step 9). With ``variants`` also the seedable-sampler and the stateful-loader runs
    (uninterrupted, and saving at step 9), and a loader with a custom sampler saved twice (the warnings it gives)."""
    root = Path(out)
    observed = {"plain": run(fsdp_version),
                "saving": run(fsdp_version, save_at=(6, 9), out=str(root / "plain"), epoch_end_save=True)}
    if variants:
        for name, flags in (("seedable", {"seedable": True}), ("stateful", {"stateful": True})):
            observed[name] = run(fsdp_version, **flags)
            observed[f"{name}_saving"] = run(fsdp_version, save_at=(9,), out=str(root / name), **flags)
        accelerator, model, optimizer, loader = _build(fsdp_version, sampler=ShuffledEveryTime(SAMPLES))
        _train_step(accelerator, model, optimizer, next(iter(loader))[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.save_state(str(root / "custom" / "first"))
            accelerator.save_state(str(root / "custom" / "second"))
        observed["custom_warnings"] = [str(w.message) for w in caught if "data order" in str(w.message)]
    return observed


def resumes(fsdp_version: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each job (the keyword arguments of :func:`run`, or ``{"old": checkpoint}``) with a fresh Accelerator, in
    order; the first one in a fresh process."""
    return [old_checkpoint(fsdp_version, job["old"]) if "old" in job else run(fsdp_version, **job) for job in jobs]


def old_checkpoint(fsdp_version: int, checkpoint: str) -> dict[str, Any]:
    """Load a checkpoint without data-order records (an earlier accelerate-txn's): it loads and restores no order, as
    before: the loader starts at epoch 0 with the generator ``prepare`` gave it (what a fresh run iterates)."""
    _accelerator, _model, _optimizer, loader = _build(fsdp_version)
    fresh = [batch[0].tolist() for batch in loader]
    accelerator, _model, _optimizer, loader = _build(fsdp_version)
    accelerator.load_state(checkpoint)
    iteration = loader.iteration
    return {"iteration": iteration, "order": [batch[0].tolist() for batch in loader], "fresh": fresh}
