"""Which gradients a checkpoint would lose: the pending-gradient rule of the protected save (and load).

A checkpoint holds no gradients. A save is refused only where resumed training would differ for that reason: a
gradient written by ``backward()`` that the live run's next ``optimizer.step()`` would still apply. Not pending
(saved, as native Accelerate saves them):

* a gradient that is ``None`` or exactly zero (``optimizer.zero_grad(set_to_none=False)``): accumulating into a
  zeroed buffer gives what accumulating into none gives. A sharded gradient is judged by this rank's local data
  (a DTensor's local tensor, an FSDP1 flat parameter's shard), without a collective;
* a gradient a completed ``optimizer.step()`` already applied: the step ran after the gradient was last written
  (the script saves between ``step()`` and ``zero_grad()``).

The second is told by :func:`track_steps` (installed with the patch, ``accelerate.patch.install``): a hook on every
optimizer step that ran (public ``torch.optim.optimizer.register_optimizer_step_post_hook``) notes, per parameter, its
gradient tensor (a weak reference) and version counters (a DTensor's local tensor's too: FSDP2 accumulates into
it). A later ``backward()`` writes a new gradient tensor or bumps the counter, so the note no longer matches. A step
skipped by the gradient scaler (an inf/NaN under fp16) never runs the optimizer's step: its gradients stay
pending, as do those of a parameter no stepped optimizer holds. Without the hook (after ``uninstall()``) only zero
gradients pass. Costs a Python loop over the parameters per step (about 0.4 ms per 1,000 parameters on CPU); no
device synchronisation.

Every check here is this rank's own; the preflight runs in a rank phase (``core.ranks.run_phase``), so a pending
gradient on any rank refuses the save on every rank with the same error.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ..fsdp.internals import clean_fsdp_name, version_counter

_Note = tuple["weakref.ref[torch.Tensor]", int, int]
# Per optimizer that completed a step: {id(parameter): note of its gradient right after that step}. The optimizer
# holds its parameters, so their ids are stable while it lives.
_APPLIED: WeakKeyDictionary[Any, dict[int, _Note]] = WeakKeyDictionary()
_HOOK: dict[str, Any] = {"handle": None, "active": None}


def _local(gradient: torch.Tensor) -> torch.Tensor:
    """This rank's data of ``gradient``: a DTensor's local tensor (FSDP2), else the tensor itself."""
    if type(gradient) is torch.Tensor:  # the common case, checked first: this runs per parameter per step
        return gradient
    from torch.distributed.tensor import DTensor

    if isinstance(gradient, DTensor):
        with torch.no_grad():  # to_local() without an autograd node: the local tensor itself
            return gradient.to_local()
    return gradient


def _note(gradient: torch.Tensor) -> _Note:
    return weakref.ref(gradient), version_counter(gradient), version_counter(_local(gradient))


def _noted_after_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    active = _HOOK["active"]
    if active is not None and not active():  # nothing protected can run: the step stays exactly native
        _APPLIED.pop(optimizer, None)
        return
    try:
        _APPLIED[optimizer] = {id(p): _note(p.grad) for group in optimizer.param_groups for p in group["params"]
                               if p.grad is not None}
    except Exception:  # bookkeeping never breaks a step: without a note its gradients count as pending
        _APPLIED.pop(optimizer, None)


def track_steps(active: Callable[[], bool] | None = None) -> None:
    """Note the gradients each optimizer step applies (idempotent); see the module docstring. ``active()`` False (no
    protected path can run: dispatch off and nothing opted in) makes a step note nothing."""
    _HOOK["active"] = active
    if _HOOK["handle"] is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK["handle"] = register_optimizer_step_post_hook(_noted_after_step)


def untrack_steps() -> None:
    """Remove the hook of :func:`track_steps` (its notes are dropped: every nonzero gradient counts as pending)."""
    handle, _HOOK["handle"] = _HOOK["handle"], None
    if handle is not None:
        handle.remove()
    _APPLIED.clear()


def _applied(note: _Note | None, gradient: torch.Tensor) -> bool:
    return (note is not None and note[0]() is gradient and note[1] == version_counter(gradient)
            and note[2] == version_counter(_local(gradient)))


def pending_gradient(models: Iterable[Any]) -> str | None:
    """The name of the first parameter of ``models`` whose gradient is pending on this rank (nonzero and not
    applied by a completed optimizer step), without FSDP1's wrapper prefixes (a flat parameter:
    ``body.0._flat_param``), or None. One device synchronisation per device holding such gradients."""
    notes: dict[int, _Note] = {}
    for noted in list(_APPLIED.values()):  # every live optimizer's: whichever holds the parameter stepped it
        notes.update(noted)
    unapplied = [(name, p.grad) for model in models for name, p in model.named_parameters()
                 if p.grad is not None and not _applied(notes.get(id(p)), p.grad)]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for index, (_name, gradient) in enumerate(unapplied):
        local = _local(gradient)
        values = local.coalesce().values() if local.is_sparse else local
        by_device.setdefault(values.device, []).append((index, values))
    nonzero: list[int] = []
    for items in by_device.values():
        # Tensor.any(): True for any element that is not zero (NaN included); False for an empty shard.
        flags = torch.stack([values.any() for _index, values in items]).tolist()
        nonzero.extend(index for (index, _values), flag in zip(items, flags) if flag)
    return clean_fsdp_name(unapplied[min(nonzero)][0]) if nonzero else None  # FSDP1: without wrapper prefixes


def skipped_step(optimizers: Iterable[Any]) -> bool:
    """Whether the gradient scaler skipped the last step of one of ``optimizers`` (Accelerate's public
    ``AcceleratedOptimizer.step_was_skipped``)."""
    return any(bool(getattr(optimizer, "step_was_skipped", False)) for optimizer in optimizers)
