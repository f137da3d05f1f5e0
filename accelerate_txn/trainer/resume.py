"""The Trainer resume: which ``checkpoint-N`` ``train(resume_from_checkpoint=...)`` loads, verified on every rank
before Trainer loads anything.

Collective: every rank calls :func:`resolve_resume` from the wrapped ``Trainer.train``, before the native ``train``
runs (nothing of the model, optimizer, scheduler, RNG or Trainer state has been touched yet).

* ``resume_from_checkpoint=True``: rank 0 lists ``checkpoint-N`` under ``args.output_dir`` newest first and skips,
  with a logged reason, every one that is not complete (``core.select.checkpoint_candidates``: no or invalid
  manifest, missing, truncated, extra or corrupt control files, incomplete DCP metadata, a file a resume reads
  missing for some saving rank); then every rank re-hashes the files it will read (its RNG file and DCP shards; rank
  0 the shared files), then every rank reads, safely, every file its Trainer resume reads (:mod:`.reads`: its own RNG
  file, ``scheduler.pt``, ``trainer_state.json``, ...; no arbitrary unpickling), and a candidate that fails on any
  rank is skipped for the next older one. A manifest-less (native Trainer) checkpoint is taken only when no complete
  one exists, with a warning, after checking the files a resume reads are there and readable on every rank. No
  directory at all: native Trainer's own ``ValueError``; only incomplete ones:
  :class:`~accelerate_txn.errors.NoCheckpointError` listing why each was skipped.
* an explicit path: the same checks, on every rank, without fallback: the same
  :class:`~accelerate_txn.errors.CheckpointIntegrityError` on every rank, no hang.

Once a checkpoint verified, every rank compares what decides the resumed data order and position (dataset length,
batch size, gradient accumulation, ``drop_last``, sampler and its seed) with its manifest's record (:mod:`.order`):
a change is the same :class:`~accelerate_txn.errors.CheckpointConfigurationError` on every rank, before anything
loads (never a reason to fall back to an older checkpoint), unless ``ignore_data_skip`` accepts it.

Every rank holds each candidate in use (``store.base.Hold``) from before its verification; the one chosen stays
held, returned to the caller, until Trainer has read all of it (:mod:`.restore`), so retention, ``accelerate-txn
prune`` and another job's retention keep it meanwhile (``CheckpointLockedError``: kept for their next run). A skipped
candidate is released at once, and every hold on any error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..core import quarantine
from ..core.manifest import check_hashes, hashed_names, writer_rank
from ..core.ranks import on_main, rank, run_phase, world_size
from ..core.select import check_candidate, checkpoint_candidates, numbered_checkpoints, refuse_transient
from ..errors import CheckpointIntegrityError, NoCheckpointError
from ..store import local_store
from ..store.base import Hold
from .layout import RANK_TEMPLATES, TrainerRules
from .order import check_data_order
from .reads import check_resume_files

logger = logging.getLogger(__name__)


def _own_hashes(path: Path, manifest: dict[str, Any] | None) -> None:
    """Every rank re-hashes the recorded files it is responsible for (its own shards and RNG file; rank 0 the
    shared ones)."""
    if manifest is None:
        return
    world, me = world_size(), rank()
    check_hashes(path, manifest, [name for name in hashed_names(manifest, full=True)
                                  if writer_rank(name, min(world, int(manifest["trainer"]["world_size"])),
                                                 RANK_TEMPLATES) == me])


def _verify(trainer: Any, path: Path, rules: TrainerRules) -> str | None:
    """Every rank: ``path`` passes the checks (rank 0 the structure, every rank its own hashes, then every rank reads
    the files its resume reads: :mod:`.reads`; then every rank compares what decides the data order with the
    checkpoint's record: :mod:`.order`); returns the run id of its manifest (``None`` for a native
    checkpoint). Raises the same error on every rank."""
    manifest = on_main(lambda: check_candidate(path, rules), f"Checking {path}")
    run_phase(lambda: _own_hashes(path, manifest), f"Verifying the content hashes of {path}")
    check_resume_files(trainer, path, manifest)
    run_phase(lambda: check_data_order(trainer, path, manifest),
              f"Comparing what decides the data order with the one {path} was saved with")
    if manifest is None and rank() == 0:
        logger.warning("Resuming from %s, which has no completion manifest (saved by native Trainer): its files a "
                       "resume reads are present, but its completeness cannot be proven", path)
    return manifest["run_id"] if manifest is not None else None


def _held_and_verified(trainer: Any, path: Path, rules: TrainerRules) -> tuple[str | None, Hold]:
    """Every rank holds ``path`` in use, then verifies it (:func:`_verify`): its run id and this rank's hold, which
    the caller releases; on any error the hold is released here, on every rank."""
    hold = local_store().hold(path)
    try:
        run_phase(hold.acquire, f"Holding {path} in use")
        return _verify(trainer, path, rules), hold
    except BaseException:
        hold.release()
        raise


def resolve_resume(trainer: Any, resume: Any) -> tuple[Any, str | None, Hold | None]:
    """The ``resume_from_checkpoint`` native ``train`` gets, the run id of the checkpoint, and this rank's hold on it
    (``None`` when there is no checkpoint at all), which the caller releases (see the module docstring). ``resume`` is
    ``True`` or a path (``None``/``False`` never reach here)."""
    rules = TrainerRules(world_size())
    if resume is True:
        root = Path(trainer.args.output_dir).expanduser().absolute()
        found = on_main(lambda: _listed(root, rules), f"Selecting the newest complete checkpoint in {root}")
        if found is None:
            return True, None, None  # nothing at all: native Trainer raises its own ValueError, as without the library
        candidates, reasons = found
        for candidate in candidates:
            try:
                return (candidate, *_held_and_verified(trainer, Path(candidate), rules))
            except CheckpointIntegrityError as exc:  # raised on every rank alike: every rank moves on
                reasons.append(f"{Path(candidate).name}: {exc}")
                if rank() == 0:
                    logger.warning("Skipping checkpoint %s: %s", candidate, exc)
        raise NoCheckpointError(
            f"No complete checkpoint to resume from in {root}; skipped " + "; ".join(reasons)
            + ". Restore an intact copy, or start without resume_from_checkpoint.")
    path = Path(resume).expanduser().absolute()

    def exists() -> None:
        if not path.is_dir():
            raise NoCheckpointError(f"Checkpoint directory {path} does not exist")
        refuse_transient(path)
        if rank() == 0:  # an explicit path still loads a quarantined checkpoint: said, not refused
            quarantine.warn_if_set_aside(path)

    run_phase(exists, f"Checking {path}")
    return (str(resume), *_held_and_verified(trainer, path, rules))


def _listed(root: Path, rules: TrainerRules) -> tuple[list[str], list[str]] | None:
    """Rank 0: candidates best first and skip reasons; ``None`` when ``root`` holds no ``checkpoint-N`` at all."""
    if not numbered_checkpoints(root):
        return None
    candidates, reasons = checkpoint_candidates(root, rules)
    return [str(path) for path in candidates], reasons

