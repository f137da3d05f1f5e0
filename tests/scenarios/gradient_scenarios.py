"""The pending-gradient rule (``accelerate.gradients``) inside launched gloo ranks: every order of
``optimizer.step()``, ``save_state()`` and ``optimizer.zero_grad()`` (``set_to_none`` both ways) on one live run,
one case after another, for FSDP1 (original and flat parameters, in one launch) or FSDP2 (with asynchronous saves
too). A save that publishes is loaded into a second run: its state must equal the live run's at the save bitwise,
and one more training step from both must give bitwise equal states (the live run with its zeroed or applied
gradient buffers, the restored one with none). A refused save must publish nothing."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import wait_for_checkpoint
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error

#: case -> the operations in order ("backward" of a fresh batch; "micro": a backward inside
#: ``accelerator.accumulate`` with 2 accumulation steps; "poke": rank 1 alone adds 1 to a gradient in place).
CASES: dict[str, tuple[str, ...]] = {
    "step, save, zero_grad(None)": ("backward", "step", "save", "zero_none"),
    "step, save, zero_grad(zeros)": ("backward", "step", "save", "zero_keep"),
    "step, zero_grad(zeros), save": ("backward", "step", "zero_keep", "save"),
    "step, zero_grad(None), save": ("backward", "step", "zero_none", "save"),
    "backward, zero_grad(zeros), save": ("backward", "zero_keep", "save"),
    "backward, save": ("backward", "save", "zero_none"),
    "step, backward, save": ("backward", "step", "backward", "save", "zero_none"),
    "step, zero_grad(zeros), backward, save": ("backward", "step", "zero_keep", "backward", "save", "zero_none"),
    "step, rank 1 writes a gradient, save": ("backward", "step", "poke", "save", "zero_none"),
    "mid-accumulation save": ("micro", "save"),
    "accumulation complete, step, save": ("micro", "step", "save", "zero_keep"),
}
ASYNC_CASES: dict[str, tuple[str, ...]] = {
    "async: step, save, zero_grad(zeros)": ("backward", "step", "async_save", "zero_keep"),
    "async: backward, save": ("backward", "async_save", "zero_none"),
}


def _build(fsdp_version: int, use_orig_params: bool, seed: int) -> tuple[Any, Any, Any]:
    accelerator = fsdp_accelerator(fsdp_version=fsdp_version, use_orig_params=use_orig_params)
    torch.manual_seed(seed)
    raw = TinyModel()
    if fsdp_version == 2:  # FSDP2: prepared together
        model, optimizer = accelerator.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    else:  # FSDP1: the optimizer is built on the wrapped model
        model = accelerator.prepare(raw)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _local(value: Any) -> Any:
    value = value.to_local() if hasattr(value, "to_local") else value
    return value.detach().clone() if torch.is_tensor(value) else value


def _snapshot(model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's parameters and optimizer state (local shards), and the global RNG."""
    names = {id(p): n for n, p in model.named_parameters()}
    raw = optimizer.optimizer
    return {"params": {n: _local(p) for n, p in model.named_parameters()},
            "optim": {f"{names[id(p)]}.{k}": _local(v) for p, s in raw.state.items() for k, v in s.items()},
            "rng": {"": torch.get_rng_state()}}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    found = []
    for part in ("params", "optim", "rng"):
        if set(a[part]) != set(b[part]):
            found.append(f"{part} keys differ")
        for key in set(a[part]) & set(b[part]):
            x, y = a[part][key], b[part][key]
            same = (torch.equal(x, y) and x.dtype == y.dtype) if torch.is_tensor(x) and torch.is_tensor(y) else x == y
            if not same:
                found.append(f"{part}.{key}")
    return sorted(found)


def _batch(case: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * case + rank))


def _step(accelerator: Any, model: Any, optimizer: Any, batch: torch.Tensor) -> None:
    accelerator.backward(model(batch).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _run_setup(root: Path, fsdp_version: int, use_orig_params: bool, cases: dict[str, tuple[str, ...]]
               ) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    acc, model, opt = _build(fsdp_version, use_orig_params, seed=0)
    acc2, model2, opt2 = _build(fsdp_version, use_orig_params, seed=7)  # the run each published save resumes into
    results: dict[str, Any] = {}
    for number, (case, operations) in enumerate(cases.items()):
        path = root / f"case_{number}"
        expected: dict[str, Any] | None = None
        error = None
        for operation in operations:
            if operation == "backward":
                acc.backward(model(_batch(number, rank)).pow(2).mean())
            elif operation == "micro":
                acc.gradient_accumulation_steps = 2
                with acc.accumulate(model):
                    acc.backward(model(_batch(number, rank)).pow(2).mean())
            elif operation == "step":
                opt.step()
            elif operation in ("zero_none", "zero_keep"):
                opt.zero_grad(set_to_none=operation == "zero_none")
            elif operation == "poke" and rank == 1:
                gradient = next(model.parameters()).grad
                with torch.no_grad():  # FSDP2: into the local tensor, as FSDP2 accumulates (the DTensor's counter stays)
                    (gradient.to_local() if hasattr(gradient, "to_local") else gradient).add_(1.0)
            elif operation in ("save", "async_save"):
                expected = _snapshot(model, opt)
                error = _error(functools.partial(acc.save_state, str(path), async_save=operation == "async_save"))
                if error is None and operation == "async_save":
                    error = _error(lambda: wait_for_checkpoint(acc))
        result: dict[str, Any] = {"error": error, "published": path.exists()}
        if error is None and expected is not None:
            # The live run's next step (with whatever gradient buffers the case left), then the restored run's.
            batch = _batch(100 + number, rank)
            _step(acc, model, opt, batch)
            live = _snapshot(model, opt)
            acc2.gradient_accumulation_steps = acc.gradient_accumulation_steps  # the configuration it was saved in
            acc2.load_state(str(path))
            result["load_differences"] = _differences(expected, _snapshot(model2, opt2))
            _step(acc2, model2, opt2, batch)
            result["next_step_differences"] = _differences(live, _snapshot(model2, opt2))
            acc2.gradient_accumulation_steps = 1
        if acc.sync_gradients:  # a cycle in the middle ("mid-accumulation save") goes on in the next case
            acc.gradient_accumulation_steps = 1
            opt.zero_grad(set_to_none=True)
        results[case] = result
    return results


def orders(root: str, fsdp_version: int) -> dict[str, Any]:
    """Every case of :data:`CASES` in sequence on one live run: FSDP1 with original, then flat parameters; FSDP2
    with :data:`ASYNC_CASES` too. Returns {setup: {case: observations}}."""
    base = Path(root)
    if fsdp_version == 1:
        return {f"fsdp1 use_orig_params={flag}": _run_setup(base / f"orig_{flag}", 1, flag, CASES)
                for flag in (True, False)}
    return {"fsdp2": _run_setup(base / "fsdp2", 2, True, {**CASES, **ASYNC_CASES})}
