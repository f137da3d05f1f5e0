"""The training-configuration descriptor: what a checkpoint was saved *for*, and its comparison on load.

The descriptor is plain JSON recorded in the manifest. On load the live descriptor must equal the saved
one, except for the documented migrations in :func:`check_resume` (legacy metadata keys, scheduler
class names recorded with their module, FSDP group order when no scheduler depends on it) and the changes
``resume_changes`` names (a schedule's new length, run-length metadata; others when accepted by name).
"""

from __future__ import annotations

import functools
import json
import re
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.jsondiff import differences
from ..errors import CheckpointConfigurationError
from ..fsdp.fsdp1 import parameter_layout
from ..fsdp.internals import inter_node_group, uses_orig_params
from ..fsdp.optimizer_state import raw_optimizer
from ..runtime.accelerate_internals import (
    custom_objects,
    prepared_dataloaders,
    prepared_models,
    prepared_optimizers,
    prepared_schedulers,
)
from ..runtime.versions import fsdp_state_dict_type, full_fsdp_version, sharded_fsdp_version
from ..runtime.versions import path_of as path_of  # the gate decides which path an Accelerator takes
from .config import checkpoint_config, plain
from .data_order import order_settings
from .layouts import mesh_text, unit_text
from .resume_changes import Change, accept_hint, builtin_settings, named_changes

SUPPORTED_BACKENDS = ("FSDP", "NO", "MULTI_CPU", "MULTI_GPU")


def class_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _model_class(model: Any) -> str:
    """The model's class; for FSDP2 the class ``fully_shard`` swapped in (``FSDP<Name>``, created in a torch-private
    module that moves between releases) is recorded as the user's class it derives from."""
    from ..fsdp.fsdp2 import original_class

    return class_name(model) if original_class(model) is None else _qualified(original_class(model))


def backend(accelerator: Any) -> str:
    return accelerator.distributed_type.name


def is_fsdp1_sharded(accelerator: Any) -> bool:
    """True for FSDP1 with ``SHARDED_STATE_DICT``: the configuration the protected path is built for."""
    return sharded_fsdp_version(accelerator) == 1


def is_fsdp2_sharded(accelerator: Any) -> bool:
    """True for FSDP2 (``fully_shard``) with ``SHARDED_STATE_DICT``."""
    return sharded_fsdp_version(accelerator) == 2


def is_fsdp_sharded(accelerator: Any) -> bool:
    """FSDP1 or FSDP2 with ``SHARDED_STATE_DICT``: the configurations the library's own FSDP writers and readers
    handle (the FSDP1 direct writer, the sharded optimizer restores, elastic resharding)."""
    return sharded_fsdp_version(accelerator) in (1, 2)


def is_fsdp_full(accelerator: Any) -> bool:
    """FSDP1 or FSDP2 with ``FULL_STATE_DICT`` (Accelerate's and the Trainer's default): native Accelerate writes and
    reads the full model and optimizer files (rank 0 writes them) inside the protected transaction."""
    return full_fsdp_version(accelerator) in (1, 2)


def is_fsdp_protected(accelerator: Any) -> bool:
    """An FSDP configuration the protected path takes: FSDP1 or FSDP2 with ``SHARDED_STATE_DICT`` or
    ``FULL_STATE_DICT``."""
    return is_fsdp_sharded(accelerator) or is_fsdp_full(accelerator)


def state_dict_kind(accelerator: Any) -> str | None:
    """The FSDP state dict type's name (``"FULL_STATE_DICT"``), ``None`` without FSDP."""
    found = fsdp_state_dict_type(accelerator)
    return None if found is None else found[1]


PROTECTED_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
HYBRID_SHARDING = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_NATIVE_FIX = "Unpatch it (unpatch_accelerate_fsdp) to use native save_state/load_state."


def unsupported_reason(accelerator: Any) -> str | None:
    """Why the protected path cannot checkpoint this Accelerator as it is now, or None. Local, no collective;
    the live optimizer state decides (``fsdp.optimizer_state``), so the answer can change after the first step."""
    from ..fsdp.optimizer_state import unsupported_state

    mode = backend(accelerator)
    if mode not in SUPPORTED_BACKENDS:
        return f"Protected checkpoints support {', '.join(SUPPORTED_BACKENDS)}; this Accelerator uses {mode}."
    if accelerator.project_configuration.save_on_each_node:
        return ("Protected checkpoints need one shared checkpoint filesystem: set "
                "ProjectConfiguration(save_on_each_node=False).")
    if mode != "FSDP":
        return None
    if not is_fsdp_protected(accelerator):
        return ("Protected FSDP checkpoints require FSDP1 or FSDP2 with state_dict_type=SHARDED_STATE_DICT or "
                "FULL_STATE_DICT.")
    if len(prepared_models(accelerator)) != len(prepared_optimizers(accelerator)):
        return (f"Protected FSDP checkpoints need one optimizer per prepared model; this Accelerator has "
                f"{len(prepared_models(accelerator))} models and {len(prepared_optimizers(accelerator))} optimizers.")
    if is_fsdp_full(accelerator):
        # Native Accelerate writes and reads the full files (any optimizer state, any sharding it saves): the
        # transaction around it needs nothing of the library's sharded readers.
        return None
    for optimizer in prepared_optimizers(accelerator):
        reason = unsupported_state(raw_optimizer(optimizer))
        if reason:
            return f"Unsupported optimizer: {reason}."
    if is_fsdp2_sharded(accelerator):
        from ..fsdp.fsdp2 import unsupported_fsdp2

        return unsupported_fsdp2(prepared_models(accelerator), accelerator.num_processes)
    return _unsupported_units(accelerator)


def _unsupported_units(accelerator: Any) -> str | None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for model in prepared_models(accelerator):
        for unit in FSDP.fsdp_modules(model):
            group_size = dist.get_world_size(unit.process_group) if dist.is_initialized() else 1
            strategy = unit.sharding_strategy.name
            replicas = hybrid_replicas(unit)
            # Hybrid sharding: each unit shards over its shard group and replicates over its replica group, the
            # two a grid over every rank; DCP writes each replicated chunk once. FSDP1 turns a hybrid unit whose
            # shard group has one rank into NO_SHARD (as on CPU without emulated nodes), which keeps the replica
            # group but never all-reduces over it: its replicas drift apart, and that is refused here.
            hybrid = replicas is not None and strategy in HYBRID_SHARDING
            if replicas is not None and not hybrid:
                return (f"Unsupported sharding strategy: an FSDP1 unit asked for hybrid sharding has a shard group "
                        f"of {group_size} rank, so FSDP1 runs it as {strategy} and never all-reduces across its "
                        f"{replicas} replicas (they drift apart, and no checkpoint can hold all of them). Give each "
                        "shard group 2 or more ranks (nodes of several devices), or use FULL_SHARD.")
            if group_size * (replicas if hybrid else 1) != accelerator.num_processes:
                return (f"Unsupported sharding strategy: protected FSDP checkpoints need units sharded over all "
                        f"{accelerator.num_processes} ranks; this one shards over {group_size} "
                        f"(a custom process group).")
            if strategy not in PROTECTED_SHARDING + HYBRID_SHARDING:
                return (f"Unsupported sharding strategy: protected FSDP checkpoints support "
                        f"{', '.join(PROTECTED_SHARDING + HYBRID_SHARDING)}; got {strategy}.")
            if unit.cpu_offload.offload_params and not uses_orig_params(unit):
                return ("FSDP parameter CPU offload requires use_orig_params=True for a reliable restore: set "
                        "FullyShardedDataParallelPlugin(use_orig_params=True).")
    return None


def hybrid_grid(unit: Any) -> dict[str, Any]:
    """A hybrid-sharded FSDP1 unit's descriptor entry for its grid, ``{"hybrid": {"replicate": R, "shard": S}}`` (R
    replicas of S ranks); ``{}`` for any other unit."""
    import torch.distributed as dist

    if unit.sharding_strategy.name not in HYBRID_SHARDING:
        return {}
    return {"hybrid": {"replicate": hybrid_replicas(unit), "shard": dist.get_world_size(unit.process_group)}}


def hybrid_replicas(unit: Any) -> int | None:
    """The number of replicas of a hybrid-sharded FSDP1 unit (the size of its replica group), else None."""
    import torch.distributed as dist

    group = inter_node_group(unit)
    return None if group is None else dist.get_world_size(group)


def _without_fsdp1_layout(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Elastic resume: drop each FSDP1 unit's sharding strategy and hybrid grid (both sides normalised in place). The
    saved files hold original-shape tensors whatever the strategy (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD``
    on any grid, ``_HYBRID_SHARD_ZERO2``; ``NO_SHARD`` on one rank), and model and optimizer are read into the live
    layout exactly."""
    for old, new in zip(saved.get("models", []), current.get("models", [])):
        for old_unit, new_unit in zip(old.get("fsdp", []), new.get("fsdp", [])):
            if "sharding" in old_unit and "sharding" in new_unit:
                for key in ("sharding", "hybrid"):
                    old_unit.pop(key, None)
                    new_unit.pop(key, None)


def _fsdp1_layout(descriptor: dict[str, Any]) -> list[list[str]]:
    """Each model's FSDP1 units as ``"STRATEGY"`` or ``"STRATEGY (R replicas x S ranks)"`` (hybrid)."""
    return [[unit_text(unit) for unit in model.get("fsdp", []) if isinstance(unit, dict) and "sharding" in unit]
            for model in descriptor.get("models", []) if isinstance(model, dict)]


def _fsdp1_layout_hint(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The FSDP1 sharding part of a refusal on the same world size: another strategy or hybrid grid is an elastic
    resume too."""
    before, after = _fsdp1_layout(saved), _fsdp1_layout(current)
    if before == after:
        return ""

    def strategies(layout: list[list[str]]) -> str:
        return ", ".join(sorted({name for units in layout for name in units})) or "none"

    return (f"\nThis checkpoint was saved with FSDP1 sharding {strategies(before)} and this run shards with "
            f"{strategies(after)}: a sharding change is refused before anything is restored. Resume with the saved "
            "sharding_strategy, or opt in to elastic resume with configure_checkpointing(accelerator, "
            "allow_reshard=True) (model and optimizer are resharded exactly: docs/elastic.md).")


def validate_owner(accelerator: Any) -> None:
    """Reject configurations the protected path does not support, with the reason and the fix."""
    reason = unsupported_reason(accelerator)
    if reason:
        raise CheckpointConfigurationError(f"{reason} {_NATIVE_FIX}")


def _plain_names(model: Any, accelerator: Any) -> tuple[dict[int, str], dict[str, Any]]:
    """Non-FSDP models: parameter id -> name (names of the unwrapped model, stable across DDP), and shapes."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    named = dict(unwrapped.named_parameters())
    by_id = {id(parameter): name for name, parameter in named.items()}
    shapes = {name: (tuple(p.shape), p.dtype, p.requires_grad) for name, p in named.items()}
    return by_id, shapes


def _callable_signature(function: Any) -> dict[str, Any]:
    if isinstance(function, functools.partial):
        return {"partial": _callable_signature(function.func), "args": plain(function.args, "partial args"),
                "kwargs": plain(function.keywords, "partial kwargs")}
    if isinstance(function, types.FunctionType):
        code = function.__code__
        positional = code.co_varnames[:code.co_argcount]
        defaults = len(function.__defaults__ or ())
        # The names let a resume speak of "num_training_steps", not "closure[1]" (``resume_changes``).
        return {
            "function": function.__name__,
            "defaults": plain(function.__defaults__, f"{function.__name__} defaults"),
            "default_names": list(positional[len(positional) - defaults:]) if defaults else [],
            "keywords": plain(function.__kwdefaults__, f"{function.__name__} keyword defaults"),
            "closure": [plain(cell.cell_contents, f"{function.__name__} closure") for cell in function.__closure__ or ()],
            "closure_names": list(code.co_freevars),
        }
    raise CheckpointConfigurationError(
        f"LR scheduler callable {class_name(function)} cannot be described for a checkpoint: use a plain function or "
        "functools.partial, whose defaults and closure can be compared on resume."
    )


def describe(accelerator: Any, *, require_model_ids: bool = True) -> dict[str, Any]:
    """The live training-configuration descriptor of one Accelerator (JSON-able). Mutates nothing."""
    validate_owner(accelerator)
    config = checkpoint_config(accelerator)
    fsdp = backend(accelerator) == "FSDP"
    known = {id(model) for model in prepared_models(accelerator)}
    strangers = [name for model, name in config.model_ids.items() if id(model) not in known]
    if config.model_ids and (strangers or len(config.model_ids) != len(prepared_models(accelerator))):
        raise CheckpointConfigurationError(
            "configure_checkpointing(model_ids=...) must name every prepared model, and only prepared models "
            f"(unknown roles: {strangers}); pass the models returned by accelerator.prepare()."
        )
    classes = [_model_class(accelerator.unwrap_model(model, keep_torch_compile=False)) for model in prepared_models(accelerator)]
    models, optimizers = [], []
    for index, model in enumerate(prepared_models(accelerator)):
        optimizer = (raw_optimizer(prepared_optimizers(accelerator)[index])
                     if index < len(prepared_optimizers(accelerator)) else None)
        units: list[dict[str, Any]] = []
        placements: dict[str, Any] = {}
        if fsdp and path_of(accelerator) == "fsdp2":
            from ..fsdp.fsdp2 import layout, mesh_record

            groups, layouts = layout(model, optimizer)
            shapes = {name: entry[:3] for name, entry in layouts.items()}
            placements = {name: entry[3] for name, entry in layouts.items()}
            units = [{"fsdp_version": 2, **mesh_record(model)}]
        elif fsdp:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            groups, shapes = parameter_layout(model, optimizer)
            # Hybrid units also record their grid: replicas x ranks of one shard group (absent otherwise).
            units = [{"original_params": uses_orig_params(unit), "cpu_offload": unit.cpu_offload.offload_params,
                      "sharding": unit.sharding_strategy.name, **hybrid_grid(unit)}
                     for unit in FSDP.fsdp_modules(model)]
        else:
            by_id, shapes = _plain_names(model, accelerator)
            groups = ([[by_id.get(id(p), "<not in model>") for p in group["params"]] for group in optimizer.param_groups]
                      if optimizer is not None else [])
        role = config.model_ids.get(model)
        if role is None:
            if classes.count(classes[index]) > 1 and require_model_ids:
                raise CheckpointConfigurationError(
                    f"Several prepared models are {classes[index]}: name them with "
                    "configure_checkpointing(accelerator, model_ids={'role': model, ...}) so a resume cannot swap them."
                )
            role = (f"legacy_model_{index}" if classes.count(classes[index]) > 1
                    else "model" if len(classes) == 1 else classes[index])
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        model_config = getattr(unwrapped, "config", None)
        model_config = ({str(k): v for k, v in dict(model_config).items() if not str(k).startswith("_")}
                        if hasattr(model_config, "items") else {})
        models.append({
            "id": role,
            "class": classes[index],
            "parameters": {name: {"shape": list(shape), "dtype": str(dtype), "requires_grad": bool(grad),
                                  **({"placements": placements[name]} if name in placements else {})}
                           for name, (shape, dtype, grad) in sorted(shapes.items())},
            "config": _safe_plain(model_config),
            "fsdp": units,
        })
        if optimizer is not None:
            optimizers.append({
                "class": class_name(optimizer),
                "groups": groups,
                "execution": [{key: plain(group.get(key, False), key) for key in ("capturable", "fused", "differentiable")}
                              for group in optimizer.param_groups],
            })
    if len({model["id"] for model in models}) != len(models):
        raise CheckpointConfigurationError("Checkpoint model roles must be unique; check configure_checkpointing(model_ids=...)")
    schedulers = []
    for wrapped in prepared_schedulers(accelerator):
        scheduler = getattr(wrapped, "scheduler", wrapped)
        bound = getattr(scheduler, "optimizer", None)
        index = next((i for i, opt in enumerate(prepared_optimizers(accelerator)) if bound in (opt, raw_optimizer(opt))), None)
        if index is None:
            raise CheckpointConfigurationError(
                f"LR scheduler {class_name(scheduler)} is not bound to an optimizer prepared by this Accelerator."
            )
        row: dict[str, Any] = {"class": class_name(scheduler), "optimizer": index}
        if hasattr(scheduler, "lr_lambdas"):
            row["functions"] = [_callable_signature(function) for function in scheduler.lr_lambdas]
        settings = builtin_settings(scheduler)
        if settings is not None:  # what load_state_dict restores from the checkpoint, overriding the live value
            row["settings"] = _safe_plain(settings)
        schedulers.append(row)
    descriptor = {
        "world_size": accelerator.num_processes,
        "backend": backend(accelerator),
        "mixed_precision": str(accelerator.mixed_precision),
        "accumulation_steps": accelerator.gradient_accumulation_steps,
        "models": models,
        "optimizers": optimizers,
        "schedulers": schedulers,
        "custom_objects": [class_name(obj) for obj in custom_objects(accelerator)],
        "scaler": class_name(accelerator.scaler) if accelerator.scaler is not None else None,
        "private_states": json.loads(json.dumps(config.private_states, sort_keys=True)),
        "training": config.metadata,
        "dataloaders": [{
            "class": class_name(loader),
            "dataset": class_name(getattr(loader.dataset, "checkpoint_dataset", loader.dataset)),
            "workers": getattr(loader, "num_workers", 0),
            "stateful": bool(getattr(loader, "use_stateful_dataloader", False)),
            **order_settings(loader, accelerator.num_processes),  # compared by resume_changes (absent: unknown)
        } for loader in prepared_dataloaders(accelerator)],
    }
    if is_fsdp_full(accelerator):
        # Recorded for FULL_STATE_DICT only (sharded descriptors keep their shape): a full checkpoint is resumed by a
        # FULL_STATE_DICT run, never read as a sharded one (the comparison refuses the difference).
        descriptor["state_dict_type"] = "FULL_STATE_DICT"
    return descriptor


def _safe_plain(value: dict[str, Any]) -> dict[str, Any]:
    """Model-config values as JSON. A value a manifest cannot record is described stably instead, never by a
    ``repr()`` that can hold a memory address (which differs per process, so ranks would disagree and no resume
    could match): see :func:`_stable_description`."""
    result = {}
    for key, item in value.items():
        try:
            result[key] = plain(item, key)
        except CheckpointConfigurationError:
            result[key] = _stable_description(item)
    return result


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")


def _qualified(value: Any) -> str:
    module = getattr(value, "__module__", None) or type(value).__module__
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__qualname__
    return f"{module}.{name}"


def _stable_description(value: Any) -> Any:
    """A description of a model-config value that is the same in every process:

    * functions, classes, methods and builtins (lambdas included): ``"<callable module.qualname>"``;
    * ``functools.partial``: the callable's description with its recorded arguments;
    * enum members: ``"<enum module.Class.NAME>"``; sets: sorted descriptions of their items;
    * any other object whose ``repr()`` is stable: that ``repr()`` (as before);
    * an object whose ``repr()`` holds a memory address (the default ``object.__repr__``): only its type,
      ``"<instance of module.qualname>"``; its value is deliberately left out of the descriptor.
    """
    import enum

    if isinstance(value, functools.partial):
        return {"partial": _stable_description(value.func),
                "args": [_described(item) for item in value.args],
                "kwargs": {str(k): _described(v) for k, v in sorted(value.keywords.items())}}
    if isinstance(value, enum.Enum):
        return f"<enum {type(value).__module__}.{type(value).__qualname__}.{value.name}>"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        return f"<callable {_qualified(value)}>"
    if isinstance(value, (set, frozenset)):
        return sorted((_described(item) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
    text = repr(value)
    if _ADDRESS.search(text):
        return f"<instance of {type(value).__module__}.{type(value).__qualname__}>"
    return text


def _described(value: Any) -> Any:
    try:
        return plain(value, "value")
    except CheckpointConfigurationError:
        return _stable_description(value)


def _normalise(descriptor: dict[str, Any], reorder_groups: bool) -> dict[str, Any]:
    descriptor = json.loads(json.dumps(descriptor))
    descriptor.pop("hooks", None)  # early manifests recorded hook identities
    for state in descriptor.get("private_states", {}).values():
        state.setdefault("schema_version", 1)
    for scheduler in descriptor.get("schedulers", []):
        scheduler["class"] = scheduler["class"].rsplit(".", 1)[-1]
        for function in scheduler.get("functions", []):
            _strip_callable_module(function)
    if reorder_groups:
        for optimizer in descriptor.get("optimizers", []):
            pairs = sorted(zip(optimizer["groups"], optimizer["execution"]), key=lambda pair: sorted(pair[0]))
            optimizer["groups"] = [sorted(group) for group, _ in pairs]
            optimizer["execution"] = [execution for _, execution in pairs]
    return descriptor


def _strip_callable_module(signature: dict[str, Any]) -> None:
    if "partial" in signature:
        _strip_callable_module(signature["partial"])
    if "function" in signature:
        signature["function"] = signature["function"].rsplit(".", 1)[-1]
    signature.pop("code", None)


@dataclass(frozen=True)
class ResumeCheck:
    """What a passing comparison decided: the legacy metadata keys migrated, and the named changes accepted
    (automatically or by ``accept_changes``), which the load reports in one line and applies."""

    migrated: list[str]
    accepted: list[Change]


def compare_descriptor(saved: dict[str, Any], current: dict[str, Any], **options: Any) -> list[str]:
    """Raise :class:`CheckpointConfigurationError` unless a run described by ``current`` may resume ``saved``
    (:func:`check_resume`, same options); returns the migrated legacy metadata keys."""
    return check_resume(saved, current, **options).migrated


def check_resume(
    saved: dict[str, Any],
    current: dict[str, Any],
    *,
    legacy_metadata_keys: tuple[str, ...] = (),
    legacy_metadata_groups: tuple[tuple[str, ...], ...] = (),
    accept_changes: Iterable[str] = (),
    where: str = "checkpoint",
    warn: bool = True,
    allow_reshard: bool = False,
    limit: int | None = 8,
) -> ResumeCheck:
    """Raise :class:`CheckpointConfigurationError` unless ``saved`` matches ``current``; its message lists the
    refused named changes and up to ``limit`` other differences (every one with ``None``: ``accelerate-txn diff``).

    Migrations: legacy metadata groups (absent as a whole -> current values, with a warning; partially absent
    -> error); FSDP optimizer group order when neither side has a scheduler. Named changes
    (``resume_changes``): a schedule's length and run-length or cadence metadata are accepted; the other named
    changes only when ``accept_changes`` names them. Pure: the same inputs decide the same on every rank.
    """
    reorder = (saved.get("backend") == current.get("backend") == "FSDP"
               and not saved.get("schedulers") and not current.get("schedulers"))
    saved, current = _normalise(saved, reorder), _normalise(current, reorder)
    if allow_reshard:
        _without_world_size(saved, current)
        _without_fsdp1_layout(saved, current)
    training = saved.setdefault("training", {})
    migrated: list[str] = []
    for group in (legacy_metadata_keys, *legacy_metadata_groups):
        absent = sorted(set(group) - set(training))
        if absent and set(group) & set(training):
            raise CheckpointConfigurationError(
                f"{where}: training metadata records only part of the field group {sorted(group)} (missing {absent}); "
                "a partial migration would guess values. Restore from a checkpoint that records all of them."
            )
        migrated.extend(absent)
    for key in migrated:
        training[key] = current["training"][key]
    accept = set(accept_changes)
    changes = named_changes(saved, current)
    refused = [change for change in changes
               if not change.automatic and (change.name not in accept or not change.acceptable)]
    found = differences(saved, current, limit=limit)
    if found or refused:
        raise CheckpointConfigurationError(
            f"{where} was saved for a different training configuration:\n  "
            + "\n  ".join([change.refused_line() for change in refused] + found)
            + "\nResume with the configuration it was saved with (models and roles, optimizer type and groups, "
            "schedulers, precision, accumulation, world size, dataloaders, metadata), or start a new run directory."
            + _accept_hint(refused, bool(found)) + _reshard_hint(saved, current) + _fsdp1_layout_hint(saved, current)
        )
    if migrated and warn:
        warnings.warn(
            f"{where} lacks training metadata {migrated}; using the current values. They cannot be verified "
            "historically; the next save records them.", RuntimeWarning, stacklevel=3,
        )
    return ResumeCheck(migrated, [change for change in changes if change not in refused])


def _accept_hint(refused: list[Change], others: bool) -> str:
    """The part of a refusal that says how to resume with its named changes anyway (those that can be accepted)."""
    refused = [change for change in refused if change.acceptable]
    if not refused:
        return ""
    also = " (the other differences above must still match)" if others else ""
    return (f"\nTo resume with {'this change' if len(refused) == 1 else 'these changes'} on purpose{also}, accept "
            f"{'it' if len(refused) == 1 else 'them'} by name: {accept_hint(c.name for c in refused)} "
            '(docs/configuration.md, "What may change on resume").')


_MESH_KEYS = ("mesh", "mesh_dims")


def full_on_both(saved: Any, current: dict[str, Any]) -> bool:
    """Whether a checkpoint saved with ``FULL_STATE_DICT`` is resumed by a ``FULL_STATE_DICT`` run: its model and
    optimizer files hold whole tensors, so the world size and the sharding may change (as natively)."""
    return (isinstance(saved, dict) and saved.get("state_dict_type") == "FULL_STATE_DICT"
            and current.get("state_dict_type") == "FULL_STATE_DICT")


def _without_world_size(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Elastic resume: drop what only records how the state is spread over the ranks (both sides normalised in
    place). The world size itself; an FSDP2 device mesh (its shape and dimension names: 1-D, HSDP, with TP) and
    each parameter's DTensor placements (DCP stores every tensor by its global shape and reads it onto any mesh); and
    the number of processes each data loader shards over (the elastic data-order policy of docs/elastic.md applies).
    FSDP1's strategy and grid: :func:`_without_fsdp1_layout`."""
    saved.pop("world_size", None)
    current.pop("world_size", None)
    for loader in [*saved.get("dataloaders", []), *current.get("dataloaders", [])]:
        if isinstance(loader, dict):
            loader.pop("processes", None)
    for old, new in zip(saved.get("models", []), current.get("models", [])):
        fsdp2 = [unit for unit in [*old.get("fsdp", []), *new.get("fsdp", [])] if "mesh" in unit]
        for unit in fsdp2:
            for key in _MESH_KEYS:
                unit.pop(key, None)
        if fsdp2:
            for parameter in [*old.get("parameters", {}).values(), *new.get("parameters", {}).values()]:
                if isinstance(parameter, dict):
                    parameter.pop("placements", None)


def _meshes(descriptor: dict[str, Any]) -> list[dict[str, Any]]:
    return [{key: unit.get(key) for key in _MESH_KEYS} for model in descriptor.get("models", [])
            for unit in model.get("fsdp", []) if isinstance(unit, dict) and "mesh" in unit]


def _reshard_hint(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The world-size part of a refusal: resuming on another number of ranks, or on another device mesh, needs the
    elastic-resume opt-in."""
    if saved.get("world_size") == current.get("world_size"):
        if _meshes(saved) == _meshes(current):
            return ""
        old, new = (next(iter(_meshes(side)), {"mesh": "(none)"}) for side in (saved, current))
        return (f"\nThis checkpoint was saved on the device mesh {mesh_text(old)} and this run has "
                f"{mesh_text(new)}: a mesh change is refused before anything is restored. Resume on the same mesh "
                "(the same ParallelismConfig), or opt in to elastic resume with "
                "configure_checkpointing(accelerator, allow_reshard=True) (model and optimizer are resharded onto the "
                "new mesh: docs/elastic.md).")
    return (f"\nThis checkpoint was saved on {saved.get('world_size')} ranks and this run has "
            f"{current.get('world_size')}: a world-size change is refused before anything is restored. Resume on "
            f"{saved.get('world_size')} ranks, or opt in to elastic resume with "
            "configure_checkpointing(accelerator, allow_reshard=True) (model and optimizer are resharded; per-rank "
            "RNG, data-loader and private state follow the documented policy: docs/elastic.md).")


def participants(owners: Any) -> dict[str, Any]:
    """``{component: Accelerator}``: one Accelerator is the root component ``""``; a dict names sub-directories."""
    from pathlib import PurePosixPath

    if owners is None:
        raise CheckpointConfigurationError("save/load_training_checkpoint needs an Accelerator or {component: Accelerator}")
    items = owners.items() if isinstance(owners, dict) else [("", owners)]
    result: dict[str, Any] = {}
    for name, owner in sorted(items, key=lambda kv: str(kv[0])):
        path = PurePosixPath(str(name))
        if path.is_absolute() or ".." in path.parts:
            raise CheckpointConfigurationError(f"Checkpoint component {name!r} must be a relative path inside the checkpoint")
        key = "" if str(path) == "." else path.as_posix()
        if key in result or any(owner is other for other in result.values()):
            raise CheckpointConfigurationError(f"Checkpoint components and Accelerators must be unique (component {key!r})")
        if any(other and (key == "" or path.is_relative_to(other) or PurePosixPath(other).is_relative_to(path))
               for other in result) or ("" in result and key):
            raise CheckpointConfigurationError(f"Checkpoint component {key!r} overlaps another component")
        result[key] = owner
    if not result:
        raise CheckpointConfigurationError("save/load_training_checkpoint needs at least one Accelerator")
    return result
