"""The optimizer restore of a protected Trainer resume: Trainer's ``load_fsdp_optimizer`` call routed to the library's
sharded restore.

Why: on resume Trainer creates its optimizer fresh, then calls Accelerate's ``load_fsdp_optimizer`` (its own binding,
``internals.LOAD_OPTIMIZER``), whose FSDP1 ``SHARDED_STATE_DICT`` branch builds the DCP read template from the live
optimizer state: a fresh optimizer has none, so nothing is read and nothing restored, silently (Accelerate
1.13-1.15); the resumed run then trains from empty moments. Here, while a protected ``train`` resumes (:func:`resuming`,
entered by the ``Trainer.train`` wrapper once the checkpoint was verified on every rank), that call goes to
:func:`..fsdp.fsdp1.load_fsdp1_optimizer` (FSDP1) or :func:`..fsdp.fsdp2.load_fsdp2_optimizer` (FSDP2), the same
restores the Accelerate front end uses: the template comes from the checkpoint's own metadata, every entry is checked
against the live model and optimizer before anything changes, each rank reads only its own elements, and afterwards
every parameter with saved state must hold it again (``verify_restored_*``). Every rank raises the same error.

Anything else (no protected resume running, another Trainer's Accelerator, ``FULL_STATE_DICT``, ``use_dcp=False``)
calls Accelerate's function unchanged. Parameter groups are never reordered: Trainer always has an LR scheduler,
whose state is indexed by group.

Trainer loads the model before the optimizer, so a checkpoint whose optimizer does not match the live model and
optimizer (another model, other parameter groups, other trained parameters) would be refused by the optimizer
restore after the model was loaded. :func:`check_before_model_load` wraps Trainer's ``load_fsdp_model`` binding: on a
routed resume it first runs the optimizer restore's own checks (from the checkpoint's metadata and group entries; no
collective inside, one agreement phase) so that such a checkpoint is refused, on every rank, before the model loads.

The checkpoint a protected resume restores from is held in use (``store.base.Hold``, taken by :mod:`.resume`
before its verification) until Trainer has read everything from it: :func:`resuming` releases it when ``train``
returns or raises, and earlier, once Trainer's load is over, at the first of :func:`rng_loaded` (Trainer's
``_load_rng_state``, the last read of a resume, returned or raised) and :func:`loaded` (the first save). Every rank
holds and releases its own. With ``auto_find_batch_size`` Trainer may run its setup, every load included, again after
an out-of-memory error, so the hold lasts until the first save or the end of ``train``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.ranks import run_phase
from ..fsdp import fsdp1, fsdp2
from ..fsdp.optimizer_state import group_tuples_kept
from ..store.base import Hold
from .adapters import load_arguments
from .internals import model_load_arguments, optimizer_load_arguments
from .layout import backend, state_dict_type

logger = logging.getLogger(__name__)
#: The Trainer whose protected ``train(resume_from_checkpoint=...)`` runs in this context (``None``: none).
_RESUMING: contextvars.ContextVar[Any] = contextvars.ContextVar("accelerate_txn_trainer_resuming", default=None)
#: The hold on the checkpoint that protected resume restores from, while Trainer may still read it (``None``: none).
_HOLD: contextvars.ContextVar[Hold | None] = contextvars.ContextVar("accelerate_txn_trainer_hold", default=None)


@contextlib.contextmanager
def resuming(trainer: Any, hold: Hold | None = None) -> Iterator[None]:
    """While inside, Trainer's optimizer restores for ``trainer`` take the library's path, and ``hold`` (this rank's
    hold on the checkpoint it resumes from) is kept until Trainer's load is over (:func:`loaded`), at the latest until
    the block ends, however it ends."""
    token, held = _RESUMING.set(trainer), _HOLD.set(hold)
    try:
        yield
    finally:
        try:
            if hold is not None:
                hold.release()
        finally:
            _HOLD.reset(held)
            _RESUMING.reset(token)


def loaded(trainer: Any) -> None:
    """Trainer has read everything it restores from the checkpoint ``trainer`` resumes from: stop holding it in use
    (idempotent; nothing when ``trainer`` is not resuming)."""
    hold = _HOLD.get()
    if hold is not None and trainer is not None and trainer is _RESUMING.get():
        hold.release()


def rng_loaded(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper of ``Trainer._load_rng_state``, a resume's last read: the checkpoint is released once it returns or
    raises (not with ``auto_find_batch_size``, whose retry after an out-of-memory error loads everything again)."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        if instance is not None and not getattr(instance.args, "auto_find_batch_size", False):
            loaded(instance)


def routed_backend(trainer: Any, bound: dict[str, Any]) -> str | None:
    """``"FSDP1"``/``"FSDP2"`` when this ``load_fsdp_optimizer`` call of ``trainer`` takes the library's restore,
    else ``None`` (native)."""
    if trainer is None or bound.get("accelerator") is not getattr(trainer, "accelerator", None):
        return None
    if state_dict_type(trainer) != "SHARDED_STATE_DICT" or not bound.get("use_dcp", True):
        return None
    kind = backend(trainer)
    return kind if kind in ("FSDP1", "FSDP2") else None


def restore_optimizer(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper of Trainer's ``load_fsdp_optimizer`` binding (see the module docstring). Collective when routed."""
    bound = optimizer_load_arguments(args, kwargs)
    trainer = _RESUMING.get()
    kind = routed_backend(trainer, bound)
    if kind is None:
        full = trainer is not None and state_dict_type(trainer) == "FULL_STATE_DICT" and "optimizer" in bound
        with group_tuples_kept([bound["optimizer"]] if full else ()):  # FSDP2's full restore makes them lists
            return wrapped(*args, **kwargs)
    optimizer, model, index = bound["optimizer"], bound["model"], int(bound["optimizer_index"])
    directory = Path(bound["input_dir"]) / f"optimizer_{index}"
    if kind == "FSDP1":
        fsdp1.load_fsdp1_optimizer(optimizer, model, str(bound["input_dir"]), index, allow_reorder=False)
        run_phase(lambda: fsdp1.verify_restored_fsdp1(model, optimizer, directory),
                  "Checking the restored optimizer state")
    else:
        fsdp2.load_fsdp2_optimizer(optimizer, model, str(bound["input_dir"]), index, allow_reorder=False)
        run_phase(lambda: fsdp2.verify_restored_fsdp2(model, optimizer, directory),
                  "Checking the restored optimizer state")
    logger.info("Restored the %s optimizer state from %s (each rank its own shard)", kind, directory)
    return None  # as Accelerate's load_fsdp_optimizer


def check_before_model_load(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper of Trainer's ``load_fsdp_model`` binding: when the optimizer restore that follows will be routed
    (:func:`routed_backend`) and the checkpoint has ``optimizer_0``, check it against the live model and optimizer
    first (the same error on every rank; nothing loaded yet), then load the model natively. Collective when routed."""
    bound = model_load_arguments(args, kwargs)
    trainer = _RESUMING.get()
    kind = routed_backend(trainer, bound)
    optimizer = getattr(trainer, "optimizer", None)
    directory = Path(bound["input_dir"]) / "optimizer_0"
    if kind is not None and optimizer is not None:  # (Trainer passes adapter_only=True whatever the model)
        validate = fsdp1.validate_fsdp1_optimizer if kind == "FSDP1" else fsdp2.validate_fsdp2_optimizer

        def check() -> None:
            if directory.is_dir():  # none (a model-only checkpoint): Trainer restores no optimizer, nothing to check
                validate(bound["model"], optimizer, directory, False)

        run_phase(check, "Checking the checkpoint's optimizer state against the live optimizer, before the model "
                  "is loaded")
    args, kwargs = load_arguments(trainer, kind, bound, args, kwargs)  # an FSDP1 PEFT model saved whole
    return wrapped(*args, **kwargs)
