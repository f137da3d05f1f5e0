"""Per-Accelerator checkpoint configuration (``configure_checkpointing``) and the failed-restore guard.

Configuration lives beside the Accelerator in a ``WeakKeyDictionary``: nothing is stored on the Accelerator
itself and nothing keeps it alive.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary, ref

import torch

from .errors import CheckpointConfigurationError, RestoreFailedError

FINITE_ENV = "VIDEOX_CHECKPOINT_FINITE"
CHECKSUM_MODES = ("metadata", "full")


def plain(value: Any, where: str = "value") -> Any:
    """A JSON-able, key-sorted copy of ``value`` (one-element tensors become numbers); raises on anything else."""
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointConfigurationError(
            f"Checkpoint metadata {where} is {value!r}: a non-finite number never compares equal, so no resume could "
            "ever match it. Record it as a string or leave it out."
        )
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (tuple, list)):
        return [plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(key): plain(item, f"{where}.{key}") for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    raise CheckpointConfigurationError(
        f"Checkpoint metadata {where} has type {type(value).__module__}.{type(value).__qualname__}, which cannot be "
        "recorded in a manifest: use str, int, float, bool, None, lists and dicts of those."
    )


Validator = Callable[[Path, int], Any]


@dataclass
class CheckpointConfig:
    model_ids: WeakKeyDictionary = field(default_factory=WeakKeyDictionary)
    allow_legacy: bool = True
    check_finite: bool = False
    checksum: str = "metadata"
    metadata: dict[str, Any] = field(default_factory=dict)
    legacy_metadata_keys: tuple[str, ...] = ()
    legacy_metadata_groups: tuple[tuple[str, ...], ...] = ()
    # File-name template -> schema recorded in the descriptor; and -> validator(directory, rank).
    private_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    validators: dict[str, Validator] = field(default_factory=dict)
    run_id: str | None = None
    failed: bool = False
    step_guards: list[Any] = field(default_factory=list)


_CONFIGS: WeakKeyDictionary = WeakKeyDictionary()


def checkpoint_config(accelerator: Any) -> CheckpointConfig:
    """The configuration of ``accelerator`` (created with defaults on first use)."""
    config = _CONFIGS.get(accelerator)
    if config is None:
        config = CheckpointConfig(check_finite=os.environ.get(FINITE_ENV, "0").strip() == "1")
        _CONFIGS[accelerator] = config
    return config


def configure_checkpointing(
    accelerator: Any,
    *,
    model_ids: Mapping[str, torch.nn.Module] | None = None,
    allow_legacy: bool | None = None,
    check_finite: bool | None = None,
    checksum: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    legacy_metadata_keys: Iterable[str] = (),
    legacy_metadata_groups: Iterable[Iterable[str]] = (),
) -> Any:
    """Configure protected checkpoints of one Accelerator; returns it.

    * ``model_ids``: stable role names for the prepared models (``{"transformer": model}``); required when
      several models share a class, since native order alone cannot prove which weights belong where.
    * ``allow_legacy``: load checkpoints without a completion manifest (with a warning). Default True.
    * ``check_finite``: refuse to save (and to finish a restore of) NaN/Inf parameters and optimizer state.
      Default from ``VIDEOX_CHECKPOINT_FINITE=1``.
    * ``checksum``: ``"metadata"`` hashes every control file and records every payload's size;
      ``"full"`` also hashes every payload (verified on explicit loads).
    * ``metadata``: JSON-able user training configuration recorded in the manifest and compared on load.
    * ``legacy_metadata_keys`` / ``legacy_metadata_groups``: metadata fields added after older checkpoints
      were written. A checkpoint lacking a whole group loads with a warning (current values are assumed);
      lacking part of a group is an error; present values must still match.
    """
    config = checkpoint_config(accelerator)
    if model_ids is not None:
        if not all(isinstance(name, str) and name for name in model_ids):
            raise CheckpointConfigurationError("configure_checkpointing(model_ids=...): every role must be a non-empty str")
        if len({id(model) for model in model_ids.values()}) != len(model_ids):
            raise CheckpointConfigurationError("configure_checkpointing(model_ids=...): each model needs exactly one role")
        config.model_ids = WeakKeyDictionary((model, name) for name, model in model_ids.items())
    if metadata is not None:
        config.metadata = plain(dict(metadata), "metadata")
    keys = tuple(legacy_metadata_keys)
    groups = tuple(tuple(group) for group in legacy_metadata_groups)
    unknown = sorted({key for group in (keys, *groups) for key in group} - set(config.metadata))
    if unknown:
        raise CheckpointConfigurationError(
            f"configure_checkpointing: legacy metadata keys {unknown} are not in metadata=...; a migrated field "
            "must have a current value to fall back on"
        )
    config.legacy_metadata_keys, config.legacy_metadata_groups = keys, groups
    if allow_legacy is not None:
        config.allow_legacy = bool(allow_legacy)
    if check_finite is not None:
        config.check_finite = bool(check_finite)
    if checksum is not None:
        if checksum not in CHECKSUM_MODES:
            raise CheckpointConfigurationError(f"configure_checkpointing(checksum={checksum!r}): use 'metadata' or 'full'")
        config.checksum = checksum
    return accelerator


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Accelerate's ``AcceleratedOptimizer`` wraps the real optimizer in ``.optimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def mark_failed(accelerator: Any, failed: bool) -> None:
    """Mark a restore as failed (``optimizer.step()`` and saving raise) or clear the mark."""
    config = checkpoint_config(accelerator)
    config.failed = failed
    if failed and not config.step_guards:
        owner = ref(accelerator)

        def guard(optimizer: Any, args: Any, kwargs: Any) -> None:
            target = owner()
            if target is not None and checkpoint_config(target).failed:
                raise RestoreFailedError(
                    "The last load_state() failed part-way, so parameters and optimizer state may be inconsistent: "
                    "load a checkpoint successfully before calling optimizer.step()."
                )

        for optimizer in accelerator._optimizers:
            config.step_guards.append(raw_optimizer(optimizer).register_step_pre_hook(guard))
    elif not failed:
        for handle in config.step_guards:
            handle.remove()
        config.step_guards.clear()


def ensure_not_failed(accelerator: Any) -> None:
    if checkpoint_config(accelerator).failed:
        raise RestoreFailedError(
            "Refusing to save: the last load_state() failed part-way and the training state may be inconsistent. "
            "Load a checkpoint successfully first."
        )
