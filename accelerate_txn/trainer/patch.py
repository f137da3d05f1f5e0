"""The Trainer patch (wrapt) and the dispatch decision: protected transaction or native Trainer.

``install()`` wraps ``Trainer.train`` (the resume), ``Trainer._save_checkpoint`` (the save), the method that ends a
run (its removal of every checkpoint but the best: ``internals.FINALIZE``), ``Trainer._load_rng_state`` (a resume's
last read: the checkpoint is held in use until then) and the module's ``load_fsdp_optimizer``, ``load_fsdp_model``
(the optimizer restore) and ``save_fsdp_model`` (an FSDP1 PEFT model saved whole: :mod:`.adapters`) bindings of
``transformers.trainer`` exactly once; ``uninstall()`` puts the originals back. The wrappers only decide and hand off
to :mod:`.resume`, :mod:`.save` and :mod:`.restore` (which acts only inside a protected resume:
:func:`.restore.resuming`).

Protected when all hold: automatic dispatch is on (``ACCELERATE_TXN_PATCHES`` unset or truthy); the installed
transformers, torch and Accelerate are protected by the evidence about the pieces the Trainer relies on
(:mod:`.versions`) or the override is set; the Trainer's class (a subclass's overrides too) has the private points of
:mod:`.internals` with their signatures; the Trainer is not DeepSpeed's (DeepSpeed writes its own checkpoint layout)
and does not push checkpoints to the Hub (the upload reads the checkpoint directory during the save). Otherwise
native Trainer, after one warning per process and path for a changed piece and one log line per Trainer for the
rest. Nothing native
Trainer does becomes an error.

Caveats: a subclass that overrides ``train`` or ``_save_checkpoint`` without calling ``super()`` bypasses the patch;
wrapped methods do not pickle.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import wrapt

from ..compat.evidence import warn_once
from ..core import faults
from ..core.ranks import agree, run_phase
from ..runtime.protection import REQUIRE, STATE_DICT_FIX, VERSIONS_FIX, Protection, refuse_native, say_native
from .adapters import save_model, saving
from .internals import LOAD_MODEL, LOAD_OPTIMIZER, LOAD_RNG, SAVE_CHECKPOINT, SAVE_MODEL, finalize_target, missing_points
from .layout import backend, state_dict_type
from .restore import check_before_model_load, loaded, restore_optimizer, resuming, rng_loaded
from .resume import resolve_resume
from .save import RUN_IDS, protected_finalize, protected_save
from .versions import (
    DISPATCH,
    automatic_dispatch_requested,
    override_requested,
    path_of_trainer,
    protected,
    transformers_series,
    unsupported_message,
)

logger = logging.getLogger(__name__)
MODULE = "transformers.trainer"
ORIGINALS: dict[str, Any] = {}
_WARNED: set[str] = set()  # the reasons said by a warning (no INFO line besides)


def native_reason(trainer: Any, *, warn: bool = True) -> str | None:
    """Why this Trainer's checkpoints run native (``None``: protected); a changed piece, a damaged evidence file or a
    Trainer without its private points is warned once per process and reason (``compat.evidence.warn_once``) unless
    ``warn`` is false (:func:`protection` only answers)."""
    if not automatic_dispatch_requested():
        return f"automatic dispatch is off ({DISPATCH.source()}={os.environ.get(DISPATCH.source())!r})"
    path = path_of_trainer(trainer)
    if not protected(type(trainer), path):
        message = unsupported_message(type(trainer), path)
        if warn:
            _WARNED.add(message)
            warn_once(message, stacklevel=4)
        return message
    missing = missing_points(type(trainer), transformers_series())
    if missing:
        message = (f"accelerate-txn: this transformers Trainer lacks {', '.join(missing)} (or has another signature): "
                   "Trainer checkpoints run natively, NOT protected.")
        if warn:
            _WARNED.add(message)
            warn_once(message, stacklevel=4)
        return message
    if backend(trainer) == "DeepSpeed":
        return "DeepSpeed writes its own checkpoint layout (native Trainer)"
    if state_dict_type(trainer) not in (None, "SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        return f"state_dict_type is {state_dict_type(trainer)} (protected: SHARDED_STATE_DICT and FULL_STATE_DICT)"
    if getattr(trainer.args, "push_to_hub", False):
        return "push_to_hub uploads the checkpoint directory during the save (native Trainer)"
    return None


def _read_switches() -> None:
    automatic_dispatch_requested()
    override_requested()
    REQUIRE.read()
    for variable in faults.SWITCHES:
        variable.read()


def _trainer_fix(reason: str) -> str | None:
    """The one change that would protect a Trainer's checkpoints, for its native ``reason``."""
    if reason.startswith("automatic dispatch is off"):
        return f"unset {DISPATCH.source()} (or set it to 1)"
    if reason.startswith("state_dict_type is"):
        return STATE_DICT_FIX
    if reason.startswith("push_to_hub"):
        return "push to the Hub after training (trainer.push_to_hub()) instead of push_to_hub=True during it"
    if "NOT protected" in reason:
        return VERSIONS_FIX
    return None


def protection(trainer: Any) -> Protection:
    """Whether ``trainer``'s checkpoints take the protected path now (``accelerate_txn.protection``); local, no
    collective, no warning."""
    path = path_of_trainer(trainer)
    reason = native_reason(trainer, warn=False)
    if reason is None:
        return Protection(True, "trainer", path)
    return Protection(False, "trainer", path, reason, _trainer_fix(reason))


def _protected(trainer: Any) -> bool:
    # The switches native_reason (and the save's crash points) read, first in a rank phase: a value invalid on one rank
    # (ACCELERATE_TXN_PATCHES=maybe) raises the same error on every rank, not on that rank alone while the others
    # wait in the agreement below.
    run_phase(_read_switches, "Reading the environment's switches")
    reason = native_reason(trainer)
    strict = REQUIRE.read()
    agree([reason, strict], "whether Trainer checkpoints are protected")  # every rank takes the same path
    if reason is None:
        return True
    if strict:
        refuse_native("this Trainer's checkpoints", reason, _trainer_fix(reason))
    # One WARNING per process and reason (none besides a changed piece's own warning): a Trainer on FSDP is told;
    # DeepSpeed's own checkpoints are its own business.
    if reason not in _WARNED and backend(trainer) != "DeepSpeed":
        say_native("this Trainer's checkpoints", reason, _trainer_fix(reason),
                   main=bool(getattr(trainer.args, "process_index", 0) == 0))
    return False


def _save_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None or not _protected(instance):
        return wrapped(*args, **kwargs)
    loaded(instance)  # a save comes after every load of a resume: its retention may remove what it resumed from
    with saving(instance):  # an FSDP1 PEFT model is saved whole (``.adapters``)
        return protected_save(wrapped, instance, args, kwargs)


def _train_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    resume = bound.arguments.get("resume_from_checkpoint")
    if resume is None or resume is False or not _protected(instance):
        return wrapped(*args, **kwargs)
    chosen, run_id, hold = resolve_resume(instance, resume)  # every rank holds the checkpoint in use from here
    # Trainer's optimizer restore takes the library's sharded path, and the checkpoint stays held until Trainer has
    # read all of it (``.restore``), released whatever happens.
    with resuming(instance, hold):
        if run_id is not None:
            RUN_IDS[instance] = run_id  # the resumed run's retention goes on pruning its own checkpoints
        bound.arguments["resume_from_checkpoint"] = chosen
        return wrapped(*bound.args, **bound.kwargs)


def _finalize_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None or not _protected(instance):
        return wrapped(*args, **kwargs)
    return protected_finalize(wrapped, instance, transformers_series(), args, kwargs)


_WRAPPERS = {SAVE_CHECKPOINT: _save_wrapper, "Trainer.train": _train_wrapper, LOAD_OPTIMIZER: restore_optimizer,
             LOAD_MODEL: check_before_model_load, LOAD_RNG: rng_loaded, SAVE_MODEL: save_model}


def _targets(module: Any) -> dict[str, Any]:
    """The wrapt paths to wrap and their wrappers: the fixed ones, and the end-of-training method of the installed
    series when it has one (an unlisted release without it runs native anyway: ``missing_points``)."""
    targets = {target: wrapper for target, wrapper in _WRAPPERS.items() if _resolvable(module, target)}
    finalize = finalize_target(transformers_series())
    if callable(getattr(module.Trainer, finalize.split(".", 1)[1], None)):
        targets[finalize] = _finalize_wrapper
    return targets


def _resolvable(module: Any, target: str) -> bool:
    """Whether ``target`` names something in ``module``: a release without one of the bindings is not wrapped there
    (the evidence keeps every path relying on it native, with its one warning)."""
    try:
        wrapt.resolve_path(module, target)
    except AttributeError:
        return False
    return True


def _current(module: Any, target: str) -> Any:
    """What ``target`` (a path relative to ``module``) names now, as stored (not bound)."""
    parent, attribute, _original = wrapt.resolve_path(module, target)
    return vars(parent).get(attribute)


def install() -> None:
    """Wrap ``Trainer.train``, ``Trainer._save_checkpoint``, the end-of-training method, ``Trainer._load_rng_state``
    and ``transformers.trainer.load_fsdp_optimizer``, ``load_fsdp_model`` and ``save_fsdp_model`` (idempotent)."""
    import transformers.trainer as module

    for target, wrapper in _targets(module).items():
        if isinstance(_current(module, target), wrapt.FunctionWrapper):
            continue
        ORIGINALS[target] = _current(module, target)
        wrapt.wrap_function_wrapper(module, target, wrapper)


def uninstall() -> None:
    """Put the originals back (no-op if not installed)."""
    import transformers.trainer as module

    for target, original in list(ORIGINALS.items()):
        parent, attribute, _ = wrapt.resolve_path(module, target)
        setattr(parent, attribute, original)
        del ORIGINALS[target]


def installed() -> bool:
    import transformers.trainer as module

    return all(isinstance(_current(module, target), wrapt.FunctionWrapper) for target in _targets(module))
