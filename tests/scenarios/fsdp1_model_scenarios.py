"""Rank bodies for tests/fsdp/test_fsdp1_model_restore.py: the protected FSDP1 model restore that reads each rank's
elements straight into its flat-parameter shard (``accelerate_txn.fsdp.fsdp1_model``), against native loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn.accelerate.native import native_method
from accelerate_txn.fsdp import fsdp1_model
from accelerate_txn.fsdp.internals import flat_param
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.async_scenarios import _tensor_collectives

_GATHERS = ("all_gather_into_tensor", "_all_gather_base", "all_gather")


class BufferedModel(TinyModel):
    """TinyModel with a persistent buffer (saved, restored) and a non-persistent one (neither)."""

    __module__ = "tests.scenarios.fsdp1_model_scenarios"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", torch.zeros(7))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.stats[:5].sum() * 0


def _build(seed: int, *, use_orig_params: bool = True) -> tuple:
    accelerator = fsdp_accelerator(use_orig_params=use_orig_params)
    torch.manual_seed(seed)
    model = accelerator.prepare(BufferedModel())
    next(b for name, b in model.named_buffers() if name.endswith("stats")).copy_(torch.randn(7))  # differs per seed
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _train(accelerator: Any, model: Any, optimizer: Any, steps: int, seed: int) -> None:
    torch.manual_seed(seed)  # dropout draws the same on both sides of a comparison
    generator = torch.Generator().manual_seed(seed + accelerator.process_index)
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters as the model exposes them, its buffers, and every flat shard with its padding."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state = {f"param:{name}": p.detach().clone() for name, p in model.named_parameters()}
    state.update({f"buffer:{name}": b.detach().clone() for name, b in model.named_buffers()})
    for index, unit in enumerate(FSDP.fsdp_modules(model)):
        flat = flat_param(unit)
        if flat is not None:
            state[f"flat:{index}"] = flat.detach().clone()
    return state


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Entries that differ bitwise (the non-persistent buffer is neither saved nor restored)."""
    if set(a) != set(b):
        return [f"keys {sorted(set(a) ^ set(b))}"]
    return sorted(k for k in a if not k.endswith("scratch") and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])))


def _load(accelerator: Any, path: Path, native: bool = False) -> dict[str, Any]:
    """Load ``path``; which way it went (direct model loads, FSDP's gathers on the training group)."""
    before = len(fsdp1_model.DIRECT_LOADS)
    with _tensor_collectives() as seen:
        (native_method(accelerator, "load_state") if native else accelerator.load_state)(str(path))
    return {"direct": len(fsdp1_model.DIRECT_LOADS) - before, "gathers": sum(name in _GATHERS for name in seen)}


def restores(root: str) -> dict[str, Any]:
    base = Path(root)
    obs: dict[str, Any] = {}
    for label, orig in (("orig", True), ("flat", False)):
        acc, model, opt = _build(0, use_orig_params=orig)
        _train(acc, model, opt, 2, seed=1)
        path = base / f"protected_{label}"
        acc.save_state(str(path))
        expected = _snapshot(model)
        _train(acc, model, opt, 1, seed=5)
        after_step = _snapshot(model)

        acc2, model2, opt2 = _build(1, use_orig_params=orig)
        obs[f"{label}_protected"] = _load(acc2, path)
        obs[f"{label}_protected_differences"] = _differences(expected, _snapshot(model2))
        acc3, model3, _opt3 = _build(2, use_orig_params=orig)
        obs[f"{label}_native"] = _load(acc3, path, native=True)  # Accelerate's own loader (all-gathers)
        obs[f"{label}_native_differences"] = _differences(expected, _snapshot(model3))
        if orig:  # the original parameters are still views of their flat shard (what the optimizer steps)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            storages = {flat_param(u).untyped_storage().data_ptr() for u in FSDP.fsdp_modules(model2)
                        if flat_param(u) is not None}
            obs["orig_views_kept"] = all(p.untyped_storage().data_ptr() in storages
                                         for p in model2.parameters() if p.numel())
        _train(acc2, model2, opt2, 1, seed=5)
        obs[f"{label}_next_step_differences"] = _differences(after_step, _snapshot(model2))

    # (d) checkpoints written by native FSDP1 (dim-0 chunks) and by the library's capture (flat-range boxes)
    acc, model, opt = _build(3)
    _train(acc, model, opt, 2, seed=1)
    accelerate_txn.unpatch_accelerate_fsdp(acc)
    acc.save_state(str(base / "native"))
    accelerate_txn.patch_accelerate_fsdp(acc)
    accelerate_txn.configure_checkpointing(acc, async_save=True)
    acc.save_state(str(base / "captured"))
    accelerate_txn.wait_for_checkpoint(acc)
    expected = _snapshot(model)
    for label in ("native", "captured"):
        acc4, model4, _opt4 = _build(4)
        obs[f"from_{label}"] = _load(acc4, base / label)
        obs[f"from_{label}_differences"] = _differences(expected, _snapshot(model4))

    # (e) a layout the direct read declines (a user load_state_dict hook): native load, same result
    acc5, model5, _opt5 = _build(6)
    model5.register_load_state_dict_post_hook(lambda module, keys: None)
    obs["declined"] = _load(acc5, base / "native")
    obs["declined_differences"] = _differences(expected, _snapshot(model5))
    return obs
