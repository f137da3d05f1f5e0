"""Exporting a full state dict as bounded Diffusers shards: shard planning and writing, :func:`save_diffusers_state_dict`.

Publishing the written directory atomically is :mod:`._publish`'s job; the DCP export (:mod:`._dcp`) reuses the
plan and the writer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import CheckpointConfigurationError
from ._common import (
    ADAPTER_WEIGHTS_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    DIFFUSERS,
    PEFT,
    SAFETENSORS_INDEX_NAME,
    TRANSFORMERS,
    TRANSFORMERS_INDEX_NAME,
    TRANSFORMERS_WEIGHTS_NAME,
    PathLike,
    check_dtype,
    examples,
    output_dtype,
)
from ._publish import publish_export
from ._signature import export_signer


def _file_mode() -> int:
    """The mode ``open()`` gives a new file: ``0o666`` less the process umask, read without changing it where
    Linux reports it (``os.umask`` sets it, briefly, for every thread)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _shard_name(index: int, count: int, layout: str = DIFFUSERS) -> str:
    """A shard's file name: Diffusers' (always numbered, with an index) or transformers' (``model.safetensors``
    alone, else numbered ``model-0000i-of-0000n.safetensors`` with an index) or PEFT's (``adapter_model.safetensors``,
    one file: PEFT loads no shards), as each library's loader expects."""
    if layout == PEFT:
        return ADAPTER_WEIGHTS_NAME
    if layout == TRANSFORMERS:
        return TRANSFORMERS_WEIGHTS_NAME if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"
    return f"diffusion_pytorch_model-{index:05d}-of-{count:05d}.safetensors"


def check_layout(layout: str) -> None:
    if layout not in (DIFFUSERS, TRANSFORMERS):
        raise CheckpointConfigurationError(
            f"layout={layout!r} is not an export layout: pass {DIFFUSERS!r} (diffusion_pytorch_model* files, for "
            f"Diffusers' from_pretrained) or {TRANSFORMERS!r} (model.safetensors or model-*-of-* shards with "
            "model.safetensors.index.json, for transformers' from_pretrained)."
        )


def resolve_shard_size(max_shard_size: int | str) -> int:
    """Bytes per shard; accepts an int or a size string such as ``"5GB"`` (as ``save_pretrained`` does)."""
    if isinstance(max_shard_size, str):
        from accelerate.utils import convert_file_size_to_int

        try:
            size = convert_file_size_to_int(max_shard_size)
        except ValueError:
            size = -1
    elif isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = max_shard_size
    else:
        size = -1
    if size <= 0:
        raise CheckpointConfigurationError(
            f"max_shard_size={max_shard_size!r} is not a positive size: pass bytes as an int or a string such as "
            "'5GB'."
        )
    return size


def _for_safetensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """CPU, contiguous, cast per the dtype rule; clone tensors sharing storage (tied weights) within one shard.

    safetensors refuses aliased tensors in one file; a tied weight is therefore written twice, which loads back
    exactly (``load_state_dict`` copies into the tied parameter twice).
    """
    ready: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in tensors.items():
        value = value.detach().to(device="cpu", dtype=output_dtype(dtype, value.dtype)).contiguous()
        pointer = value.untyped_storage().data_ptr()
        if value.numel() and pointer in storages:
            value = value.clone()
        storages.add(value.untyped_storage().data_ptr())
        ready[key] = value
    return ready


# --------------------------------------------------------------------------------------------- shard planning


@dataclass(frozen=True)
class ShardPlan:
    """Which keys go into which shard file, decided from sizes alone before anything is written."""

    shards: tuple[tuple[str, ...], ...]
    total_size: int
    layout: str = DIFFUSERS  # the file names (``_shard_name``)

    @classmethod
    def build(cls, sizes: list[tuple[str, int]], max_shard_size: int, where: Path,
              layout: str = DIFFUSERS) -> ShardPlan:
        """Greedy, in key order. Reports every tensor larger than ``max_shard_size`` at once."""
        too_big = [f"{key} ({size} bytes)" for key, size in sizes if size > max_shard_size]
        if too_big:
            raise CheckpointConfigurationError(
                f"Cannot export to {where}: {len(too_big)} tensor(s) exceed max_shard_size={max_shard_size} bytes "
                f"({examples(too_big)}). A tensor cannot be split across shards: raise max_shard_size to at least "
                f"{max(size for _key, size in sizes)}."
            )
        shards: list[list[str]] = [[]]
        filled = 0
        for key, size in sizes:
            if shards[-1] and filled + size > max_shard_size:
                shards.append([])
                filled = 0
            shards[-1].append(key)
            filled += size
        return cls(tuple(tuple(keys) for keys in shards), sum(size for _key, size in sizes), layout)

    def files(self) -> Iterator[tuple[str, tuple[str, ...]]]:
        for number, keys in enumerate(self.shards, 1):
            yield _shard_name(number, len(self.shards), self.layout), keys

    def index_name(self) -> str | None:
        """The index file's name; ``None`` where the layout has none (a single transformers file, a PEFT adapter)."""
        if self.layout == PEFT:
            return None
        if self.layout == TRANSFORMERS:
            return TRANSFORMERS_INDEX_NAME if len(self.shards) > 1 else None
        return SAFETENSORS_INDEX_NAME

    def index(self) -> dict[str, Any]:
        weight_map = {key: name for name, keys in self.files() for key in keys}
        return {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}


def write_shards(
    staging: Path,
    plan: ShardPlan,
    fetch: Callable[[tuple[str, ...]], dict[str, torch.Tensor]],
    dtype: torch.dtype | None,
) -> None:
    """Write every shard of ``plan`` and the index into ``staging``; ``fetch(keys)`` yields one shard's tensors.

    Only one shard's tensors are referenced here at a time, which is what bounds the export's memory.
    """
    mode = _file_mode()
    for filename, keys in plan.files():
        tensors = _for_safetensors(fetch(keys), dtype)
        save_file(tensors, staging / filename, metadata={"format": "pt"})
        os.chmod(staging / filename, mode)  # safetensors creates its files 0600, whatever the umask
        del tensors
    index = plan.index_name()
    if index is not None:
        (staging / index).write_text(json.dumps(plan.index(), indent=2) + "\n")


# --------------------------------------------------------------------------------------------- export


def _check_state_dict(state_dict: Mapping[str, Any], where: Path) -> None:
    if not isinstance(state_dict, Mapping):
        raise CheckpointConfigurationError(
            f"Cannot export to {where}: state_dict must be a dict of name -> tensor, got {type(state_dict).__name__}."
        )
    if not state_dict:
        raise CheckpointConfigurationError(
            f"Cannot export an empty state dict to {where}: gather the full model state first (under FSDP every "
            "rank must take part in gathering before rank 0 exports)."
        )
    wrapped = [
        f"{key!r} ({type(value).__name__})"
        for key, value in state_dict.items()
        if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter)
    ]
    if wrapped:
        raise CheckpointConfigurationError(
            f"Cannot export to {where}: {len(wrapped)} entr(ies) are tensor subclasses such as DTensor or a sharded "
            f"parameter, which hold only part of the tensor ({examples(wrapped)}): gather a full state dict first "
            "(e.g. get_model_state_dict with full_state_dict=True, cpu_offload=True) and export plain tensors."
        )
    bad = [
        repr(key)
        for key, value in state_dict.items()
        if not isinstance(key, str)
        or not isinstance(value, torch.Tensor)
        or value.layout != torch.strided
        or value.is_meta
    ]
    if bad:
        raise CheckpointConfigurationError(
            f"Cannot export to {where}: {len(bad)} entr(ies) are not dense, materialised tensors with string "
            f"names ({examples(bad)}). Pass a full state dict (not meta tensors, sparse tensors or nested dicts)."
        )


def config_writer(model: Any, layout: str = DIFFUSERS) -> Callable[[Path], None]:
    """How to write ``model``'s ``config.json``: Diffusers' ``save_config``, or for a transformers export the
    ``PreTrainedModel``'s ``config.save_pretrained``."""
    if layout == TRANSFORMERS:
        save_pretrained = getattr(getattr(model, "config", None), "save_pretrained", None)
        if not callable(save_pretrained):
            raise CheckpointConfigurationError(
                f"{type(model).__name__} has no config.save_pretrained(): pass the transformers model "
                "(PreTrainedModel) or a path to its config.json, so the export carries the config from_pretrained "
                "needs."
            )
        return save_pretrained
    save_config = getattr(model, "save_config", None)
    if not callable(save_config):
        raise CheckpointConfigurationError(
            f"{type(model).__name__} has no save_config(): pass the Diffusers model (ModelMixin/ConfigMixin) or an "
            "object offering save_config(directory), so the export carries the config.json loaders need."
        )
    return save_config


def save_diffusers_state_dict(
    state_dict: MutableMapping[str, torch.Tensor],
    model: Any,
    output_dir: PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    dtype: torch.dtype | None = None,
    sign_key: PathLike | None = None,
) -> Path:
    """Export ``state_dict`` as bounded Diffusers shards plus the index and ``model``'s config, atomically.

    Layout of ``output_dir`` afterwards (nothing else): ``diffusion_pytorch_model-0000i-of-0000n.safetensors``,
    ``diffusion_pytorch_model.safetensors.index.json`` and ``config.json`` (from ``model.save_config``).

    * Consumes ``state_dict``: each shard's tensors are popped as it is written, so the peak extra memory is about
      one shard (only tensors that need a copy - another device, another dtype, non-contiguous - cost memory).
      Every argument check runs first: if one fails, the dict is untouched. If writing fails part-way, the dict is
      partially consumed and ``output_dir`` is unchanged.
    * ``dtype``: floating tensors are cast to it; integer and boolean tensors never are. ``None`` keeps every dtype.
    * Re-export over an earlier export replaces it completely (stale shards disappear) and atomically: until the
      new export is complete, readers see the old one. A directory holding other files is refused.
    * ``sign_key``: an ECDSA (P-256, P-384, P-521) private key file; the export then also holds ``model.sig``, its
      signature in OpenSSF model_signing's format (``model_signing verify key`` verifies it; ``pip install
      'accelerate-txn[model-signing]'``), written before the publish: the export appears with its signature or not
      at all.

    Raises :class:`CheckpointConfigurationError` for an empty dict, non-tensor values, a bad ``dtype``, a tensor
    larger than ``max_shard_size``, or a ``sign_key`` that is unreadable or no such key (or model_signing missing);
    :class:`CheckpointExistsError` if ``output_dir`` holds foreign files; :class:`CheckpointLockedError` if another
    writer is exporting into the same parent directory. Returns ``output_dir`` as an absolute path. Call it on one
    process (rank 0, after gathering).
    """
    where = Path(output_dir)
    check_dtype(dtype)
    shard_size = resolve_shard_size(max_shard_size)
    _check_state_dict(state_dict, where)
    write_config = config_writer(model)
    sizes = [(key, value.numel() * output_dtype(dtype, value.dtype).itemsize) for key, value in state_dict.items()]
    plan = ShardPlan.build(sizes, shard_size, where)
    signer = export_signer(sign_key)

    def write(staging: Path) -> None:
        write_config(staging)  # first: a failing save_config must not cost the caller's state dict
        write_shards(staging, plan, lambda keys: {key: state_dict.pop(key) for key in keys}, dtype)

    return publish_export(output_dir, write, signer)
