"""Host memory for the staged copy of an asynchronous save.

The blocking part of an asynchronous save is one copy of this rank's state into host memory. By default every
save copies into fresh memory, released when the staged copy is dropped after its write: fresh pages are faulted
in and zeroed by the kernel on first touch, which costs more than the copy itself (300 MB on the 2-vCPU
development machine: about 0.15 s against 0.035 s into memory already touched). With
``configure_checkpointing(reuse_staging_memory=True)`` the buffers of the previous save are kept in a
:class:`StagingPool` and copied into again (as DCP's own ``cache_staged_state_dict``): one staged copy of this
rank's state stays allocated between saves. CUDA tensors are copied into pinned memory (torch's caching host
allocator keeps freed pinned blocks for reuse in any case). Each copy owns its storage, so DCP writes it as it is
(a view of a larger storage would be cloned first).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .internals import host_dtensor

_Key = tuple[torch.Size, torch.dtype, bool]


class StagingPool:
    """The staging buffers of one Accelerator's previous asynchronous save, handed out again by shape, dtype and
    pinning. A buffer is reused only by the next save, which starts after the previous write finished (one save
    in flight): nothing still reads it. Buffers the next save does not need are released when it ends."""

    def __init__(self) -> None:
        self._previous: dict[_Key, list[torch.Tensor]] = {}
        self._current: list[torch.Tensor] = []

    def take(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        spare = self._previous.get((shape, dtype, pinned))
        buffer = spare.pop() if spare else torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
        self._current.append(buffer)
        return buffer

    def end_save(self) -> None:
        """The save staged everything: its buffers are the ones the next save reuses."""
        previous: dict[_Key, list[torch.Tensor]] = {}
        for buffer in self._current:
            previous.setdefault((buffer.shape, buffer.dtype, buffer.is_pinned()), []).append(buffer)
        self._previous, self._current = previous, []

    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffers in self._previous.values() for buffer in buffers)


_active = threading.local()  # .pool: the StagingPool of the save staging in this thread


@contextlib.contextmanager
def staging_into(pool: StagingPool | None) -> Iterator[None]:
    """Copies made by :func:`staged_tensor` in this thread come from ``pool`` (None: fresh memory)."""
    _active.pool = pool
    try:
        yield
    finally:
        _active.pool = None
        if pool is not None:
            pool.end_save()


def reserved_buffer(source: torch.Tensor, *, pin: bool = True) -> torch.Tensor | None:
    """The buffer a copy of ``source`` goes into, taken now from the pool active in this thread (see
    :func:`staging_into`); None without a pool (fresh memory, allocated by :func:`copy_to_host` where the copy is
    made). Lets the caller reserve a save's buffers while the copy itself runs later, in another thread."""
    pool: StagingPool | None = getattr(_active, "pool", None)
    if pool is None:
        return None
    return pool.take(source.shape, source.dtype, pin and source.is_cuda)


def copy_to_host(source: torch.Tensor, target: torch.Tensor | None = None, *, pin: bool = True) -> torch.Tensor:
    """``source`` copied into ``target`` (or fresh host memory, pinned when ``source`` is on CUDA and ``pin``).
    From CUDA the copy is asynchronous on the current stream: synchronise before reading it."""
    source = source.detach()
    pinned = pin and source.is_cuda
    if target is None:
        target = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
    target.copy_(source, non_blocking=pinned)
    return target


def copy_fence() -> Any | None:
    """After an asynchronous save staged its state in the caller: on CUDA, an event recorded on the current stream,
    after every copy into pinned memory enqueued there (None without CUDA: every copy is already complete). The copies
    were enqueued on the stream training runs on, so anything training enqueues after ``save_state`` returns, in
    particular every in-place update of the sources, runs after them: the staged copy is the state at
    ``save_state``, and the host did not wait for it."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_for_copies(fence: Any | None) -> None:
    """Block this (background) thread until the copies before ``fence`` (:func:`copy_fence`) are complete: only then
    is the pinned host memory read."""
    if fence is not None:
        fence.synchronize()


def staged_tensor(source: torch.Tensor, *, pin: bool = True) -> torch.Tensor:
    """A host-memory copy of ``source`` (pinned when it is on CUDA and ``pin``), with its own storage."""
    return copy_to_host(source, reserved_buffer(source, pin=pin), pin=pin)


# --------------------------------------------------------------------------------------------------- staging
def staged_copy(value: Any, pin: bool = True) -> Any:
    """A host-memory copy of a DCP state dict: tensors copied (plain tensors and DTensor local shards into dense
    host memory, with CUDA pinned, fresh or the pool's: :func:`staged_tensor`; a DTensor keeps its spec around the
    host copy, :func:`.internals.host_dtensor`; ``ShardedTensor`` by its own deep copy, which keeps
    its sharding metadata), containers rebuilt, everything else shared (ints, floats, strings are immutable)."""
    if isinstance(value, torch.Tensor):
        if type(value) is torch.Tensor:
            return staged_tensor(value, pin=pin)
        if _is_dtensor(value):  # FSDP2: the local shard only (a deepcopy copies its whole storage), CPU or CUDA
            return host_dtensor(staged_tensor(value.to_local(), pin=pin), like=value)
        if value.device.type == "cpu":
            return copy.deepcopy(value)
        # CUDA ShardedTensor (FSDP1 staged natively): a copy whose shards' placements say CPU (as torch's own async
        # staging does), in fresh memory
        return value.to(device="cpu")
    if isinstance(value, dict):
        return type(value)((key, staged_copy(item, pin)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(staged_copy(item, pin) for item in value)
    return value


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)

