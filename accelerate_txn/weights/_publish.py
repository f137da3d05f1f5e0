"""Atomic publish of an export directory: staging, lock, recovery of a killed export, directory swap.

An export is written into a hidden staging sibling (``accelerate_txn._staging``) and published by a rename.
Re-exporting over an earlier export swaps the two directories with one atomic ``renameat2(RENAME_EXCHANGE)`` on
Linux (two renames elsewhere, recovered by the next export if interrupted).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointExistsError
from ..store.posix import DirectoryLock, StagedDirectory, fsync_path, fsync_tree, new_id, remove_tree, staging_leftovers
from ._common import EXPORT_FILES, PathLike, examples

logger = logging.getLogger(__name__.rpartition(".")[0])  # "accelerate_txn.weights", as before the split

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _exchange_directories(first: Path, second: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; ``False`` where unsupported.

    Generic: could live in ``store/posix.py``. Unsupported means a non-Linux OS, an old libc or kernel, or a
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
        remove_tree(leftover)
    for leftover, _run in staging_leftovers(parent):
        if leftover.name.startswith(f".{final.name}.staging-"):
            logger.warning("Removing %s: staging directory of an export that did not finish", leftover)
            remove_tree(leftover)


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
        if entry.is_dir() or not (entry.name in EXPORT_FILES or entry.name.startswith("diffusion_pytorch_model"))
    )
    if foreign:
        raise CheckpointExistsError(
            f"Refusing to replace {final}: besides model weights it holds {examples(foreign)}, which a re-export "
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
        remove_tree(old)
    except OSError as exc:
        logger.warning("Published %s but could not remove the previous export %s: %s", final, old, exc)


def publish_export(output_dir: PathLike, write: Callable[[Path], None]) -> Path:
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
