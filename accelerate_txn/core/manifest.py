"""The completion manifest: schema, inventory and verification. Pure file logic, no process group, no torch at
import (the CLI's ``verify``/``list``/``latest`` use it without loading torch).

A directory is a complete checkpoint only if ``checkpoint_manifest.json`` is a regular file of bounded size and
depth, names a readable protocol with status ``complete``, and the directory tree (no symbolic links anywhere)
holds exactly the files of its inventory, each with the recorded size and content hash. A file present but not
in the inventory is refused when a loader (Accelerate, DCP, a registered state) could read it, and reported
otherwise.

Integrity modes (recorded as ``integrity``): ``"full"`` (the default) hashes every file; ``"metadata"`` hashes
control files and small payloads and records only the size of payloads over 16 MiB. The hash is XXH3-128 (fast,
non-cryptographic: it detects corruption, not a forger who can also rewrite the manifest); ``sha256`` is
available and older manifests that used it are still verified.

Each rank hashes and fsyncs the files it wrote (:func:`writer_rank`), so the cost is spread over the ranks and
the flush happens where the data was written.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointIntegrityError
from ..store.base import HASH, HASHES, Store, hash_file, open_regular
from .signing import Key, Keyring, check_authenticator, signed

MANIFEST = "checkpoint_manifest.json"
PROTOCOL = 2
READABLE_PROTOCOLS = (1, 2)  # 1: sha256 rows, payloads over 16 MiB sized only
INTEGRITY_MODES = ("full", "metadata")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_DEPTH = 32
_PAYLOAD_SUFFIXES = (".distcp", ".safetensors", ".bin")
_SMALL = 16 * 1024 * 1024
_IDENTIFIER = re.compile(r"[0-9A-Za-z]+")
_HEX = re.compile(r"[0-9a-f]{16,128}")
# Files some loader may read when present: Accelerate's component files (by name) and anything holding tensors or
# pickles. An unlisted file of this kind in a published checkpoint is refused; other unlisted files are reported.
_LOADER_NAME = re.compile(
    r"(?:(?:pytorch_model|model|optimizer|scheduler|sampler|dl_state_dict)(?:_\d+)?"
    r"|random_states_\d+|custom_checkpoint_\d+|scaler)\.(?:bin|safetensors|pt|pkl)\Z"
    r"|\.metadata\Z|.*\.(?:distcp|pkl|pt|pth|bin|safetensors|npy|npz|ckpt)\Z|.*\.index\.json\Z"
)
_DCP_PAYLOAD = re.compile(r"__(\d+)_\d+\.distcp\Z")
#: Directories of the native FSDP layout (sharded model and optimizer state), owned whole by the checkpoint.
LAYOUT_DIRECTORIES = re.compile(r"(?:pytorch_model_fsdp|optimizer)_\d+\Z")
LOADER_FILE = "dataloader_states_{rank}.pt"  # per-rank stateful data-loader state (``accelerate.loader_state``)
RNG_TEMPLATE = "random_states_{rank}.pkl"  # Accelerate writes one per rank on every save_state
RANK_FILES = (RNG_TEMPLATE, LOADER_FILE)  # per-rank files (plus registered private states)
#: Per-rank state policies this version restores by (``rank_state.policy`` of a manifest; ``accelerate.elastic``).
RANK_POLICIES = ("keep-or-derive/1",)


# --- hashing (HASH, hash_file, open_regular: in store.base, below every store, which hashes what it moves) ----

def sha256_file(path: Path) -> str:
    return hash_file(path, "sha256")[1]


def _is_large_payload(name: str, size: int) -> bool:
    return Path(name).suffix in _PAYLOAD_SUFFIXES and size > _SMALL


def relative_inside(name: str) -> Path:
    """``name`` as a relative path that stays inside its checkpoint; raises otherwise."""
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name or "\x00" in name:
        raise CheckpointIntegrityError(f"Checkpoint entry {name!r} points outside its checkpoint directory")
    return path


def list_tree(directory: Path, *, max_depth: int = 64, keep: Callable[[str], bool] | None = None) -> dict[str, int]:
    """Relative POSIX name -> size of every file under ``directory`` (the manifest excluded); with ``keep``, of the
    files whose name it accepts only: the others are not stat'ed (a rank selecting its own files among every rank's
    pays one directory listing, not one ``stat`` per file of the world).

    Refuses symbolic links (to files or directories), anything that is not a regular file or directory, and a
    directory nested more than ``max_depth`` levels below ``directory`` (no checkpoint is that deep; a hostile one must
    be skipped with its reason, not exhaust the caller). Iterative (an explicit stack), so no depth raises
    ``RecursionError``.
    """
    root = Path(directory)
    found: dict[str, int] = {}

    def shown(name: str) -> str:  # a path for a message, its middle elided past a few hundred characters
        text = str(root / name) if name else str(root)
        return text if len(text) <= 400 else f"{text[:200]}...{text[-150:]}"

    if Path(root).is_symlink():
        raise CheckpointIntegrityError(f"Checkpoint directory {root} is a symbolic link; pass the real directory")
    stack: list[tuple[Path, str, int]] = [(root, "", 0)]  # (directory, its relative name + "/", its depth)
    while stack:
        folder, prefix, depth = stack.pop()
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except OSError as exc:
            raise CheckpointIntegrityError(
                f"Cannot list checkpoint directory {shown(prefix.rstrip('/'))}: {exc.strerror}"
            ) from exc
        for entry in entries:
            name = f"{prefix}{entry.name}"
            if entry.is_symlink():
                raise CheckpointIntegrityError(
                    f"Checkpoint entry {shown(name)} is a symbolic link: a checkpoint holds only its own files. "
                    "Copy the data in place of the link."
                )
            if entry.is_dir(follow_symlinks=False):
                if depth + 1 > max_depth:
                    raise CheckpointIntegrityError(
                        f"Checkpoint directory {shown(name)} is nested more than {max_depth} levels deep: no checkpoint "
                        "is; the directory was altered (or is not a checkpoint). Remove that tree or restore an "
                        "intact copy."
                    )
                stack.append((Path(entry.path), f"{name}/", depth + 1))
            elif entry.is_file(follow_symlinks=False):
                if name != MANIFEST and (keep is None or keep(name)):
                    found[name] = entry.stat(follow_symlinks=False).st_size
            else:
                raise CheckpointIntegrityError(f"Checkpoint entry {shown(name)} is not a regular file or directory")
    return found


@functools.lru_cache(maxsize=256)
def _rank_template(template: str) -> re.Pattern[str]:
    """The names a per-rank template produces, the rank as group 1 (compiled once: :func:`writer_rank` runs per
    inventory entry)."""
    return re.compile(re.escape(template).replace(re.escape("{rank}"), r"(\d+)"))


def writer_rank(name: str, world_size: int, rank_files: Iterable[str] = RANK_FILES) -> int:
    """The rank that wrote ``name`` in a protected save: DCP's ``__R_*.distcp`` and per-rank files (RNG,
    registered private states) belong to their rank; everything else (DCP ``.metadata``, scheduler, scaler,
    custom objects, ...) to rank 0. A rank outside ``world_size`` maps to rank 0."""
    base = name.rsplit("/", 1)[-1]
    match = _DCP_PAYLOAD.fullmatch(base)
    if match:
        rank = int(match.group(1))
        return rank if rank < world_size else 0
    for template in rank_files:
        match = _rank_template(template).fullmatch(base)
        if match:
            rank = int(match.group(1))
            return rank if rank < world_size else 0
    return 0


def hash_rows(directory: Path, names: Iterable[str], *, algorithm: str = HASH, integrity: str = "full",
              flush: bool = False, after_first: Callable[[], None] | None = None,
              written: Mapping[str, tuple[int, str]] | None = None) -> dict[str, dict[str, Any]]:
    """Inventory rows (size and hash per the integrity mode) of ``names`` under ``directory``, hashed in
    parallel threads (hashing and reading release the GIL); ``flush`` also fsyncs each file.

    ``written``: ``(size, digest)`` (of ``algorithm``) of files hashed while they were written
    (``core.hashing``): such a file is not read again; its size on disk must be the size written."""
    names = sorted(names)
    root = Path(directory)
    written = written or {}

    def row(name: str) -> tuple[str, dict[str, Any]]:
        path = root / relative_inside(name)
        large = integrity == "metadata" and _is_large_payload(name, path.lstat().st_size)
        if large or name in written:
            fd = open_regular(path)  # size only, or hashed as written: flush without reading the payload
            try:
                if flush:
                    os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if large:
                return name, {"size": size}
            if size != written[name][0]:
                raise CheckpointIntegrityError(
                    f"{path} holds {size} bytes, but {written[name][0]} were written to it: something else changed "
                    "the staged file while it was being saved. Nothing was published; save again.")
            return name, {"size": size, algorithm: written[name][1]}
        size, digest = hash_file(path, algorithm, flush=flush)
        return name, {"size": size, algorithm: digest}

    rows: dict[str, dict[str, Any]] = {}
    if not names:
        return rows
    with ThreadPoolExecutor(max_workers=min(4, len(names), os.cpu_count() or 1)) as pool:
        for index, (name, value) in enumerate(pool.map(row, names)):
            rows[name] = value
            if index == 0 and after_first is not None:
                after_first()
    return rows


def add_schemas(directory: Path, rows: dict[str, dict[str, Any]]) -> None:
    """Record the tensor schema of every DCP ``.metadata`` in ``rows`` (read with the restricted unpickler)."""
    for name, row in rows.items():
        if name.rsplit("/", 1)[-1] == ".metadata":
            row["schema"] = dcp_schema((Path(directory) / name).parent)


def complete_rows(directory: Path, rows: dict[str, dict[str, Any]], *, integrity: str) -> None:
    """Rank 0, before a publish: complete the inventory ``rows`` that the ranks hashed (each its own files) from
    the staged ``directory`` itself. A hashed file that vanished or changed size is refused (something else writes
    into the staging directory; nothing is published); files no rank claimed (written after the ranks listed the
    tree) are hashed and fsynced here; DCP schemas are added."""
    present = list_tree(directory)
    vanished = sorted(set(rows) - set(present))
    changed = sorted(name for name in set(rows) & set(present) if rows[name]["size"] != present[name])
    if vanished or changed:
        raise CheckpointIntegrityError(
            f"Staged file {Path(directory) / (vanished or changed)[0]} {'vanished' if vanished else 'changed size'} "
            "after it was hashed: something else writes into the staging directory. Nothing was published.")
    rows.update(hash_rows(directory, sorted(set(present) - set(rows)), algorithm=HASH, integrity=integrity,
                          flush=True))
    add_schemas(directory, rows)


def build_inventory(directory: Path, checksum: str = "full", algorithm: str = HASH) -> dict[str, dict[str, Any]]:
    """Size and hash (per the integrity mode ``checksum``) of every file under ``directory``, and the schema of
    every DCP ``.metadata`` (single-process form of what a protected save assembles across ranks)."""
    rows = hash_rows(directory, list_tree(directory), algorithm=algorithm, integrity=checksum)
    add_schemas(directory, rows)
    return rows


# --- DCP metadata ----------------------------------------------------------------------------------------------

class MetadataUnpickler(pickle.Unpickler):
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
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    } | {
        # Python 3.13 moved the concrete path classes to pathlib._local (StorageMeta.checkpoint_id is a path).
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    }

    def find_class(self, module: str, name: str) -> Any:
        import torch

        # Exact (module, name) pairs only: a dotted name would walk from an allowed module to anything it
        # imports (e.g. "os.system" through a module that imports os).
        if "." not in name and (module, name) in self._NAMES:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" and "." not in name else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


#: Per thread, while a transaction runs (:func:`metadata_cache`): ``.metadata`` identity -> parsed ``Metadata``.
_METADATA_CACHE = threading.local()


@contextlib.contextmanager
def metadata_cache() -> Iterator[None]:
    """Within the block (in this thread), :func:`read_dcp_metadata` parses each ``.metadata`` once while its
    identity is unchanged (path, device, inode, size, modification and change times; the file is still opened and
    checked on every call). One save's publish or one load reads each of them five to ten times. Callers treat
    the returned object as read-only."""
    outer = getattr(_METADATA_CACHE, "entries", None)
    if outer is None:
        _METADATA_CACHE.entries = {}
    try:
        yield
    finally:
        if outer is None:
            _METADATA_CACHE.entries = None


def with_metadata_cache(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: each call of ``function`` runs inside :func:`metadata_cache` (one save's publish, one load)."""
    import functools

    @functools.wraps(function)
    def cached(*args: Any, **kwargs: Any) -> Any:
        with metadata_cache():
            return function(*args, **kwargs)

    return cached


def read_dcp_metadata(directory: Path) -> Any:
    """DCP ``Metadata`` of ``directory`` read with a restricted unpickler; integrity error if unreadable."""
    path = Path(directory) / ".metadata"
    from torch.distributed.checkpoint.metadata import Metadata

    if not path.is_symlink() and not path.exists():
        raise CheckpointIntegrityError(f"Missing DCP metadata {path}: the sharded state in {directory} is incomplete")
    fd = open_regular(path)
    cache = getattr(_METADATA_CACHE, "entries", None)
    key = None
    if cache is not None:
        info = os.fstat(fd)
        key = (str(path.absolute()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        if key in cache:
            os.close(fd)
            return cache[key]
    try:
        with os.fdopen(fd, "rb", closefd=False) as stream:
            metadata = MetadataUnpickler(stream).load()
    except CheckpointIntegrityError:
        raise
    except Exception as exc:  # any unpickling failure, RecursionError included
        raise CheckpointIntegrityError(f"Unreadable DCP metadata {path}: {exc}") from exc
    finally:
        os.close(fd)
    if not isinstance(metadata, Metadata):
        raise CheckpointIntegrityError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    if key is not None:
        cache[key] = metadata
    return metadata


def dcp_payload_names(metadata: Any) -> set[str]:
    """Relative names of the payload files a DCP ``Metadata`` reads."""
    paths = {str(storage.relative_path) for storage in (metadata.storage_data or {}).values()}
    return {relative_inside(path).as_posix() for path in paths}  # one check per file, not per chunk


def check_dcp_payloads(directory: Path) -> Any:
    """Every payload range named in the DCP metadata exists in full; returns the metadata."""
    metadata = read_dcp_metadata(directory)
    for storage in (metadata.storage_data or {}).values():
        payload = Path(directory) / relative_inside(str(storage.relative_path))
        needed = storage.offset + storage.length
        if payload.is_symlink() or not payload.is_file():
            raise CheckpointIntegrityError(f"Missing DCP payload {payload} (named by {Path(directory) / '.metadata'})")
        size = payload.stat().st_size
        if size < needed:
            raise CheckpointIntegrityError(f"Truncated DCP payload {payload}: {size} bytes, needs at least {needed}")
    return metadata


def dcp_schema(directory: Path, metadata: Any = None) -> dict[str, Any]:
    """Key -> {path, shape, dtype} of a DCP directory: what the manifest records of its ``.metadata`` (``metadata``:
    that file already read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(directory) if metadata is None else metadata
    rows: dict[str, Any] = {}
    planner_data = metadata.planner_data or {}
    for key, value in metadata.state_dict_metadata.items():
        row: dict[str, Any] = {"path": [str(part) if not isinstance(part, int) else part
                                        for part in planner_data.get(key, (key,))]}
        if isinstance(value, TensorStorageMetadata):
            row.update(shape=list(value.size), dtype=str(value.properties.dtype))
        rows[key] = row
    return rows


# --- the manifest file ---------------------------------------------------------------------------------------

def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_MANIFEST_DEPTH:
            return depth
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``directory``, ``None`` if it has none; integrity error if it is not valid.

    Bounded: a manifest over :data:`MAX_MANIFEST_BYTES`, nested deeper than :data:`MAX_MANIFEST_DEPTH`, or that
    is a symbolic link is refused without being read whole.
    """
    path = Path(directory) / MANIFEST
    if not path.is_symlink() and not path.exists():
        return None
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointIntegrityError(
                f"Checkpoint manifest {path} has {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit: it was not "
                "written by accelerate-txn (or was altered); the checkpoint is not loadable."
            )
        with os.fdopen(fd, "rb", closefd=False) as stream:
            # As many bytes as the file holds (one more shows growth), never a buffer of the whole limit.
            data = stream.read(size + 1)
            if len(data) > size:  # it grew since: read on, still bounded
                data += stream.read(MAX_MANIFEST_BYTES + 1 - len(data))
    finally:
        os.close(fd)
    return parse_manifest(data, str(path))


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The manifest held by ``data`` (read, bounded, from ``where``: a path or a URL, for messages); integrity
    error if it is not a JSON object of bounded size and depth."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointIntegrityError(
            f"Checkpoint manifest {where} has {len(data)} bytes, over the {MAX_MANIFEST_BYTES} byte limit: it was not "
            "written by accelerate-txn (or was altered); the checkpoint is not loadable.")
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError, MemoryError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CheckpointIntegrityError(f"Unreadable checkpoint manifest {where}: {reason}") from None
    if not isinstance(value, dict):
        raise CheckpointIntegrityError(f"Invalid checkpoint manifest {where}: not a JSON object")
    if _depth(value) > MAX_MANIFEST_DEPTH:
        raise CheckpointIntegrityError(f"Invalid checkpoint manifest {where}: nested deeper than {MAX_MANIFEST_DEPTH}")
    return value


def manifest_bytes(manifest: dict[str, Any], signer: Key | None = None) -> bytes:
    """The bytes a manifest is written as (the same on every store). With ``signer`` (a save under a signing key,
    ``core.signing``) they carry its authenticator over the manifest's canonical bytes; without, the manifest is
    written as it is (a copy keeps the authenticator it was published with, and an unsigned one stays unsigned)."""
    return json.dumps(signed(manifest, signer) if signer is not None else manifest, sort_keys=True, indent=1).encode()


def write_manifest(directory: Path, manifest: dict[str, Any], *, store: Store, signer: Key | None = None) -> None:
    """Write the manifest last, through ``store``'s atomic write (POSIX: a temporary name, fsynced, renamed into
    place, directory fsynced); ``signer``: see :func:`manifest_bytes`."""
    store.write_atomic(Path(directory) / MANIFEST, manifest_bytes(manifest, signer))


def loader_may_read(name: str, private_patterns: Iterable[re.Pattern[str]] = ()) -> bool:
    """Whether a loader (Accelerate, DCP, a registered private state) could read the file ``name``."""
    base = name.rsplit("/", 1)[-1]
    return bool(_LOADER_NAME.fullmatch(base)) or any(pattern.fullmatch(base) for pattern in private_patterns)


def layout_owns(name: str, roots: Iterable[str] = ("",), names: Iterable[str] = (),
                private_patterns: Iterable[re.Pattern[str]] = (), *, directory: bool = False) -> bool:
    """Whether ``name`` (relative, POSIX; ``directory``: it names a directory) is part of a checkpoint's native
    layout under one of its component ``roots``; ``names``: the front end's own file names at a root (the Trainer's
    ``trainer_state.json``)."""
    own = {MANIFEST, MANIFEST + ".tmp", *names}
    patterns = list(private_patterns)
    for root in roots:
        if root:
            if not name.startswith(root + "/"):
                continue
            rest = name[len(root) + 1:]
        else:
            rest = name
        first, _, below = rest.partition("/")
        if directory and not below:
            if LAYOUT_DIRECTORIES.fullmatch(first):
                return True
        elif below:
            if LAYOUT_DIRECTORIES.fullmatch(first):
                return True
        elif first in own or loader_may_read(first, patterns):
            return True
    return False


def rank_file_pattern(template: str) -> re.Pattern[str]:
    """The file names a per-rank template such as ``training_state_{rank}.pt`` produces, for any rank."""
    return re.compile(re.escape(template).replace(re.escape("{rank}"), r"\d+"))


def _row_hash(row: dict[str, Any]) -> tuple[str, str] | None:
    for algorithm in HASHES:
        if algorithm in row:
            return algorithm, row[algorithm]
    return None


def check_structure(directory: Path, manifest: dict[str, Any], *,
                    private_patterns: Iterable[re.Pattern[str]] = (), keys: Keyring | None = None) -> dict[str, Any]:
    """Everything about ``directory`` against its manifest except content hashes; returns a partial report.

    First the authenticator, when verification keys are configured (``keys``; default: the environment's or the
    command line's, ``core.signing.active_keyring``): nothing of a manifest that may be forged is trusted. Then the
    header (protocol, status, identifiers), inventory entries, no symbolic links, every listed file present with
    its size, every payload a DCP ``.metadata`` names listed, and no unlisted file that a loader could read.
    """
    where = Path(directory) / MANIFEST
    signed_by = check_authenticator(manifest, where, keys)
    if "protocol" not in manifest:
        raise CheckpointIntegrityError(f"{where} is not an accelerate-txn manifest (it names no protocol)")
    if manifest.get("protocol") not in READABLE_PROTOCOLS:
        raise CheckpointIntegrityError(
            f"{where} uses checkpoint protocol {manifest.get('protocol')!r}; this accelerate-txn reads protocols "
            f"{list(READABLE_PROTOCOLS)}. Use the accelerate-txn version that wrote it."
        )
    if manifest.get("status") != "complete":
        raise CheckpointIntegrityError(f"{where} does not mark a complete checkpoint (status {manifest.get('status')!r})")
    for key in ("run_id", "transaction_id"):
        if not (isinstance(manifest.get(key), str) and _IDENTIFIER.fullmatch(manifest[key])):
            raise CheckpointIntegrityError(f"{where} lacks a valid {key} (letters and digits)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointIntegrityError(f"{where} has no file inventory")
    integrity = manifest.get("integrity", "metadata")
    if integrity not in INTEGRITY_MODES:
        raise CheckpointIntegrityError(f"{where} names an unknown integrity mode {integrity!r}")
    for name, row in files.items():
        relative_inside(name)
        if (not isinstance(row, dict) or not isinstance(row.get("size"), int) or isinstance(row.get("size"), bool)
                or row["size"] < 0):
            raise CheckpointIntegrityError(f"{where} has a malformed entry for {name!r}")
        recorded = _row_hash(row)
        if recorded is not None and not (isinstance(recorded[1], str) and _HEX.fullmatch(recorded[1])):
            raise CheckpointIntegrityError(f"{where} has a malformed {recorded[0]} for {name!r}")
        if recorded is None and (integrity == "full" or not _is_large_payload(name, row["size"])):
            raise CheckpointIntegrityError(
                f"{where} records no content hash for {name!r}, which its integrity mode ({integrity!r}) requires: "
                "the manifest was altered"
            )
    templates = _rank_state_templates(manifest, where)
    present = list_tree(directory)
    for name, row in sorted(files.items()):
        path = Path(directory) / name
        if name not in present:
            raise CheckpointIntegrityError(f"Checkpoint file {path} is missing (listed in {where})")
        if present[name] != row["size"]:
            raise CheckpointIntegrityError(
                f"Checkpoint file {path} has {present[name]} bytes; the manifest recorded {row['size']} (truncated or "
                "changed after the checkpoint was published)"
            )
    patterns = list(private_patterns)
    user = user_files(manifest, where)
    extra = sorted(set(present) - set(files))
    # The user's own files a replacement carried (``core.carry``) are listed, not hashed: present or not, edited or
    # not, they change nothing; one a loader may read is accepted only outside the native layout (where no
    # checkpoint loader looks).
    read = [name for name in extra if loader_may_read(name, patterns)
            and (name not in user or _in_native_layout(name, manifest, patterns))]
    if read:
        raise CheckpointIntegrityError(
            f"{Path(directory) / read[0]} is not in the inventory of {where}, but a loader would read it "
            f"({len(read)} such file(s)): the checkpoint was altered after it was published. Remove the file(s) or "
            "restore an intact copy."
        )
    check_rank_coverage(directory, files, manifest.get("components"), templates)
    return {"files": len(files), "extra": [name for name in extra if name not in user], "integrity": integrity,
            "user_files": sorted(user), "signed_by": signed_by,
            "algorithm": next((a for a in HASHES if any(a in row for row in files.values())), HASH)}


def user_files(manifest: dict[str, Any], where: Path | str = MANIFEST) -> dict[str, int]:
    """The manifest's ``user_files`` (``{name: size}``; absent: none): the user's files a replacement carried into
    the checkpoint, outside its inventory. A malformed entry, or one that is also in the inventory, raises."""
    rows = manifest.get("user_files", {})
    if not isinstance(rows, dict):
        raise CheckpointIntegrityError(f"{where} has a malformed user_files list")
    found: dict[str, int] = {}
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    for name, row in rows.items():
        relative_inside(name)
        size = row.get("size") if isinstance(row, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or name in files or name == MANIFEST:
            raise CheckpointIntegrityError(f"{where} has a malformed user_files entry for {name!r}")
        found[name] = size
    return found


def _in_native_layout(name: str, manifest: dict[str, Any], patterns: list[re.Pattern[str]]) -> bool:
    components = manifest.get("components")
    roots = ["", *(c for c in components if isinstance(c, str) and c)] if isinstance(components, dict) else [""]
    return layout_owns(name, roots, private_patterns=patterns)


def _rank_state_templates(manifest: dict[str, Any], where: Path) -> list[str]:
    """The per-rank file templates of a manifest's ``rank_state`` (the defaults for a manifest without one); an
    unknown policy is refused: this version would restore per-rank state by a rule the writer did not mean."""
    rank_state = manifest.get("rank_state")
    if rank_state is None:
        return list(RANK_FILES)
    policy = rank_state.get("policy") if isinstance(rank_state, dict) else None
    if policy not in RANK_POLICIES:
        raise CheckpointIntegrityError(
            f"{where} names the per-rank state policy {policy!r}; this accelerate-txn restores per-rank state by "
            f"{list(RANK_POLICIES)} only. Load it with the accelerate-txn version that wrote it."
        )
    templates = rank_state.get("files")
    if not isinstance(templates, list) or not all(isinstance(t, str) and "{rank}" in t and "/" not in t
                                                  for t in templates):
        raise CheckpointIntegrityError(f"{where} has a malformed rank_state.files entry: {templates!r}")
    return sorted({*templates, RNG_TEMPLATE})


def _ranks_of(names: Iterable[str], pattern: re.Pattern[str]) -> set[int]:
    return {int(match.group(1)) for name in names if (match := pattern.fullmatch(name))}


def check_rank_coverage(directory: Path, files: Mapping[str, Any], components: Any,
                        templates: Iterable[str] = RANK_FILES) -> None:
    """Every rank of the world each component's descriptor records contributed its files, and no other rank did:
    Accelerate's RNG file for each rank 0..W-1, every other per-rank file (``templates``) for all of them or none,
    and in every DCP directory a payload ``__R_*.distcp`` of each rank R (every rank of a DCP save writes one, empty
    or not). Proven from the inventory's file names alone (no torch): a checkpoint one rank published alone, or a
    descriptor that claims another world size than its files show, is refused. Components without a recorded
    world size (older manifests, weight exports) are not checked."""
    where = Path(directory) / MANIFEST
    if not isinstance(components, dict):
        return
    patterns = {t: re.compile(re.escape(t).replace(re.escape("{rank}"), r"(\d+)")) for t in sorted(set(templates))}
    for component, descriptor in sorted(components.items()):
        world = descriptor.get("world_size") if isinstance(descriptor, dict) else None
        if not isinstance(world, int) or isinstance(world, bool):
            continue
        if world < 1:
            raise CheckpointIntegrityError(f"{where} records an invalid world size {world!r} for component {component!r}")
        prefix = f"{component}/" if component else ""
        expected = set(range(world))
        top = [name[len(prefix):] for name in files if name.startswith(prefix) and "/" not in name[len(prefix):]]
        for template, pattern in patterns.items():
            ranks = _ranks_of(top, pattern)
            if ranks != expected and (ranks or template == RNG_TEMPLATE):
                missing, extra = sorted(expected - ranks), sorted(ranks - expected)
                raise CheckpointIntegrityError(
                    f"{where} records a world of {world} rank(s) for {component or 'the checkpoint'}, but its per-rank "
                    f"files {template} are " + (f"missing for rank(s) {missing}" if missing else
                                                f"present for rank(s) {extra} outside it")
                    + ": not every rank of the saving world contributed (or the manifest was altered). The checkpoint "
                    "is not loadable; resume from an intact one."
                )
        folders = {name[:-len(".metadata")] for name in files
                   if name.startswith(prefix) and name.rsplit("/", 1)[-1] == ".metadata"}
        for folder in sorted(folders):
            inside = [name[len(folder):] for name in files if name.startswith(folder) and "/" not in name[len(folder):]]
            ranks = _ranks_of(inside, _DCP_PAYLOAD)
            if ranks != expected:
                missing, extra = sorted(expected - ranks), sorted(ranks - expected)
                raise CheckpointIntegrityError(
                    f"{Path(directory) / folder / '.metadata'}: the checkpoint records a world of {world} rank(s), but "
                    "the inventory lists DCP payloads " + (f"of no rank {missing}" if missing else
                                                           f"of rank(s) {extra} outside it")
                    + ": not every rank of the saving world wrote its shards. The checkpoint is not loadable; resume "
                    "from an intact one."
                )


def _overlap(a: Any, b: Any) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def check_dcp_coverage(metadata: Any, where: Path) -> None:
    """Every tensor of a DCP ``Metadata`` is covered exactly by its chunks (inside its bounds, no two overlapping,
    their volumes adding up to the tensor's), and every chunk and every bytes entry has a storage entry: what a
    load reads exists for every element, so no rank's part is silently missing or left as the loader's template."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage = {(index.fqn, None if index.offset is None else tuple(index.offset))
               for index in (metadata.storage_data or {})
               if isinstance(index, MetadataIndex)}
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata):
            if (key, None) not in storage:
                raise CheckpointIntegrityError(f"{where}: entry {key!r} has no stored data: the checkpoint is incomplete")
            continue
        shape = tuple(value.size)
        total = 1
        for extent in shape:
            total *= extent
        covered = 0
        chunks = sorted(value.chunks, key=lambda chunk: tuple(chunk.offsets))
        for chunk in chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o < 0 or s < 0 or o + s > extent for o, s, extent in zip(offsets, sizes, shape)):
                raise CheckpointIntegrityError(f"{where}: a chunk of {key!r} at {list(offsets)} lies outside its shape "
                                               f"{list(shape)}")
            volume = 1
            for extent in sizes:
                volume *= extent
            covered += volume
            if volume and (key, offsets) not in storage:
                raise CheckpointIntegrityError(f"{where}: the chunk of {key!r} at {list(offsets)} has no stored data: "
                                               "the checkpoint is incomplete")
        # Chunks sorted by offset: only chunks starting before one ends on dim 0 can overlap it (a sweep).
        for index, chunk in enumerate(chunks):
            end = chunk.offsets[0] + chunk.sizes[0] if shape else 1
            for other in chunks[index + 1:]:
                if shape and other.offsets[0] >= end:
                    break
                if _overlap(chunk, other) and all(chunk.sizes) and all(other.sizes):
                    raise CheckpointIntegrityError(f"{where}: chunks of {key!r} at {list(chunk.offsets)} and "
                                                   f"{list(other.offsets)} overlap: the DCP metadata is not consistent")
        if covered != total:
            raise CheckpointIntegrityError(
                f"{where}: the chunks of {key!r} cover {covered} of its {total} elements: the stored shards of some "
                "rank are missing (a checkpoint published without every rank's part). It is not loadable; resume from "
                "an intact checkpoint."
            )


def check_dcp_inventory(directory: Path, manifest: dict[str, Any]) -> int:
    """Every listed DCP ``.metadata`` describes the tensors the manifest recorded, covers each of them completely
    (:func:`check_dcp_coverage`), and every payload it names is listed too (reads the metadata with the restricted
    unpickler, so it imports torch). Returns how many."""
    files = manifest["files"]
    count = 0
    for name, row in sorted(files.items()):
        if name.rsplit("/", 1)[-1] != ".metadata":
            continue
        count += 1
        folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        metadata_dir = (Path(directory) / name).parent
        metadata = read_dcp_metadata(metadata_dir)
        if "schema" in row and dcp_schema(metadata_dir, metadata) != row["schema"]:
            raise CheckpointIntegrityError(
                f"DCP metadata {Path(directory) / name} describes other tensors than {Path(directory) / MANIFEST} "
                "recorded"
            )
        check_dcp_coverage(metadata, Path(directory) / name)
        for payload in sorted(dcp_payload_names(metadata)):
            if f"{folder}{payload}" not in files:
                raise CheckpointIntegrityError(
                    f"{Path(directory) / name} names payload {folder}{payload}, which the inventory of "
                    f"{Path(directory) / MANIFEST} does not list: the manifest does not prove what DCP would read"
                )
    return count


def hashed_names(manifest: dict[str, Any], *, full: bool) -> list[str]:
    """Inventory entries whose hash a verification checks: all recorded hashes (``full``) or the control files
    and small payloads only (a quick check)."""
    return sorted(name for name, row in manifest["files"].items()
                  if _row_hash(row) is not None and (full or not _is_large_payload(name, row["size"])))


def check_hashes(directory: Path, manifest: dict[str, Any], names: Iterable[str],
                 progress: Callable[[int], None] | None = None) -> int:
    """Re-hash ``names`` (in parallel) and compare with the manifest; returns how many were checked.
    ``progress(nbytes)`` is called (from worker threads) after each file."""
    files = manifest["files"]
    names = list(names)
    root = Path(directory)

    def check(name: str) -> None:
        algorithm, expected = _row_hash(files[name])  # type: ignore[misc]
        size, digest = hash_file(root / relative_inside(name), algorithm)
        if size != files[name]["size"] or digest != expected:
            raise CheckpointIntegrityError(
                f"Checkpoint file {root / name} does not match its {algorithm} in {root / MANIFEST} (corrupted or "
                "changed after the checkpoint was published)"
            )
        if progress is not None:
            progress(size)

    if names:
        with ThreadPoolExecutor(max_workers=min(4, len(names), os.cpu_count() or 1)) as pool:
            list(pool.map(check, names))
    return len(names)


def verify_manifest(directory: Path, manifest: dict[str, Any], *, full: bool, dcp: bool = True,
                    private_patterns: Iterable[re.Pattern[str]] = (),
                    progress: Callable[[int], None] | None = None, keys: Keyring | None = None) -> dict[str, Any]:
    """Raise :class:`CheckpointIntegrityError` unless ``directory`` matches its manifest; return what was checked.

    ``full=True`` checks every recorded hash; ``full=False`` the control files and small payloads only. The
    report: ``files`` (inventory size), ``hashed`` (files whose content was checked), ``size_only`` (checked by
    size only), ``algorithm``, ``integrity`` (the mode it was saved with), ``extra`` (unlisted files no loader
    reads, accepted) and ``dcp_metadata`` (DCP directories whose schema and payload listing were checked; only
    with ``dcp=True``, which imports torch) and ``signed_by`` (the key id whose authenticator verified, ``None``
    when no verification key is configured: ``keys``, see :func:`check_structure`).
    """
    report = check_structure(directory, manifest, private_patterns=private_patterns, keys=keys)
    names = hashed_names(manifest, full=full)
    report["hashed"] = check_hashes(directory, manifest, names, progress)
    report["size_only"] = report["files"] - report["hashed"]
    report["dcp_metadata"] = check_dcp_inventory(directory, manifest) if dcp else 0
    return report
