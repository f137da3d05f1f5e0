"""Model-weight I/O: bounded, atomic Diffusers/Hugging Face sharded-safetensors export and validated loading.

Guarantees (each is pinned by ``tests/test_weights.py``):

* **Validate everything, then change anything.** Every loader reads the safetensors headers (or, for ``.bin``
  files, the ``weights_only`` payload) of every file first and checks keys, shapes, duplicates and the index
  against the model before a single parameter is touched. Partial checkpoints and adapter (LoRA) files are
  rejected with a message naming what is missing / unexpected.
* **Bounded memory.** Exports consume the state dict shard by shard; loaders read one file at a time; the DCP
  export materialises one shard at a time. Peak extra memory is about one shard, not the model.
* **Atomic export.** An export is written into a hidden staging sibling (``accelerate_txn._staging``) and
  published by a rename. Re-exporting over an earlier export swaps the two directories with one atomic
  ``renameat2(RENAME_EXCHANGE)`` on Linux, so a reader or a crash sees either the complete old export or the
  complete new one, never a directory whose index names missing shards.
* **Nothing read is unpickled as arbitrary objects.** ``.bin`` files go through ``torch.load(weights_only=True)``;
  DCP ``.metadata`` goes through a restricted unpickler (:func:`_read_dcp_metadata`).

Callers: one process (rank 0 after gathering the full state dict, or an offline job). Nothing here needs a
process group.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import pickle
import shutil
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ._manifest import check_dcp_payloads, read_manifest, sha256_file, verify_manifest
from ._staging import DirectoryLock, StagedDirectory, fsync_path, fsync_tree, new_id, staging_leftovers
from .errors import (
    CheckpointConfigurationError,
    CheckpointExistsError,
    CheckpointIntegrityError,
    NoCheckpointError,
)

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

CONFIG_NAME = "config.json"
SAFETENSORS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SAFETENSORS_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
BIN_INDEX_NAME = "diffusion_pytorch_model.bin.index.json"
BIN_WEIGHTS_NAME = "diffusion_pytorch_model.bin"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
DCP_MODEL_PREFIX = "model."
#: The model directory Accelerate's FSDP ``SHARDED_STATE_DICT`` save writes inside a checkpoint.
ACCELERATE_FSDP_MODEL_DIR = "pytorch_model_fsdp_0"

_EXAMPLES = 5  # how many keys an error message lists before "and N more"
_ADAPTER_MARKERS = ("lora", "lokr", "loha", "adapter", ".alpha")


class FingerprintEntry(TypedDict):
    """One file of a :func:`checkpoint_fingerprint`: its name relative to the source, size and SHA-256."""

    name: str
    size: int
    sha256: str


# --------------------------------------------------------------------------------------------- small helpers


def _shard_name(index: int, count: int) -> str:
    return f"diffusion_pytorch_model-{index:05d}-of-{count:05d}.safetensors"


def _examples(keys: list[str]) -> str:
    shown = ", ".join(keys[:_EXAMPLES])
    return f"{shown}, and {len(keys) - _EXAMPLES} more" if len(keys) > _EXAMPLES else shown


def _strip(key: str, prefix: str | None) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def _shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}


def _resolve_shard_size(max_shard_size: int | str) -> int:
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


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointConfigurationError(
            f"dtype={dtype!r} is not a floating torch.dtype: pass e.g. torch.bfloat16, or None to keep each tensor's "
            "dtype (integer and boolean tensors are never cast)."
        )


def _output_dtype(dtype: torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    """The dtype a tensor is exported in: ``dtype`` for floating tensors when given, else unchanged."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def _for_safetensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """CPU, contiguous, cast per the dtype rule; clone tensors sharing storage (tied weights) within one shard.

    safetensors refuses aliased tensors in one file; a tied weight is therefore written twice, which loads back
    exactly (``load_state_dict`` copies into the tied parameter twice).
    """
    ready: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in tensors.items():
        value = value.detach().to(device="cpu", dtype=_output_dtype(dtype, value.dtype)).contiguous()
        pointer = value.untyped_storage().data_ptr()
        if value.numel() and pointer in storages:
            value = value.clone()
        storages.add(value.untyped_storage().data_ptr())
        ready[key] = value
    return ready


# --------------------------------------------------------------------------------------------- shard planning


@dataclass(frozen=True)
class _ShardPlan:
    """Which keys go into which shard file, decided from sizes alone before anything is written."""

    shards: tuple[tuple[str, ...], ...]
    total_size: int

    @classmethod
    def build(cls, sizes: list[tuple[str, int]], max_shard_size: int, where: Path) -> _ShardPlan:
        """Greedy, in key order. Reports every tensor larger than ``max_shard_size`` at once."""
        too_big = [f"{key} ({size} bytes)" for key, size in sizes if size > max_shard_size]
        if too_big:
            raise CheckpointConfigurationError(
                f"Cannot export to {where}: {len(too_big)} tensor(s) exceed max_shard_size={max_shard_size} bytes "
                f"({_examples(too_big)}). A tensor cannot be split across shards: raise max_shard_size to at least "
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
        return cls(tuple(tuple(keys) for keys in shards), sum(size for _key, size in sizes))

    def files(self) -> Iterator[tuple[str, tuple[str, ...]]]:
        for number, keys in enumerate(self.shards, 1):
            yield _shard_name(number, len(self.shards)), keys

    def index(self) -> dict[str, Any]:
        weight_map = {key: name for name, keys in self.files() for key in keys}
        return {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}


def _write_shards(
    staging: Path,
    plan: _ShardPlan,
    fetch: Callable[[tuple[str, ...]], dict[str, torch.Tensor]],
    dtype: torch.dtype | None,
) -> None:
    """Write every shard of ``plan`` and the index into ``staging``; ``fetch(keys)`` yields one shard's tensors.

    Only one shard's tensors are referenced here at a time, which is what bounds the export's memory.
    """
    for filename, keys in plan.files():
        tensors = _for_safetensors(fetch(keys), dtype)
        save_file(tensors, staging / filename, metadata={"format": "pt"})
        del tensors
    (staging / SAFETENSORS_INDEX_NAME).write_text(json.dumps(plan.index(), indent=2) + "\n")


# --------------------------------------------------------------------------------------------- atomic publish

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}
_EXPORT_FILES = (CONFIG_NAME, SAFETENSORS_INDEX_NAME, BIN_INDEX_NAME)


def _exchange_directories(first: Path, second: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; ``False`` where unsupported.

    Generic: could live in ``_staging.py``. Unsupported means a non-Linux OS, an old libc or kernel, or a
    filesystem without exchange support; the caller then falls back to two renames (see :func:`_swap_in`).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(code)}", str(first), None, str(second))


def _aside_prefix(final: Path) -> str:
    # Deliberately not the staging pattern: `remove_leftovers` (run by any writer of this parent) must never
    # delete the only complete copy of an export.
    return f".{final.name}.replaced-"


def _recover_interrupted_export(final: Path) -> None:
    """Undo what a killed export of ``final`` left behind. Call only while holding ``DirectoryLock(parent)``.

    * ``final`` missing but set aside (a kill between the two renames of the fallback swap): rename it back.
    * Set-aside copies next to a present ``final``: the swap completed; delete them.
    * Staging directories of ``final``: a writer died before publishing (the lock proves it is dead); delete.
    """
    parent = final.parent
    asides = sorted(entry for entry in parent.iterdir() if entry.name.startswith(_aside_prefix(final)))
    if asides and not final.exists():
        logger.warning("Restoring %s from %s: an export was killed while swapping directories", final, asides[-1])
        os.rename(asides.pop(), final)
        fsync_path(parent)
    for leftover in asides:
        shutil.rmtree(leftover)
    for leftover, _run in staging_leftovers(parent):
        if leftover.name.startswith(f".{final.name}.staging-"):
            logger.warning("Removing %s: staging directory of an export that did not finish", leftover)
            shutil.rmtree(leftover)


def _check_replaceable(final: Path) -> None:
    """Refuse to replace anything that is not a previous weight export (never delete a user's other files)."""
    if final.is_symlink() or not final.is_dir():
        raise CheckpointExistsError(
            f"Refusing to export to {final}: it exists and is not a directory (or is a symlink). Choose another "
            "output_dir, or pass the real directory."
        )
    foreign = sorted(
        entry.name + ("/" if entry.is_dir() else "")
        for entry in final.iterdir()
        if entry.is_dir() or not (entry.name in _EXPORT_FILES or entry.name.startswith("diffusion_pytorch_model"))
    )
    if foreign:
        raise CheckpointExistsError(
            f"Refusing to replace {final}: besides model weights it holds {_examples(foreign)}, which a re-export "
            "would delete. Move them away or export to another directory."
        )


def _swap_in(staged: StagedDirectory) -> None:
    """Replace the published ``staged.final`` by the complete, fsynced ``staged.staging``.

    Atomic exchange where supported; afterwards the staging path holds the old export, which is deleted. The
    fallback renames the old export aside first: a kill between the two renames leaves the complete old export
    under ``.NAME.replaced-*``, which the next export of ``NAME`` renames back (:func:`_recover_interrupted_export`).
    """
    final, parent = staged.final, staged.final.parent
    if _exchange_directories(staged.staging, final):
        old = staged.staging  # the staging path now holds the previous export
    else:
        old = parent / f"{_aside_prefix(final)}{staged.txid}"
        os.rename(final, old)
        fsync_path(parent)
        try:
            os.rename(staged.staging, final)
        except BaseException:
            os.rename(old, final)  # put the previous export back before reporting the failure
            raise
    fsync_path(parent)
    # The new export is published: failing to delete the old one must not turn success into an error.
    try:
        shutil.rmtree(old)
    except OSError as exc:
        logger.warning("Published %s but could not remove the previous export %s: %s", final, old, exc)


def _publish_export(output_dir: PathLike, write: Callable[[Path], None]) -> Path:
    """Run ``write(staging)`` and publish the staged directory onto ``output_dir`` atomically.

    Holds ``DirectoryLock(parent)`` throughout, so two exporters never interleave (the second raises
    :class:`~accelerate_txn.errors.CheckpointLockedError`). The previous export, if any, stays untouched until the
    new one is complete and fsynced. On any failure the staging directory is removed and the old export remains.
    """
    final = Path(output_dir).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    with DirectoryLock(final.parent):
        _recover_interrupted_export(final)
        replacing = final.exists() or final.is_symlink()
        if replacing:
            _check_replaceable(final)
        # Not `StagedDirectory.create()`: it refuses an existing final directory, and here the previous export
        # must stay in place until the swap.
        staged = StagedDirectory(final, new_id())
        staged.staging.mkdir()
        try:
            write(staged.staging)
            if replacing:
                fsync_tree(staged.staging)
                _swap_in(staged)
            else:
                staged.publish()
        except BaseException:
            staged.discard()
            raise
    logger.info("Published weight export %s", final)
    return final


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
            f"names ({_examples(bad)}). Pass a full state dict (not meta tensors, sparse tensors or nested dicts)."
        )


def _config_writer(model: Any) -> Callable[[Path], None]:
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

    Raises :class:`CheckpointConfigurationError` for an empty dict, non-tensor values, a bad ``dtype`` or a tensor
    larger than ``max_shard_size``; :class:`CheckpointExistsError` if ``output_dir`` holds foreign files;
    :class:`CheckpointLockedError` if another writer is exporting into the same parent directory.
    Returns ``output_dir`` as an absolute path. Call it on one process (rank 0, after gathering).
    """
    where = Path(output_dir)
    _check_dtype(dtype)
    shard_size = _resolve_shard_size(max_shard_size)
    _check_state_dict(state_dict, where)
    write_config = _config_writer(model)
    sizes = [(key, value.numel() * _output_dtype(dtype, value.dtype).itemsize) for key, value in state_dict.items()]
    plan = _ShardPlan.build(sizes, shard_size, where)

    def write(staging: Path) -> None:
        write_config(staging)  # first: a failing save_config must not cost the caller's state dict
        _write_shards(staging, plan, lambda keys: {key: state_dict.pop(key) for key in keys}, dtype)

    return _publish_export(output_dir, write)


# --------------------------------------------------------------------------------------------- locating files


@dataclass(frozen=True)
class _WeightFiles:
    """The weight files of one checkpoint and, for an indexed directory, its index."""

    source: Path
    files: tuple[Path, ...]
    index: Path | None = None
    weight_map: Mapping[str, str] | None = None


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index file, validated: non-empty, ``str -> plain file name`` only."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointIntegrityError(
            f"Index {index} is unreadable or has no 'weight_map' ({exc!r}): the export is corrupt; re-export it."
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointIntegrityError(f"Index {index} has an empty or malformed weight_map: re-export the weights.")
    bad = sorted(
        f"{key!r} -> {name!r}"
        for key, name in weight_map.items()
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name
    )
    if bad:
        raise CheckpointIntegrityError(
            f"Index {index} maps tensors to files outside its directory or to invalid names ({_examples(bad)}): "
            "an index may only name shard files next to it. Re-export the weights."
        )
    return weight_map


def _indexed(directory: Path, index_name: str) -> _WeightFiles | None:
    """The shards an index in ``directory`` names, all present; ``None`` without that index."""
    index = directory / index_name
    if not index.is_file():
        return None
    weight_map = _read_index(index)
    files = tuple(directory / name for name in sorted(set(weight_map.values())))
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CheckpointIntegrityError(
            f"Index {index} names {len(missing)} shard(s) that do not exist ({_examples(missing)}): the export is "
            "incomplete (interrupted or partly copied). Re-export or re-copy the whole directory."
        )
    return _WeightFiles(directory, files, index, weight_map)


def _locate_weights(path: Path, *, any_safetensors: bool = False) -> _WeightFiles:
    """Find a checkpoint's weight files: a single file, or a Diffusers directory (index first, then one file).

    Directory precedence: safetensors index, ``diffusion_pytorch_model.safetensors``, (with ``any_safetensors``)
    every ``*.safetensors`` in the directory, ``.bin`` index, ``diffusion_pytorch_model.bin``. An index that names
    a missing shard raises :class:`CheckpointIntegrityError`; no weights at all raises :class:`NoCheckpointError`.
    """
    if not path.exists():
        raise NoCheckpointError(f"No checkpoint at {path}: the path does not exist.")
    if not path.is_dir():
        return _WeightFiles(path, (path,))
    if found := _indexed(path, SAFETENSORS_INDEX_NAME):
        return found
    if (path / SAFETENSORS_WEIGHTS_NAME).is_file():
        return _WeightFiles(path, (path / SAFETENSORS_WEIGHTS_NAME,))
    if any_safetensors and (files := tuple(sorted(file for file in path.glob("*.safetensors") if file.is_file()))):
        return _WeightFiles(path, files)
    if found := _indexed(path, BIN_INDEX_NAME):
        return found
    if (path / BIN_WEIGHTS_NAME).is_file():
        return _WeightFiles(path, (path / BIN_WEIGHTS_NAME,))
    raise NoCheckpointError(
        f"No model weights in {path}: expected {SAFETENSORS_INDEX_NAME} with its shards, {SAFETENSORS_WEIGHTS_NAME}, "
        f"{BIN_INDEX_NAME} or {BIN_WEIGHTS_NAME}. Pass the directory save_diffusers_state_dict wrote, or a weight file."
    )


def safetensor_checkpoint_files(path: PathLike) -> list[str] | None:
    """The safetensors files holding a checkpoint's weights, in load order; ``None`` if it has none.

    ``path`` is a ``.safetensors`` file or a directory: its index's shards, else
    ``diffusion_pytorch_model.safetensors``, else every ``*.safetensors`` file in it (sorted). A path that does not
    exist raises :class:`NoCheckpointError`; an index naming a missing shard raises
    :class:`CheckpointIntegrityError`. Only file names are inspected here, not contents.
    """
    path = Path(path)
    if not path.exists():
        raise NoCheckpointError(f"No checkpoint at {path}: the path does not exist.")
    if not path.is_dir():
        return [str(path)] if path.suffix == ".safetensors" else None
    try:
        weights = _locate_weights(path, any_safetensors=True)
    except NoCheckpointError:
        return None
    if weights.files[0].suffix != ".safetensors":
        return None
    return [str(file) for file in weights.files]


# --------------------------------------------------------------------------------------------- reading files


def _load_bin(path: Path, state_dict_key: str | None = None) -> dict[str, torch.Tensor]:
    """A PyTorch ``.bin``/``.pt`` state dict, read with ``weights_only=True`` (memory-mapped when possible).

    Unwraps ``{"state_dict": ...}`` and then ``state_dict_key`` when present, and insists on a flat name -> tensor
    dict.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        raise CheckpointIntegrityError(
            f"{path} holds objects other than tensors and plain containers, which torch.load(weights_only=True) "
            f"refuses to unpickle ({str(exc).splitlines()[0]}). Convert it to safetensors from a trusted environment."
        ) from None
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointIntegrityError(f"{path} is not a readable PyTorch state dict ({exc}): re-export it.") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if state_dict_key is not None and isinstance(state, dict) and isinstance(state.get(state_dict_key), dict):
        state = state[state_dict_key]
    if not isinstance(state, dict):
        raise CheckpointIntegrityError(f"{path} holds a {type(state).__name__}, not a state dict of tensors.")
    bad = sorted(repr(key) for key, value in state.items() if not (isinstance(key, str) and torch.is_tensor(value)))
    if bad:
        raise CheckpointIntegrityError(
            f"{path} is not a flat state dict: {_examples(bad)} are not name -> tensor entries. Pass state_dict_key "
            "to select the nested model weights, or a weights-only file."
        )
    return state


def _file_shapes(path: Path, state_dict_key: str | None = None) -> dict[str, tuple[int, ...]]:
    """Key -> shape of one weight file, from the safetensors header (no tensor payload is read)."""
    if path.suffix != ".safetensors":
        return _shapes(_load_bin(path, state_dict_key))
    try:
        with safe_open(str(path), framework="pt", device="cpu") as reader:
            return {key: tuple(reader.get_slice(key).get_shape()) for key in reader.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointIntegrityError(
            f"{path} is not a readable safetensors file ({exc}): it is truncated or corrupt. Re-export it."
        ) from None


def _read_file(path: Path, state_dict_key: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one weight file, on CPU."""
    if path.suffix != ".safetensors":
        return _load_bin(path, state_dict_key)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointIntegrityError(f"{path} could not be read ({exc}): re-export it.") from None


def _scan(
    weights: _WeightFiles, *, strip_prefix: str | None = None, state_dict_key: str | None = None
) -> dict[str, tuple[int, ...]]:
    """Key (``strip_prefix`` removed) -> shape over all files, validated: no duplicates, index matches exactly.

    Reads headers only (``.bin`` files are memory-mapped). Every problem is reported in one error.
    """
    found: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    stored: set[str] = set()
    duplicates: list[str] = []
    misplaced: list[str] = []
    weight_map = weights.weight_map
    for file in weights.files:
        for source_key, shape in _file_shapes(file, state_dict_key).items():
            key = _strip(source_key, strip_prefix)
            if key in found:
                duplicates.append(f"{key} (in {origin[key]} and {file.name})")
                continue
            if weight_map is not None and weight_map.get(source_key) != file.name:
                misplaced.append(f"{source_key} (in {file.name}, index says {weight_map.get(source_key) or 'nothing'})")
            found[key], origin[key] = shape, file.name
            stored.add(source_key)
    problems = []
    if duplicates:
        problems.append(f"{len(duplicates)} tensor(s) stored twice: {_examples(duplicates)}")
    if misplaced:
        problems.append(f"{len(misplaced)} tensor(s) not where the index {weights.index} says: {_examples(misplaced)}")
    unbacked = sorted(set(weight_map or ()) - stored)
    if unbacked:
        problems.append(f"the index lists {len(unbacked)} tensor(s) that no shard holds: {_examples(unbacked)}")
    if not found:
        problems.append("it holds no tensors")
    if problems:
        raise CheckpointIntegrityError(
            f"Checkpoint {weights.source} is inconsistent: {'; '.join(problems)}. The export is partial, mixed with "
            "another export, or corrupt: re-export it."
        )
    return found


def _looks_like_adapter(keys: list[str]) -> bool:
    return any(marker in key.lower() for key in keys for marker in _ADAPTER_MARKERS)


def _check_matches_model(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], source: Path
) -> None:
    """Raise :class:`CheckpointIntegrityError` unless ``found`` has exactly the model's keys and shapes."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    mismatched = sorted(
        f"{key}: checkpoint {list(found[key])} vs model {list(expected[key])}"
        for key in expected.keys() & found.keys()
        if tuple(found[key]) != tuple(expected[key])
    )
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} of {len(expected)} model tensor(s): {_examples(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensor(s): {_examples(unexpected)}")
    if mismatched:
        parts.append(f"{len(mismatched)} shape mismatch(es): {_examples(mismatched)}")
    if unexpected and _looks_like_adapter(unexpected):
        advice = (
            "It looks like an adapter (LoRA) file, not full model weights: load it with the adapter loader "
            "(e.g. load_lora_weights) or pass the full weights."
        )
    elif missing and not (unexpected or mismatched):
        advice = "The checkpoint is partial (an interrupted export or a subset): pass a complete export."
    else:
        advice = "Pass weights exported from this model architecture and config."
    raise CheckpointIntegrityError(f"Checkpoint {source} does not match the model: {'; '.join(parts)}. {advice}")


# --------------------------------------------------------------------------------------------- loading


def read_diffusers_state_dict(directory: PathLike) -> dict[str, torch.Tensor]:
    """Read a complete Diffusers checkpoint (sharded or single file) into one CPU state dict.

    Validates the index and every header (duplicates, index entries, missing shards) before reading any payload.
    The result holds the whole model: use :func:`load_model_checkpoint` to load shard by shard into a model.
    """
    weights = _locate_weights(Path(directory))
    _scan(weights)
    state: dict[str, torch.Tensor] = {}
    for file in weights.files:
        state.update(_read_file(file))
    return state


def load_model_checkpoint(model: torch.nn.Module, checkpoint: PathLike) -> tuple[list[str], list[str]]:
    """Load a full local checkpoint into ``model``, one file at a time, after validating all of it.

    ``checkpoint``: a ``.safetensors``/``.bin`` file or a Diffusers directory. Every key, shape, duplicate and index
    entry is checked against ``model.state_dict()`` before any parameter changes; a partial or adapter checkpoint
    raises :class:`CheckpointIntegrityError` and leaves ``model`` untouched. Loading goes through
    ``model.load_state_dict`` so model-specific load hooks run. Returns ``(missing_keys, unexpected_keys)``, both
    empty after a successful validation (kept for callers that expect ``load_state_dict``'s result).
    """
    weights = _locate_weights(Path(checkpoint))
    found = _scan(weights)
    expected = _shapes(model.state_dict())
    _check_matches_model(found, expected, weights.source)
    loaded: set[str] = set()
    unexpected: set[str] = set()
    for file in weights.files:
        tensors = _read_file(file)
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
    selects a nested dict in a ``.bin`` file. Floating source tensors are rounded through ``weight_dtype`` (when not
    ``None``) and copied into each destination tensor, which keeps its own dtype and device. All names and shapes are
    validated first: on any mismatch :class:`CheckpointIntegrityError` is raised and ``model`` is untouched.
    """
    _check_dtype(weight_dtype)
    weights = _locate_weights(Path(path), any_safetensors=True)
    found = _scan(weights, strip_prefix=strip_prefix, state_dict_key=state_dict_key)
    destination = model.state_dict()
    _check_matches_model(found, _shapes(destination), weights.source)
    with torch.no_grad():
        for key, value in _iter_tensors(weights.files, state_dict_key):
            if weight_dtype is not None and value.is_floating_point():
                value = value.to(weight_dtype)
            destination[_strip(key, strip_prefix)].copy_(value)


def _iter_tensors(files: tuple[Path, ...], state_dict_key: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every tensor; safetensors files are read one tensor at a time."""
    for file in files:
        if file.suffix != ".safetensors":
            yield from _load_bin(file, state_dict_key).items()
            continue
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                yield key, reader.get_tensor(key)


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

    ``model_cls`` is a Diffusers ``ModelMixin`` subclass or any class with the same ``load_config`` /
    ``from_config`` / ``from_pretrained`` methods; ``model_name`` (+ ``subfolder``) is the base model whose config
    defines the expected keys and shapes. ``checkpoint`` is either a directory with ``config.json`` (loaded with
    ``from_pretrained``; base weights are never read) or a single weight file (the base model is loaded with
    ``from_pretrained`` for its config and precision rules, then every tensor is replaced). Partial and adapter
    checkpoints raise :class:`CheckpointIntegrityError` before any weights are loaded.
    """
    if checkpoint is None:
        raise CheckpointConfigurationError(
            "A full model checkpoint is required: pass the directory written by save_diffusers_state_dict or a "
            "full .safetensors/.bin file (adapters are loaded with the adapter loader instead)."
        )
    checkpoint = Path(checkpoint)
    config = model_cls.load_config(model_name, subfolder=subfolder)
    expected = _shapes(_meta_model(model_cls, config).state_dict())
    if checkpoint.is_dir() and not (checkpoint / CONFIG_NAME).is_file():
        raise CheckpointIntegrityError(
            f"{checkpoint} has no {CONFIG_NAME}: it is not a complete Diffusers model directory. Export it with "
            "save_diffusers_state_dict (which writes the config) or pass a single weight file."
        )
    weights = _locate_weights(checkpoint)
    _check_matches_model(_scan(weights), expected, weights.source)
    if checkpoint.is_dir():
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


def _public_config(model: Any) -> str:
    config = getattr(model, "config", None)
    items = dict(config) if isinstance(config, Mapping) else {}
    public = {key: value for key, value in items.items() if not key.startswith("_")}
    return json.dumps(public, sort_keys=True, default=str)


def is_complete_diffusers_checkpoint(model_cls: Any, path: PathLike, base_config: Mapping[str, Any]) -> bool:
    """Whether ``path`` is a complete safetensors Diffusers export of a ``model_cls`` built from ``base_config``.

    True only if: ``path`` is a directory with ``config.json`` whose normalised config (private ``_`` keys
    ignored) equals ``base_config``'s, its safetensors files are consistent with their index, and their headers hold
    exactly the model's keys and shapes. Reads headers only; never raises for an incomplete checkpoint.
    """
    path = Path(path)
    if not path.is_dir() or not (path / CONFIG_NAME).is_file():
        return False
    try:
        weights = _locate_weights(path, any_safetensors=True)
        if weights.files[0].suffix != ".safetensors":
            return False
        found = _scan(weights)
    except (CheckpointIntegrityError, NoCheckpointError):
        return False
    expected_model = _meta_model(model_cls, base_config)
    candidate_model = _meta_model(model_cls, model_cls.load_config(path))
    return (
        _public_config(expected_model) == _public_config(candidate_model)
        and found == _shapes(expected_model.state_dict())
    )


# --------------------------------------------------------------------------------------------- fingerprint


def _hash_file(file: Path) -> tuple[int, str]:
    """``(size, sha256)`` of ``file``, streamed; raises if the file changes while it is read."""
    before = file.stat()
    sha256 = sha256_file(file)
    after = file.stat()
    identity = ("st_ino", "st_dev", "st_size", "st_mtime_ns", "st_ctime_ns")
    if any(getattr(before, field) != getattr(after, field) for field in identity):
        raise CheckpointIntegrityError(
            f"{file} changed while it was being hashed: the model source is not frozen. Stop whatever writes it "
            "(an export, a sync, a download) and fingerprint it again."
        )
    return after.st_size, sha256


def checkpoint_fingerprint(path: PathLike) -> list[FingerprintEntry]:
    """Content identity of a frozen model source: one entry per file, sorted by name.

    A single file is named ``"weights"``; a Diffusers directory contributes its weight files plus ``config.json``
    and any index, named relative to the directory so that a moved or copied checkpoint has the same identity.
    Every byte is hashed (streamed, bounded memory), so an in-place replacement with the same names and sizes is
    detected. Raises :class:`CheckpointIntegrityError` if a file changes while it is hashed and
    :class:`NoCheckpointError` if there are no weights.
    """
    path = Path(path)
    files = list(_locate_weights(path, any_safetensors=True).files)
    if path.is_dir():
        files += [path / name for name in _EXPORT_FILES if (path / name).is_file()]
    entries: list[FingerprintEntry] = []
    for file in sorted(set(files)):
        size, sha256 = _hash_file(file)
        name = file.relative_to(path).as_posix() if path.is_dir() else "weights"
        entries.append({"name": name, "size": size, "sha256": sha256})
    return entries


# --------------------------------------------------------------------------------------------- DCP export


def _read_dcp_metadata(directory: PathLike) -> Any:
    """``Metadata`` of a ``torch.distributed.checkpoint`` directory, read without trusting the pickle.

    DCP's own ``FileSystemReader.read_metadata`` calls ``pickle.load``, which runs whatever code the file names.
    This delegates to the project's restricted reader (``_manifest.read_dcp_metadata``: only DCP's metadata
    classes and the torch/pathlib types they are built from may be constructed; the globals real files use were
    listed with ``pickletools``), which also checks that every payload range the metadata names exists in full
    (``_manifest.check_dcp_payloads``). Anything else raises :class:`CheckpointIntegrityError` without running it.
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
        sample = _examples(sorted(metadata.state_dict_metadata))
        raise CheckpointIntegrityError(
            f"{directory} holds no entries under the prefix {prefix!r} (it has: {sample or 'nothing'}). Pass the model "
            "DCP directory, or the prefix its keys use."
        )
    not_tensors = sorted(fqn for fqn, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if not_tensors:
        raise CheckpointIntegrityError(
            f"{directory} stores {len(not_tensors)} non-tensor model entr(ies) ({_examples(not_tensors)}), which "
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
            f"DCP checkpoint {directory} is incomplete or corrupt: {_examples(problems)}. Use a complete checkpoint."
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


def _config_source_writer(source: Any) -> tuple[Callable[[Path], None], dict[str, tuple[int, ...]] | None]:
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
    expected = _shapes(source.state_dict()) if isinstance(source, torch.nn.Module) else None
    return _config_writer(source), expected


def export_dcp_to_diffusers(
    dcp_dir: PathLike,
    model_or_config_source: Any,
    output_dir: PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    dtype: torch.dtype | None = None,
    prefix: str = DCP_MODEL_PREFIX,
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
    Memory: one shard of tensors at a time. Output layout, dtype rule and atomic publish are those of
    :func:`save_diffusers_state_dict`. ``.metadata`` is read with a restricted unpickler, tensors with
    ``weights_only=True``.
    """
    where = Path(output_dir)
    _check_dtype(dtype)
    shard_size = _resolve_shard_size(max_shard_size)
    directory = _locate_dcp(Path(dcp_dir))
    metadata = _read_dcp_metadata(directory)
    entries = _dcp_tensors(metadata, directory, prefix)
    write_config, expected = _config_source_writer(model_or_config_source)
    names = {fqn[len(prefix):]: fqn for fqn in entries}
    if expected is not None:
        _check_matches_model({name: tuple(entries[fqn].size) for name, fqn in names.items()}, expected, directory)
    sizes = [
        (name, entries[fqn].size.numel() * _output_dtype(dtype, entries[fqn].properties.dtype).itemsize)
        for name, fqn in names.items()
    ]
    plan = _ShardPlan.build(sizes, shard_size, where)
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
        _write_shards(staging, plan, fetch, dtype)

    return _publish_export(output_dir, write)


__all__ = [
    "FingerprintEntry",
    "checkpoint_fingerprint",
    "copy_diffusers_checkpoint",
    "export_dcp_to_diffusers",
    "is_complete_diffusers_checkpoint",
    "load_diffusers_checkpoint",
    "load_model_checkpoint",
    "read_diffusers_state_dict",
    "safetensor_checkpoint_files",
    "save_diffusers_state_dict",
]
