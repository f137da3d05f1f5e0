"""Content identity of a frozen model source: :func:`checkpoint_fingerprint`."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from .._manifest import sha256_file
from ..errors import CheckpointIntegrityError
from ._common import _EXPORT_FILES, PathLike
from ._layout import _locate_weights


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


def checkpoint_fingerprint(path: PathLike) -> list[FingerprintEntry]:
    """Content identity of a frozen model source: one entry per file, sorted by name.

    A single file is named ``"weights"``; a Diffusers directory contributes its weight files plus ``config.json``
    and any index, named relative to the directory so that a moved or copied checkpoint has the same identity.
    Every byte is hashed (streamed, bounded memory), so an in-place replacement with the same names and sizes is
    detected. Raises :class:`CheckpointIntegrityError` if a file changes while it is hashed and
    :class:`NoCheckpointError` if there are no weights.
    """
    path = Path(path)
    files = list(_locate_weights(path).files)
    if path.is_dir():
        files += [path / name for name in _EXPORT_FILES if (path / name).is_file()]
    entries: list[FingerprintEntry] = []
    for file in sorted(set(files)):
        size, sha256 = _hash_file(file)
        name = file.relative_to(path).as_posix() if path.is_dir() else "weights"
        entries.append({"name": name, "size": size, "sha256": sha256})
    return entries
