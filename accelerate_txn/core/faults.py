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
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "ACCELERATE_TXN_KILL_AT"
SIGNAL_ENV = "ACCELERATE_TXN_KILL_SIGNAL"

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


def point(name: str) -> None:
    """Crash here (``SIGKILL``, or ``ACCELERATE_TXN_KILL_SIGNAL``) if ``ACCELERATE_TXN_KILL_AT`` asks for ``name`` on
    this rank."""
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return
    target, _, count = wanted.partition("#")
    target, _, rank = target.partition("@")
    if target != name or (rank and rank != os.environ.get("RANK", "0")):
        return
    _reached[name] = _reached.get(name, 0) + 1
    if count and int(count) != _reached[name]:
        return
    os.kill(os.getpid(), chosen_signal())


def chosen_signal() -> int:
    """The signal :func:`point` sends: ``ACCELERATE_TXN_KILL_SIGNAL`` (a name such as ``SIGTERM`` or ``TERM``, or a
    number), ``SIGKILL`` when unset."""
    wanted = os.environ.get(SIGNAL_ENV, "").strip().upper()
    if not wanted:
        return int(signal.SIGKILL)
    if wanted.isdigit():
        return int(wanted)
    return int(getattr(signal, wanted if wanted.startswith("SIG") else f"SIG{wanted}"))
