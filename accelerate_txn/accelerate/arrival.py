"""Every rank reaches a checkpoint call before its first collective: the check at the start of the patched FSDP
``save_state``/``load_state`` and of ``save_training_checkpoint``/``load_training_checkpoint``.

The most common FSDP checkpointing mistake is a save made on rank 0 only (inside ``if accelerator.is_main_process:``).
Natively, and through the library's first agreement alike, that ends in a bare collective mismatch (gloo: ``op.
preamble.length <= op.nbytes``) or a hang. :func:`check_arrival` runs ``core.ranks.arrive`` first: the ranks meet
in the default process group's store, with no collective, and the ranks that did reach the call raise
:class:`~accelerate_txn.errors.CheckpointArrivalError` within ``arrival_timeout`` seconds, saying what happened and
the usual cause. Nothing has been written or restored by then.

Called on every rank, in the caller's thread. Without a process group, or with one rank, it does nothing (no store
traffic); so does it inside :func:`arrived`, which the patch uses around the explicit API it hands a call to (one
call arrives once).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..core.ranks import arrive, distributed, world_size
from ..fsdp.internals import default_store
from .config import ARRIVAL_TIMEOUT_ENV, arrival_timeout

_ARRIVED: ContextVar[bool] = ContextVar("accelerate_txn_arrived", default=False)


def check_arrival(owners: Any, op: str) -> None:
    """Raise :class:`~accelerate_txn.errors.CheckpointArrivalError` on this rank unless every rank reaches ``op``
    (``"save_state"``, ``"load_state"``, ...) within the arrival timeout of ``owners`` (an Accelerator or
    ``{component: Accelerator}``); see :mod:`accelerate_txn.accelerate.arrival`."""
    if _ARRIVED.get() or not distributed() or world_size() == 1:
        return
    primary = next(iter(owners.values()), None) if isinstance(owners, Mapping) else owners
    timeout = arrival_timeout(primary)
    arrive(op, timeout, default_store(),
           advice="Every rank must make the same checkpoint calls in the same order: under FSDP, save_state() and "
                  "load_state() are collective (a common cause: calling one inside `if accelerator.is_main_process:`"
                  "); call it on every rank. Nothing was written or restored.",
           wait_hint=f"If a rank is only slow to get there, wait longer: configure_checkpointing(accelerator, "
                     f"arrival_timeout=SECONDS) or {ARRIVAL_TIMEOUT_ENV} (now {timeout:g} s).")


@contextmanager
def arrived() -> Iterator[None]:
    """Inside: :func:`check_arrival` does nothing (this call already arrived)."""
    token = _ARRIVED.set(True)
    try:
        yield
    finally:
        _ARRIVED.reset(token)
