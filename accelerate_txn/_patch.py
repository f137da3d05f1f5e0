"""The import-time patch (wrapt), per-instance opt-in/out, and the dispatch decision.

``install()`` wraps ``Accelerator.save_state``/``load_state`` and Accelerate's FSDP1 ``load_fsdp_model`` /
``load_fsdp_optimizer`` (as bound in ``accelerate.accelerator``) exactly once; ``uninstall()`` puts the
originals back. The wrappers only decide and hand off.

Protected path when all hold (and every rank agrees, else every rank raises):
automatic dispatch is on (``VIDEOX_ACCELERATE_PATCHES`` unset or truthy) or the instance was opted in with
:func:`patch_accelerate_fsdp`; it was not opted out with :func:`unpatch_accelerate_fsdp`; the installed
versions are validated (or the override is set); and the backend is FSDP1 with ``SHARDED_STATE_DICT``.

Caveats: a subclass that overrides ``save_state``/``load_state`` without calling ``super()`` bypasses the
patch; wrapped methods do not pickle.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import wrapt

from ._descriptor import is_fsdp1_sharded
from ._native import _OPTED_IN, _OPTED_OUT, ORIGINALS, routed
from ._ranks import agree
from ._versions import override_requested, unsupported_message, versions_ok
from .errors import UnsupportedVersionError

logger = logging.getLogger(__name__)
PATCH_ENV = "VIDEOX_ACCELERATE_PATCHES"
_TARGETS = ("Accelerator.save_state", "Accelerator.load_state", "load_fsdp_model", "load_fsdp_optimizer")
_warned_versions = False


def automatic_dispatch_requested() -> bool:
    return os.environ.get(PATCH_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _protected(accelerator: Any) -> bool:
    """The dispatch decision; for FSDP a collective (all ranks must agree)."""
    global _warned_versions
    if accelerator.distributed_type.name != "FSDP":
        # Native, and without any collective: the backend is the same on every rank, and users of other
        # backends may call save_state on the main process only, which a collective here would hang.
        return False
    opted_in = accelerator in _OPTED_IN
    enabled = (opted_in or automatic_dispatch_requested()) and accelerator not in _OPTED_OUT
    eligible = is_fsdp1_sharded(accelerator)
    validated = versions_ok()
    agree({"enabled": enabled, "eligible": eligible, "validated": validated,
           "backend": accelerator.distributed_type.name}, "whether to use the protected checkpoint path")
    if enabled and eligible and not validated:
        if not _warned_versions:
            _warned_versions = True
            warnings.warn(f"{unsupported_message()} Using native save_state/load_state.", RuntimeWarning, stacklevel=4)
        return False
    return enabled and eligible


def _save_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if instance is None or not _protected(instance):
        return wrapped(*args, **kwargs)
    return _protected_save(instance, *args, **kwargs)


def _protected_save(instance: Any, output_dir: Any = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
    from ._save import save_training_checkpoint

    return save_training_checkpoint(instance, output_dir, safe_serialization=safe_serialization, **kwargs)


def _load_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if instance is None or not _protected(instance):
        return wrapped(*args, **kwargs)
    _protected_load(instance, *args, **kwargs)
    return None  # as native load_state


def _protected_load(instance: Any, input_dir: Any = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
    from ._load import load_training_checkpoint

    if load_kwargs is not None:  # the parameter exists from Accelerate 1.8 on; pass it only when given
        kwargs["load_kwargs"] = load_kwargs
    load_training_checkpoint(instance, input_dir, **kwargs)


def _load_fsdp_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # (fsdp_plugin, accelerator, model, input_dir, model_index=0, ...). Accelerate 1.7-1.14 pick the DCP
    # directory by substring ("pytorch_model_fsdp" anywhere in the path); pass the exact directory instead.
    accelerator = args[1] if len(args) > 1 else kwargs.get("accelerator")
    if accelerator is None or not routed(accelerator) or not is_fsdp1_sharded(accelerator):
        return wrapped(*args, **kwargs)
    args = list(args)
    index = args[4] if len(args) > 4 else kwargs.get("model_index", 0)
    if len(args) > 3:
        args[3] = os.path.join(args[3], f"pytorch_model_fsdp_{index}")
    else:
        kwargs["input_dir"] = os.path.join(kwargs["input_dir"], f"pytorch_model_fsdp_{index}")
    return wrapped(*args, **kwargs)


def _load_fsdp_optimizer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # (fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, ...)
    names = ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir", "optimizer_index")
    bound = dict(zip(names, args))
    bound.update({key: value for key, value in kwargs.items() if key in names})
    accelerator = bound.get("accelerator")
    if accelerator is None or not routed(accelerator) or not is_fsdp1_sharded(accelerator):
        return wrapped(*args, **kwargs)
    from ._fsdp_optimizer import load_sharded_optimizer

    # No barrier here (native has one): a bare collective inside a phase could pair with another rank's phase
    # exchange; load_sharded_optimizer's first phase synchronises the ranks.
    return load_sharded_optimizer(accelerator, bound["optimizer"], bound["model"], bound["input_dir"],
                                  bound.get("optimizer_index", 0))


_WRAPPERS = {
    "Accelerator.save_state": _save_state,
    "Accelerator.load_state": _load_state,
    "load_fsdp_model": _load_fsdp_model,
    "load_fsdp_optimizer": _load_fsdp_optimizer,
}


def installed() -> bool:
    import accelerate.accelerator as module

    return isinstance(module.Accelerator.__dict__.get("save_state"), wrapt.FunctionWrapper)


def install() -> None:
    """Wrap the Accelerate entry points once (idempotent)."""
    import accelerate.accelerator as module

    if installed():
        return
    for target in _TARGETS:
        _parent, _attribute, original = wrapt.resolve_path(module, target)
        ORIGINALS[target] = original
        wrapt.wrap_function_wrapper(module, target, _WRAPPERS[target])


def uninstall() -> None:
    """Restore the original Accelerate functions (for tests and tools)."""
    import accelerate.accelerator as module

    if not installed():
        return
    for target in _TARGETS:
        parent, attribute, _current = wrapt.resolve_path(module, target)
        setattr(parent, attribute, ORIGINALS.pop(target))


def patch_accelerate_fsdp(accelerator: Any) -> Any:
    """Opt ``accelerator`` in to the protected path (also with ``VIDEOX_ACCELERATE_PATCHES=0``); returns it.

    Its FSDP1 sharded optimizer loads, even through a native ``load_state``, use accelerate-txn's loader.
    Raises :class:`UnsupportedVersionError` outside the validated version table unless
    ``VIDEOX_ACCELERATE_ALLOW_UNVALIDATED=1``.
    """
    if not versions_ok():
        raise UnsupportedVersionError(unsupported_message())
    if override_requested():
        logger.warning("accelerate-txn: unvalidated versions allowed by override; you accept the risk")
    install()
    _OPTED_OUT.discard(accelerator)
    _OPTED_IN.add(accelerator)
    return accelerator


def unpatch_accelerate_fsdp(accelerator: Any) -> Any:
    """Opt ``accelerator`` out: its save_state/load_state run native Accelerate unchanged; returns it."""
    _OPTED_IN.discard(accelerator)
    _OPTED_OUT.add(accelerator)
    return accelerator
