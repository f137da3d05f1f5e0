"""The host copy of an asynchronous FSDP2 save, made in the background behind the next forward and backward.

Between ``save_state`` returning and the next ``optimizer.step()``, nothing in ordinary training mutates the
parameters' local shards or the optimizer state: forward and backward only read them (FSDP2 all-gathers into
separate unsharded buffers and reduce-scatters into the gradients). So an asynchronous FSDP2 save does not copy
those large tensors in the caller. :meth:`DeferredCopy.stage` (in ``save_state``, from ``_dcp_save``'s staging
branch) rebuilds the state dict Accelerate passed to DCP, copying everything small at once (buffers, which
forward may change, e.g. BatchNorm running statistics; ``step`` tensors; anything that is neither a parameter's
local shard nor an optimizer state tensor of its parameter's shape) and leaving a placeholder, with a reference
to the live DTensor and its in-place version counters, for each large one. The background thread's first phase
(:meth:`DeferredCopy.copy`, a rank phase on the background group) makes those copies, then writes as before.

A guard makes every mutation wait for that copy: a step pre-hook on each of the saving Accelerators' torch
optimizers blocks ``step()`` until the copy completed (it raises nothing itself: a failed copy is the save's
error, raised at ``wait_for_checkpoint`` or the next save like any background failure); ``zero_grad`` does not
wait (gradients are not saved). ``load_state``, the next ``save_state``, ``wait_for_checkpoint``,
``end_training`` and ``destroy_process_group`` wait for the whole save in any case.

Safety net: mutations outside ``optimizer.step`` (an in-place EMA of the parameters, ``p.mul_()`` under
``no_grad``, ``load_state_dict`` into the model) are not guarded. Each deferred tensor's version counters
(``fsdp.internals.version_counter``, of the DTensor and of its local tensor) are recorded at ``save_state`` and
compared after the copy: any change fails the save on every rank with a :class:`CheckpointError` naming the
tensor, and nothing is published. (A write that bypasses autograd's counters, through ``.data`` or a local tensor
obtained separately, is not seen: call ``wait_for_checkpoint(accelerator)`` before modifying parameters outside
``optimizer.step``, or save with ``async_save=False``.)

Which saves defer: every asynchronous save of an FSDP2 Accelerator (the default with ``async_save=True``); FSDP1
keeps its collective-free caller-side staging (``fsdp.capture``), which already blocks for little. The files are
the same: the same tensors, copied a little later, written by the same writer. With ``reuse_staging_memory`` the
buffers are reserved from the pool in the caller (the pool's bookkeeping is unchanged) and filled in the
background. On CUDA the copies run on a side stream that first waits for an event recorded on the caller's
stream at ``save_state`` (the sources' last writes), into pinned memory; the background thread synchronises that
stream before the guard is released, so the next step is enqueued only after the copy is complete.

``COPY_GATE`` (cleared: background copies wait for it) and ``GUARD_WAITING`` (set when a step starts waiting for a
copy) are for the tests only, like ``ACCELERATE_TXN_ASYNC_FAIL_AT``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..fsdp.host_memory import copy_to_host, reserved_buffer, staged_copy
from ..fsdp.internals import host_dtensor, version_counter

#: Tests only: while cleared, background copies wait (a deterministic window between save_state and the copy).
COPY_GATE = threading.Event()
COPY_GATE.set()
#: Tests only: set when an optimizer step starts waiting for a deferred copy.
GUARD_WAITING = threading.Event()


def deferrable_storages(models: Iterable[Any], optimizers: Iterable[Any]) -> frozenset[int]:
    """The storages (``data_ptr`` of each local tensor's untyped storage) whose tensors an FSDP2 save may copy in the
    background: the DTensor parameters' local shards of ``models`` and, of the torch ``optimizers``, each DTensor
    state tensor with its parameter's shape (Adam's moments, SGD's momentum); never a ``step`` or a buffer."""
    from torch.distributed.tensor import DTensor

    found: set[int] = set()

    def add(tensor: Any) -> None:
        with torch.no_grad():  # a view of the local shard, no autograd node
            pointer = tensor.to_local().untyped_storage().data_ptr()
        if pointer:  # an empty shard has no memory (and nothing to defer)
            found.add(pointer)

    for model in models:
        for parameter in model.parameters():
            if isinstance(parameter, DTensor):
                add(parameter)
    for optimizer in optimizers:
        for parameter, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, DTensor) and value.shape == parameter.shape:
                    add(value)
    return frozenset(found)


@dataclass
class _Pending:
    """One deferred tensor: the live source, where it goes, and its version counters at ``save_state``."""

    name: str
    source: Any  # the state dict's DTensor (a view sharing the parameter's version counter) or plain tensor
    target: torch.Tensor | None  # a pool buffer reserved in the caller, or None (fresh memory, in the background)
    versions: tuple[int, int]
    pin: bool


class _Slot:
    """The placeholder of a deferred tensor in a staged state dict (its index in :attr:`DeferredCopy._pending`)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _versions(tensor: Any) -> tuple[int, int]:
    return version_counter(tensor), version_counter(_local(tensor))


class DeferredCopy:
    """The deferred host copies of one asynchronous save (all its DCP writes), and the guard that holds optimizer
    steps until they are made. Created in ``save_state``; :meth:`copy` runs in the background thread."""

    def __init__(self, deferrable: frozenset[int]) -> None:
        self.deferrable = deferrable
        self._pending: list[_Pending] = []
        self._copies: list[Any] = []
        #: Set once the background copy ended (made, failed, or never to be made): the guard waits for it.
        self.copied = threading.Event()
        self._ready: Any = None  # CUDA: an event on the caller's stream after the sources' last writes
        self._hooks: list[Any] = []

    # --------------------------------------------------------------------------------------- in the caller
    def stage(self, state_dict: Any, prefix: str, pin: bool = True) -> Any:
        """``state_dict`` rebuilt for the background: tensors in :attr:`deferrable` storages left as placeholders
        (their pool buffers reserved now), everything else copied now (:func:`staged_copy`)."""
        staged = self._stage(state_dict, prefix, pin)
        if torch.cuda.is_available() and any(p.source.is_cuda for p in self._pending):
            self._ready = torch.cuda.Event()
            self._ready.record()  # on the caller's current stream: the copies start after what it enqueued so far
        return staged

    def _stage(self, value: Any, name: str, pin: bool) -> Any:
        if isinstance(value, torch.Tensor):
            local = _local(value)
            pointer = local.untyped_storage().data_ptr() if local.layout == torch.strided else 0
            if pointer and pointer in self.deferrable:
                self._pending.append(_Pending(name, value, reserved_buffer(local, pin=pin), _versions(value), pin))
                return _Slot(len(self._pending) - 1)
            return staged_copy(value, pin)
        if isinstance(value, dict):
            return type(value)((key, self._stage(item, f"{name}/{key}", pin)) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(self._stage(item, f"{name}[{i}]", pin) for i, item in enumerate(value))
        return value

    def pending(self) -> int:
        """How many tensors wait for the background copy (0 once it was made)."""
        return sum(1 for p in self._pending if p.source is not None)

    def guard(self, optimizers: Iterable[Any]) -> None:
        """Hold each torch optimizer's ``step()`` until the copy ended (a step pre-hook; removed by
        :meth:`release`, from the thread that settles the save: a hook cannot remove itself while torch iterates
        the hooks)."""
        if not self._pending:
            return
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.copied.is_set():
            GUARD_WAITING.set()
            self.copied.wait()

    def release(self) -> None:
        """Remove the guard (the save settled)."""
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    # ------------------------------------------------------------------------------- in the background
    def copy(self) -> None:
        """Make every deferred copy, then check that no source was modified in place since ``save_state``
        (raises :class:`CheckpointError` naming them). Releases the guard either way."""
        try:
            COPY_GATE.wait()
            self._copies = [None] * len(self._pending)
            cuda = [p.source for p in self._pending if p.source.is_cuda]
            stream = torch.cuda.Stream(device=cuda[0].device) if cuda else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None and self._ready is not None:
                    stream.wait_event(self._ready)
                for index, pending in enumerate(self._pending):
                    self._copies[index] = copy_to_host(_local(pending.source), pending.target, pin=pending.pin)
            if stream is not None:
                stream.synchronize()  # the pinned copies are complete before a step may mutate the sources
            changed = [p.name for p in self._pending if _versions(p.source) != p.versions]
        finally:
            copies = [(p.source, copy) for p, copy in zip(self._pending, self._copies, strict=False)]
            for pending in self._pending:
                pending.source = None  # the live tensors are not kept past the copy
            self.copied.set()
        self._copies = [host_dtensor(copy, like=source) if hasattr(source, "to_local") else copy
                        for source, copy in copies]
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise CheckpointError(
                f"The asynchronous save could not copy {shown}: modified in place after save_state returned and "
                "before the background copy (outside optimizer.step, which waits for it; e.g. an in-place EMA or "
                "p.mul_() under no_grad). The checkpoint would not hold the state at save_state: nothing was "
                "published. Call accelerate_txn.wait_for_checkpoint(accelerator) before modifying parameters or "
                "optimizer state outside optimizer.step, or save with async_save=False.")

    def resolve(self, staged: Any) -> Any:
        """``staged`` with each placeholder replaced by its copy (after :meth:`copy`)."""
        if isinstance(staged, _Slot):
            return self._copies[staged.index]
        if isinstance(staged, dict):
            return type(staged)((key, self.resolve(item)) for key, item in staged.items())
        if isinstance(staged, (list, tuple)):
            return type(staged)(self.resolve(item) for item in staged)
        return staged

    def finish(self) -> None:
        """The save ended (or failed before copying): drop what is left and release any waiting step."""
        for pending in self._pending:
            pending.source = pending.target = None
        self._copies = []
        self.copied.set()
