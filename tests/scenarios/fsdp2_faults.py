"""FSDP2 rank faults and the gradient scaler, inside launched gloo ranks (tests/fsdp/test_fsdp2_faults.py).

Rank faults on FSDP2 (``fsdp_version=2``, DTensor parameters): ranks that disagree on the training configuration,
and a save pre-hook that raises on rank 1 only; every rank must raise the same explained error, nothing may be
published, and the next save must work (no lock left held, no rank out of step).

The gradient scaler: Accelerate's FSDP2 ``load_state`` loads ``scaler.pt`` before the optimizer and then calls
the scaler's private ``_lazy_init_scale_growth_tracker``, which raises ``AssertionError("_growth_tracker
initialized before _scale")`` when the scaler is already initialised: after any ``accelerator.backward`` with the
scaler (every fp16 step), or after an earlier ``load_state`` in the same process. Each scaler case restores a
protected checkpoint into an Accelerator whose scaler is in one of those states and records the outcome and what
changed. On CPU Accelerate creates no scaler (fp16 needs an accelerator device), so a real CPU ``GradScaler`` is
attached, as in tests/scenarios/corruption_scenarios.py; ``accelerator.backward`` then scales the loss as on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from accelerate_txn import MANIFEST, configure_checkpointing
from accelerate_txn.accelerate.config import checkpoint_config, mark_failed
from tests.scenarios import corruption_scenarios as scenarios
from tests.scenarios.corruption_fsdp2 import build
from tests.scenarios.corruption_scenarios import snapshot


def _train_scaled(run: scenarios.Run, steps: int, seed: int) -> None:
    """Training steps whose backward goes through ``accelerator.backward`` (the scaler scales the loss)."""
    generator = torch.Generator().manual_seed(seed + 1000 * scenarios._rank())
    for _ in range(steps):
        run.acc.backward(run.model(torch.randn(4, run.width, generator=generator)).pow(2).mean())
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad(set_to_none=True)
    run.acc.step += steps


def _try_load(run: scenarios.Run, directory: Path, saved: dict[str, Any]) -> dict[str, Any]:
    before = snapshot(run)
    same_as_saved = [key for key in saved if key not in scenarios.differences(before, saved)]
    error = scenarios._error(lambda: run.acc.load_state(str(directory)))
    after = snapshot(run)
    outcome = {"error": error, "changed": scenarios.differences(before, after),
               "restored_differences": scenarios.differences(saved, after),
               "marked_failed": bool(checkpoint_config(run.acc).failed), "same_as_saved": same_as_saved}
    mark_failed(run.acc, False)  # observe the next case from a usable Accelerator
    return outcome


def _rank_faults(run: scenarios.Run, root: Path) -> dict[str, Any]:
    """Disagreeing configuration, then a save hook failing on rank 1 only; then a save that must succeed."""
    rank = scenarios._rank()
    obs: dict[str, Any] = {}
    configure_checkpointing(run.acc, metadata={"dataset": "laion" if rank == 0 else "coyo"})
    obs["disagreement"] = scenarios._error(lambda: run.acc.save_state(str(root / "disagreement")))
    obs["disagreement_published"] = (root / "disagreement").exists()
    configure_checkpointing(run.acc, metadata={"dataset": "laion"})

    def failing_on_rank_1(models: Any, weights: Any, output_dir: str) -> None:
        if rank == 1:
            raise RuntimeError("save hook failed on rank 1")

    handle = run.acc.register_save_state_pre_hook(failing_on_rank_1)
    obs["hook_failure"] = scenarios._error(lambda: run.acc.save_state(str(root / "hook_failure")))
    obs["hook_failure_published"] = (root / "hook_failure").exists()
    handle.remove()
    obs["next_save"] = scenarios._error(lambda: run.acc.save_state(str(root / "after_faults")))
    obs["next_save_published"] = (root / "after_faults" / MANIFEST).is_file()
    return obs


def fsdp2_faults(root: str) -> dict[str, Any]:
    root_path = Path(root)
    obs: dict[str, Any] = {}
    run = build(0)
    _train_scaled(run, 2, seed=1)
    obs["scaler_initialised_by_backward"] = run.acc.scaler._growth_tracker is not None
    checkpoint = root_path / "checkpoint"
    run.acc.save_state(str(checkpoint))
    saved = snapshot(run)
    # 1. load_state right after save_state in the training process (fp16: the scaler is initialised).
    _train_scaled(run, 1, seed=2)
    scenarios._perturb(run, 2)  # every component differs from the saved state
    obs["same_process"] = _try_load(run, checkpoint, saved)
    # 2. A fresh process-like Accelerator: the first load initialises the scaler, a second load (a rollback) follows.
    fresh = build(7)
    scenarios._perturb(fresh, 0)  # every component differs from the saved state (the scaler stays uninitialised)
    obs["fresh_scaler_uninitialised"] = fresh.acc.scaler._growth_tracker is None
    obs["fresh_first"] = _try_load(fresh, checkpoint, saved)
    scenarios._perturb(fresh, 1)
    obs["fresh_second"] = _try_load(fresh, checkpoint, saved)
    obs["rank_faults"] = _rank_faults(fresh, root_path)
    return obs
