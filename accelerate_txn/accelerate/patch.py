"""The import-time patch (wrapt), per-instance opt-in/out, and the dispatch decision.

``install()`` wraps ``Accelerator.save_state``/``load_state`` and Accelerate's ``load_fsdp_model`` /
``load_fsdp_optimizer`` / ``save_fsdp_optimizer`` (as bound in ``accelerate.accelerator``) exactly once, and the
prepared data loaders' ``__iter__`` (``accelerate.data_order``: it notes where each epoch starts, yielding exactly what
native Accelerate yields); ``uninstall()`` puts the originals back. The wrappers only decide and hand off.

Protected path when all hold (and every rank agrees, else every rank raises):
automatic dispatch is on (``ACCELERATE_TXN_PATCHES`` unset or truthy) or the instance was opted in with
:func:`patch_accelerate_fsdp`; it was not opted out with :func:`unpatch_accelerate_fsdp`; the evidence protects the
installed releases on this Accelerator's path (``runtime.versions``: FSDP1, FSDP2, one-process/DDP), or the override
is set; the backend is FSDP1 or FSDP2 with ``SHARDED_STATE_DICT`` or ``FULL_STATE_DICT`` (Accelerate's FSDP1 default;
native Accelerate writes and reads the full files inside the transaction; FSDP1's ``LOCAL_STATE_DICT`` runs native);
and the protected path can handle this setup (``accelerate.descriptor.unsupported_reason``: one optimizer per model,
one shared filesystem, and with ``SHARDED_STATE_DICT`` optimizer state made of parameter-shaped tensors and scalars,
a supported sharding strategy, ...; on load also the checkpoint's optimizer state), decided from the live state at
each call and agreed on by every rank. With ``configure_checkpointing(protect="all")`` or
``ACCELERATE_TXN_PROTECT=all`` one process and DDP (:data:`BROADER_BACKENDS`) take the same path.

Never does importing the library make a working native save fail, unless strict mode asks for it: under automatic
dispatch an unsupported setup runs native Accelerate with one ``RuntimeWarning`` per Accelerator saying why and what
is unprotected. An instance opted in with :func:`patch_accelerate_fsdp` is refused instead
(``CheckpointConfigurationError``). Every other FSDP setup that runs native logs one WARNING per process and reason
(logger ``accelerate_txn``, main process: ``runtime.protection.say_native``) naming the condition that failed and
the one change that would protect it, except where the evidence does not protect the path (a changed piece, a
damaged evidence file): then one ``RuntimeWarning`` per process and reason says why, and nothing repeats it. Strict
mode (``configure_checkpointing(require_protection=True)``, else ``ACCELERATE_TXN_REQUIRE_PROTECTION=1``) raises
``CheckpointUnprotectedError`` on every rank instead of any native run, before anything is written or read.

Caveats: a subclass that overrides ``save_state``/``load_state`` without calling ``super()`` bypasses the
patch; wrapped methods do not pickle.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any
from weakref import WeakSet

import wrapt

from ..compat.evidence import warn_once
from ..core.ranks import agree, any_rank, collective, distributed, run_phase, world_size
from ..core.remote import is_url
from ..errors import CheckpointConfigurationError, UnsupportedVersionError
from ..runtime.accelerate_internals import accelerator_module, prepared_optimizers
from ..runtime.protection import REQUIRE, STATE_DICT_FIX, VERSIONS_FIX, Protection, refuse_native, say_native
from ..runtime.versions import (
    DISPATCH,
    automatic_dispatch_requested,
    override_requested,
    protected,
    unsupported_message,
)
from . import data_order, gradients
from .arrival import arrived, check_arrival, install_leaving_notice
from .config import checkpoint_config, existing_config, protect_mode, read_configs
from .descriptor import is_fsdp2_sharded, is_fsdp_protected, is_fsdp_sharded, path_of, unsupported_reason
from .native import OPTED_IN, OPTED_OUT, ORIGINALS, fsdp_routing, routed

logger = logging.getLogger(__name__)
_WARNED: WeakSet = WeakSet()  # Accelerators warned that an unsupported setup runs native
_TARGETS = ("Accelerator.save_state", "Accelerator.load_state", "load_fsdp_model", "load_fsdp_optimizer",
            "save_fsdp_optimizer")
#: The distributed types beyond FSDP that ``protect="all"`` routes through the protected path (what the explicit API
#: supports: ``accelerate.descriptor.SUPPORTED_BACKENDS``).
BROADER_BACKENDS = ("NO", "MULTI_CPU", "MULTI_GPU")


def _native_condition(accelerator: Any, enabled: bool) -> str:
    """Which dispatch condition sends an FSDP setup to native Accelerate (the first that fails; a changed piece is
    said by its own warning instead)."""
    if not enabled:
        if accelerator in OPTED_OUT:
            return "opted out with unpatch_accelerate_fsdp()"
        return f"automatic dispatch is off ({DISPATCH.source()}={os.environ.get(DISPATCH.source(), '')!r})"
    plugin = accelerator.state.fsdp_plugin  # not eligible
    if plugin is not None and getattr(plugin, "fsdp_version", 1) not in (1, 2):
        return f"FSDP{plugin.fsdp_version} is not protected (FSDP1 and FSDP2 only)"
    kind = getattr(getattr(plugin, "state_dict_type", None), "name", None)
    return f"state_dict_type is {kind} (protected: SHARDED_STATE_DICT and FULL_STATE_DICT)"


def _fix(accelerator: Any, condition: str) -> str | None:
    """The one change that would protect this Accelerator's checkpoints, for a native ``condition``."""
    if accelerator in OPTED_OUT:
        return "opt it back in with patch_accelerate_fsdp(accelerator)"
    if condition.startswith("automatic dispatch is off"):
        return f"unset {DISPATCH.source()} (or set it to 1), or opt this Accelerator in with patch_accelerate_fsdp()"
    if condition.startswith("state_dict_type is"):
        return STATE_DICT_FIX
    if condition.startswith("FSDP") and "is not protected" in condition:
        return "use FSDP1 or FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=1 or 2))"
    return None


def require_protection(accelerator: Any) -> tuple[bool, str]:
    """Whether strict mode is on for ``accelerator`` and where it was asked for: ``configure_checkpointing(
    require_protection=...)`` if set, else :data:`runtime.protection.REQUIRE` (read now)."""
    config = existing_config(accelerator)
    if config is not None and config.require_protection is not None:
        return config.require_protection, f"configure_checkpointing(require_protection={config.require_protection})"
    return REQUIRE.read(), f"{REQUIRE.source()}={REQUIRE.raw()}"


def _native(accelerator: Any, condition: str, fix: str | None = None, *, say: bool = True) -> bool:
    """This call runs native because of ``condition``: raise in strict mode, else say so (one WARNING per process and
    reason, from the main process); returns False (the dispatch decision). ``say=False``: a warning already said it."""
    fix = fix if fix is not None else _fix(accelerator, condition)
    strict, source = require_protection(accelerator)
    if strict:
        refuse_native("this Accelerator's checkpoints", condition, fix, source=source)
    if say:
        say_native("FSDP checkpoints of this Accelerator", condition, fix,
                   main=bool(getattr(accelerator, "is_main_process", True)))
    return False


def protection(accelerator: Any) -> Protection:
    """Whether ``accelerator``'s checkpoints take the protected path now (``accelerate_txn.protection``): decided on
    this process from the live setup, with no collective; see :class:`runtime.protection.Protection`."""
    kind = accelerator.distributed_type.name
    path = path_of(accelerator)
    enabled = (accelerator in OPTED_IN or automatic_dispatch_requested()) and accelerator not in OPTED_OUT

    def native(reason: str, fix: str | None = None) -> Protection:
        return Protection(False, "accelerate", path, reason, fix if fix is not None else _fix(accelerator, reason))

    if kind != "FSDP" and kind not in BROADER_BACKENDS:
        return native(f"the distributed type {kind} is not protected")
    if kind != "FSDP" and protect_mode(accelerator) != "all":
        return native(f"{kind} checkpoints are protected only with protect='all'",
                      "configure_checkpointing(accelerator, protect='all') or ACCELERATE_TXN_PROTECT=all")
    if not enabled:
        return native(_native_condition(accelerator, enabled))
    if not protected(path):
        return native(unsupported_message(path), VERSIONS_FIX)
    if kind == "FSDP" and not is_fsdp_protected(accelerator):
        return native(_native_condition(accelerator, enabled))
    reason = unsupported_reason(accelerator)
    if reason is not None:
        return native(reason)
    return Protection(True, "accelerate", path)


def _checkpoint_reason(accelerator: Any, input_dir: Any) -> str | None:
    """Load only: optimizer state in the checkpoint that the protected path cannot restore (a native checkpoint
    of an unsupported optimizer), read from each optimizer's DCP metadata. Local; unreadable metadata is left to
    the protected load, which refuses it with the reason."""
    from pathlib import Path

    from ..core.manifest import read_dcp_metadata
    from ..fsdp.optimizer_state import unsupported_checkpoint

    if input_dir is None or not is_fsdp_sharded(accelerator):
        return None  # automatic selection: only published (protected, hence supported) checkpoints or legacy
    for index in range(len(prepared_optimizers(accelerator))):
        directory = Path(input_dir) / f"optimizer_{index}"
        try:
            metadata = read_dcp_metadata(directory)
        except Exception:  # the protected load reports it
            continue
        reason = unsupported_checkpoint(metadata, str(directory))
        if reason:
            return reason
    return None


def _destination_reason(accelerator: Any, output_dir: Any) -> str | None:
    """Save only: why this save's existing destination cannot take a protected save, which replaces its destination
    as a whole, while native ``save_state`` writes into it (a directory of other files, the working directory, ...:
    ``core.select.replace_refusal``). ``None`` with automatic naming (native refuses an existing directory too) or
    ``overwrite="refuse"`` (the user asked for the protected path's refusal)."""
    from pathlib import Path

    from ..core.select import replace_refusal
    from .config import checkpoint_config
    from .save import protected_directories

    if output_dir is None or accelerator.project_configuration.automatic_checkpoint_naming:
        return None
    if checkpoint_config(accelerator).overwrite == "refuse":
        return None
    path = Path(os.fspath(output_dir)).expanduser().absolute()
    if not (path.exists() or path.is_symlink()):
        return None
    why = replace_refusal(path, protected_directories(accelerator))
    if why is None:
        return None
    return (f"the destination {path} exists and is not a checkpoint directory ({why}); a protected save replaces "
            "its destination as a whole, so this save writes into it as native save_state does. Save each "
            "checkpoint into a directory of its own (e.g. OUTPUT/checkpoint-N) to have it protected")


def _agreed_reason(accelerator: Any, input_dir: Any, loading: bool, output_dir: Any = None) -> tuple[str | None, bool]:
    """The first rank's reason the protected path cannot take this call, the same on every rank (one
    fixed-size exchange; reasons travel only when some rank has one), and whether it concerns this call only (its
    destination) rather than the Accelerator's setup."""
    import torch.distributed as dist

    per_call = False
    try:
        reason = unsupported_reason(accelerator) or (_checkpoint_reason(accelerator, input_dir) if loading else None)
        if reason is None and not loading:
            reason = _destination_reason(accelerator, output_dir)
            per_call = reason is not None
    except Exception as exc:  # an unreadable setup is a reason, never a hang
        reason = f"the setup could not be inspected ({type(exc).__name__}: {exc})"
    if not any_rank(reason is not None) or not distributed() or world_size() == 1:
        return reason, per_call
    gathered: list[Any] = [None] * world_size()
    with collective("Gathering the reasons the protected path cannot take this call"):
        dist.all_gather_object(gathered, (reason, per_call))
    return next(((f"rank {r}: {text}", call) for r, (text, call) in enumerate(gathered) if text), (None, False))


def _broader(accelerator: Any, kind: str) -> bool:
    """Whether ``protect="all"`` routes this non-FSDP Accelerator through the protected path; warns once per
    Accelerator when it is asked for a distributed type it does not cover (which runs native)."""
    if protect_mode(accelerator) != "all":
        return False
    if kind in BROADER_BACKENDS:
        return True
    if accelerator not in _WARNED:
        _WARNED.add(accelerator)
        warnings.warn(f"accelerate-txn: protect='all' covers {', '.join(BROADER_BACKENDS)} and FSDP sharded "
                      f"checkpoints; this Accelerator uses {kind}: its save_state/load_state run native Accelerate, "
                      "UNPROTECTED.", RuntimeWarning, stacklevel=5)
    return False


def _eligibility(accelerator: Any) -> tuple[bool, bool, bool]:
    """(eligible, validated, strict) on this rank, with the settings the protected path will use read now (inside the
    caller's rank phase: a setting invalid on one rank raises the same error on every rank)."""
    eligible = is_fsdp_protected(accelerator) or accelerator.distributed_type.name in BROADER_BACKENDS
    validated = protected(path_of(accelerator))
    strict, _source = require_protection(accelerator)
    if eligible and validated:
        read_configs({"": accelerator})
    return eligible, validated, strict


def _protected(accelerator: Any, input_dir: Any = None, *, loading: bool = False, output_dir: Any = None) -> bool:
    """The dispatch decision; for FSDP (and, with ``protect="all"``, one process and DDP) with dispatch on, a
    collective (all ranks must agree), preceded by the collective-free check that every rank reached this call
    (``accelerate.arrival``). Every native outcome goes through :func:`_native`: a WARNING, or in strict mode an
    error raised where every rank decides alike."""
    kind = accelerator.distributed_type.name
    opted_in = accelerator in OPTED_IN
    enabled = (opted_in or automatic_dispatch_requested()) and accelerator not in OPTED_OUT
    if kind != "FSDP" and not (enabled and _broader(accelerator, kind)):
        # Native, and without any collective: the backend is the same on every rank, and users of other
        # backends may call save_state on the main process only, which a collective here would hang. With
        # protect="all" (opt-in) one process and DDP take the protected path: every rank must call it. Only strict
        # mode speaks here (native one-process and DDP checkpoints are the default, said by the docs, not each call).
        if require_protection(accelerator)[0]:
            found = protection(accelerator)
            _native(accelerator, found.reason or f"{kind} checkpoints run native", found.fix, say=False)
        return False
    if not enabled:
        # Off is exactly native: no collective, no file, nothing beyond the environment read above (and the one
        # WARNING per process that says protection is off).
        return _native(accelerator, _native_condition(accelerator, enabled))
    # Before the first collective: a call made on some ranks only (save_state under ``if is_main_process:``) ends
    # there with an explained CheckpointArrivalError on those ranks, not in a mismatched collective.
    check_arrival(accelerator, "load_state" if loading else "save_state", input_dir if loading else output_dir)
    eligible, validated, strict = run_phase(functools.partial(_eligibility, accelerator),
                                            "Deciding whether to use the protected checkpoint path")
    agree({"enabled": enabled, "eligible": eligible, "validated": validated, "strict": strict,
           "backend": accelerator.distributed_type.name}, "whether to use the protected checkpoint path")
    if enabled and eligible and not validated:
        # One warning per process and reason, on every rank: it names what changed (no other line besides it).
        if not strict:
            warn_once(unsupported_message(path_of(accelerator)), stacklevel=4)
        return _native(accelerator, unsupported_message(path_of(accelerator)),
                       VERSIONS_FIX,
                       say=False)
    if not (enabled and eligible):
        return _native(accelerator, _native_condition(accelerator, enabled))
    reason, per_call = _agreed_reason(accelerator, input_dir, loading, output_dir)
    if reason is None:
        return True
    if opted_in:
        raise CheckpointConfigurationError(
            f"This Accelerator was opted in with patch_accelerate_fsdp(), but the protected path cannot handle it: "
            f"{reason} Unpatch it (unpatch_accelerate_fsdp) to use native save_state/load_state, unprotected.")
    if strict:
        return _native(accelerator, reason, say=False)
    if per_call:  # this save's destination only: warn for each such save
        warnings.warn(f"accelerate-txn: this save_state() runs native Accelerate, UNPROTECTED: {reason}.",
                      RuntimeWarning, stacklevel=4)
        return False
    if accelerator not in _WARNED:
        _WARNED.add(accelerator)
        warnings.warn(
            f"accelerate-txn: this Accelerator's FSDP checkpoints run native Accelerate save_state/load_state, "
            f"UNPROTECTED (no manifest, no atomic publish, no verification before restore): {reason}",
            RuntimeWarning, stacklevel=4)
    return False


_WARNED_MIRROR: WeakSet = WeakSet()  # Accelerators told that their mirror is unused (native path)


def _save_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    output_dir = args[0] if args else kwargs.get("output_dir")
    if instance is None or not _protected(instance, output_dir=output_dir):
        if instance is not None:
            _warn_unprotected_remote(instance, output_dir, "save_state")
        return wrapped(*args, **kwargs)
    return _protected_save(instance, *args, **kwargs)


def _warn_unprotected_remote(accelerator: Any, location: Any, call: str) -> None:
    """Native Accelerate knows no object store: ``save_state("s3://b/k")`` writes a local directory ``s3:/b/k`` and
    ``configure_checkpointing(mirror=...)`` uploads nothing. Say so (no error: native behaviour is kept)."""
    if is_url(location):
        warnings.warn(f"accelerate-txn: this {call}() runs native Accelerate, which does not know object stores: "
                      f"{location!r} is used as a LOCAL path (a directory named '{str(location).partition('://')[0]}:' in the "
                      "working directory). "
                      "Only the protected path (FSDP, or protect='all') reads and writes object storage.",
                      RuntimeWarning, stacklevel=4)
    elif checkpoint_config(accelerator).mirror is not None and accelerator not in _WARNED_MIRROR:
        _WARNED_MIRROR.add(accelerator)
        warnings.warn(f"accelerate-txn: configure_checkpointing(mirror={checkpoint_config(accelerator).mirror!r}) "
                      f"has no effect here: this {call}() runs native Accelerate, so nothing is uploaded to the mirror.",
                      RuntimeWarning, stacklevel=4)


def _protected_save(instance: Any, output_dir: Any = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
    from .save import save_training_checkpoint

    # arrived(): this call already checked that every rank reached it (in _protected)
    with fsdp_routing(instance), arrived():  # FSDP2 optimizer saves go through _save_fsdp_optimizer's own writer
        return save_training_checkpoint(instance, output_dir, safe_serialization=safe_serialization, **kwargs)


def _load_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    input_dir = args[0] if args else kwargs.get("input_dir")
    if instance is None or not _protected(instance, input_dir, loading=True):
        if instance is not None:
            _warn_unprotected_remote(instance, input_dir, "load_state")
        return wrapped(*args, **kwargs)
    _protected_load(instance, *args, **kwargs)
    return None  # as native load_state


def _protected_load(instance: Any, input_dir: Any = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
    from .load import load_training_checkpoint

    if load_kwargs is not None:  # the parameter exists from Accelerate 1.8 on; pass it only when given
        kwargs["load_kwargs"] = load_kwargs
    with arrived():  # this call already checked that every rank reached it (in _protected)
        load_training_checkpoint(instance, input_dir, **kwargs)


def _load_fsdp_model(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # (fsdp_plugin, accelerator, model, input_dir, model_index=0, ...). Accelerate 1.7-1.14 pick the DCP
    # directory by substring ("pytorch_model_fsdp" anywhere in the path); pass the exact directory instead.
    accelerator = args[1] if len(args) > 1 else kwargs.get("accelerator")
    if accelerator is None or not routed(accelerator) or not is_fsdp_sharded(accelerator):
        return wrapped(*args, **kwargs)
    args = list(args)
    index = args[4] if len(args) > 4 else kwargs.get("model_index", 0)
    if len(args) > 3:
        args[3] = os.path.join(args[3], f"pytorch_model_fsdp_{index}")
    else:
        kwargs["input_dir"] = os.path.join(kwargs["input_dir"], f"pytorch_model_fsdp_{index}")
    if is_fsdp2_sharded(accelerator):
        from .optimizers import load_fsdp2_model

        names = ("fsdp_plugin", "accelerator", "model", "input_dir", "model_index", "adapter_only", "use_dcp")
        bound = {**dict(zip(names, args)), **kwargs}
        if (protected("fsdp2") and not bound.get("adapter_only", False)
                and bound.get("use_dcp", True)):
            # Accelerate's own sharded FSDP2 model load, reading each tensor into the parameter in place.
            return load_fsdp2_model(bound["fsdp_plugin"], bound["model"], bound["input_dir"])
        return wrapped(*args, **kwargs)
    from ..fsdp.fsdp1_model import load_fsdp1_model

    names = ("fsdp_plugin", "accelerator", "model", "input_dir", "model_index", "adapter_only", "use_dcp")
    bound = {**dict(zip(names, args)), **kwargs}
    # Each rank's elements read straight into its flat-parameter shard, no all-gather; where that would not equal
    # native's result exactly (it says so on every rank, having changed nothing), Accelerate's native load.
    # Accelerate discards load_fsdp_model's return value (the load's missing/unexpected keys: none here).
    if (not bound.get("adapter_only", False) and bound.get("use_dcp", True)
            and load_fsdp1_model(bound["fsdp_plugin"], bound["model"], bound["input_dir"])):
        return None
    return wrapped(*args, **kwargs)


def _load_fsdp_optimizer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # (fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, ...)
    names = ("fsdp_plugin", "accelerator", "optimizer", "model", "input_dir", "optimizer_index")
    bound = dict(zip(names, args))
    bound.update({key: value for key, value in kwargs.items() if key in names})
    accelerator = bound.get("accelerator")
    if accelerator is None or not routed(accelerator) or not is_fsdp_sharded(accelerator):
        return wrapped(*args, **kwargs)
    if is_fsdp2_sharded(accelerator):
        from .optimizers import load_fsdp2_optimizer

        if not protected("fsdp2"):
            return wrapped(*args, **kwargs)
        return load_fsdp2_optimizer(accelerator, bound["optimizer"], bound["model"], bound["input_dir"],
                                    bound.get("optimizer_index", 0))
    from .optimizers import load_sharded_optimizer

    # No barrier here (native has one): a bare collective inside a phase could pair with another rank's phase
    # exchange; load_sharded_optimizer's first phase synchronises the ranks.
    return load_sharded_optimizer(accelerator, bound["optimizer"], bound["model"], bound["input_dir"],
                                  bound.get("optimizer_index", 0))


def _save_fsdp_optimizer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # (fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, use_dcp=True). FSDP2 only: the
    # native writer calls get_optimizer_state_dict, which steps an optimizer without state once (see fsdp.fsdp2).
    names = ("fsdp_plugin", "accelerator", "optimizer", "model", "output_dir", "optimizer_index", "use_dcp")
    bound = dict(zip(names, args))
    bound.update({key: value for key, value in kwargs.items() if key in names})
    accelerator = bound.get("accelerator")
    if (accelerator is None or not routed(accelerator) or not is_fsdp2_sharded(accelerator)
            or not bound.get("use_dcp", True)):
        return wrapped(*args, **kwargs)
    from ..fsdp.fsdp2 import save_fsdp2_optimizer

    if not protected("fsdp2"):
        return wrapped(*args, **kwargs)
    return save_fsdp2_optimizer(bound["optimizer"], bound["model"], bound["output_dir"],
                                bound.get("optimizer_index", 0))


_WRAPPERS = {
    "Accelerator.save_state": _save_state,
    "Accelerator.load_state": _load_state,
    "load_fsdp_model": _load_fsdp_model,
    "load_fsdp_optimizer": _load_fsdp_optimizer,
    "save_fsdp_optimizer": _save_fsdp_optimizer,
}


def installed() -> bool:
    module = accelerator_module()

    return isinstance(module.Accelerator.__dict__.get("save_state"), wrapt.FunctionWrapper)


def _may_protect() -> bool:
    """Whether the protected path can run (for ``destroy_process_group``, which must not raise): an invalid
    ``ACCELERATE_TXN_PATCHES`` counts as on, since its error is raised by the saves and loads, not here."""
    try:
        return automatic_dispatch_requested() or len(OPTED_IN) > 0
    except CheckpointConfigurationError:
        return True


def install() -> None:
    """Wrap the Accelerate entry points once (idempotent)."""
    module = accelerator_module()

    data_order.install()  # where each prepared data loader's epochs start (``accelerate.data_order``)
    # which gradients a completed optimizer step applied (``accelerate.gradients``), where a protected save can run
    gradients.track_steps(_may_protect)
    # A rank that destroys its process group says so: one waiting for it raises at once (only where the protected
    # path can run: with dispatch off and nothing opted in, destroy_process_group stays exactly native).
    install_leaving_notice(_may_protect)
    if installed():
        return
    for target in _TARGETS:
        try:
            _parent, _attribute, original = wrapt.resolve_path(module, target)
        except AttributeError:  # a release without this binding: the evidence keeps the paths relying on it native
            continue
        ORIGINALS[target] = original
        wrapt.wrap_function_wrapper(module, target, _WRAPPERS[target])


def uninstall() -> None:
    """Restore the original Accelerate functions (for tests and tools)."""
    module = accelerator_module()

    data_order.uninstall()
    gradients.untrack_steps()
    if not installed():
        return
    for target in [target for target in _TARGETS if target in ORIGINALS]:
        parent, attribute, _current = wrapt.resolve_path(module, target)
        setattr(parent, attribute, ORIGINALS.pop(target))


def patch_accelerate_fsdp(accelerator: Any) -> Any:
    """Opt ``accelerator`` in to the protected path (also with ``ACCELERATE_TXN_PATCHES=0``); returns it.

    Its FSDP1 and FSDP2 sharded optimizer loads, even through a native ``load_state``, use accelerate-txn's loaders.
    Raises :class:`UnsupportedVersionError` where the evidence does not protect the installed releases on this
    Accelerator's path (a private piece it relies on changed: :mod:`.versions`) unless
    ``ACCELERATE_TXN_ALLOW_UNVALIDATED=1``.
    """
    if not protected(path_of(accelerator)):
        raise UnsupportedVersionError(unsupported_message(path_of(accelerator)))
    if override_requested():
        logger.warning("accelerate-txn: unvalidated versions allowed by override; you accept the risk")
    install()
    OPTED_OUT.discard(accelerator)
    OPTED_IN.add(accelerator)
    return accelerator


def unpatch_accelerate_fsdp(accelerator: Any) -> Any:
    """Opt ``accelerator`` out: its save_state/load_state run native Accelerate unchanged; returns it."""
    OPTED_IN.discard(accelerator)
    OPTED_OUT.add(accelerator)
    return accelerator
