"""Atomic publish of an export directory: staging, lock, recovery of a killed export, directory swap.

An export is written into a hidden staging sibling (``accelerate_txn._staging``) and published by a rename.
Re-exporting over an earlier export swaps the two directories with one atomic ``renameat2(RENAME_EXCHANGE)`` on
Linux (two renames elsewhere, recovered by the next export if interrupted): ``store.posix.replace_directory``.
An export's signature (``sign_key=``, :mod:`._signature`) is written into the staging directory before the publish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointExistsError
from ..store.posix import (
    DirectoryLock,
    StagedDirectory,
    create_directory,
    fsync_tree,
    new_id,
    recover_replaced,
    remove_tree,
    replace_directory,
    staging_leftovers,
)
from ._common import EXPORT_FILES, EXPORT_WEIGHT_PREFIXES, SIGNATURE_NAME, PathLike, examples

logger = logging.getLogger(__name__.rpartition(".")[0])  # "accelerate_txn.weights", as before the split


def _recover_interrupted_export(final: Path) -> None:
    """Undo what a killed export of ``final`` left behind. Call only while holding ``DirectoryLock(parent)``.

    * ``final`` missing but set aside (a kill between the two renames of the fallback swap): renamed back, and
      set-aside copies next to a present ``final`` deleted (``store.posix.recover_replaced``).
    * Staging directories of ``final``: a writer died before publishing (the lock proves it is dead); delete.
    """
    recover_replaced(final.parent, final.name)
    for leftover, _run in staging_leftovers(final.parent):
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
        if entry.is_dir() or not (entry.name in (*EXPORT_FILES, SIGNATURE_NAME)
                                  or entry.name.startswith(EXPORT_WEIGHT_PREFIXES))
    )
    if foreign:
        raise CheckpointExistsError(
            f"Refusing to replace {final}: besides model weights it holds {examples(foreign)}, which a re-export "
            "would delete. Move them away or export to another directory."
        )


def publish_export(output_dir: PathLike, write: Callable[[Path], None],
                   sign: Callable[[Path, str], None] | None = None) -> Path:
    """Run ``write(staging)`` (then ``sign(staging, NAME)``, NAME being ``output_dir``'s name: the export's
    signature, :class:`._signature.ExportSigner`) and publish the staged directory onto ``output_dir`` atomically.

    Holds ``DirectoryLock(parent)`` throughout, so two exporters never interleave (the second raises
    :class:`~accelerate_txn.errors.CheckpointLockedError`). The previous export, if any, stays untouched until the
    new one is complete and fsynced. On any failure the staging directory is removed and the old export remains.
    """
    final = Path(output_dir).absolute()
    create_directory(final.parent)  # refuses an object-store FUSE mount (store.mounts) before creating anything
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
            if sign is not None:
                sign(staged.staging, final.name)
            if replacing:
                fsync_tree(staged.staging)
                replace_directory(staged.staging, final, staged.txid)
            else:
                staged.publish()
        except BaseException:
            staged.discard()
            raise
    logger.info("Published weight export %s", final)
    return final
