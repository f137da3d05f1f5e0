"""Every private transformers access of the Trainer front end, keyed by transformers version.

The front end wraps the fewest, most stable points of ``transformers.Trainer``:

* ``Trainer.train`` (public) for the resume: ``resume_from_checkpoint=True`` is resolved here, before Trainer's own
  ``get_last_checkpoint`` runs, and an explicit path is verified before anything is loaded;
* ``Trainer._save_checkpoint(model, trial)`` (private) for the save: the whole native save (model, optimizer,
  scheduler, scaler, RNG, ``trainer_state.json``, Trainer's own rotation) runs inside it;
* ``Trainer._get_output_dir(trial)`` (private), the run directory ``_save_checkpoint`` joins ``checkpoint-N`` to: for
  the duration of one save it names a hidden staging directory, so the native save writes there;
* the method that ends a training run with Trainer's own removal of every checkpoint but the best
  (``save_total_limit=1`` with a best model: ``shutil.rmtree``, unsynchronised, of whatever ``checkpoint-*`` it
  globs): ``_finalize_training(trial, ...)`` in 5.24, ``_inner_training_loop(..., trial, ...)`` in 4.57 (the removal
  is inline there). Its only call of ``_get_output_dir`` outside ``_save_checkpoint`` is that removal's listing: while
  it runs, :func:`redirected_output_dir` names a directory that does not exist, so the listing is empty, and the
  library removes the checkpoints itself (``save.end_of_training_removal``);
* ``Trainer._load_rng_state(checkpoint)`` (private), the last read of a resume: Trainer loads the model, optimizer,
  scheduler, scaler and ``trainer_state.json`` while it sets training up, then each rank's RNG file when the resumed
  epoch starts (right away, or after the first batch past the skipped ones). The front end holds the checkpoint in
  use until it returns (:func:`.restore.rng_loaded`);
* ``transformers.trainer.load_fsdp_model``, the same kind of binding, which ``Trainer._load_from_checkpoint`` calls
  on an FSDP resume once the optimizer exists and before the optimizer restore: the checkpoint's optimizer state is
  checked against the live optimizer there, before the model is loaded;
* ``transformers.trainer.load_fsdp_optimizer`` (a private binding: the module's import of Accelerate's
  ``accelerate.utils.load_fsdp_optimizer``, which ``Trainer._load_optimizer_and_scheduler`` calls on resume). It is
  not the binding the Accelerate front end wraps (``accelerate.accelerator``'s), so the Trainer front end wraps this
  one, to route a protected resume to the library's sharded optimizer restore;
* ``transformers.trainer.save_fsdp_model``, the binding ``Trainer._save_optimizer_and_scheduler`` saves an FSDP model
  with (``adapter_only=True``): an FSDP1 PEFT model is saved whole inside a protected save (``.adapters``).

:data:`POINTS` records, per transformers minor series, the private names and signatures this module relies on;
:func:`missing_points` checks them on the installed Trainer class, so a release that moved them runs native Trainer
with a warning instead of failing inside a save. Between 4.46 and 5.24 ``_save_checkpoint`` lost its ``metrics``
argument (4.47); ``_get_output_dir`` kept its signature. The validated series, 4.57 (the newest 4.x) and 5.24, have
the same points: 4.57 rotates with its own ``Trainer._rotate_checkpoints`` where 5.24 calls
``trainer_utils.rotate_checkpoints``, neither of which the front end touches (both run inside the staging directory,
where there is nothing to rotate; each is a piece of its release: :data:`ROTATE_PIECES`).
:data:`MODULE_POINTS` records the same for the module-level bindings of ``transformers.trainer``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

from ..compat.pieces import Piece

#: transformers minor series -> the private points of the Trainer class, as ``{attribute: parameter names}``.
POINTS: dict[str, dict[str, tuple[str, ...]]] = {
    "4.57": {"_save_checkpoint": ("self", "model", "trial"), "_get_output_dir": ("self", "trial"),
             "_inner_training_loop": ("self", "batch_size", "args", "resume_from_checkpoint", "trial"),
             "_load_rng_state": ("self", "checkpoint")},
    "5.24": {"_save_checkpoint": ("self", "model", "trial"), "_get_output_dir": ("self", "trial"),
             "_finalize_training": ("self", "trial"), "_load_rng_state": ("self", "checkpoint")},
}
#: transformers minor series -> the Trainer method that runs the end-of-training removal (one of its POINTS).
FINALIZE: dict[str, str] = {"4.57": "_inner_training_loop", "5.24": "_finalize_training"}
#: transformers minor series -> the bindings of the ``transformers.trainer`` module used, as ``{name: parameter
#: names}`` (the leading parameters of Accelerate's function, as Trainer calls it).
MODULE_POINTS: dict[str, dict[str, tuple[str, ...]]] = {
    "4.57": {"load_fsdp_optimizer": ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir",
                                     "optimizer_index"),
             "load_fsdp_model": ("fsdp_plugin", "accelerator", "model", "input_dir", "model_index"),
             "save_fsdp_model": ("fsdp_plugin", "accelerator", "model", "output_dir", "model_index")},
    "5.24": {"load_fsdp_optimizer": ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir",
                                     "optimizer_index"),
             "load_fsdp_model": ("fsdp_plugin", "accelerator", "model", "input_dir", "model_index"),
             "save_fsdp_model": ("fsdp_plugin", "accelerator", "model", "output_dir", "model_index")},
}
#: The points of the newest series listed: what an unlisted release is checked against (it runs native anyway
#: unless the user set the override).
DEFAULT_SERIES = "5.24"
SAVE_CHECKPOINT = "Trainer._save_checkpoint"
"""The wrapt path of the save point, relative to ``transformers.trainer``."""
LOAD_RNG = "Trainer._load_rng_state"
"""The wrapt path of a resume's last read (each rank's RNG file), relative to ``transformers.trainer``."""
LOAD_OPTIMIZER = "load_fsdp_optimizer"
"""The wrapt path of the optimizer-restore point (a module binding), relative to ``transformers.trainer``."""
LOAD_MODEL = "load_fsdp_model"
"""The wrapt path of the model-restore point (a module binding), relative to ``transformers.trainer``."""
SAVE_MODEL = "save_fsdp_model"
"""The wrapt path of the FSDP model-save point (a module binding), relative to ``transformers.trainer``."""


def finalize_target(series: str) -> str:
    """The wrapt path (relative to ``transformers.trainer``) of the method that ends a run of ``series``."""
    return f"Trainer.{FINALIZE.get(series, FINALIZE[DEFAULT_SERIES])}"


def finalize_trial(series: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``trial`` of a call of :func:`finalize_target` (``_finalize_training(trial, ...)``;
    ``_inner_training_loop(batch_size, args, resume_from_checkpoint, trial, ...)``)."""
    parameters = points_for(series)[FINALIZE.get(series, FINALIZE[DEFAULT_SERIES])][1:]
    position = parameters.index("trial")
    return args[position] if len(args) > position else kwargs.get("trial")


def points_for(series: str) -> dict[str, tuple[str, ...]]:
    return POINTS.get(series, POINTS[DEFAULT_SERIES])


def module_points_for(series: str) -> dict[str, tuple[str, ...]]:
    return MODULE_POINTS.get(series, MODULE_POINTS[DEFAULT_SERIES])


def _signature_differs(function: Any, parameters: tuple[str, ...]) -> bool:
    try:
        found = tuple(inspect.signature(function).parameters) if function is not None else None
    except (TypeError, ValueError):
        found = None
    return found is None or found[: len(parameters)] != parameters


def missing_points(trainer_class: type, series: str) -> list[str]:
    """The private points of ``series`` that ``trainer_class`` (or the ``transformers.trainer`` module) lacks or has
    with another signature (empty: all there), each as ``"name(parameters)"``."""
    missing = [f"{name}({', '.join(parameters[1:])})" for name, parameters in points_for(series).items()
               if _signature_differs(getattr(trainer_class, name, None), parameters)]
    module = importlib.import_module("transformers.trainer")
    missing += [f"transformers.trainer.{name}({', '.join(parameters)})"
                for name, parameters in module_points_for(series).items()
                if _signature_differs(getattr(module, name, None), parameters)]
    return missing


def output_dir(trainer: Any, trial: Any) -> str:
    """The run directory a native save of ``trainer`` writes ``checkpoint-N`` into (``_get_output_dir``: the output
    directory, or a hyperparameter-search trial's own run directory). The class's method, whatever
    :func:`redirected_output_dir` shadows on the instance."""
    return str(type(trainer)._get_output_dir(trainer, trial))


@contextlib.contextmanager
def redirected_output_dir(trainer: Any, directory: str) -> Iterator[None]:
    """While inside, ``trainer._get_output_dir(...)`` returns ``directory`` (an instance attribute shadowing the
    method; removed on the way out, whatever happens)."""
    saved = trainer.__dict__.get("_get_output_dir")
    trainer._get_output_dir = lambda trial=None: directory
    try:
        yield
    finally:
        if saved is None:
            trainer.__dict__.pop("_get_output_dir", None)
        else:
            trainer._get_output_dir = saved


def save_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``trial`` of a ``_save_checkpoint(model, trial)`` call."""
    return args[1] if len(args) > 1 else kwargs.get("trial")


def _bind(names: tuple[str, ...], defaults: dict[str, Any], args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name: ``defaults``, then ``adapter_only=False`` and ``use_dcp=True`` (every Accelerate
    FSDP save/load function Trainer calls has them), then the positional ``args`` under ``names``, then ``kwargs``."""
    bound: dict[str, Any] = {**defaults, "adapter_only": False, "use_dcp": True}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def optimizer_load_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir,
    optimizer_index=0, adapter_only=False, use_dcp=True)`` call (Accelerate 1.15, as Trainer makes it) by name,
    with the defaults filled in."""
    return _bind(("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir", "optimizer_index", "adapter_only",
                  "use_dcp"), {"optimizer_index": 0}, args, kwargs)


def model_save_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0,
    adapter_only=False, use_dcp=True)`` call (Accelerate 1.15, as Trainer makes it) by name, with the defaults
    filled in."""
    return _bind(("fsdp_plugin", "accelerator", "model", "output_dir", "model_index", "adapter_only", "use_dcp"),
                 {"model_index": 0}, args, kwargs)


def model_load_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index=0,
    adapter_only=False, use_dcp=True)`` call (Accelerate 1.15, as Trainer makes it) by name, with the defaults
    filled in."""
    return _bind(("fsdp_plugin", "accelerator", "model", "input_dir", "model_index", "adapter_only", "use_dcp"),
                 {"model_index": 0}, args, kwargs)


# --- The evidence ------------------------------------------------------------------------------------------------
# What the front end needs of each private transformers piece, checked against the values recorded for every
# transformers release that passed the Trainer tests (accelerate_txn/evidence.json; ``compat.evidence``). ``code``:
# the functions whose behaviour the protected save and resume depend on (the order of Trainer's writes, what a
# resume reads and when, which checkpoint ``get_last_checkpoint`` selects).

_TRAINER = "transformers.trainer"
TRAINER_PIECES: tuple[Piece, ...] = (
    Piece("transformers", _TRAINER, "Trainer.train", "signature",
          "wrapped: resume_from_checkpoint is resolved (public: its body is the training loop, not checkpointing)"),
    Piece("transformers", _TRAINER, "Trainer._save_checkpoint", "code",
          "the whole native save runs inside it, into the staging directory: its writes and their order"),
    Piece("transformers", _TRAINER, "Trainer._get_output_dir", "code", "redirected to the staging directory"),
    Piece("transformers", _TRAINER, "Trainer._save_optimizer_and_scheduler", "code",
          "the optimizer, scheduler and FSDP model files of a save"),
    Piece("transformers", _TRAINER, "Trainer._save_rng_state", "code", "each rank's RNG file"),
    Piece("transformers", _TRAINER, "Trainer._save_scaler", "code",
          "called by _save_checkpoint: the scaler.pt file of a save (with a gradient scaler)"),
    Piece("transformers", _TRAINER, "Trainer._save", "code",
          "called by Trainer.save_model inside _save_checkpoint: the model files of a save without FSDP"),
    Piece("transformers", _TRAINER, "Trainer._load_scaler", "code",
          "what a resume reads of scaler.pt (with a gradient scaler)"),
    Piece("transformers", _TRAINER, "Trainer._load_from_checkpoint", "code",
          "the model restore, checked against the optimizer before it loads"),
    Piece("transformers", _TRAINER, "Trainer._load_optimizer_and_scheduler", "code",
          "the optimizer restore, routed to the library's sharded restore"),
    Piece("transformers", _TRAINER, "Trainer._load_rng_state", "code", "a resume's last read"),
    *(Piece("transformers", _TRAINER, name, "exists", "a module binding Trainer calls, wrapped by the front end")
      for name in ("load_fsdp_optimizer", "load_fsdp_model", "save_fsdp_model")),
    Piece("transformers", "transformers.trainer_utils", "get_last_checkpoint", "code",
          "resume_from_checkpoint=True: which checkpoint Trainer itself would select"),
)
_FSDP_UTILS = "accelerate.utils.fsdp_utils"
#: The Accelerate functions Trainer calls through its own module's bindings on an FSDP save or resume (not the
#: bindings the Accelerate front end wraps): their bodies run in a protected Trainer checkpoint, with FSDP1 and FSDP2.
TRAINER_FSDP_PIECES: tuple[Piece, ...] = (
    Piece("transformers", _TRAINER, "save_fsdp_optimizer", "exists",
          "the module binding Trainer._save_optimizer_and_scheduler saves an FSDP optimizer with, not wrapped "
          "(Accelerate's function it names is a piece below)"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_model", "code",
          "the model restore of a protected resume (transformers.trainer.load_fsdp_model, wrapped and then called)"),
    Piece("accelerate", _FSDP_UTILS, "_set_model_state_dict", "code",
          "called by load_fsdp_model on a protected resume (FSDP1 and FSDP2): what loads the model state it read"),
    Piece("accelerate", _FSDP_UTILS, "save_fsdp_optimizer", "code",
          "the optimizer files of a protected save (transformers.trainer.save_fsdp_optimizer)"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_optimizer", "code",
          "the optimizer restore of a protected resume where it is not routed to the library's (a state dict type "
          "other than SHARDED_STATE_DICT)"),
)
#: The method that ends a run with Trainer's own removal of old checkpoints, by where the installed Trainer has it.
FINALIZE_PIECES: dict[str, Piece] = {
    name: Piece("transformers", _TRAINER, f"Trainer.{name}", "code",
                "its removal of every checkpoint but the best is done by the library instead")
    for name in ("_finalize_training", "_inner_training_loop")}


#: What rotates old checkpoints inside ``_save_checkpoint`` (in the staging directory, where there are none), by where
#: the installed Trainer has it: its own method (4.57) or ``trainer_utils.rotate_checkpoints`` (5.x).
ROTATE_PIECES: dict[str, Piece] = {
    "_rotate_checkpoints": Piece("transformers", _TRAINER, "Trainer._rotate_checkpoints", "code",
                                 "called by _save_checkpoint on the directory it saved into (the staging one)"),
    "rotate_checkpoints": Piece("transformers", "transformers.trainer_utils", "rotate_checkpoints", "code",
                                "called by _save_checkpoint on the directory it saved into (the staging one)"),
}
#: Each group of alternative pieces, the first one a release has winning: only that one is the release's piece.
ALTERNATIVES: tuple[tuple[Piece, ...], ...] = (
    (FINALIZE_PIECES["_finalize_training"], FINALIZE_PIECES["_inner_training_loop"]),
    (ROTATE_PIECES["_rotate_checkpoints"], ROTATE_PIECES["rotate_checkpoints"]),
)


def trainer_pieces(trainer_class: type | None = None) -> tuple[Piece, ...]:
    """The pieces of the installed Trainer: :data:`TRAINER_PIECES`, the method that ends a run
    (``_finalize_training`` where it exists, 5.x; else ``_inner_training_loop``, 4.57) and what rotates checkpoints
    (``Trainer._rotate_checkpoints`` where it exists, 4.57; else ``trainer_utils.rotate_checkpoints``, 5.x)."""
    if trainer_class is None:
        import transformers.trainer as module

        trainer_class = module.Trainer
    name = "_finalize_training" if callable(getattr(trainer_class, "_finalize_training", None)) \
        else "_inner_training_loop"
    rotate = "_rotate_checkpoints" if callable(getattr(trainer_class, "_rotate_checkpoints", None)) \
        else "rotate_checkpoints"
    return (*TRAINER_PIECES, FINALIZE_PIECES[name], ROTATE_PIECES[rotate])
