"""The completion manifest: schema, inventory and verification. Pure file logic, no process group.

A directory is a complete checkpoint only if ``checkpoint_manifest.json`` exists, parses, names protocol
:data:`PROTOCOL` with status ``complete``, and every file it lists is present with the recorded size (and,
depending on the integrity mode, the recorded sha256). Control files (DCP ``.metadata``, RNG, scheduler,
scaler, custom objects, small files) are always hashed; large payloads are hashed in ``"full"`` mode.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ._staging import fsync_path
from .errors import CheckpointIntegrityError

MANIFEST = "checkpoint_manifest.json"
PROTOCOL = 1
_PAYLOAD_SUFFIXES = (".distcp", ".safetensors", ".bin")
_SMALL = 16 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024
_IDENTIFIER = re.compile(r"[0-9A-Za-z]+")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def relative_inside(name: str) -> Path:
    """``name`` as a relative path that stays inside its checkpoint; raises otherwise."""
    path = Path(name)
    if path.is_absolute() or ".." in path.parts:
        raise CheckpointIntegrityError(f"Checkpoint entry {name!r} points outside its checkpoint directory")
    return path


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP ``.metadata`` without executing arbitrary code: only DCP's metadata classes and the torch and
    pathlib types they are built from may be constructed."""

    _NAMES = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str) -> Any:
        # Exact (module, name) pairs only: a dotted name would walk from an allowed module to anything it
        # imports (e.g. "os.system" through a module that imports os).
        if "." not in name and (module, name) in self._NAMES:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" and "." not in name else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(directory: Path) -> Any:
    """DCP ``Metadata`` of ``directory`` read with a restricted unpickler; integrity error if unreadable."""
    path = Path(directory) / ".metadata"
    if not path.is_file():
        raise CheckpointIntegrityError(f"Missing DCP metadata {path}: the sharded state in {directory} is incomplete")
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:
        raise CheckpointIntegrityError(f"Unreadable DCP metadata {path}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointIntegrityError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


def check_dcp_payloads(directory: Path) -> Any:
    """Every payload range named in the DCP metadata exists in full; returns the metadata."""
    metadata = read_dcp_metadata(directory)
    for storage in (metadata.storage_data or {}).values():
        payload = Path(directory) / relative_inside(str(storage.relative_path))
        needed = storage.offset + storage.length
        if not payload.is_file():
            raise CheckpointIntegrityError(f"Missing DCP payload {payload} (named by {Path(directory) / '.metadata'})")
        size = payload.stat().st_size
        if size < needed:
            raise CheckpointIntegrityError(f"Truncated DCP payload {payload}: {size} bytes, needs at least {needed}")
    return metadata


def dcp_schema(directory: Path) -> dict[str, Any]:
    """Key -> {path, shape, dtype} of a DCP directory: what the manifest records of its ``.metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(directory)
    rows: dict[str, Any] = {}
    planner_data = metadata.planner_data or {}
    for key, value in metadata.state_dict_metadata.items():
        row: dict[str, Any] = {"path": [str(part) if not isinstance(part, int) else part
                                        for part in planner_data.get(key, (key,))]}
        if isinstance(value, TensorStorageMetadata):
            row.update(shape=list(value.size), dtype=str(value.properties.dtype))
        rows[key] = row
    return rows


def build_inventory(directory: Path, checksum: str) -> dict[str, dict[str, Any]]:
    """Size of every file under ``directory``, sha256 of control files (of all files in ``"full"`` mode),
    and the schema of every DCP ``.metadata``."""
    result: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.is_symlink():
            raise CheckpointIntegrityError(f"Checkpoint cannot contain symbolic links: {path}")
        if not path.is_file() or path.name == MANIFEST:
            continue
        size = path.stat().st_size
        row: dict[str, Any] = {"size": size}
        if checksum == "full" or path.suffix not in _PAYLOAD_SUFFIXES or size <= _SMALL:
            row["sha256"] = sha256_file(path)
        if path.name == ".metadata":
            row["schema"] = dcp_schema(path.parent)
        result[path.relative_to(directory).as_posix()] = row
    return result


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``directory``, ``None`` if it has none; integrity error if it is not valid."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointIntegrityError(f"Unreadable checkpoint manifest {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointIntegrityError(f"Invalid checkpoint manifest {path}: not a JSON object")
    return value


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last: to a temporary name, fsynced, renamed into place, directory fsynced."""
    temporary = Path(directory) / (MANIFEST + ".tmp")
    with temporary.open("x") as stream:
        json.dump(manifest, stream, sort_keys=True, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.rename(temporary, Path(directory) / MANIFEST)
    fsync_path(Path(directory))


def verify_manifest(directory: Path, manifest: dict[str, Any], *, full: bool) -> None:
    """Raise :class:`CheckpointIntegrityError` unless ``directory`` matches its manifest.

    ``full=False`` (selection) checks sizes, control-file hashes and DCP schemas; ``full=True`` (restore)
    also checks every payload hash the manifest records.
    """
    where = Path(directory) / MANIFEST
    if manifest.get("protocol") != PROTOCOL:
        raise CheckpointIntegrityError(
            f"{where} uses checkpoint protocol {manifest.get('protocol')!r}; this accelerate-txn reads protocol "
            f"{PROTOCOL}. Use the accelerate-txn version that wrote it."
        )
    if manifest.get("status") != "complete":
        raise CheckpointIntegrityError(f"{where} does not mark a complete checkpoint (status {manifest.get('status')!r})")
    for key in ("run_id", "transaction_id"):
        if not (isinstance(manifest.get(key), str) and _IDENTIFIER.fullmatch(manifest[key])):
            raise CheckpointIntegrityError(f"{where} lacks a valid {key} (letters and digits)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointIntegrityError(f"{where} has no file inventory")
    for name, expected in files.items():
        if not isinstance(expected, dict) or not isinstance(expected.get("size"), int):
            raise CheckpointIntegrityError(f"{where} has a malformed entry for {name!r}")
        path = Path(directory) / relative_inside(name)
        if path.is_symlink() or not path.is_file():
            raise CheckpointIntegrityError(f"Checkpoint file {path} is missing (listed in {where})")
        size = path.stat().st_size
        if size != expected.get("size"):
            raise CheckpointIntegrityError(
                f"Checkpoint file {path} has {size} bytes; the manifest recorded {expected.get('size')} (truncated or "
                "changed after the checkpoint was published)"
            )
        hashed = "sha256" in expected
        small = expected.get("size", 0) <= _SMALL or path.suffix not in _PAYLOAD_SUFFIXES
        if hashed and (full or small) and sha256_file(path) != expected["sha256"]:
            raise CheckpointIntegrityError(f"Checkpoint file {path} does not match its sha256 in {where} (corrupted)")
        if "schema" in expected and dcp_schema(path.parent) != expected["schema"]:
            raise CheckpointIntegrityError(f"DCP metadata {path} describes other tensors than {where} recorded")
