"""Every rank reaches a checkpoint call before its first collective: the check at the start of the patched FSDP
``save_state``/``load_state`` and of ``save_training_checkpoint``/``load_training_checkpoint``.

The most common FSDP checkpointing mistake is a save made on rank 0 only (inside ``if accelerator.is_main_process:``).
Natively, and through the library's first agreement alike, that ends in a bare collective mismatch (gloo: ``op.
preamble.length <= op.nbytes``) or a hang. :func:`check_arrival` runs ``core.ranks.arrive`` first: the ranks meet
in the default process group's store, with no collective, and the ranks that did reach the call raise
:class:`~accelerate_txn.errors.CheckpointArrivalError` within ``arrival_timeout`` seconds, saying what happened and
the usual cause. Nothing has been written or restored by then.

A wait that lasts :data:`~accelerate_txn.core.ranks.ARRIVAL_NOTICE` seconds logs one WARNING naming the ranks
waited for, the call and its directory, the timeout and how to set it. The wait ends sooner, with the same error, on
conclusive evidence only: a rank reached the same call for another directory (it is at another checkpoint), a
missing rank's process ended (seen on this host), or a missing rank destroyed its process group
(:func:`install_leaving_notice`: ``destroy_process_group()``, which ``accelerator.end_training()`` calls, records it
in the store first). A missing rank that goes on training in collectives of its own gives no such evidence: it is
waited for until the timeout.

Called on every rank, in the caller's thread. Without a process group, or with one rank, it does nothing (no store
traffic); so does it inside :func:`arrived`, which the patch uses around the explicit API it hands a call to (one
call arrives once).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ..core.ranks import arrive, distributed, note_leaving, world_size
from ..core.remote import is_url
from ..fsdp.internals import default_store
from .config import ARRIVAL_TIMEOUT_ENV, arrival_timeout

_ARRIVED: ContextVar[bool] = ContextVar("accelerate_txn_arrived", default=False)


def _target(location: Any) -> str | None:
    """The directory a call names, as the later agreement on the path compares it (None: the default one)."""
    if not isinstance(location, (str, os.PathLike)):
        return None
    text = os.fspath(location)
    return text if is_url(text) else str(Path(text))


def check_arrival(owners: Any, op: str, location: Any = None) -> None:
    """Raise :class:`~accelerate_txn.errors.CheckpointArrivalError` on this rank unless every rank reaches ``op``
    (``"save_state"``, ``"load_state"``, ...) for the same ``location`` (the directory the call names, if any)
    within the arrival timeout of ``owners`` (an Accelerator or ``{component: Accelerator}``); see
    :mod:`accelerate_txn.accelerate.arrival`."""
    if _ARRIVED.get() or not distributed() or world_size() == 1:
        return
    primary = next(iter(owners.values()), None) if isinstance(owners, Mapping) else owners
    timeout = arrival_timeout(primary)
    arrive(op, timeout, default_store(), target=_target(location),
           setting=f"To wait less (or longer): configure_checkpointing(accelerator, arrival_timeout=SECONDS) or "
                   f"{ARRIVAL_TIMEOUT_ENV}=SECONDS.",
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


_LEAVING = [False]


def install_leaving_notice(active: Callable[[], bool]) -> None:
    """Once: ``torch.distributed.destroy_process_group()`` of the default group first records in the store that this
    rank leaves (``core.ranks.note_leaving``), so that a rank waiting for it at a checkpoint call raises at once.
    Only while ``active()`` (the protected path can run: with ``ACCELERATE_TXN_PATCHES=0`` and nothing opted in,
    the call is exactly native, nothing written to the store)."""
    if _LEAVING[0]:
        return
    _LEAVING[0] = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import wrapt

    def destroy_process_group(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if (args[0] if args else kwargs.get("group")) is None and distributed() and active():
            try:
                store = default_store()
            except (RuntimeError, ValueError, AttributeError):
                store = None
            note_leaving(store)
        return wrapped(*args, **kwargs)

    for module in {id(dist): dist, id(c10d): c10d}.values():  # torch.distributed re-exports c10d's function
        if hasattr(module, "destroy_process_group"):
            wrapt.wrap_function_wrapper(module, "destroy_process_group", destroy_process_group)
