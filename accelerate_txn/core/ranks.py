"""Rank agreement: run a phase everywhere and raise the same error everywhere; agree on digests.

Every helper here is a collective when a default process group exists: all ranks of the group must call it
in the same order. Without a process group they run locally.

* :func:`run_phase` runs a local function on every rank, then exchanges one flag per rank (a fixed-size
  all-reduce). Only if some rank failed are the failure messages gathered; every rank then raises the same
  exception. ``BaseException`` is caught on purpose: DCP's ``CheckpointException`` derives from it.
* :func:`agree` exchanges a fixed-size sha256 digest of a value (O(world) bytes, not O(world x value)). Only on
  a mismatch is rank 0's value broadcast, so each disagreeing rank can explain what differs.
* :func:`on_main` computes a value on rank 0 (as a phase) and broadcasts it.

One helper is not a collective: :func:`arrive` checks, through the process group's key-value store, that every rank
reached the same checkpoint call before its first collective, so a call made on some ranks only ends with an
explained error on those ranks, in bounded time, instead of a mismatched collective.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointArrivalError, CheckpointConfigurationError, CheckpointError, CheckpointRankError
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


def gather_rows(rows: dict[str, dict[str, Any]], world: int, group: Any = None) -> dict[str, dict[str, Any]]:
    """Rank 0 receives every rank's rows (the other ranks get ``{}``), and proves that each of the ``world`` ranks
    of the saving world contributed: a rank that lost its process group must never publish alone."""
    if not distributed():
        if world != 1:
            raise CheckpointRankError(
                f"The checkpoint was started on {world} ranks, but this process no longer belongs to a process group "
                "(destroy_process_group() was called during the save): nothing was published.")
        return rows
    gathered: list[Any] = [None] * world_size(group) if rank(group) == 0 else []
    dist.gather_object((rank(), rows), gathered if rank(group) == 0 else None, dst=dist.get_global_rank(group, 0)
                       if group is not None else 0, group=group)
    merged: dict[str, dict[str, Any]] = {}
    if rank(group) == 0:
        contributed = sorted(part[0] for part in gathered)
        if contributed != list(range(world)):
            raise CheckpointRankError(
                f"The checkpoint was started on ranks 0..{world - 1}, but ranks {contributed} contributed their "
                "files: nothing was published.")
        for _rank, part in gathered:
            merged.update(part)
    return merged


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


def on_main(function: Callable[[], T], context: str = "Checkpoint phase", group: Any = None) -> T:
    """Compute ``function()`` on rank 0 only (errors raised everywhere) and broadcast its value over ``group``
    (None: the default group; another group must contain global rank 0, as the background group does)."""
    value = run_phase(lambda: function() if rank() == 0 else None, context, group)
    if distributed():
        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=group)
        value = holder[0]
    return value


# --- arrival: every rank reached the same checkpoint call (through the store, no collective) -----------------

ARRIVAL_PREFIX = "accelerate_txn/arrival"
"""Prefix of the keys :func:`arrive` keeps in the process group's store."""
_POLL_FIRST = 0.001  # seconds between two looks at the store while waiting: doubling from this ...
_POLL_MAX = 0.1  # ... up to this (a waiting rank asks the store at most about ten times a second)
# This process's arrival calls so far, and the lowest call number whose shared keys may still be in the store.
_ARRIVALS = {"calls": 0, "clean_from": 1}


def arrive(op: str, timeout: float, store: Any, *, advice: str = "", wait_hint: str = "") -> None:
    """Return once every rank of the default process group has reached checkpoint call ``op``. Raise
    :class:`CheckpointArrivalError` on this rank when some rank did not get there within ``timeout`` seconds, when
    a rank reached another call at the same point, or when this rank came after the others stopped waiting.
    ``advice`` (what to do) ends every message, ``wait_hint`` (how to wait longer) the timeout's.

    Not a collective: the ranks meet in ``store`` (the default group's key-value store), so a call that only some
    ranks make ends with an explained error on those ranks instead of a mismatched collective. Calls are numbered
    per process, the same on every rank while every rank makes the same calls. For call N every rank records
    ``rank R = "N op"``, claims ``N/first = "R op"`` if it is still free, and if its ``op`` differs from the first
    rank's it decides "mismatch", all before it counts itself in ``N/count``. The rank whose count completes the
    world decides "go"; a rank that waited ``timeout`` seconds decides "abort", naming the ranks that had arrived.
    A decision is a create-if-absent ``compare_set`` of ``N/decision``: every rank follows the first one written,
    and a rank arriving after an abort reads it and raises too, instead of waiting in a later collective.

    The keys stay bounded: each rank reuses its one ``rank R`` key, and once call N is "go" every rank is past
    every earlier call, so the rank that decided it deletes the earlier calls' keys. Waiting is polling the store
    with a backoff of at most :data:`_POLL_MAX` seconds, within the deadline.

    Without a process group, or with one rank, it returns at once and touches nothing.
    """
    if not distributed() or world_size() == 1:
        return
    deadline = time.monotonic() + timeout
    _ARRIVALS["calls"] += 1
    number = _ARRIVALS["calls"]
    me, world = rank(), world_size()
    try:
        keys = dist.PrefixStore(ARRIVAL_PREFIX, store)
        decision_key = f"{number}/decision"
        keys.set(f"rank {me}", f"{number} {op}")
        first_rank, _, first_op = keys.compare_set(f"{number}/first", "", f"{me} {op}").decode().partition(" ")
        if first_op != op:  # decided before this rank counts itself: "go" can never be written first
            _decide(keys, decision_key, {"kind": "mismatch", "calls": sorted([[int(first_rank), first_op], [me, op]])})
        completes = keys.add(f"{number}/count", 1) == world
        decision = _decide(keys, decision_key, {"kind": "go"}) if completes else _await(keys, decision_key, deadline)
        if decision is None:  # waited ``timeout`` seconds
            arrived = [r for r in range(world) if _arrived(keys, r, number)]
            decision = _decide(keys, decision_key, {"kind": "abort", "op": op, "arrived": arrived, "timeout": timeout})
        if decision["kind"] == "go":
            if completes:  # every rank is past every earlier call: their keys are garbage
                for old in range(_ARRIVALS["clean_from"], number):
                    for name in ("first", "count", "decision"):
                        keys.delete_key(f"{old}/{name}")
            _ARRIVALS["clean_from"] = number
            return
    except (RuntimeError, ValueError) as exc:  # the store itself failed (its host rank died, a timeout)
        raise CheckpointRankError(
            f"Could not check that every rank reached {op}(): the process group's store failed "
            f"({_describe(exc)}). A rank may have died; restart the job from the last complete checkpoint."
        ) from exc
    raise CheckpointArrivalError(_arrival_message(decision, me, world, op, advice, wait_hint))


def _decide(keys: Any, key: str, decision: dict[str, Any]) -> dict[str, Any]:
    """Write ``decision`` unless one was written first; the decision that stands."""
    return json.loads(keys.compare_set(key, "", json.dumps(decision, sort_keys=True)).decode())


def _await(keys: Any, key: str, deadline: float) -> dict[str, Any] | None:
    """The decision at ``key`` once written, or None at ``deadline``."""
    delay = _POLL_FIRST
    while not keys.check([key]):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(delay, remaining))  # a poll interval within the deadline, not a synchronisation
        delay = min(2 * delay, _POLL_MAX)
    return json.loads(keys.get(key).decode())


def _arrived(keys: Any, other: int, number: int) -> bool:
    return keys.check([f"rank {other}"]) and keys.get(f"rank {other}").decode().partition(" ")[0] == str(number)


def _arrival_message(decision: dict[str, Any], me: int, world: int, op: str, advice: str, wait_hint: str) -> str:
    if decision["kind"] == "mismatch":
        (one, one_op), (other, other_op) = decision["calls"]
        text = f"Rank {one} called {one_op}() while rank {other} called {other_op}() at the same point."
    else:
        arrived, seconds = decision["arrived"], f"{decision['timeout']:g} s"
        missing = [r for r in range(world) if r not in arrived]
        if me in arrived:
            text = f"{op}() was called on ranks {arrived} but ranks {missing} did not reach it within {seconds}."
        else:
            text = (f"This rank ({me}) reached {op}() after ranks {arrived} had stopped waiting for ranks {missing} "
                    f"at {decision['op']}() (they waited {seconds} and raised CheckpointArrivalError).")
        advice = f"{advice} {wait_hint}".strip()
    return f"{text} {advice}".strip()


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
