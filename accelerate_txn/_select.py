"""Selecting the newest complete checkpoint, and retention. File logic only: callers run these on rank 0
(or every rank) and agree on the result themselves."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from ._config import checkpoint_config
from ._descriptor import participants
from ._manifest import PROTOCOL, read_manifest, verify_manifest
from ._required import check_required_files
from .errors import CheckpointIntegrityError, NoCheckpointError

logger = logging.getLogger(__name__)
CHECKPOINT_NAME = re.compile(r"checkpoint[-_](\d+)\Z")


def numbered_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(number, path)`` of every ``checkpoint_N`` directory under ``root``, oldest first."""
    if not Path(root).is_dir():
        return []
    found = []
    for path in Path(root).iterdir():
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def complete_run_id(path: Path) -> str | None:
    """The run id of a published checkpoint with a readable manifest, else ``None``."""
    try:
        manifest = read_manifest(path)
    except CheckpointIntegrityError:
        return None
    if not manifest or manifest.get("protocol") != PROTOCOL or manifest.get("status") != "complete":
        return None
    run_id = manifest.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def latest_training_checkpoint(output_dir: str | Path, owners: Any = None) -> str | None:
    """The newest complete checkpoint under ``output_dir`` (a directory of ``checkpoint_N``), or ``None``.

    Candidates are tried newest first; a broken one (no or invalid manifest, missing or truncated files) is
    skipped with a log line saying why. Pass ``owners`` (an Accelerator or ``{component: Accelerator}``) to
    also require that the checkpoint holds their components and required files, and to consider legacy
    (manifest-less) checkpoints when every owner allows them. Uses no collectives.
    Raises :class:`NoCheckpointError` if candidates exist but none is complete.
    """
    group = participants(owners) if owners is not None else None
    candidates = numbered_checkpoints(Path(output_dir))
    reasons = []
    for _number, path in reversed(candidates):
        try:
            manifest = read_manifest(path)
            if manifest is not None:
                verify_manifest(path, manifest, full=False)
                if group is not None and set(manifest.get("components", {})) != set(group):
                    raise CheckpointIntegrityError(
                        f"it holds components {sorted(manifest.get('components', {}))}, not {sorted(group)}"
                    )
            elif group is None or not all(checkpoint_config(owner).allow_legacy for owner in group.values()):
                raise CheckpointIntegrityError("it has no completion manifest")
            if group is not None:
                for name, owner in group.items():
                    check_required_files(owner, path / name, range(owner.num_processes))
        except CheckpointIntegrityError as exc:  # configuration errors are not a reason to pick an older one
            reasons.append(f"{path.name}: {exc}")
            logger.warning("Skipping checkpoint %s: %s", path, exc)
            continue
        return str(path)
    if candidates:
        raise NoCheckpointError(
            f"No complete checkpoint in {output_dir}; skipped " + "; ".join(reasons)
            + ". Restore an intact copy or start a new run directory."
        )
    return None


def prune(root: Path, run_id: str, limit: int, newest: Path) -> list[Path]:
    """Delete the oldest complete checkpoints of ``run_id`` beyond ``limit`` (counting ``newest``).

    Never deletes ``newest``, an incomplete directory (a save may be in progress, or it is evidence), or
    another run's checkpoint. Returns the deleted paths.
    """
    ours = [(number, path) for number, path in numbered_checkpoints(root) if complete_run_id(path) == run_id]
    deleted = []
    excess = len(ours) - limit
    for _number, path in ours:
        if excess <= 0:
            break
        if path.resolve() == Path(newest).resolve():
            continue
        logger.info("Retention (total_limit=%d): deleting %s", limit, path)
        shutil.rmtree(path)
        deleted.append(path)
        excess -= 1
    return deleted
