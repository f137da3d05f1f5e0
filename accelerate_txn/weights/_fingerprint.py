"""Content identity of a frozen model source: :func:`checkpoint_fingerprint`."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from ..core.manifest import sha256_file
from ..errors import CheckpointError, CheckpointIntegrityError
from ._common import EXPORT_FILES, PathLike, examples
from ._layout import locate_weights


class FingerprintEntry(TypedDict):
    """One file of a :func:`checkpoint_fingerprint`: its name relative to the source, size and SHA-256."""

    name: str
    size: int
    sha256: str


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


_IDENTITY = ("st_dev", "st_ino", "st_size", "st_mtime_ns")


def _files(path: Path) -> list[Path]:
    """The files a fingerprint covers: the weights exactly as the loaders find them, plus config and indexes."""
    files = list(locate_weights(path).files)
    if path.is_dir():
        files += [path / name for name in EXPORT_FILES if (path / name).is_file()]
    return sorted(set(files))


def _identities(path: Path, files: list[Path]) -> dict[Path, tuple[int, ...]]:
    """``(st_dev, st_ino, size, mtime_ns)`` of ``path`` itself and of every file."""
    return {entry: tuple(getattr(entry.stat(), field) for field in _IDENTITY) for entry in (path, *files)}


def checkpoint_fingerprint(path: PathLike) -> list[FingerprintEntry]:
    """Content identity of a frozen model source: one entry per file, sorted by name.

    A single file is named ``"weights"``; a Diffusers directory contributes its weight files - found exactly as
    the loaders find them (safetensors index, ``diffusion_pytorch_model.safetensors``, ``.bin`` index,
    ``diffusion_pytorch_model.bin``) - plus ``config.json`` and any index, named relative to the directory so
    that a moved or copied checkpoint has the same identity. Other files in the directory are not covered. Every
    byte is hashed (streamed, bounded memory), so an in-place replacement with the same names and sizes is
    detected. The directory and every file are identified (device, inode, size, mtime) before and after the whole
    hash: if anything changed, or a file vanished or could not be read, :class:`CheckpointIntegrityError` is
    raised rather than a fingerprint of a state that may never have existed. :class:`NoCheckpointError` if there
    are no weights.
    """
    path = Path(path)
    try:
        files = _files(path)
        before = _identities(path, files)
        entries: list[FingerprintEntry] = []
        for file in files:
            size, sha256 = _hash_file(file)
            name = file.relative_to(path).as_posix() if path.is_dir() else "weights"
            entries.append({"name": name, "size": size, "sha256": sha256})
        after = _identities(path, _files(path))
    except CheckpointError:  # NoCheckpointError is an OSError too: keep the library's own errors as they are
        raise
    except OSError as exc:
        raise CheckpointIntegrityError(
            f"{exc.filename or path} could not be read while {path} was being fingerprinted ({exc.strerror or exc}): "
            "the model source is being replaced (a concurrent export?) or deleted. Fingerprint it again once it is "
            "frozen."
        ) from None
    if before != after:
        changed = sorted(str(entry) for entry in before.keys() | after.keys() if before.get(entry) != after.get(entry))
        raise CheckpointIntegrityError(
            f"{path} changed while it was being fingerprinted ({examples(changed)}): the model source is not "
            "frozen (a concurrent export, sync or download). Fingerprint it again once nothing writes it."
        )
    return entries
