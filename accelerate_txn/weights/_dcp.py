"""Offline export of a sharded training checkpoint (``torch.distributed.checkpoint``): :func:`export_dcp_to_diffusers`,
:func:`export_dcp_to_transformers` (the same export under transformers' file names) and :func:`export_dcp_to_peft`
(a PEFT model's LoRA adapter, as PEFT's ``save_pretrained`` writes it; names: :mod:`._peft`).

``.metadata`` is read with a restricted unpickler (:func:`_read_dcp_metadata`), tensors with ``weights_only=True``;
the output is planned, written and published exactly as by :func:`~._export.save_diffusers_state_dict`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..core.manifest import check_dcp_payloads, read_manifest, verify_manifest
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError, NoCheckpointError
from ._common import (
    ACCELERATE_FSDP_MODEL_DIR,
    ADAPTER_CONFIG_NAME,
    CONFIG_NAME,
    DCP_MODEL_PREFIX,
    DEFAULT_MAX_SHARD_SIZE,
    DIFFUSERS,
    PEFT,
    TRANSFORMERS,
    PathLike,
    check_dtype,
    examples,
    output_dtype,
    shapes,
)
from ._export import ShardPlan, check_layout, config_writer, resolve_shard_size, write_shards
from ._peft import adapter_entries, check_adapter_config, peft_entries, read_adapter_config
from ._publish import publish_export
from ._read import check_matches_model
from ._signature import export_signer


def _read_dcp_metadata(directory: PathLike) -> Any:
    """``Metadata`` of a ``torch.distributed.checkpoint`` directory, read without trusting the pickle.

    DCP's own ``FileSystemReader.read_metadata`` calls ``pickle.load``, which runs whatever code the file names.
    This delegates to the project's restricted reader (``core.manifest.read_dcp_metadata``: only DCP's metadata
    classes and the torch/pathlib types they are built from may be constructed; the globals real files use were
    listed with ``pickletools``), which also checks that every payload range the metadata names exists in full
    (``core.manifest.check_dcp_payloads``). Anything else raises :class:`CheckpointIntegrityError` without running it.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = check_dcp_payloads(Path(directory))
    if not isinstance(metadata, Metadata):
        raise CheckpointIntegrityError(
            f"{Path(directory) / '.metadata'} holds a {type(metadata).__name__}, not DCP Metadata: it is not a "
            "torch.distributed.checkpoint directory."
        )
    return metadata


def _locate_dcp(dcp_dir: Path) -> Path:
    """The DCP directory itself, or the model directory Accelerate writes inside a checkpoint directory.

    A protected checkpoint directory (one with ``checkpoint_manifest.json``) is verified against its manifest
    first: sizes, control-file hashes and DCP schemas (payload hashes are not re-read).
    """
    manifest = read_manifest(dcp_dir) if dcp_dir.is_dir() else None
    if manifest is not None:
        verify_manifest(dcp_dir, manifest, full=False)
    if (dcp_dir / ".metadata").is_file():
        return dcp_dir
    nested = dcp_dir / ACCELERATE_FSDP_MODEL_DIR
    if (nested / ".metadata").is_file():
        return nested
    raise NoCheckpointError(
        f"No torch.distributed.checkpoint model state in {dcp_dir}: expected {dcp_dir / '.metadata'} or "
        f"{nested / '.metadata'} (Accelerate's FSDP SHARDED_STATE_DICT layout)."
    )


def _dcp_tensors(metadata: Any, directory: Path, prefix: str) -> dict[str, Any]:
    """``fqn -> TensorStorageMetadata`` of the model tensors, after checking every chunk has a storage record."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = {fqn: entry for fqn, entry in metadata.state_dict_metadata.items() if fqn.startswith(prefix)}
    if not entries:
        sample = examples(sorted(metadata.state_dict_metadata))
        raise CheckpointIntegrityError(
            f"{directory} holds no entries under the prefix {prefix!r} (it has: {sample or 'nothing'}). Pass the model "
            "DCP directory, or the prefix its keys use."
        )
    not_tensors = sorted(fqn for fqn, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if not_tensors:
        raise CheckpointIntegrityError(
            f"{directory} stores {len(not_tensors)} non-tensor model entr(ies) ({examples(not_tensors)}), which "
            "safetensors cannot hold: export those weights another way."
        )
    # Payload files and ranges were checked with the metadata; here: every chunk of every tensor is recorded.
    stored = {(index.fqn, tuple(index.offset)) for index in metadata.storage_data}
    problems = [
        f"{fqn}: chunk at {list(chunk.offsets)} has no storage record"
        for fqn, entry in entries.items()
        for chunk in entry.chunks
        if (fqn, tuple(chunk.offsets)) not in stored
    ]
    if problems:
        raise CheckpointIntegrityError(
            f"DCP checkpoint {directory} is incomplete or corrupt: {examples(problems)}. Use a complete checkpoint."
        )
    return entries


class _DCPSingleProcessLoader:
    """Loads chosen tensors of a DCP directory on one process, with metadata read by :func:`_read_dcp_metadata`."""

    def __init__(self, directory: Path, metadata: Any) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        class _VerifiedReader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # never pickle.load
                return metadata

        self._reader = _VerifiedReader(directory)
        self._directory = directory

    def load(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill ``targets`` (fqn -> preallocated tensor) in place; chunks are narrowed into place by DCP."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(targets, storage_reader=self._reader, planner=DefaultLoadPlanner(), no_dist=True)
            except CheckpointException as exc:  # a BaseException: catch it deliberately
                raise CheckpointIntegrityError(f"Reading DCP checkpoint {self._directory} failed: {exc}") from None


def config_layout(config: Any) -> str:
    """The export layout a parsed config asks for: ``"peft"`` for a PEFT ``adapter_config.json`` (it has
    ``peft_type``); ``"transformers"`` when it has ``model_type`` (every transformers config records it) and not
    Diffusers' ``_class_name``; else ``"diffusers"`` (the layout every export had before there was a choice)."""
    if isinstance(config, dict) and "peft_type" in config:
        return PEFT
    if isinstance(config, dict) and "model_type" in config and "_class_name" not in config:
        return TRANSFORMERS
    return DIFFUSERS


def _config_source_writer(source: Any, layout: str = DIFFUSERS
                          ) -> tuple[Callable[[Path], None], dict[str, tuple[int, ...]] | None]:
    """How to write ``config.json``, and the expected shapes when ``source`` is a model."""
    if isinstance(source, (str, os.PathLike)):
        config = Path(source)
        config = config / CONFIG_NAME if config.is_dir() else config
        try:
            text = config.read_text()
            json.loads(text)
        except (OSError, ValueError) as exc:
            raise CheckpointConfigurationError(
                f"Cannot use {config} as the export's {CONFIG_NAME} ({exc}): pass the model, or a directory/file "
                "holding its JSON config."
            ) from None

        def copy_config(directory: Path) -> None:
            (directory / CONFIG_NAME).write_text(text)

        return copy_config, None
    expected = shapes(source.state_dict()) if isinstance(source, torch.nn.Module) else None
    return config_writer(source, layout), expected


def export_dcp_to_diffusers(
    dcp_dir: PathLike,
    model_or_config_source: Any,
    output_dir: PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    dtype: torch.dtype | None = None,
    prefix: str = DCP_MODEL_PREFIX,
    sign_key: PathLike | None = None,
) -> Path:
    """Export a sharded training checkpoint's model (DCP) as a Diffusers sharded-safetensors directory, offline.

    ``dcp_dir``: a ``torch.distributed.checkpoint`` directory (``.metadata`` + ``*.distcp``), or a checkpoint
    directory containing Accelerate's ``pytorch_model_fsdp_0/``; a protected checkpoint directory is verified
    against its ``checkpoint_manifest.json`` first (an altered or incomplete one is refused). Keys under
    ``prefix`` (Accelerate saves ``{"model": state_dict}``, hence ``"model."``) are exported with the prefix
    removed; other entries are ignored.
    ``model_or_config_source``: the model (a ``torch.nn.Module`` with ``save_config``; on the meta device is fine),
    against whose ``state_dict()`` every key and shape is validated before anything is written, or a path to a
    config directory/file that is copied as ``config.json`` (then only the checkpoint's own consistency is checked).

    Runs on one process with no process group; chunks written by any number of ranks are reassembled by DCP.
    Memory: one shard of tensors at a time (about two with ``dtype``: stored and cast copies). Output layout, dtype
    rule, atomic publish and ``sign_key`` (a ``model.sig`` OpenSSF model_signing verifies) are those of
    :func:`save_diffusers_state_dict`. ``.metadata`` is read with a restricted unpickler, tensors with
    ``weights_only=True``.
    """
    return _export_dcp(dcp_dir, model_or_config_source, output_dir, max_shard_size, dtype, prefix, DIFFUSERS, sign_key)


def export_dcp_to_transformers(
    dcp_dir: PathLike,
    model_or_config_source: Any,
    output_dir: PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    dtype: torch.dtype | None = None,
    prefix: str = DCP_MODEL_PREFIX,
    sign_key: PathLike | None = None,
) -> Path:
    """Export a sharded training checkpoint's model (DCP) under the file names transformers' ``from_pretrained``
    loads: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``
    when it takes more than one shard of ``max_shard_size``; plus ``config.json``.

    As :func:`export_dcp_to_diffusers` in every other respect (verification, validation, memory, dtype, atomic
    publish, ``sign_key``), except that a model given as ``model_or_config_source`` is a transformers ``PreTrainedModel``, whose
    ``config.save_pretrained`` writes ``config.json``.
    """
    return _export_dcp(dcp_dir, model_or_config_source, output_dir, max_shard_size, dtype, prefix, TRANSFORMERS,
                       sign_key)


def _export_dcp(dcp_dir: PathLike, model_or_config_source: Any, output_dir: PathLike, max_shard_size: int | str,
                dtype: torch.dtype | None, prefix: str, layout: str, sign_key: PathLike | None) -> Path:
    where = Path(output_dir)
    check_layout(layout)
    check_dtype(dtype)
    shard_size = resolve_shard_size(max_shard_size)
    signer = export_signer(sign_key)
    directory = _locate_dcp(Path(dcp_dir))
    metadata = _read_dcp_metadata(directory)
    entries = _dcp_tensors(metadata, directory, prefix)
    write_config, expected = _config_source_writer(model_or_config_source, layout)
    names = {fqn[len(prefix):]: fqn for fqn in entries}
    lora = peft_entries(names)
    if lora:
        raise CheckpointConfigurationError(
            f"{directory} holds a PEFT model's state ({examples(lora)}), which {layout} from_pretrained cannot load "
            "as the model: export its LoRA adapter with export_dcp_to_peft (accelerate-txn export --format peft) and "
            "load it with PeftModel.from_pretrained over the base model."
        )
    if expected is not None:
        check_matches_model({name: tuple(entries[fqn].size) for name, fqn in names.items()}, expected, directory)
    sizes = [
        (name, entries[fqn].size.numel() * output_dtype(dtype, entries[fqn].properties.dtype).itemsize)
        for name, fqn in names.items()
    ]
    plan = ShardPlan.build(sizes, shard_size, where, layout)
    loader = _DCPSingleProcessLoader(directory, metadata)

    def fetch(keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        targets = {
            names[key]: torch.empty(tuple(entries[names[key]].size), dtype=entries[names[key]].properties.dtype)
            for key in keys
        }
        loader.load(targets)
        return {key: targets[names[key]] for key in keys}

    def write(staging: Path) -> None:
        write_config(staging)
        write_shards(staging, plan, fetch, dtype)

    return publish_export(output_dir, write, signer)


def export_dcp_to_peft(
    dcp_dir: PathLike,
    adapter_config_source: Any,
    output_dir: PathLike,
    *,
    adapter_name: str = "default",
    dtype: torch.dtype | None = None,
    prefix: str = DCP_MODEL_PREFIX,
    sign_key: PathLike | None = None,
) -> Path:
    """Export the LoRA adapter of a PEFT model's sharded training checkpoint as PEFT's ``save_pretrained`` writes it:
    ``adapter_model.safetensors`` (one file: PEFT loads no shards) and ``adapter_config.json``, which
    ``peft.PeftModel.from_pretrained(base_model, output_dir)`` loads.

    ``dcp_dir``: as for :func:`export_dcp_to_diffusers` (a protected checkpoint is verified against its manifest
    first). Its model entries may be the adapter alone under PEFT's saved names (Trainer under FSDP2) or the whole
    PEFT model under its live names (Trainer under FSDP1 with this library): then only the entries of
    ``adapter_name`` are read, renamed as PEFT saves them (``...lora_A.default.weight`` -> ``...lora_A.weight``).
    ``adapter_config_source``: ``adapter_config.json`` (or its directory; a protected Trainer checkpoint of a PEFT
    model carries one), a PEFT config such as ``LoraConfig``, or the PEFT model.

    Refuses with :class:`CheckpointConfigurationError` an adapter that is not LoRA, a LoRA training biases, entries
    of the adapter that are no LoRA parameter (``modules_to_save``, trainable tokens) and a missing ``adapter_name``
    (naming the adapters there are); with :class:`CheckpointIntegrityError` a checkpoint holding no adapter (a native
    FSDP1 Trainer save of a PEFT model holds no tensor at all). Memory: the adapter's tensors only; dtype rule,
    atomic publish and ``sign_key`` are those of :func:`save_diffusers_state_dict`.
    """
    check_dtype(dtype)
    signer = export_signer(sign_key)
    config, write_config = read_adapter_config(adapter_config_source, adapter_name)
    check_adapter_config(config, str(dcp_dir))
    directory = _locate_dcp(Path(dcp_dir))
    metadata = _read_dcp_metadata(directory)
    if not metadata.state_dict_metadata:
        raise CheckpointIntegrityError(
            f"{directory} holds no tensor: nothing to export. A native FSDP1 Trainer save of a PEFT model writes none "
            "(Trainer saves it adapter_only, and the adapter's names do not match under FSDP1); a Trainer protected by "
            "accelerate_txn saves the whole model there. Export from such a checkpoint."
        )
    entries = _dcp_tensors(metadata, directory, prefix)
    names = adapter_entries([fqn[len(prefix):] for fqn in entries], adapter_name, str(directory))
    stored = {saved: prefix + name for saved, name in names.items()}
    sizes = [(saved, entries[fqn].size.numel() * output_dtype(dtype, entries[fqn].properties.dtype).itemsize)
             for saved, fqn in stored.items()]
    plan = ShardPlan.build(sizes, sum(size for _name, size in sizes) or 1, Path(output_dir), PEFT)
    loader = _DCPSingleProcessLoader(directory, metadata)

    def fetch(keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        targets = {stored[key]: torch.empty(tuple(entries[stored[key]].size), dtype=entries[stored[key]].properties.dtype)
                   for key in keys}
        loader.load(targets)
        return {key: targets[stored[key]] for key in keys}

    def write(staging: Path) -> None:
        write_config(staging)
        if not (staging / ADAPTER_CONFIG_NAME).is_file():
            raise CheckpointConfigurationError(f"The adapter configuration's save_pretrained wrote no {ADAPTER_CONFIG_NAME}.")
        write_shards(staging, plan, fetch, dtype)

    return publish_export(output_dir, write, signer)
