"""Where a checkpoint's weights are: index reading, locating weight files, :func:`safetensor_checkpoint_files`.

Only file names and the index are inspected here; reading the files is :mod:`._read`'s job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointIntegrityError, NoCheckpointError
from ._common import (
    BIN_INDEX_NAME,
    BIN_WEIGHTS_NAME,
    SAFETENSORS_INDEX_NAME,
    SAFETENSORS_WEIGHTS_NAME,
    PathLike,
    examples,
)


@dataclass(frozen=True)
class WeightFiles:
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
            f"Index {index} maps tensors to files outside its directory or to invalid names ({examples(bad)}): "
            "an index may only name shard files next to it. Re-export the weights."
        )
    return weight_map


def _indexed(directory: Path, index_name: str) -> WeightFiles | None:
    """The shards an index in ``directory`` names, all present; ``None`` without that index."""
    index = directory / index_name
    if not index.is_file():
        return None
    weight_map = _read_index(index)
    files = tuple(directory / name for name in sorted(set(weight_map.values())))
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CheckpointIntegrityError(
            f"Index {index} names {len(missing)} shard(s) that do not exist ({examples(missing)}): the export is "
            "incomplete (interrupted or partly copied). Re-export or re-copy the whole directory."
        )
    return WeightFiles(directory, files, index, weight_map)


def locate_weights(path: Path, *, any_safetensors: bool = False) -> WeightFiles:
    """Find a checkpoint's weight files: a single file, or a Diffusers directory (index first, then one file).

    Directory precedence: safetensors index, ``diffusion_pytorch_model.safetensors``, (with ``any_safetensors``)
    every ``*.safetensors`` in the directory, ``.bin`` index, ``diffusion_pytorch_model.bin``. An index that names
    a missing shard raises :class:`CheckpointIntegrityError`; no weights at all raises :class:`NoCheckpointError`.
    """
    if not path.exists():
        raise NoCheckpointError(f"No checkpoint at {path}: the path does not exist.")
    if not path.is_dir():
        return WeightFiles(path, (path,))
    if found := _indexed(path, SAFETENSORS_INDEX_NAME):
        return found
    if (path / SAFETENSORS_WEIGHTS_NAME).is_file():
        return WeightFiles(path, (path / SAFETENSORS_WEIGHTS_NAME,))
    if any_safetensors and (files := tuple(sorted(file for file in path.glob("*.safetensors") if file.is_file()))):
        return WeightFiles(path, files)
    if found := _indexed(path, BIN_INDEX_NAME):
        return found
    if (path / BIN_WEIGHTS_NAME).is_file():
        return WeightFiles(path, (path / BIN_WEIGHTS_NAME,))
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
        weights = locate_weights(path, any_safetensors=True)
    except NoCheckpointError:
        return None
    if weights.files[0].suffix != ".safetensors":
        return None
    return [str(file) for file in weights.files]
