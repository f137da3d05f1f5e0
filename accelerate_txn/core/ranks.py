"""Rank agreement: run a phase everywhere and raise the same error everywhere; agree on digests.

Every helper here is a collective when a default process group exists: all ranks of the group must call it
in the same order. Without a process group they run locally.

* :func:`run_phase` runs a local function on every rank, then exchanges one flag per rank (a fixed-size
  all-reduce). Only if some rank failed are the failure messages gathered; every rank then raises the same
  exception. ``BaseException`` is caught on purpose: DCP's ``CheckpointException`` derives from it.
* :func:`agree` all-reduces a fixed-size sha256 digest of a value (64 bytes at any world size). Only on a
  mismatch is rank 0's value broadcast, so each disagreeing rank can explain what differs.
* :func:`gather_rows` brings every rank's inventory rows to rank 0: each rank sends its own rows, rank 0 receives
  O(files written) bytes; no rank receives anything per rank but rank 0.
* :func:`on_main` computes a value on rank 0 (as a phase) and broadcasts it.

A rank that goes away (killed, or ended by a signal, at any instant) makes the next collective of the others fail
with the backend's raw error (gloo: "Connection reset by peer"). Every collective here runs inside
:func:`collective`, which turns that into :class:`CheckpointRankError` naming the ranks that went away, with the
evidence (:func:`lost_ranks`): a rank that left a checkpoint call on an exception (a signal handler's, Ctrl-C) says so
in the store first; a rank on this host whose process ended is seen in ``/proc``; with two ranks the peer whose
connection closed is the other one. The error is final on the rank that raises it (``out_of_step``): an enclosing
phase never exchanges again over a broken group.

One helper is not a collective: :func:`arrive` checks, through the process group's key-value store, that every rank
reached the same checkpoint call before its first collective, so a call made on some ranks only ends with an
explained error on those ranks, in bounded time, instead of a mismatched collective.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointArrivalError, CheckpointConfigurationError, CheckpointError, CheckpointRankError
from .jsondiff import differences

logger = logging.getLogger(__name__)
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


# --- a rank that went away ------------------------------------------------------------------------------------

PROCESSES_PREFIX = "accelerate_txn/processes"
"""Prefix of the store keys where each rank records its process (one key per host and PID namespace)."""
DEPARTED_KEY = "accelerate_txn/departed"
"""The store key where a rank that leaves a collective on an exception (a signal handler's, Ctrl-C) says so."""
LOSS_WAIT = 10.0
"""Seconds a rank whose collective lost its connection waits (polling ``/proc``) for a suspect on its host to end: a
rank leaving on an exception closes its connections while it exits. A bound on explaining, never on failing."""
_LOSS_WORDS = ("closed", "reset", "broken pipe", "connection", "socket", "peer", "read error", "write error",
               "aborted", "remote process exited", "timed out", "timeout")
# This process: the process group it registered in, its same-host peers {rank: (pid, start time)} once read, and the
# successful exchanges per group (equal on every rank that is in step: dates a departure notice).
_SELF: dict[str, Any] = {"group": None, "peers": None}
_EXCHANGES: dict[int, int] = {}


def _host_key() -> str | None:
    """This host and PID namespace (processes with the same key see each other in ``/proc``); None without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as stream:
            boot = stream.read().strip()
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}-{namespace.st_dev}-{namespace.st_ino}"


def _started(pid: int) -> str | None:
    """Process ``pid``'s start time while it runs; None once it ended (no entry, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            fields = stream.read().rpartition(")")[2].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19]


def _world_store() -> Any:
    """The default process group's store, or None where this torch does not expose it publicly."""
    try:
        getter = getattr(dist.group.WORLD, "get_group_store", None)
        return getter() if getter is not None else None
    except (RuntimeError, ValueError, NotImplementedError):
        return None


def _register() -> None:
    """Record this process (rank, pid, start time) under its host in the store, once per default process group. Best
    effort: without it a lost rank is explained with less evidence, and nothing else depends on it."""
    world = dist.group.WORLD
    if _SELF["group"] == id(world):
        return
    _SELF.update(group=id(world), peers=None)
    host, store = _host_key(), _world_store()
    if host is None or store is None:
        return
    try:
        store.append(f"{PROCESSES_PREFIX}/{host}", f"{rank()} {os.getpid()} {_started(os.getpid())};")
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):  # an old store: no registry
        pass


def _peers(store: Any, refresh: bool = False) -> dict[int, tuple[int, str]]:
    """The other ranks on this host, as recorded by :func:`_register` (read once: every rank registered before the
    first exchange completed)."""
    if _SELF["peers"] is not None and not refresh:
        return dict(_SELF["peers"])
    host = _host_key()
    if host is None or store is None:
        return dict(_SELF["peers"] or {})
    try:
        text = store.get(f"{PROCESSES_PREFIX}/{host}").decode()
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):  # the store's host may be the lost rank
        return dict(_SELF["peers"] or {})
    peers: dict[int, tuple[int, str]] = {}
    for entry in filter(None, text.split(";")):
        fields = entry.split()
        if len(fields) == 3 and fields[0].isdigit() and fields[1].isdigit() and int(fields[0]) != rank():
            peers[int(fields[0])] = (int(fields[1]), fields[2])
    _SELF["peers"] = peers
    return dict(peers)


_NO_STORE = object()  # ended_peers: use only what this process already knows


def ended_peers(store: Any = None) -> dict[int, str]:
    """The other ranks on this host whose process has ended, each with how it was seen (a few ``/proc`` reads; the
    store is asked for the ranks on this host only if they were never read, and never with ``_NO_STORE``)."""
    known = _peers(None) if store is _NO_STORE else _peers(store if store is not None else _world_store())
    return {r: f"its process (pid {pid}, on this host) has ended" for r, (pid, start) in known.items()
            if _started(pid) != start}


def _note_departure(exc: BaseException, group: Any) -> None:
    """Tell the other ranks, through the store, that this rank leaves a collective on ``exc`` (best effort: the
    exception itself goes on)."""
    store = _world_store()
    if store is None:
        return
    try:
        store.append(DEPARTED_KEY, f"{rank()} {_EXCHANGES.get(id(group), 0)} {_describe(exc)}"[:500].replace("\n", " ")
                     + "\n")
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):
        pass


def _departures(store: Any, group: Any) -> dict[int, str]:
    """Ranks that said they left an exchange of ``group`` at most one exchange before this rank's current one."""
    try:
        text = store.get(DEPARTED_KEY).decode() if store is not None and store.check([DEPARTED_KEY]) else ""
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):
        return {}
    now = _EXCHANGES.get(id(group), 0)
    found: dict[int, str] = {}
    for line in filter(None, text.split("\n")):
        who, count, why = [*line.split(" ", 2), "", ""][:3]
        if who.isdigit() and count.isdigit() and int(count) >= now - 1 and int(who) != rank():
            found[int(who)] = f"it left the checkpoint call on {why}"
    return found


def _members(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the default group); every rank of the default group if it is gone."""
    try:
        return list(dist.get_process_group_ranks(group)) if group is not None else list(range(world_size()))
    except (RuntimeError, ValueError):  # destroyed meanwhile
        return list(range(dist.get_world_size())) if distributed() else []


def lost_ranks(group: Any = None, suspected: bool = True, wait: float = LOSS_WAIT) -> dict[int, str]:
    """The ranks of ``group`` that went away, each with the evidence: a departure it recorded, or (on this host) its
    ended process. With ``suspected`` (this rank's connection to a peer closed) and no evidence yet, a suspect on this
    host still running is given ``wait`` seconds to end (it may be exiting)."""
    store = _world_store()
    members = set(_members(group))
    found = {r: why for r, why in _departures(store, group).items() if r in members}
    peers = _peers(store, refresh=_SELF["peers"] is None)
    deadline = time.monotonic() + (wait if suspected else 0.0)
    while True:
        found.update({r: f"its process (pid {pid}, on this host) has ended" for r, (pid, start) in peers.items()
                      if r in members and r not in found and _started(pid) != start})
        if found or not any(r in members for r in peers) or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)  # a poll interval within the deadline: waiting for a process to end, not a synchronisation


def _peer_lost(context: str, group: Any, exc: BaseException, earlier: BaseException | None) -> CheckpointRankError:
    """The error a rank raises when a collective of phase ``context`` failed under it (see :func:`collective`)."""
    text = _describe(exc)
    suspected = any(word in text.lower() for word in _LOSS_WORDS)
    found = lost_ranks(group, suspected)
    me = rank()
    others = [r for r in _members(group) if r != me]
    if not found and suspected and len(others) == 1:
        found = {others[0]: "the only other rank of the process group: its connection to this rank closed"}
    first = f" (this rank's own step had failed first: {_describe(earlier)})" if earlier is not None else ""
    restart = ("The process group cannot be used any more: restart the whole job (every rank) from the last complete "
               "checkpoint. A save interrupted before its publish published nothing (rank 0 removes its staging "
               "directory, or the next save does); a restore interrupted midway leaves the Accelerator marked failed.")
    if found:
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(found.items()))
        message = (f"{context} failed: rank(s) {sorted(found)} went away ({detail}). Rank {me} saw it as its "
                   f"collective failed: {text}{first}. Check the log of rank(s) {sorted(found)} for the signal or "
                   f"error that ended them. {restart}")
    elif suspected:
        message = (f"{context} failed: a rank went away (rank {me}'s collective lost its connection: {text}){first}; "
                   f"which one could not be seen from this host. Check the logs of ranks {others} for the one that "
                   f"ended. {restart}")
    else:
        message = (f"{context} failed: this rank's collective failed ({text}){first}; the ranks can no longer agree. "
                   f"Check every rank's log. {restart}")
    error = CheckpointRankError(message)
    error.failures = dict(found) if found else {me: text}
    error.out_of_step = True  # type: ignore[attr-defined]  # final: an enclosing phase must not exchange again
    return error


@contextlib.contextmanager
def collective(context: str, group: Any = None, earlier: BaseException | None = None) -> Iterator[None]:
    """Run a collective of phase ``context`` over ``group``: if it fails (a rank went away: gloo's "Connection reset by
    peer"), raise :class:`CheckpointRankError` naming the ranks that went away; if ``group`` was destroyed under it
    (an asynchronous save's phase while the script called ``destroy_process_group``), the same error as a phase
    that starts after the destruction; if this rank leaves it on another exception (a signal handler's, Ctrl-C),
    record that in the store first, for the others' error."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        if group is not None and not distributed():  # the script destroyed the group under this collective
            raise _group_destroyed(context) from exc  # (c10d then raises anything: KeyError, ValueError, ...)
        if isinstance(exc, RuntimeError):  # gloo/NCCL: RuntimeError, DistBackendError, DistNetworkError
            raise _peer_lost(context, group, exc, earlier) from exc
        _note_departure(exc, group)
        raise
    except BaseException as exc:
        _note_departure(exc, group)
        raise


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
    _register()
    tag = zlib.crc32(context.encode()) & 0x3FFFFFFF
    exchange = torch.tensor([0 if failure is None else 1, tag, -tag], dtype=torch.int32, device=_device(group))
    with collective(context, group, caught):
        dist.all_reduce(exchange, op=dist.ReduceOp.MAX, group=group)
    _EXCHANGES[id(group)] = _EXCHANGES.get(id(group), 0) + 1
    if _SELF["peers"] is None:  # every rank registered before this exchange completed: learn this host's ranks once
        _peers(_world_store(), refresh=True)
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
    with collective(context, group, caught):
        dist.all_gather_object(gathered, failure, group=group)
    if isinstance(caught, _PASS_THROUGH):
        raise caught  # KeyboardInterrupt/SystemExit on this rank: the others were told above.
    if caught is not None and all(item is not None and item[2] and item[1] == failure[1] for item in gathered):
        raise caught  # the same already-agreed error on every rank: pass it on unchanged
    failures = {r: item[:2] for r, item in enumerate(gathered) if item is not None}
    raise_gathered(failures, context, caught, group)


def row_payload(who: int, rows: dict[str, dict[str, Any]]) -> bytes:
    """What rank ``who`` sends rank 0 in :func:`gather_rows`: its rank and rows as compact JSON (rows are JSON: they
    become the manifest's inventory), so rank 0 parses data, never unpickles it."""
    return json.dumps([who, rows], sort_keys=True, separators=(",", ":")).encode()


def merge_row_payloads(own: dict[str, dict[str, Any]], payloads: list[bytes], world: int,
                       me: int = 0) -> dict[str, dict[str, Any]]:
    """Rank 0's side of :func:`gather_rows`: its ``own`` rows and the other ranks' :func:`row_payload` (trailing
    blanks of the padding allowed) merged; raises unless exactly the ranks ``0..world-1`` contributed. Linear in the
    bytes received: no term in the number of ranks squared."""
    parts: list[tuple[int, dict[str, dict[str, Any]]]] = [(me, own)]
    for payload in payloads:
        who, rows = json.loads(payload)
        parts.append((who, rows))
    contributed = sorted(part[0] for part in parts)
    if contributed != list(range(world)):
        raise CheckpointRankError(
            f"The checkpoint was started on ranks 0..{world - 1}, but ranks {contributed} contributed their "
            "files: nothing was published.")
    merged: dict[str, dict[str, Any]] = {}
    for _rank, rows in parts:
        merged.update(rows)
    return merged


def gather_rows(rows: dict[str, dict[str, Any]], world: int, group: Any = None) -> dict[str, dict[str, Any]]:
    """Rank 0 receives every rank's rows (the other ranks get ``{}``), and proves that each of the ``world`` ranks
    of the saving world contributed: a rank that lost its process group must never publish alone.

    Two collectives, neither of which sends any rank a per-rank list: a fixed-size all-reduce of the longest
    payload, then a gather to rank 0 of each other rank's :func:`row_payload`, padded to that length with blanks
    (rank 0 keeps its own rows). Each rank other than 0 sends and receives O(1) bytes beyond its own rows; rank 0
    receives (W - 1) x the longest payload. (``gather_object`` would all-gather every rank's size first: W sizes to
    every rank.)"""
    if not distributed():
        if world != 1:
            raise CheckpointRankError(
                f"The checkpoint was started on {world} ranks, but this process no longer belongs to a process group "
                "(destroy_process_group() was called during the save): nothing was published.")
        return rows
    me = rank(group)
    payload = b"" if me == 0 else row_payload(rank(), rows)
    device = _device(group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    with collective("Gathering every rank's file rows", group):
        longest = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        padded = bytearray(payload.ljust(int(longest.item()), b" ")) or bytearray(b" ")
        mine = torch.frombuffer(padded, dtype=torch.uint8).to(device)
        gathered = [torch.empty_like(mine) for _ in range(world_size(group))] if me == 0 else None
        dist.gather(mine, gathered, dst=root, group=group)
    if me != 0:
        return {}
    return merge_row_payloads(rows, [bytes(part.cpu().numpy()) for part in gathered[1:]], world,  # type: ignore[index]
                              rank())


def any_rank(flag: bool, group: Any = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (one fixed-size all-reduce)."""
    if not distributed():
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device(group))
    with collective("Exchanging one flag per rank", group):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def digest(value: Any) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()


def agree(value: Any, what: str, group: Any = None) -> None:
    """Check that every rank holds the same JSON-able ``value``; raise the same error everywhere if not."""
    if not distributed() or world_size(group) == 1:
        return
    # One fixed-size all-reduce (MAX) of the digest's four 64-bit words d and their complements ~d: every rank holds
    # the same digest exactly when each word's maximum equals its minimum (~max(~d)). Nothing per rank travels to
    # any rank, and eight elements keep a small-message all-reduce as cheap as the all-gather it replaces.
    own = torch.frombuffer(bytearray(digest(value)), dtype=torch.int64)
    exchange = torch.cat([own, torch.bitwise_not(own)]).to(_device(group))
    with collective(f"Agreeing on {what}", group):
        dist.all_reduce(exchange, op=dist.ReduceOp.MAX, group=group)
    words = _DIGEST // 8
    highest, lowest = exchange[:words].cpu(), torch.bitwise_not(exchange[words:].cpu())
    if torch.equal(highest, lowest):
        return
    # Rare path: explain. Only rank 0's value travels, to every rank.
    holder = [value if rank(group) == 0 else None]
    with collective(f"Agreeing on {what}", group):
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
        with collective(context, group):
            dist.broadcast_object_list(holder, src=0, group=group)
        value = holder[0]
    return value


# --- arrival: every rank reached the same checkpoint call (through the store, no collective) -----------------

ARRIVAL_PREFIX = "accelerate_txn/arrival"
"""Prefix of the keys :func:`arrive` keeps in the process group's store."""
LEFT_KEY = "left"
"""The arrival key where a rank that destroys its default process group says so (:func:`note_leaving`)."""
ARRIVAL_NOTICE = 5.0
"""Seconds into an arrival wait (at most half its timeout) after which the waiting rank logs one WARNING saying whom
it waits for: a normal save's ranks arrive within moments, so the line appears only when one is late or missing."""
_POLL_FIRST = 0.001  # seconds between two looks at the store while waiting: doubling from this ...
_POLL_MAX = 0.1  # ... up to this (a waiting rank asks the store at most about ten times a second)
# This process's arrival calls so far, and the lowest call number whose shared keys may still be in the store.
_ARRIVALS = {"calls": 0, "clean_from": 1}


def arrive(op: str, timeout: float, store: Any, *, target: str | None = None, advice: str = "",
           wait_hint: str = "", setting: str = "") -> None:
    """Return once every rank of the default process group has reached checkpoint call ``op`` (with ``target``, the
    directory it names, if any). Raise :class:`CheckpointArrivalError` on this rank when some rank did not get there
    within ``timeout`` seconds, when a rank reached another call (or the same call for another ``target``) at the same
    point, when a rank that has not arrived can no longer arrive (its process ended on this host, or it destroyed its
    process group: :func:`note_leaving`), or when this rank came after the others stopped waiting. ``advice`` (what
    to do) ends every message, ``wait_hint`` (how to wait longer) the timeout's; ``setting`` names how to set the
    timeout, in the one WARNING a wait longer than :data:`ARRIVAL_NOTICE` seconds logs.

    Not a collective: the ranks meet in ``store`` (the default group's key-value store), so a call that only some
    ranks make ends with an explained error on those ranks instead of a mismatched collective. Calls are numbered
    per process, the same on every rank while every rank makes the same calls. For call N every rank records
    ``rank R = "N op"``, claims ``N/first = [R, op, target]`` if it is still free, and if its call differs from the
    first rank's it decides "mismatch", all before it counts itself in ``N/count``. The rank whose count completes
    the world decides "go"; a rank that waited ``timeout`` seconds decides "abort", naming the ranks that had arrived;
    a waiting rank that sees conclusive evidence that a missing rank will never arrive decides "lost" at once (a
    rank only slow to arrive is always waited for). A decision is a create-if-absent ``compare_set`` of
    ``N/decision``: every rank follows the first one written, and a rank arriving after an abort reads it and raises
    too, instead of waiting in a later collective.

    The keys stay bounded: each rank reuses its one ``rank R`` key, and once call N is "go" every rank is past
    every earlier call, so the rank that decided it deletes the earlier calls' keys. Waiting is polling the store
    with a backoff of at most :data:`_POLL_MAX` seconds, within the deadline.

    Without a process group, or with one rank, it returns at once and touches nothing.
    """
    if not distributed() or world_size() == 1:
        return
    started = time.monotonic()
    deadline = started + timeout
    _ARRIVALS["calls"] += 1
    number = _ARRIVALS["calls"]
    me, world = rank(), world_size()
    _register()  # this process on its host: a rank that ends while the others wait here is seen at once
    call = [me, op, target]
    try:
        keys = dist.PrefixStore(ARRIVAL_PREFIX, store)
        decision_key = f"{number}/decision"
        keys.set(f"rank {me}", f"{number} {op}")
        first = json.loads(keys.compare_set(f"{number}/first", "", json.dumps(call)).decode())
        if first[1:] != call[1:]:  # decided before this rank counts itself: "go" can never be written first
            _decide(keys, decision_key, {"kind": "mismatch", "calls": sorted([first, call], key=lambda c: c[0])})
        completes = keys.add(f"{number}/count", 1) == world
        if completes:
            decision = _decide(keys, decision_key, {"kind": "go"})
        else:
            def notice() -> None:
                missing = [r for r in range(world) if r != me and not _arrived(keys, r, number)]
                where = f" into {target}" if target is not None else ""
                logger.warning(
                    "accelerate-txn: rank %d has waited %.0f s at %s()%s for rank(s) %s to reach it too (a "
                    "collective checkpoint call: every rank must make it). It waits up to %g s in all, then raises "
                    "CheckpointArrivalError (sooner if those ranks are seen to have ended). %s", me,
                    time.monotonic() - started, op, where, missing, timeout,
                    setting or "Set the wait with the arrival timeout.")

            decision = _await(keys, decision_key, deadline, number, started + min(ARRIVAL_NOTICE, timeout / 2),
                              notice)
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
        lost = ended_peers(_NO_STORE)
        if lost:
            raise _lost_before(op, lost, advice) from exc
        raise CheckpointRankError(
            f"Could not check that every rank reached {op}(): the process group's store failed "
            f"({_describe(exc)}). A rank may have died; restart the job from the last complete checkpoint."
        ) from exc
    if decision["kind"] == "lost":
        raise _lost_before(op, {int(r): why for r, why in decision["lost"].items()}, advice,
                           left=decision.get("left", False))
    raise CheckpointArrivalError(_arrival_message(decision, me, world, op, advice, wait_hint))


def note_leaving(store: Any) -> None:
    """Record in ``store`` (the default group's) that this rank is destroying its default process group, with the
    number of arrival calls it made: a rank waiting at a later call knows at once that this one will never arrive
    there. Best effort (a failing store changes nothing: the waiting rank then waits out its timeout)."""
    if not distributed() or world_size() == 1 or store is None:
        return
    try:
        dist.PrefixStore(ARRIVAL_PREFIX, store).append(LEFT_KEY, f"{rank()} {_ARRIVALS['calls']};")
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):
        pass


def _left(keys: Any, number: int) -> dict[int, str]:
    """The ranks that destroyed their process group having made fewer than ``number`` arrival calls."""
    if not keys.check([LEFT_KEY]):
        return {}
    found: dict[int, str] = {}
    for entry in filter(None, keys.get(LEFT_KEY).decode().split(";")):
        who, _, calls = entry.partition(" ")
        if who.isdigit() and calls.isdigit() and int(calls) < number and int(who) != rank():
            found[int(who)] = "it destroyed its process group (destroy_process_group(), or the end of its script) " \
                              "without making this call"
    return found


def _lost_before(op: str, lost: dict[int, str], advice: str = "", left: bool = False) -> CheckpointRankError:
    """The error of a wait that ended because ranks ``lost`` will never arrive: :class:`CheckpointArrivalError` when
    each of them ``left`` (destroyed its process group: it finished without this call), else
    :class:`CheckpointRankError` (its process ended: a crash, or the end of its script)."""
    detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(lost.items()))
    if left:
        error: CheckpointRankError = CheckpointArrivalError(
            f"{op}() could not start: rank(s) {sorted(lost)} left without reaching it ({detail}): this call was made "
            f"on some ranks only. {advice} Nothing was written or restored.".replace("  ", " "))
    else:
        error = CheckpointRankError(
            f"{op}() could not start: rank(s) {sorted(lost)} went away ({detail}). If they crashed, check the log of "
            f"rank(s) {sorted(lost)} for the signal or error that ended them, and restart the whole job (every rank) "
            f"from the last complete checkpoint. If they finished normally, this call was made on some ranks only. "
            f"{advice} Nothing was written or restored.".replace("  ", " "))
    error.failures = lost
    return error


def _decide(keys: Any, key: str, decision: dict[str, Any]) -> dict[str, Any]:
    """Write ``decision`` unless one was written first; the decision that stands."""
    return json.loads(keys.compare_set(key, "", json.dumps(decision, sort_keys=True)).decode())


def _await(keys: Any, key: str, deadline: float, number: int, notice_at: float,
           notice: Callable[[], None]) -> dict[str, Any] | None:
    """The decision at ``key`` once written, or None at ``deadline``; ``notice()`` is called once at ``notice_at``.
    A missing rank that can never arrive makes this rank decide "lost" at once (waiting out the timeout would only
    delay the error): one on this host whose process ended, or one that destroyed its process group before call
    ``number`` (:func:`note_leaving`). A rank still running that has not arrived is waited for: nothing cheap tells
    a slow rank from one that went on without this call (training in collectives of its own)."""
    delay = _POLL_FIRST
    while not keys.check([key]):
        left = _left(keys, number)
        ended = {**ended_peers(_NO_STORE), **left}  # /proc reads of the ranks recorded on this host
        if ended:
            return _decide(keys, key, {"kind": "lost", "lost": {str(r): why for r, why in sorted(ended.items())},
                                       "left": set(ended) <= set(left)})
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            return None
        if now >= notice_at:
            notice_at = float("inf")
            notice()
        time.sleep(min(delay, remaining))  # a poll interval within the deadline, not a synchronisation
        delay = min(2 * delay, _POLL_MAX)
    return json.loads(keys.get(key).decode())


def _arrived(keys: Any, other: int, number: int) -> bool:
    return keys.check([f"rank {other}"]) and keys.get(f"rank {other}").decode().partition(" ")[0] == str(number)


def _arrival_message(decision: dict[str, Any], me: int, world: int, op: str, advice: str, wait_hint: str) -> str:
    if decision["kind"] == "mismatch":
        (one, one_op, one_target), (other, other_op, other_target) = decision["calls"]
        if one_op == other_op:
            one_dir, other_dir = (repr(t) if t is not None else "its default directory" for t in (one_target, other_target))
            text = (f"Rank {one} called {one_op}() for {one_dir} while rank {other} called it for {other_dir} at the "
                    "same point: the ranks are at different checkpoints (a rank skipped one, or the ranks name "
                    "different directories).")
        else:
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
        with collective("Creating the background process group"):
            _BACKGROUND.append(dist.new_group(backend="gloo"))
    return _BACKGROUND[0]



def is_background_group(group: Any) -> bool:
    """Whether ``group`` is the background process group of this process."""
    return any(group is ours for ours in _BACKGROUND)


def drop_background_group() -> None:
    """Forget the background group (its default process group is being destroyed): the next default group gets
    a new one."""
    _BACKGROUND.clear()
