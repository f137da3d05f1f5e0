"""What weight files hold: reading ``.safetensors``/``.bin`` files, header scans and validation against a model.

Shared by the loaders (:mod:`._loaders`) and the DCP export (:mod:`._dcp`). Every check reads headers only
(``.bin`` files are memory-mapped) and reports every problem in one error.

A checkpoint's files are opened once (:class:`OpenWeights`, relative to one open directory descriptor) and both
the scan and the payload reads go through those descriptors, so a re-export that swaps the directory meanwhile
cannot mix two exports: the reader keeps reading the export it validated.
"""

from __future__ import annotations

import errno
import os
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointIntegrityError
from ._common import examples, shapes, strip
from ._layout import WeightFiles

_ADAPTER_MARKERS = ("lora", "lokr", "loha", "adapter", ".alpha")


def _select(state: object, path: Path, state_dict_key: str | None) -> object:
    """The state dict a loaded ``.bin`` payload holds, per ``state_dict_key`` (see :func:`_load_bin`)."""
    nested = state.get("state_dict") if isinstance(state, dict) else None
    if state_dict_key is None:
        return nested if isinstance(nested, dict) else state
    if isinstance(state, dict) and isinstance(state.get(state_dict_key), dict):
        return state[state_dict_key]
    if isinstance(nested, dict) and isinstance(nested.get(state_dict_key), dict):
        return nested[state_dict_key]
    top = examples(sorted(repr(key) for key in state)) if isinstance(state, dict) else f"none (a {type(state).__name__})"
    under = f"; under 'state_dict': {examples(sorted(repr(key) for key in nested))}" if isinstance(nested, dict) else ""
    raise CheckpointIntegrityError(
        f"{path} has no state dict under {state_dict_key!r} (looked at the top level, then under 'state_dict'). Keys "
        f"at the top level: {top}{under}. Pass one of them as state_dict_key, or None for the plain state dict."
    )


def _load_bin(path: Path, state_dict_key: str | None = None, source: Path | None = None) -> dict[str, torch.Tensor]:
    """A PyTorch ``.bin``/``.pt`` state dict, read with ``weights_only=True`` (memory-mapped when possible).

    Without ``state_dict_key``: ``{"state_dict": ...}`` is unwrapped. With it: ``state[state_dict_key]``, else
    ``state["state_dict"][state_dict_key]``, else :class:`CheckpointIntegrityError` listing the keys there are.
    Insists on a flat name -> tensor dict. ``source`` names the file in messages when ``path`` is another path to it.
    """
    source = source or path
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        raise CheckpointIntegrityError(
            f"{source} holds objects other than tensors and plain containers, which torch.load(weights_only=True) "
            f"refuses to unpickle ({str(exc).splitlines()[0]}). Convert it to safetensors from a trusted environment."
        ) from None
    except (OSError, RuntimeError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointIntegrityError(
            f"{source} is not a readable PyTorch file ({type(exc).__name__}: {exc}): it is truncated or corrupt. "
            "Re-export it."
        ) from None
    state = _select(state, source, state_dict_key)
    if not isinstance(state, dict):
        raise CheckpointIntegrityError(f"{source} holds a {type(state).__name__}, not a state dict of tensors.")
    bad = sorted(repr(key) for key, value in state.items() if not (isinstance(key, str) and torch.is_tensor(value)))
    if bad:
        raise CheckpointIntegrityError(
            f"{source} is not a flat state dict: {examples(bad)} are not name -> tensor entries. Pass state_dict_key "
            "to select the nested model weights, or a weights-only file."
        )
    return state


def _descriptor_path(fd: int) -> str | None:
    """A path that opens the file ``fd`` already refers to (Linux ``/proc/self/fd``, BSD/macOS ``/dev/fd``)."""
    for root in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(root):
            return f"{root}/{fd}"
    return None


class OpenWeights:
    """The weight files of one checkpoint, each opened exactly once, relative to one open directory.

    Used as a context manager. :meth:`path` names an open file (through its descriptor where the platform allows),
    so headers and payloads are read from the very files that were opened, even if a re-export swaps the directory
    in the meantime. A file that vanishes before it is opened raises :class:`CheckpointIntegrityError`.
    """

    def __init__(self, weights: WeightFiles) -> None:
        self.weights = weights
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> OpenWeights:
        source = self.weights.source
        directory = None
        try:
            if source.is_dir() and os.open in os.supports_dir_fd:
                directory = os.open(source, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            for file in self.weights.files:
                if directory is None:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                else:
                    self._fds[file] = os.open(file.name, os.O_RDONLY, dir_fd=directory)
        except OSError as exc:
            self.close()
            if exc.errno != errno.ENOENT:
                raise CheckpointIntegrityError(f"{source} could not be opened ({exc}).") from None
            raise CheckpointIntegrityError(
                f"{exc.filename or source} vanished while {source} was being opened: it is being replaced (a "
                "concurrent export?) or deleted. Read it again once the writer has finished."
            ) from None
        finally:
            if directory is not None:
                os.close(directory)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def path(self, file: Path) -> str:
        """A path reading the already-open ``file`` (its own path where descriptors cannot be named)."""
        return _descriptor_path(self._fds[file]) or str(file)


def _file_shapes(opened: OpenWeights, file: Path, state_dict_key: str | None = None) -> dict[str, tuple[int, ...]]:
    """Key -> shape of one open weight file, from the safetensors header (no tensor payload is read)."""
    if file.suffix != ".safetensors":
        return shapes(_load_bin(Path(opened.path(file)), state_dict_key, source=file))
    try:
        with safe_open(opened.path(file), framework="pt", device="cpu") as reader:
            return {key: tuple(reader.get_slice(key).get_shape()) for key in reader.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointIntegrityError(
            f"{file} is not a readable safetensors file ({exc}): it is truncated or corrupt. Re-export it."
        ) from None


def read_file(opened: OpenWeights, file: Path, state_dict_key: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one open weight file, on CPU."""
    return dict(_iter_file(opened, file, state_dict_key))


def _iter_file(opened: OpenWeights, file: Path, state_dict_key: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every tensor of one open file; a safetensors file is read one tensor at a time."""
    if file.suffix != ".safetensors":
        yield from _load_bin(Path(opened.path(file)), state_dict_key, source=file).items()
        return
    try:
        with safe_open(opened.path(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                yield key, reader.get_tensor(key)
    except (SafetensorError, OSError) as exc:
        raise CheckpointIntegrityError(f"{file} could not be read ({exc}): re-export it.") from None


def scan(
    opened: OpenWeights, *, strip_prefix: str | None = None, state_dict_key: str | None = None
) -> dict[str, tuple[int, ...]]:
    """Key (``strip_prefix`` removed) -> shape over all open files, validated: no duplicates, index matches exactly.

    Reads headers only (``.bin`` files are memory-mapped). Every problem is reported in one error.
    """
    weights = opened.weights
    found: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    stored: set[str] = set()
    duplicates: list[str] = []
    misplaced: list[str] = []
    weight_map = weights.weight_map
    for file in weights.files:
        for source_key, shape in _file_shapes(opened, file, state_dict_key).items():
            key = strip(source_key, strip_prefix)
            if key in found:
                duplicates.append(f"{key} (in {origin[key]} and {file.name})")
                continue
            if weight_map is not None and weight_map.get(source_key) != file.name:
                misplaced.append(f"{source_key} (in {file.name}, index says {weight_map.get(source_key) or 'nothing'})")
            found[key], origin[key] = shape, file.name
            stored.add(source_key)
    problems = []
    if duplicates:
        problems.append(f"{len(duplicates)} tensor(s) stored twice: {examples(duplicates)}")
    if misplaced:
        problems.append(f"{len(misplaced)} tensor(s) not where the index {weights.index} says: {examples(misplaced)}")
    unbacked = sorted(set(weight_map or ()) - stored)
    if unbacked:
        problems.append(f"the index lists {len(unbacked)} tensor(s) that no shard holds: {examples(unbacked)}")
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


def check_matches_model(
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
        parts.append(f"missing {len(missing)} of {len(expected)} model tensor(s): {examples(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensor(s): {examples(unexpected)}")
    if mismatched:
        parts.append(f"{len(mismatched)} shape mismatch(es): {examples(mismatched)}")
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


def iter_tensors(opened: OpenWeights, state_dict_key: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every tensor of every open file; safetensors files are read one tensor at a time."""
    for file in opened.weights.files:
        yield from _iter_file(opened, file, state_dict_key)
