"""Every private Accelerate internal accelerate-txn relies on, in one file (the Accelerate front end's internals layer).

The rest of the library reaches Accelerate internals only through these functions; private torch, NumPy and
CPython pieces live in :mod:`accelerate_txn.fsdp.internals` (tests/runtime/test_internals.py fails on a private access
anywhere else, and calls every function of both on the installed versions). Supporting a new Accelerate release
means reading this file against the new source, and running that test.

Checked against (source of each release read side by side): Accelerate 1.7.0, 1.8.1, 1.9.0, 1.10.1, 1.11.0, 1.12.0,
1.13.0, 1.14.0, 1.15.0, 1.16.0: everything below is the same in all of them (attributes initialised in
``Accelerator.__init__``, the module globals ``load_state`` calls). Where a later release differs, branch here on
the installed version (``packaging.version.Version(accelerate.__version__)``) and note both sides; callers stay
unchanged.

Accelerate 1.16.0 against 1.15.0 (both sources compared file by file): every attribute and module global here is
unchanged, and ``save_state`` is the same code (same files, names and layout). On the library's path: FSDP2
``load_state`` loads ``scaler.pt`` once, after the data loaders, and no longer calls
``_lazy_init_scale_growth_tracker`` (``fsdp.internals.uninitialise_grad_scaler`` is then unneeded and harmless);
the RNG file's device key comes from ``get_torch_accelerator_backend()`` (unchanged on CPU and CUDA); FSDP2
``prepare`` accepts a model without an optimizer (such a setup runs native, as before). 1.16 needs Python 3.11+
and torch 2.6+.

FSDP2 on Accelerate 1.7 to 1.12 (``utils/fsdp_utils.py`` of each wheel compared with 1.13/1.14): ``save_fsdp_model``
and ``save_fsdp_optimizer`` are the same code as in 1.13 and 1.14; ``load_fsdp_model`` differs only in its
``FULL_STATE_DICT`` branch (1.7 and 1.8 load the full state dict on every rank); ``load_fsdp_optimizer``'s sharded
branch builds its DCP read template from ``optimizer.state_dict()`` (1.13 and later: ``get_optimizer_state_dict``),
so natively a fresh optimizer reads no state at all there. The protected path uses neither native loader's template
(``fsdp.fsdp2.load_fsdp2_optimizer`` builds its own from the checkpoint's metadata), so it is the same on every
Accelerate from 1.7 (validated: the rows of ``validated.json`` marked ``"fsdp2": true``).

Under torch 2.8 to 2.14 (with Accelerate 1.15.0), nothing here differs from torch 2.13: Accelerate's own branches
on the torch version (``is_torch_version``) all sit at 2.8 or below, so it takes the same paths under each.

Not here: attributes with public names that the code uses as they are (``accelerator.state.fsdp_plugin``,
``AcceleratedOptimizer.optimizer``). Imports of Accelerate are lazy: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping
from types import ModuleType
from typing import Any

from ..compat.pieces import Piece

# --- Accelerator state ------------------------------------------------------------------------------------------
# What ``accelerator.prepare()`` and ``register_for_checkpointing()`` collected: the lists ``save_state`` and
# ``load_state`` iterate, in their order (index i of each is ``<kind>_<i>`` in a checkpoint). Public Accelerate
# has no accessor for them. Returned as the live lists: callers read them, never mutate them.
# Accelerate 1.7.0-1.15.0: plain lists set in ``Accelerator.__init__``; ``free_memory()`` rebinds the four prepared
# ones to new empty lists (so never keep a returned list across it).


def prepared_models(accelerator: Any) -> list[Any]:
    """The prepared (wrapped: FSDP/DDP) models, in ``prepare()`` order."""
    return accelerator._models


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The prepared optimizers (``AcceleratedOptimizer``; the torch optimizer is ``.optimizer``)."""
    return accelerator._optimizers


def prepared_schedulers(accelerator: Any) -> list[Any]:
    """The prepared LR schedulers (``AcceleratedScheduler``; the torch scheduler is ``.scheduler``)."""
    return accelerator._schedulers


def prepared_dataloaders(accelerator: Any) -> list[Any]:
    """The prepared data loaders."""
    return accelerator._dataloaders


def custom_objects(accelerator: Any) -> list[Any]:
    """Objects registered with ``register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``)."""
    return accelerator._custom_objects


# --- Prepared data loaders --------------------------------------------------------------------------------------
# Where releases differ (read in the wheels): Accelerate 1.15 hands ``skip_first_batches`` loaders the prepared
# loader's epoch counter (``DataLoaderShard(..., iteration=dataloader.iteration)``); 1.7-1.14 start them at 0. Before
# 1.13 ``DataLoaderShard`` inherits ``DataLoaderAdapter.adjust_state_dict_for_prefetch``, which takes
# ``num_processes - 1`` batches off a stateful loader's recorded position in a multi-process run: a resume replays
# them (accelerate #3938, fixed by #3952 in 1.13, where ``DataLoaderShard`` overrides it with a no-op).


def stateful_shard_position_exact() -> bool:
    """Whether a stateful ``DataLoaderShard`` records the position it yielded (Accelerate 1.13 and later)."""
    from accelerate.data_loader import DataLoaderShard

    return "adjust_state_dict_for_prefetch" in vars(DataLoaderShard)


# --- Accelerator hooks ------------------------------------------------------------------------------------------
# ``register_save_state_pre_hook``/``register_load_state_pre_hook`` store hooks in these dicts (handle id -> hook),
# called in order by ``save_state``/``load_state``. Returned live and mutable: ``accelerate.native.synchronized_hooks``
# swaps entries for the duration of one call and puts them back.
# Accelerate 1.7.0-1.15.0: ``OrderedDict`` attributes set in ``Accelerator.__init__``, keyed by
# ``torch.utils.hooks.RemovableHandle.id`` (so a swapped entry is still removed by the user's handle).


def save_state_pre_hooks(accelerator: Any) -> MutableMapping[Any, Callable[..., Any]]:
    """The live save-state pre-hooks of ``accelerator``."""
    return accelerator._save_model_state_pre_hook


def load_state_pre_hooks(accelerator: Any) -> MutableMapping[Any, Callable[..., Any]]:
    """The live load-state pre-hooks of ``accelerator``."""
    return accelerator._load_model_state_pre_hook


# --- Accelerate checkpointing module ----------------------------------------------------------------------------
# ``Accelerator.load_state`` calls these functions through the globals of ``accelerate.accelerator`` (imported
# there with ``from .utils import ...`` / ``from .checkpointing import ...``), so rebinding them in that module
# (wrapt in ``accelerate.patch``, the swap below) changes what ``load_state`` calls, and rebinding them anywhere else
# does not. Accelerate 1.7.0-1.15.0: called as ``load_fsdp_model(self.state.fsdp_plugin, self, model, input_dir,
# i)``, ``load_fsdp_optimizer(self.state.fsdp_plugin, self, opt, self._models[i], input_dir, i)`` and
# ``load_custom_state(obj, input_dir, index)``.

LOAD_STATE_GLOBALS = ("load_fsdp_model", "load_fsdp_optimizer", "load_custom_state")


def accelerator_module() -> ModuleType:
    """``accelerate.accelerator``: the module whose globals ``Accelerator.load_state`` calls."""
    import accelerate.accelerator as module

    return module


@contextlib.contextmanager
def custom_state_loader(loader: Callable[..., None]) -> Iterator[bool]:
    """Within the block, ``Accelerator.load_state`` restores each registered custom object with
    ``loader(obj, path, index)`` instead of Accelerate's ``load_custom_state`` (which unpickles with
    ``weights_only=False``). Yields False, replacing nothing, where Accelerate binds no such function. Not
    thread-safe (a module global): one load per process at a time, as ``load_state`` itself."""
    module = accelerator_module()
    original = getattr(module, "load_custom_state", None)
    if original is None:
        yield False
        return
    module.load_custom_state = loader
    try:
        yield True
    finally:
        module.load_custom_state = original


# --- Accelerate's FSDP model state dict -------------------------------------------------------------------------
# ``save_fsdp_model`` (and, for FSDP1, ``save_fsdp_optimizer``'s model side) builds the model's state dict with the
# private ``accelerate.utils.fsdp_utils._get_model_state_dict(model, adapter_only=False, sd_options=None)``, called
# through that module's globals (Accelerate 1.7.0-1.16.0): wrapping it there (``fsdp.capture.install``) changes what
# a save writes from, and wrapping it anywhere else does not.


def model_state_dict_point() -> tuple[ModuleType, str]:
    """(module, name) of the function Accelerate's FSDP saves build the model's state dict with, for wrapt."""
    import accelerate.utils.fsdp_utils as module

    return module, "_get_model_state_dict"


# --- The evidence ------------------------------------------------------------------------------------------------
# What the front end needs of each private Accelerate piece, checked against the values recorded for every
# Accelerate release that passed the library's tests (accelerate_txn/evidence.json; ``compat.evidence``): a release
# that changed none of them is protected the day it ships. ``code`` pieces are the functions whose body a protected
# path runs (called through, or wrapped and then called, fallback branches included) and those whose behaviour it
# depends on (what a native save writes, and where; what a load reads), not only their names. A piece that is only
# replaced, or only named, is read by its signature or its presence; its ``why`` says so.

_FSDP_UTILS = "accelerate.utils.fsdp_utils"
_CHECKPOINTING = "accelerate.checkpointing"
ACCELERATE_COMMON: tuple[Piece, ...] = (
    Piece("accelerate", "accelerate.accelerator", "Accelerator.__init__", "assigns",
          "the prepared objects and checkpoint hooks save_state/load_state iterate",
          ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
           "_save_model_state_pre_hook", "_load_model_state_pre_hook")),
    Piece("accelerate", "accelerate.accelerator", "Accelerator.save_state", "code",
          "the native save the protected path runs into its staging directory: its files and their names"),
    Piece("accelerate", "accelerate.accelerator", "Accelerator.load_state", "code",
          "the native restore the protected path runs after verification, and the bindings it calls"),
    Piece("accelerate", _CHECKPOINTING, "save_accelerator_state", "code",
          "the RNG, scheduler, sampler and scaler files of a checkpoint"),
    Piece("accelerate", _CHECKPOINTING, "load_accelerator_state", "code",
          "what a restore reads of them"),
    Piece("accelerate", _CHECKPOINTING, "save_custom_state", "code",
          "called by save_state: the custom_checkpoint_<i>.pkl files of a checkpoint"),
    Piece("accelerate", _CHECKPOINTING, "load_custom_state", "signature",
          "replaced by a safe loader during a protected restore: its body never runs there"),
    Piece("accelerate", "accelerate.utils.other", "save", "code",
          "what writes each file of save_accelerator_state and save_custom_state: which process writes, and how"),
    Piece("accelerate", "accelerate.utils.other", "load", "code",
          "what reads each file load_accelerator_state restores (weights_only, the allowed globals)"),
    *(Piece("accelerate", "accelerate.accelerator", name, "exists",
            "a module binding Accelerator.save_state/load_state call, wrapped by the front end (the function it "
            "names is a piece of its own)")
      for name in ("load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_optimizer", "load_custom_state")),
    *(Piece("accelerate", "accelerate.accelerator", name, "exists",
            "a module binding Accelerator.save_state/load_state call, not wrapped (the function it names is a piece "
            "of its own)")
      for name in ("save_fsdp_model", "save_accelerator_state", "load_accelerator_state", "save_custom_state")),
    Piece("accelerate", _FSDP_UTILS, "save_fsdp_model", "code", "the model's DCP files of a sharded save"),
    Piece("accelerate", _FSDP_UTILS, "_get_model_state_dict", "code",
          "called by save_fsdp_model (wrapped: an FSDP1 save captures the model state without collectives and runs "
          "it where the capture declines; an FSDP2 save runs it): the model state a sharded save writes"),
    Piece("accelerate", _FSDP_UTILS, "_prepare_sd_options", "code",
          "called by save_fsdp_model, save_fsdp_optimizer and load_fsdp_model: the state-dict options of their "
          "DCP files (full or sharded, CPU offload)"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_optimizer", "signature",
          "replaced by the library's restore on every protected path (its body runs only where the path is native)"),
    Piece("accelerate", "accelerate.data_loader", "DataLoaderShard.__iter__", "code",
          "wrapped and then called: where each prepared loader's epochs start, what it broadcasts and counts"),
    Piece("accelerate", "accelerate.data_loader", "DataLoaderDispatcher.__iter__", "code",
          "wrapped and then called: where each dispatched loader's epochs start"),
    Piece("accelerate", "accelerate.data_loader", "DataLoaderAdapter._update_state_dict", "code",
          "called by both __iter__: the stateful loader position a checkpoint records (stateful_shard_position_exact)"),
    Piece("accelerate", "accelerate.data_loader", "DataLoaderDispatcher._fetch_batches", "code",
          "called by DataLoaderDispatcher.__iter__: the batches a dispatched loader reads and hands out, in order"),
)
ACCELERATE_FSDP1: tuple[Piece, ...] = (
    Piece("accelerate", _FSDP_UTILS, "save_fsdp_optimizer", "code", "the FSDP1 optimizer's DCP files"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_model", "code",
          "wrapped: routed to the exact directory, and run where the direct read declines the layout (e.g. a "
          "MixedPrecision policy)"),
    Piece("accelerate", _FSDP_UTILS, "_set_model_state_dict", "code",
          "called by load_fsdp_model where it runs: what loads the model state it read"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_optimizer", "code",
          "run by a protected FULL_STATE_DICT restore (rank 0 reads optimizer.bin, FSDP scatters it)"),
)
ACCELERATE_FSDP2: tuple[Piece, ...] = (
    Piece("accelerate", _FSDP_UTILS, "save_fsdp_optimizer", "code",
          "replaced by the library's FSDP2 sharded save; run by a protected FULL_STATE_DICT save (rank 0 writes "
          "optimizer.bin)"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_model", "code",
          "replaced by the library's FSDP2 sharded model restore; run by a protected FULL_STATE_DICT restore (rank 0 "
          "reads pytorch_model_fsdp.bin and broadcasts it)"),
    Piece("accelerate", _FSDP_UTILS, "load_fsdp_optimizer", "code",
          "run by a protected FULL_STATE_DICT restore (rank 0 reads optimizer.bin and broadcasts it)"),
)
