"""Rank agreement: run a phase everywhere and raise the same error everywhere; agree on digests.

Every helper here is a collective when a default process group exists: all ranks of the group must call it
in the same order. Without a process group they run locally.

* :func:`run_phase` runs a local function on every rank, then exchanges one flag per rank (a fixed-size
  all-reduce). Only if some rank failed are the failure messages gathered; every rank then raises the same
  exception. ``BaseException`` is caught on purpose: DCP's ``CheckpointException`` derives from it.
* :func:`agree` exchanges a fixed-size sha256 digest of a value (O(world) bytes, not O(world x value)). Only on
  a mismatch is rank 0's value broadcast, so each disagreeing rank can explain what differs.
* :func:`on_main` computes a value on rank 0 (as a phase) and broadcasts it.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointConfigurationError, CheckpointError, CheckpointRankError
from .jsondiff import differences

T = TypeVar("T")
_DIGEST = 32
# Interrupts and exits stay what they are on the rank that got them (the other ranks are told).
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if distributed() else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if distributed() else 1


def _device(group: Any = None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe(exc: BaseException) -> str:
    # Must never raise: a failure here would skip this rank's collective and hang the others.
    try:
        text = str(exc)
    except Exception as broken:  # e.g. an exception whose __str__ is itself broken
        text = f"<message unavailable: {type(broken).__name__} in __str__>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def raise_gathered(failures: dict[int, tuple[str, str]], context: str, cause: BaseException | None = None,
                   group: Any = None) -> NoReturn:
    """Raise one exception describing ``failures`` (rank -> (library class name or "", message))."""
    from .. import errors

    names = {name for name, _ in failures.values()}
    cls: type[CheckpointError] = CheckpointRankError
    if len(names) == 1:
        candidate = getattr(errors, next(iter(names)), None) if next(iter(names)) else None
        if isinstance(candidate, type) and issubclass(candidate, CheckpointError):
            cls = candidate
    if world_size(group) == 1:
        message = f"{context} failed: {next(iter(failures.values()))[1]}"
    else:
        detail = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in sorted(failures.items()))
        message = f"{context} failed on rank(s) {sorted(failures)}: {detail}"
    error = cls(message)
    error.failures = {r: msg for r, (_, msg) in failures.items()}
    raise error from cause


def _group_destroyed(context: str) -> CheckpointRankError:
    return CheckpointRankError(
        f"{context}: the process group this checkpoint phase runs over was destroyed (destroy_process_group() "
        "was called while the save was still running, or the job is shutting down). Nothing was published. Wait "
        "for asynchronous saves (accelerate_txn.wait_for_checkpoint or accelerator.end_training()) before "
        "destroying the process group."
    )


def run_phase(function: Callable[[], T], context: str = "Checkpoint phase", group: Any = None) -> T:
    """Run ``function`` on every rank; if it raises anywhere, raise the same error on every rank.

    ``group`` names the process group the phase runs over; if it was destroyed meanwhile (the script called
    ``destroy_process_group`` while an asynchronous save was writing), the phase raises before ``function`` runs, or
    right after it if the group went while it ran: a rank that lost its group must never carry on as if it were
    alone."""
    if group is not None and not distributed():
        raise _group_destroyed(context)
    result: Any = None
    failure: tuple[str, str, bool] | None = None
    caught: BaseException | None = None
    try:
        result = function()
    except BaseException as exc:  # on purpose: DCP's CheckpointException derives from BaseException
        if getattr(exc, "out_of_step", False):
            raise  # the ranks are desynchronised: another exchange could only hang
        caught = exc
        agreed = isinstance(exc, CheckpointError) and bool(exc.failures)  # raised everywhere by a nested phase
        name = type(exc).__name__ if isinstance(exc, CheckpointError) else ""
        failure = (name, str(exc) if agreed else _describe(exc), agreed)
    if group is not None and not distributed():  # destroyed while ``function`` ran: never go on as one rank alone
        raise _group_destroyed(context) from caught
    if not distributed():
        if caught is None:
            return result
        if isinstance(caught, (CheckpointError, *_PASS_THROUGH)):
            raise caught
        raise_gathered({0: failure[:2]}, context, caught)  # type: ignore[index]
    # One fixed-size exchange: [failed, tag, -tag] with MAX. The phase tag catches ranks that are out of step (a
    # rank that failed between native collectives meeting the others in a different phase): raise at once
    # everywhere rather than exchange mismatched messages.
    tag = zlib.crc32(context.encode()) & 0x3FFFFFFF
    exchange = torch.tensor([0 if failure is None else 1, tag, -tag], dtype=torch.int32, device=_device(group))
    dist.all_reduce(exchange, op=dist.ReduceOp.MAX, group=group)
    failed, high, low = (int(value) for value in exchange.tolist())
    if high != -low:
        error = CheckpointRankError(
            f"Ranks are out of step: this rank finished '{context}' while another rank finished a different phase "
            "(a rank failed inside native Accelerate code between collectives). The training state may be "
            "inconsistent across ranks: restart from the last complete checkpoint."
        )
        error.failures = {rank(group): context}
        error.out_of_step = True  # type: ignore[attr-defined]
        raise error from caught
    if not failed:
        return result
    gathered: list[Any] = [None] * world_size(group)
    dist.all_gather_object(gathered, failure, group=group)
    if isinstance(caught, _PASS_THROUGH):
        raise caught  # KeyboardInterrupt/SystemExit on this rank: the others were told above.
    if caught is not None and all(item is not None and item[2] and item[1] == failure[1] for item in gathered):
        raise caught  # the same already-agreed error on every rank: pass it on unchanged
    failures = {r: item[:2] for r, item in enumerate(gathered) if item is not None}
    raise_gathered(failures, context, caught, group)


def any_rank(flag: bool, group: Any = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (one fixed-size all-reduce)."""
    if not distributed():
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def digest(value: Any) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()


def agree(value: Any, what: str, group: Any = None) -> None:
    """Check that every rank holds the same JSON-able ``value``; raise the same error everywhere if not."""
    if not distributed() or world_size(group) == 1:
        return
    device = _device(group)
    mine = torch.frombuffer(bytearray(digest(value)), dtype=torch.uint8).to(device)
    everyone = [torch.empty(_DIGEST, dtype=torch.uint8, device=device) for _ in range(world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if all(torch.equal(everyone[0], other) for other in everyone[1:]):
        return
    # Rare path: explain. Only rank 0's value travels, to every rank.
    holder = [value if rank(group) == 0 else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    reference = json.loads(json.dumps(holder[0], sort_keys=True, default=str))
    local = json.loads(json.dumps(value, sort_keys=True, default=str))

    def explain() -> None:
        found = differences(reference, local, names=("rank 0", f"rank {rank(group)}"), limit=3)
        if not found and digest(value) != digest(holder[0]):
            found = ["the values differ in representation (e.g. 1 vs 1.0 or True)"]
        if found:
            raise CheckpointConfigurationError(
                f"Ranks disagree on {what}: {'; '.join(found)}. Every rank must run the same configuration; "
                "check rank-dependent code before save_state/load_state."
            )

    run_phase(explain, f"Agreeing on {what}", group)


def on_main(function: Callable[[], T], context: str = "Checkpoint phase") -> T:
    """Compute ``function()`` on rank 0 only (errors raised everywhere) and broadcast its value."""
    value = run_phase(lambda: function() if rank() == 0 else None, context)
    if distributed():
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        value = holder[0]
    return value


# --- the background group of asynchronous saves ------------------------------------------------------------

_BACKGROUND: list[Any] = []  # the background process group, created once per process


def background_group() -> Any:
    """The process group of the background writes (gloo), created collectively on first use for the current
    default process group (``destroy_process_group`` drops it: :func:`drop_background_group`); None alone."""
    if not distributed():
        return None
    import torch.distributed as dist

    if _BACKGROUND:
        try:
            dist.get_rank(_BACKGROUND[0])  # destroyed by a destroy_process_group that bypassed our wrapper?
        except (ValueError, RuntimeError):
            _BACKGROUND.clear()
    if not _BACKGROUND:
        _BACKGROUND.append(dist.new_group(backend="gloo"))
    return _BACKGROUND[0]



def is_background_group(group: Any) -> bool:
    """Whether ``group`` is the background process group of this process."""
    return any(group is ours for ours in _BACKGROUND)


def drop_background_group() -> None:
    """Forget the background group (its default process group is being destroyed): the next default group gets
    a new one."""
    _BACKGROUND.clear()
