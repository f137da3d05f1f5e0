"""Elastic-resume scenarios run inside launched gloo ranks (FSDP1 or FSDP2 on CPU).

``save``: train a few steps on N ranks with a stateful data loader (each rank consumes a different number of
batches, so per-rank positions differ) and a registered private per-rank state, then save a protected
checkpoint; report every rank's per-rank state as saved. ``resume``: on M ranks, build a fresh model and
optimizer (other initial values), optionally check that a load without the opt-in is refused before anything
changes, opt in, restore, report what each rank got, take a step, and save again (the re-saved checkpoint is the
restored live state, compared consolidated by tests/accelerate/test_elastic.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration

import accelerate_txn
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error, warmup_lambda


def _build(fsdp_version: int, seed: int, variant: str = "adamw", parallelism: dict[str, int] | None = None
           ) -> tuple[Any, ...]:
    """``variant``: "adamw", or "rmsprop-flat" (RMSprop with momentum, centered; FSDP1 flat parameters).
    ``parallelism``: FSDP2 on an N-D mesh, the sizes of a ``ParallelismConfig`` (HSDP: ``dp_replicate_size``,
    ``dp_shard_size``)."""
    mesh = None
    if parallelism:  # Accelerate 1.10 and later: the matrix runs these scenarios on earlier releases too
        from accelerate.parallelism_config import ParallelismConfig

        mesh = ParallelismConfig(**parallelism)
    accelerator = fsdp_accelerator(fsdp_version=fsdp_version, use_orig_params=variant == "adamw",
                                   dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                                   parallelism_config=mesh)
    torch.manual_seed(seed)
    raw = TinyModel(width=16)
    data = torch.utils.data.TensorDataset(torch.arange(96, dtype=torch.float32).view(96, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    if variant == "adamw":  # FSDP2 (and FSDP1 with original parameters): prepared together
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
        model, optimizer, scheduler, loader = accelerator.prepare(raw, optimizer, scheduler, loader)
    else:  # FSDP1 flat parameters: the optimizer is built on the wrapped model
        model = accelerator.prepare(raw)
        optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
        optimizer, scheduler, loader = accelerator.prepare(optimizer, scheduler, loader)
    noise = torch.Generator().manual_seed(1000 + seed + accelerator.process_index)
    progress = {"samples": 0}
    accelerate_txn.register_checkpoint_state(accelerator, {"noise": noise}, progress)
    return accelerator, model, optimizer, scheduler, loader, noise, progress


def _step(accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
    loss = model(torch.randn(4, 16)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _next_batch(iterator: Any) -> list[float]:
    return next(iterator)[0].flatten().tolist()


def save(fsdp_version: int, out_dir: str, native: bool = False, variant: str = "adamw",
         asynchronous: bool = False, parallelism: dict[str, int] | None = None) -> dict[str, Any]:
    accelerator, model, optimizer, scheduler, loader, noise, progress = _build(fsdp_version, seed=1, variant=variant,
                                                                               parallelism=parallelism)
    if native:  # a legacy checkpoint: native Accelerate, no manifest
        accelerate_txn.unpatch_accelerate_fsdp(accelerator)
    if asynchronous:  # FSDP1: each rank stages its own boxes (not native dim-0 chunks)
        accelerate_txn.configure_checkpointing(accelerator, async_save=True)
    me = accelerator.process_index
    iterator = iter(loader)
    for _ in range(3):
        _step(accelerator, model, optimizer, scheduler)
    for _ in range(me + 1):  # rank r has consumed r + 1 batches: per-rank positions differ
        _next_batch(iterator)
        progress["samples"] += 2
    torch.randn(me + 1)  # and per-rank RNG streams differ
    noise.manual_seed(2000 + me)
    observed = {"rank": me, "rng": torch.get_rng_state(), "noise": noise.get_state(),
                "progress": dict(progress), "step": accelerator.step}
    accelerator.save_state(out_dir)
    if asynchronous:
        accelerate_txn.wait_for_checkpoint(accelerator)
    observed["next_batch"] = _next_batch(iterator)  # where this rank's loader goes on
    observed["lr"] = scheduler.get_last_lr()
    return observed


def resume(fsdp_version: int, source: str, out_dir: str, refuse_first: bool,
           rank_map: dict[int, int] | None = None, variant: str = "adamw",
           parallelism: dict[str, int] | None = None, damaged: str | None = None) -> dict[str, Any]:
    """``damaged``: a damaged copy of ``source``, tried first (with the opt-in): it must be refused before anything
    changes."""
    accelerator, model, optimizer, scheduler, loader, noise, progress = _build(fsdp_version, seed=7, variant=variant,
                                                                               parallelism=parallelism)
    me = accelerator.process_index
    observed: dict[str, Any] = {"rank": me}
    before = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
              for n, p in model.named_parameters()}

    def untouched() -> bool:
        return all(torch.equal((p.to_local() if hasattr(p, "to_local") else p).detach(), before[n])
                   for n, p in model.named_parameters()) and progress == {"samples": 0}

    if refuse_first:
        observed["refusal"] = _error(lambda: accelerator.load_state(source))
        observed["untouched"] = untouched()
        observed["progress_untouched"] = progress == {"samples": 0}
    if damaged is not None:
        accelerate_txn.configure_checkpointing(accelerator, allow_reshard=True, reshard_rank_map=rank_map)
        observed["damaged_refusal"] = _error(lambda: accelerator.load_state(damaged))
        observed["untouched_after_damaged"] = untouched()
    accelerate_txn.configure_checkpointing(accelerator, allow_reshard=True, reshard_rank_map=rank_map)
    accelerator.load_state(source)
    observed.update(rng=torch.get_rng_state(), noise=noise.get_state(), progress=dict(progress),
                    step=accelerator.step, lr=scheduler.get_last_lr(), next_batch=_next_batch(iter(loader)))
    accelerate_txn.configure_checkpointing(accelerator, allow_reshard=False)
    torch.manual_seed(0)  # the step after the restore must not disturb the comparison of saved RNG above
    accelerator.save_state(out_dir)  # the restored live state, before any further update
    manifest = json.loads((Path(out_dir) / accelerate_txn.MANIFEST).read_text())
    observed["resharded_from"] = manifest.get("resharded_from")
    observed["rank_state"] = manifest.get("rank_state")
    _step(accelerator, model, optimizer, scheduler)  # training continues on the new world size
    observed["finite_after_step"] = all(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
                                        for p in model.parameters())
    return observed


def resume_automatic(fsdp_version: int, project: str) -> dict[str, Any]:
    """Automatic naming: ``load_state()`` selects the newest checkpoint saved on another world size; the next
    ``save_state()`` numbers past it and records the lineage."""
    from accelerate_txn.testing import fsdp_accelerator as build

    accelerator = build(fsdp_version=fsdp_version, project_dir=project, automatic_checkpoint_naming=True,
                        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    torch.manual_seed(7)
    raw = TinyModel(width=16)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
    data = torch.utils.data.TensorDataset(torch.arange(96, dtype=torch.float32).view(96, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    model, optimizer, scheduler, loader = accelerator.prepare(raw, optimizer, scheduler, loader)
    accelerate_txn.register_checkpoint_state(accelerator, {"noise": torch.Generator()}, {"samples": 0})
    observed: dict[str, Any] = {"refusal": _error(lambda: accelerator.load_state())}
    accelerate_txn.configure_checkpointing(accelerator, allow_reshard=True)
    accelerator.load_state()
    _step(accelerator, model, optimizer, scheduler)
    accelerator.save_state()
    newest = sorted((Path(project) / "checkpoints").iterdir())[-1]
    observed["saved_to"] = newest.name
    observed["resharded_from"] = json.loads((newest / accelerate_txn.MANIFEST).read_text()).get("resharded_from")
    return observed
