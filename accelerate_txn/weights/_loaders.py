"""Loading full checkpoints, validated before anything changes.

:func:`read_diffusers_state_dict`, :func:`load_model_checkpoint`, :func:`copy_diffusers_checkpoint`,
:func:`load_diffusers_checkpoint` and :func:`is_complete_diffusers_checkpoint`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointConfigurationError, CheckpointIntegrityError, NoCheckpointError
from ._common import CONFIG_NAME, PathLike, check_dtype, examples, shapes, strip
from ._layout import locate_weights
from ._read import OpenWeights, check_matches_model, iter_tensors, read_file, scan


def read_diffusers_state_dict(directory: PathLike) -> dict[str, torch.Tensor]:
    """Read a complete Diffusers checkpoint (sharded or single file) into one CPU state dict.

    Validates the index and every header (duplicates, index entries, missing shards) before reading any payload.
    The result holds the whole model: use :func:`load_model_checkpoint` to load shard by shard into a model.
    """
    with OpenWeights(locate_weights(Path(directory))) as opened:
        scan(opened)
        state: dict[str, torch.Tensor] = {}
        for file in opened.weights.files:
            state.update(read_file(opened, file))
    return state


def load_model_checkpoint(model: torch.nn.Module, checkpoint: PathLike) -> tuple[list[str], list[str]]:
    """Load a full local checkpoint into ``model``, one file at a time, after validating all of it.

    ``checkpoint``: a ``.safetensors``/``.bin`` file or a Diffusers directory. Every key, shape, duplicate and index
    entry is checked against ``model.state_dict()`` before any parameter changes; a partial or adapter checkpoint
    raises :class:`CheckpointIntegrityError` and leaves ``model`` untouched. Loading goes through
    ``model.load_state_dict`` so model-specific load hooks run. Returns ``(missing_keys, unexpected_keys)``, both
    empty after a successful validation (kept for callers that expect ``load_state_dict``'s result).
    """
    with OpenWeights(locate_weights(Path(checkpoint))) as opened:
        found = scan(opened)
        expected = shapes(model.state_dict())
        check_matches_model(found, expected, opened.weights.source)
        loaded: set[str] = set()
        unexpected: set[str] = set()
        for file in opened.weights.files:
            tensors = read_file(opened, file)
            result = model.load_state_dict(tensors, strict=False)
            loaded.update(tensors)
            unexpected.update(result.unexpected_keys)
            del tensors
    return sorted(expected.keys() - loaded), sorted(unexpected)


def copy_diffusers_checkpoint(
    model: torch.nn.Module,
    path: PathLike,
    weight_dtype: torch.dtype | None,
    *,
    strip_prefix: str | None = None,
    state_dict_key: str | None = None,
) -> None:
    """Copy a full checkpoint into ``model``'s existing tensors in place, one tensor at a time.

    ``path``: a weight file or directory (see :func:`safetensor_checkpoint_files`; ``.bin`` files are read with
    ``weights_only=True``). ``strip_prefix`` is removed from source names that start with it; ``state_dict_key``
    selects a nested dict in a ``.bin`` file: at its top level first, then under ``"state_dict"``; found in neither,
    :class:`CheckpointIntegrityError` lists the keys there are. Floating source tensors are rounded through
    ``weight_dtype`` (when not ``None``) and copied into each destination tensor, which keeps its own dtype and
    device. All names and shapes are validated first: on any mismatch :class:`CheckpointIntegrityError` is raised
    and ``model`` is untouched.
    """
    check_dtype(weight_dtype)
    with OpenWeights(locate_weights(Path(path), any_safetensors=True)) as opened, torch.no_grad():
        found = scan(opened, strip_prefix=strip_prefix, state_dict_key=state_dict_key)
        destination = model.state_dict()
        check_matches_model(found, shapes(destination), opened.weights.source)
        for key, value in iter_tensors(opened, state_dict_key):
            if weight_dtype is not None and value.is_floating_point():
                value = value.to(weight_dtype)
            destination[strip(key, strip_prefix)].copy_(value)


def _meta_model(model_cls: Any, config: Mapping[str, Any]) -> Any:
    """``model_cls.from_config(config)`` on the meta device: shapes and normalised config without memory."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        return model_cls.from_config(config)


def load_diffusers_checkpoint(
    model_cls: Any,
    model_name: PathLike,
    checkpoint: PathLike | None,
    torch_dtype: torch.dtype | None,
    *,
    subfolder: str | None = None,
) -> Any:
    """Build a ``model_cls`` model holding the full weights of ``checkpoint``, validated before loading.

    ``model_cls`` is a Diffusers ``ModelMixin`` subclass or a duck-typed class with ``load_config(path,
    subfolder=None, **kwargs) -> dict``, ``from_config(config)`` (called under ``init_empty_weights``), a mapping
    ``config`` attribute on its models and ``from_pretrained(path, subfolder=None, low_cpu_mem_usage=True,
    torch_dtype=None, output_loading_info=False)``, which must accept all those keywords and, with
    ``output_loading_info=True``, return ``(model, info)`` with ``info["missing_keys"]``, ``["unexpected_keys"]``
    and ``["mismatched_keys"]`` lists (there is no fallback for a narrower signature). ``model_name`` (+
    ``subfolder``) is the base model whose config defines the expected keys and shapes. ``checkpoint`` is either a
    directory with ``config.json`` whose normalised public config must equal the base model's (else
    :class:`CheckpointConfigurationError` naming the differing keys), loaded with ``from_pretrained`` (base weights
    are never read), or a single weight file (the base model is loaded with ``from_pretrained`` for its config and
    precision rules, then every tensor is replaced). Partial and adapter checkpoints raise
    :class:`CheckpointIntegrityError` before any weights are loaded.
    """
    if checkpoint is None:
        raise CheckpointConfigurationError(
            "A full model checkpoint is required: pass the directory written by save_diffusers_state_dict or a "
            "full .safetensors/.bin file (adapters are loaded with the adapter loader instead)."
        )
    checkpoint = Path(checkpoint)
    config = model_cls.load_config(model_name, subfolder=subfolder)
    base_model = _meta_model(model_cls, config)
    expected = shapes(base_model.state_dict())
    if checkpoint.is_dir() and not (checkpoint / CONFIG_NAME).is_file():
        raise CheckpointIntegrityError(
            f"{checkpoint} has no {CONFIG_NAME}: it is not a complete Diffusers model directory. Export it with "
            "save_diffusers_state_dict (which writes the config) or pass a single weight file."
        )
    weights = locate_weights(checkpoint)
    with OpenWeights(weights) as opened:
        check_matches_model(scan(opened), expected, weights.source)
    if checkpoint.is_dir():
        try:
            candidate_model = _meta_model(model_cls, model_cls.load_config(checkpoint))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointIntegrityError(
                f"{checkpoint / CONFIG_NAME} is not a valid {model_cls.__name__} config ({type(exc).__name__}: {exc}): "
                "re-export the checkpoint."
            ) from None
        differing = _config_differences(base_model, candidate_model)
        if differing:
            raise CheckpointConfigurationError(
                f"{checkpoint / CONFIG_NAME} differs from the base model's ({model_name}"
                f"{'/' + subfolder if subfolder else ''}) on {len(differing)} key(s): {examples(differing)}. The "
                "checkpoint would be built with its own config: pass the base model it was trained from, or load "
                "it as a model of its own."
            )
        model, info = model_cls.from_pretrained(
            checkpoint, low_cpu_mem_usage=True, torch_dtype=torch_dtype, output_loading_info=True
        )
        problems = {key: info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
        if any(problems.values()):
            raise CheckpointIntegrityError(
                f"{model_cls.__name__}.from_pretrained({checkpoint}) did not load every tensor: {problems}. Check that "
                f"its {CONFIG_NAME} matches the base model {model_name}."
            )
        return model
    model = model_cls.from_pretrained(model_name, subfolder=subfolder, low_cpu_mem_usage=True, torch_dtype=torch_dtype)
    load_model_checkpoint(model, checkpoint)
    return model


def _public_config(model: Any) -> dict[str, str]:
    """A model's normalised config, private ``_`` keys dropped, each value as canonical JSON (tuples == lists)."""
    config = getattr(model, "config", None)
    items = dict(config) if isinstance(config, Mapping) else {}
    return {
        key: json.dumps(value, sort_keys=True, default=str) for key, value in items.items() if not key.startswith("_")
    }


def _config_differences(expected_model: Any, candidate_model: Any) -> list[str]:
    """The public config keys on which two meta models differ (present in one only, or with different values)."""
    expected, candidate = _public_config(expected_model), _public_config(candidate_model)
    return sorted(key for key in expected.keys() | candidate.keys() if expected.get(key) != candidate.get(key))


def is_complete_diffusers_checkpoint(model_cls: Any, path: PathLike, base_config: Mapping[str, Any]) -> bool:
    """Whether ``path`` is a complete safetensors Diffusers export of a ``model_cls`` built from ``base_config``.

    True only if: ``path`` is a directory with ``config.json`` whose normalised config (private ``_`` keys
    ignored) equals ``base_config``'s, its weights - found exactly as the loaders find them (safetensors index,
    else ``diffusion_pytorch_model.safetensors``) - are safetensors consistent with their index, and their headers
    hold exactly the model's keys and shapes. Reads headers only; never raises for an incomplete checkpoint or an
    unreadable/invalid ``config.json`` (it returns False). True implies :func:`load_diffusers_checkpoint` accepts
    ``path`` with a base model of this config.
    """
    path = Path(path)
    if not path.is_dir() or not (path / CONFIG_NAME).is_file():
        return False
    try:
        weights = locate_weights(path)
        if weights.files[0].suffix != ".safetensors":
            return False
        with OpenWeights(weights) as opened:
            found = scan(opened)
    except (CheckpointIntegrityError, NoCheckpointError):
        return False
    expected_model = _meta_model(model_cls, base_config)
    try:
        candidate_model = _meta_model(model_cls, model_cls.load_config(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # config.json is not valid JSON, or not a config of this class
    return not _config_differences(expected_model, candidate_model) and found == shapes(expected_model.state_dict())
