"""The Trainer save transaction: one native ``Trainer._save_checkpoint`` published atomically as ``checkpoint-N``.

Collective: every rank of the Trainer's world runs it (native ``_save_checkpoint`` is called on every rank). Order,
each step a rank phase (a failure anywhere raises the same error everywhere):

1. every rank agrees on the destination ``RUN_DIR/checkpoint-N`` and ``save_total_limit``; rank 0 chooses the run id
   (the one this Trainer resumed from or saved before, else a new one);
2. (the shared transaction, ``core.transaction``, with the Trainer's :data:`TERMS`, also runs 4-6) rank 0 takes the
   directory lock of ``RUN_DIR``, puts back a checkpoint whose replacement was killed, removes dead
   writers' leftovers, and creates the hidden staging sibling ``RUN_DIR/.checkpoint-N.staging-<run>-<txid>/``;
3. the native save runs with Trainer's run directory pointed at that staging directory (``internals``), so it
   writes ``.../staging/checkpoint-N/`` (model, optimizer, scheduler, scaler, RNG, ``trainer_state.json``) and its
   own rotation finds nothing to delete there; paths Trainer recorded into staging (``best_model_checkpoint``) are
   mapped to the published path, and rank 0 rewrites ``trainer_state.json`` with them; for a PEFT model rank 0
   adds the adapter's ``adapter_config.json`` (``adapters.write_adapter_config``);
4. every rank hashes (XXH3-128) and fsyncs the files it wrote (its DCP shards and RNG file; rank 0 the shared ones);
5. rank 0 checks that the rows cover exactly the staged tree and every file a resume reads (every rank's RNG file,
   the DCP metadata, ``trainer_state.json``) and that every DCP tensor is covered, fsyncs the directories, writes
   the manifest last, renames the tree onto ``checkpoint-N`` (an existing one is replaced atomically), fsyncs the
   parent, removes the empty staging directory;
6. retention: with ``save_total_limit``, rank 0 deletes the oldest complete checkpoints of the same run beyond it,
   never the newest nor ``best_model_checkpoint`` (renamed aside first, then deleted: ``core.select.prune``).

At the end of a run with ``save_total_limit=1`` and a best model, Trainer removes every checkpoint but the best;
:func:`end_of_training_removal` does it instead, with the same retention (complete checkpoints of the same run only,
under the directory lock, each renamed aside before it is deleted).

On failure before the publish the staging directory is removed and nothing is published; the Trainer's state is
what the native save left (as after a native failure). ``core.faults.point`` marks the instants the crash tests kill
a rank at.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

from ..core import faults
from ..core.ranks import agree, gather_rows, on_main, rank, run_phase, world_size
from ..core.signing import Keyring, environment_keyring
from ..core.transaction import Terms, Transaction, own_rows, prune_outside_a_save, retain
from ..errors import CheckpointError
from ..runtime.async_save import capture_dcp_saves
from ..store import local_store
from ..store.base import new_id
from .adapters import ADAPTER_CONFIG, write_adapter_config
from .internals import finalize_trial, output_dir, redirected_output_dir, save_arguments
from .layout import FRONTEND, RANK_TEMPLATES, TRAINER_STATE, check_files, required_files, training_record
from .versions import trainer_versions

logger = logging.getLogger(__name__)
PREFIX = "checkpoint"
#: The Trainer's own files at a checkpoint's top level beyond what a loader reads (``core.carry``: never carried).
TRAINER_NAMES = (TRAINER_STATE, "checkpoint-is-incomplete.txt")  # transformers' PREFIX_CHECKPOINT_DIR: checkpoint-N
INTEGRITY = "full"  # every file hashed (XXH3-128 costs far less than writing the file)
LOCK_TIMEOUT = 300.0  # seconds rank 0 waits for another writer of the same output directory
#: The run id of each Trainer: the run it resumed from or last saved (so retention prunes that run's checkpoints).
RUN_IDS: WeakKeyDictionary[Any, str] = WeakKeyDictionary()


#: The Trainer front end's terms of the shared transaction (``core.transaction``): the native save writes
#: ``STAGING/checkpoint-N/`` (Trainer's run directory redirected into staging), a directory with Trainer's
#: ``trainer_state.json`` is one of its checkpoints (replaced, the user's files in it carried).
TERMS = Terms(
    native="a native save",
    instead="Move it away, or set another output_dir.",
    elsewhere="set another output_dir",
    names=TRAINER_NAMES,
    own_checkpoint=lambda path: (path / TRAINER_STATE).is_file(),
    not_own=f", and it is no Trainer checkpoint (no {TRAINER_STATE})",
    nested=True,
    other_runs=False,
)


def transaction(final: Path, run_id: str) -> Transaction:
    """Rank 0's side of one Trainer save (constructed inside a phase): the shared transaction with the Trainer's
    terms, over the run directory's lock."""
    return Transaction(final, run_id, store=local_store(), terms=TERMS, lock_timeout=LOCK_TIMEOUT)


def _publish(reservation: Transaction, record: dict[str, Any], rows: dict[str, dict[str, Any]],
             keys: Keyring) -> str:
    """Rank 0: the publish of the shared transaction with the Trainer's proof (every file a resume reads) and
    manifest fields."""

    def check(tree: Path, rows: dict[str, dict[str, Any]]) -> None:
        record["required"] = required_files(record, set(rows))
        check_files(tree, set(rows), record, record["required"])

    versions = record.pop("versions")
    fields = {"frontend": FRONTEND, "trainer": record,
              "progress": {"checkpoint": record["global_step"], "global_step": record["global_step"]},
              "versions": versions}
    return str(reservation.publish(rows, fields, integrity=INTEGRITY, signer=keys.signer, check=check))


def published_path(path: str | None, staging: Path, run_dir: Path) -> str | None:
    """``path`` with a staging prefix mapped to the run directory (a path Trainer recorded during the save)."""
    if path is None:
        return None
    try:
        relative = Path(path).absolute().relative_to(staging)
    except ValueError:
        return path
    return str(run_dir / relative)


def _map_recorded_paths(trainer: Any, staging: Path, run_dir: Path, tree: Path) -> None:
    """Every rank: paths the native save recorded into staging name the published checkpoint; rank 0 (Trainer's
    ``should_save``) rewrites ``trainer_state.json`` if one changed."""
    state = trainer.state
    mapped = published_path(state.best_model_checkpoint, staging, run_dir)
    if mapped != state.best_model_checkpoint:
        state.best_model_checkpoint = mapped
        if trainer.args.should_save and (tree / TRAINER_STATE).is_file():
            state.save_to_json(str(tree / TRAINER_STATE))


def protected_save(wrapped: Any, trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``wrapped(*args, **kwargs)`` (native ``_save_checkpoint``) as a transaction; see the module docstring."""
    trial = save_arguments(args, kwargs)
    run_dir = run_phase(lambda: Path(output_dir(trainer, trial)).expanduser().absolute(), "Resolving the run directory")
    final = run_dir / f"{PREFIX}-{trainer.state.global_step}"
    limit = trainer.args.save_total_limit
    limit = limit if isinstance(limit, int) and limit > 0 else None
    # Key files named by the environment (``core.signing``): read by every rank, compared by key id only.
    keys = run_phase(environment_keyring, "Reading the signing keys (ACCELERATE_TXN_SIGNING_KEY_FILE)")
    agree({"path": str(final), "limit": limit, "keys": keys.key_ids()},
          "the Trainer checkpoint path, save_total_limit and signing keys")
    run_id: str = on_main(lambda: RUN_IDS.get(trainer) or new_id(), "Choosing the run id")
    reservation = run_phase(lambda: transaction(final, run_id) if rank() == 0 else None,
                            "Preparing the directory lock")
    result: Any = None
    try:
        tree = Path(on_main(lambda: str(reservation.open()), f"Reserving {final}"))  # type: ignore[union-attr]
        staging = tree.parent

        written: dict[Path, tuple[int, str]] = {}

        def native() -> Any:
            # The FSDP DCP files are written as in a protected Accelerate save (``fsdp.dcp_writer``, hashed as
            # written: ``runtime.async_save.capture_dcp_saves``).
            with redirected_output_dir(trainer, str(staging)), capture_dcp_saves(False, staging) as capture:
                try:
                    return wrapped(*args, **kwargs)
                finally:
                    written.update(capture.hashes)

        result = run_phase(native, f"Saving the Trainer checkpoint into {tree}")
        run_phase(lambda: _map_recorded_paths(trainer, staging, run_dir, tree), "Recording the published paths")
        on_main(lambda: write_adapter_config(trainer, tree), f"Writing the adapter's {ADAPTER_CONFIG} into {tree}")
        faults.point("save:after-native-save")
        record = {**training_record(trainer), "versions": trainer_versions()}
        rows = gather_rows(run_phase(lambda: own_rows(tree, RANK_TEMPLATES, INTEGRITY, written),
                                     "Hashing and flushing the staged checkpoint"), world_size())
        published = on_main(lambda: _publish(reservation, record, rows, keys),  # type: ignore[arg-type]
                            f"Publishing {final}")
        RUN_IDS[trainer] = run_id
        faults.point("save:after-rename")
        keep = [Path(trainer.state.best_model_checkpoint)] if trainer.state.best_model_checkpoint else []
        retain(reservation, published, limit, keep=keep, keys=keys, what="Retention (save_total_limit)")
        if rank() == 0:
            logger.info("Published Trainer checkpoint %s (global step %d)", published, trainer.state.global_step)
    finally:
        if reservation is not None:
            reservation.close()
    return result


#: Where Trainer's own end-of-training listing looks while :func:`protected_finalize` runs: a name that never exists
#: in the run directory, so Trainer globs no ``checkpoint-*`` and removes nothing itself.
NO_LISTING = ".accelerate-txn-no-listing"


def end_of_training_removal(trainer: Any, trial: Any) -> list[str]:
    """Trainer's end-of-training removal, through the library's retention: with ``save_total_limit=1`` and a best
    model, rank 0 deletes every complete checkpoint of this Trainer's run but ``best_model_checkpoint`` (Trainer's own
    condition; the newest stays if the best is not a complete checkpoint of the run), under the directory lock, each
    renamed aside before it is deleted (``core.select.prune``). Another run's checkpoints, native or incomplete
    directories are left alone. Collective (every rank calls it); a failure is logged, not raised: training is done
    and every remaining checkpoint is complete. Returns the deleted paths (rank 0)."""
    best = trainer.state.best_model_checkpoint
    run_id = RUN_IDS.get(trainer)
    if best is None or trainer.args.save_total_limit != 1 or run_id is None:
        return []
    run_dir = Path(output_dir(trainer, trial)).expanduser().absolute()

    def remove() -> list[str]:
        return [str(path) for path in prune_outside_a_save(run_dir, run_id, 1, store=local_store(),
                                                           lock_timeout=LOCK_TIMEOUT, keep=[Path(best)], newest=False)]

    try:
        return on_main(remove, "End-of-training removal (save_total_limit=1)") or []
    except CheckpointError as exc:
        if rank() == 0:
            logger.warning("The end-of-training removal of %s failed (every checkpoint left is complete): %s",
                           run_dir, exc)
        return []


def protected_finalize(wrapped: Any, trainer: Any, series: str, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """Run ``wrapped`` (the method that ends a training run, ``internals.FINALIZE``) with Trainer's end-of-training
    listing pointed at :data:`NO_LISTING`, then :func:`end_of_training_removal`. Saves inside it (4.57's
    ``_inner_training_loop``) redirect again, to their staging directory, and put this back."""
    trial = finalize_trial(series, args, kwargs)
    run_dir = Path(output_dir(trainer, trial))
    with redirected_output_dir(trainer, str(run_dir / NO_LISTING)):
        result = wrapped(*args, **kwargs)
    end_of_training_removal(trainer, trial)
    return result
