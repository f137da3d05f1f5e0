"""Named crash points for the crash-consistency tests (a real ``kill -9`` at a chosen instant).

The protected save and restore call :func:`point` at each step whose interruption the protocol must survive.
When ``ACCELERATE_TXN_KILL_AT`` names that point, the process sends itself ``SIGKILL`` there: no ``finally``
block, no atexit handler and no flush runs, exactly as when the kernel or an operator kills a job. Unset (the
only setting outside tests) a point costs one dictionary lookup.

``ACCELERATE_TXN_KILL_AT=NAME`` kills every rank that reaches ``NAME``; ``NAME@R`` only rank ``R`` (the global
rank from ``RANK``). ``NAME#K`` kills at the ``K``-th time (1-based) the point is reached in this process.

``ACCELERATE_TXN_KILL_SIGNAL`` (``SIGTERM``, ``SIGINT``, ... or a number; default ``SIGKILL``) sends another signal
instead: what an operator, a scheduler's preemption or ``torchrun`` sends. Its effect is the process's own: the
default ``SIGTERM`` action ends the process at once (as ``SIGKILL`` does, with another exit status), a Python handler
(``torchrun``'s raises ``SignalException``; ``SIGINT``'s raises ``KeyboardInterrupt``) raises at that instant.

``ACCELERATE_TXN_ASYNC_FAIL_AT=R`` (``R#K1,K2``) makes rank ``R`` raise inside the background write of its
asynchronous saves (only the ``K1``-th, ``K2``-th of this process): read by ``runtime.async_save``.

A value of any of them outside these forms raises ``CheckpointConfigurationError`` naming it (``core.environment``);
the front ends read them at the start of each save and load, inside its first rank phase.
"""

from __future__ import annotations

import os
import signal

from .environment import Variable

KILL_ENV = "ACCELERATE_TXN_KILL_AT"
SIGNAL_ENV = "ACCELERATE_TXN_KILL_SIGNAL"
ASYNC_FAIL_ENV = "ACCELERATE_TXN_ASYNC_FAIL_AT"

#: Every named point, in the order a save (then a restore) reaches them.
POINTS = (
    "save:after-native-save",   # a component's native save_state returned into staging
    "save:during-flush",        # this rank hashed and fsynced part of its files
    "save:after-manifest",      # manifest written and fsynced in staging, not yet renamed
    "save:after-rename",        # published (renamed), parent fsynced, retention not yet run
    "save:during-retention",    # an old checkpoint was renamed aside and is being deleted
    "load:during-restore",      # native restore of models/optimizers done, RNG not yet applied
)

#: The points of a save that replaces an existing checkpoint directory (``store.posix.replace_directory``), in
#: order; ``save:replace-old-aside`` is reached only where the atomic exchange is unsupported (two renames).
REPLACE_POINTS = (
    "save:replace-before-swap",  # manifest written in staging, the old checkpoint still in place
    "save:replace-old-aside",    # fallback: the old checkpoint renamed aside, the new one not yet renamed in
    "save:replace-after-swap",   # the new checkpoint published, the old tree not yet deleted
)

_reached: dict[str, int] = {}


def _number(text: str, least: int) -> int:
    """``text`` as a whole number ``>= least`` (digits only), else ``ValueError``."""
    if not text.isdigit() or int(text) < least:
        raise ValueError(text)
    return int(text)


def _kill_spec(raw: str) -> tuple[str, int | None, int | None]:
    """``NAME[@R][#K]`` as (point, rank or None, count or None)."""
    target, hash_mark, count = raw.partition("#")
    name, at, rank = target.partition("@")
    if not name or (at and not rank) or (hash_mark and not count):
        raise ValueError(raw)
    return name, _number(rank, 0) if at else None, _number(count, 1) if hash_mark else None


def _signal_number(raw: str) -> int:
    """A signal's name (``SIGTERM``, ``term``) or number, as its number."""
    if raw.isdigit():
        if _number(raw, 1) >= signal.NSIG:
            raise ValueError(raw)
        return int(raw)
    wanted = raw.upper()
    try:
        return int(signal.Signals[wanted if wanted.startswith("SIG") else f"SIG{wanted}"])
    except KeyError:
        raise ValueError(raw) from None


def _fail_spec(raw: str) -> tuple[int, tuple[int, ...]]:
    """``R[#K1,K2,...]`` as (rank, the counts; empty: every save)."""
    rank, hash_mark, counts = raw.partition("#")
    if hash_mark and not counts:
        raise ValueError(raw)
    return _number(rank, 0), tuple(_number(count.strip(), 1) for count in counts.split(",")) if counts else ()


KILL_AT = Variable(KILL_ENV, _kill_spec, None,
                   "use NAME, NAME@R, NAME#K or NAME@R#K: the crash point NAME (docs/configuration.md), reached by "
                   "global rank R only, the K-th time only (K >= 1)")
KILL_SIGNAL = Variable(SIGNAL_ENV, _signal_number, int(signal.SIGKILL),
                       "use a signal's name (SIGTERM, TERM, SIGINT, ..., any case) or its number; unset: SIGKILL")
ASYNC_FAIL_AT = Variable(ASYNC_FAIL_ENV, _fail_spec, None,
                         "use R or R#K1,K2,...: global rank R fails the background write of its asynchronous saves "
                         "(only the K1-th, K2-th of this process, each >= 1)")
#: The test switches a save or load reads deep inside (a crash point, a background write): the front ends read them
#: at its start, inside its first rank phase, so that a malformed one raises there on every rank.
SWITCHES = (KILL_AT, KILL_SIGNAL, ASYNC_FAIL_AT)


def point(name: str) -> None:
    """Crash here (``SIGKILL``, or ``ACCELERATE_TXN_KILL_SIGNAL``) if ``ACCELERATE_TXN_KILL_AT`` asks for ``name`` on
    this rank."""
    if not os.environ.get(KILL_ENV):
        return
    spec = KILL_AT.read()
    if spec is None:
        return
    target, rank, count = spec
    if target != name or (rank is not None and rank != int(os.environ.get("RANK", "0"))):
        return
    _reached[name] = _reached.get(name, 0) + 1
    if count is not None and count != _reached[name]:
        return
    os.kill(os.getpid(), chosen_signal())


def chosen_signal() -> int:
    """The signal :func:`point` sends: ``ACCELERATE_TXN_KILL_SIGNAL`` (a name such as ``SIGTERM`` or ``TERM``, or a
    number), ``SIGKILL`` when unset."""
    return KILL_SIGNAL.read()
