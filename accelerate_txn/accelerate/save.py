"""``save_training_checkpoint``: publish one Accelerator (or a named group) as one atomic checkpoint.

Order (each step a rank phase: a failure anywhere raises the same error everywhere):

1. preflight on every rank: descriptor, no pending gradients, not mid-accumulation, optional finite check;
2. every rank agrees on the path, descriptors, policies, retention and hook counts (fixed-size digests);
3. rank 0 takes the directory lock, puts back a checkpoint whose replacement was killed, decides whether an
   existing destination is replaced (``configure_checkpointing(overwrite=...)``), removes dead writers' leftovers
   and creates the staging sibling;
4. native ``save_state`` of every component into staging (user hooks synchronised);
5. every rank checks its required files, then hashes and fsyncs the files it wrote (its DCP shards, its RNG and
   private state; rank 0 also every shared file): the flush and the content hashes cost one read of each file,
   spread over the ranks;
6. rank 0 gathers the rows, checks that they cover exactly the staged tree and every rank's files, fsyncs the
   directories, writes the manifest last (fsynced), renames staging onto the final name (or swaps it with the
   checkpoint it replaces, deleting that one after the commit), fsyncs the
   parent, then prunes older complete checkpoints of the same run (renamed aside first, then deleted).

Steps 3, 5 and 6 are the shared transaction (``core.transaction``) with this front end's terms (:data:`TERMS`).
``core.faults.point`` marks the instants the crash-consistency tests kill a rank at.

On failure the iteration counters are restored and staging is removed; nothing is published.

With ``async_save`` (see ``runtime.async_save``) steps 1-4 run in the caller (the DCP writes of step 4 staged in memory)
and the DCP writes, then steps 5-6 (``_finish``) run in a background thread over a dedicated process group.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core import faults as _faults
from ..core.manifest import check_rank_coverage, rank_file_pattern, with_metadata_cache
from ..core.ranks import agree, background_group, gather_rows, on_main, rank, run_phase, world_size
from ..core.remote import is_url
from ..core.remote import split as split_url
from ..core.select import CHECKPOINT_NAME
from ..core.transaction import Policy, Terms, Transaction, own_rows, retain
from ..errors import CheckpointConfigurationError
from ..fsdp.host_memory import StagingPool, copy_fence
from ..fsdp.optimizer_state import raw_optimizer
from ..runtime import async_save as _async
from ..runtime.accelerate_internals import load_state_pre_hooks, prepared_models, prepared_optimizers, save_state_pre_hooks
from ..runtime.versions import installed_versions, require_supported_versions
from ..store import local_store
from ..store.base import new_id
from . import remote as _remote
from .arrival import check_arrival
from .config import checkpoint_config, ensure_not_failed, group_keys, read_configs
from .descriptor import describe, participants, path_of
from .elastic import POLICY as RESHARD_POLICY
from .finite import check_finite_state
from .gradients import pending_gradient, skipped_step
from .loader_state import write_loader_states
from .native import automatic_naming_off, fsdp_routing, native_method, synchronized_hooks
from .required import check_required_files, rank_files

logger = logging.getLogger(__name__)


def optimizer_steps(owner: Any) -> list[int | None]:
    """The optimizer steps taken, one per prepared optimizer of ``owner``: the largest ``step`` in its per-parameter
    state, read from the first parameter with state in each parameter group (one value per group, so a GPU model
    with thousands of parameters pays a few device reads, not thousands). Adam, AdamW, NAdam, RAdam, Adamax,
    Adagrad, RMSprop, Adadelta, ASGD and Rprop count every ``step()`` there (a step the gradient scaler skips is
    not counted), and the count is part of the optimizer state, so it survives a restore. ``None`` for an optimizer
    that keeps no count (plain SGD, SGD with momentum) or has not stepped yet. Unlike ``accelerator.step`` (which
    moves only inside ``accelerator.accumulate()``) or a scheduler's ``last_epoch`` (Accelerate steps a prepared
    scheduler once per process), it is the number a training loop sees."""
    counts: list[int | None] = []
    for optimizer in prepared_optimizers(owner):
        raw = raw_optimizer(optimizer)
        found: int | None = None
        for group in raw.param_groups:
            state = next((raw.state[p] for p in group.get("params", ()) if raw.state.get(p)), None)
            step = state.get("step") if isinstance(state, dict) else None
            if step is None:
                continue
            value = step.item() if hasattr(step, "item") else step
            if isinstance(value, (int, float)) and value >= 0:
                found = max(found or 0, int(value))
        counts.append(found)
    return counts


def progress_record(path: Path, owners: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``progress``: the checkpoint number (``N`` of ``checkpoint_N``, ``None`` for another name) and
    each component's :func:`optimizer_steps`. Informational: never verified, never compared with a live run."""
    match = CHECKPOINT_NAME.fullmatch(Path(path).name)
    return {"checkpoint": int(match.group(1)) if match else None,
            "optimizer_steps": {name: optimizer_steps(owner) for name, owner in owners.items()}}


def progress_text(progress: dict[str, Any], steps: dict[str, Any]) -> str:
    """``progress`` (see :func:`progress_record`) and ``{component: accelerator.step}`` for a log line."""
    counts = sorted({c for values in progress.get("optimizer_steps", {}).values() for c in values if c is not None})
    number = progress.get("checkpoint")
    optimizer = "unknown" if not counts else ", ".join(map(str, counts))
    return (f"checkpoint {'-' if number is None else number}, optimizer step {optimizer}, Accelerator step "
            f"{', '.join(str(step) for step in steps.values())}")


def _refuse_pending_gradients(owner: Any) -> None:
    """Gradients a checkpoint would lose (``accelerate.gradients``): nonzero and not applied by a completed
    optimizer step. Zeroed gradients and a save between ``optimizer.step()`` and ``zero_grad()`` pass."""
    pending = pending_gradient(prepared_models(owner))
    if pending is None:
        return
    skipped = (" (the gradient scaler skipped the last optimizer step, an inf/NaN gradient: they were not applied)"
               if skipped_step(prepared_optimizers(owner)) else "")
    raise CheckpointConfigurationError(
        f"save_state() found pending gradients (e.g. {pending}): backward() wrote them after the last completed "
        f"optimizer.step(){skipped}, and a checkpoint holds no gradients, so resumed training would differ. Save "
        "after optimizer.step() (before or after optimizer.zero_grad()), or call optimizer.zero_grad() first."
    )


def _preflight(owners: dict[str, Any]) -> dict[str, Any]:
    descriptors = {}
    for name, owner in owners.items():
        ensure_not_failed(owner)
        descriptors[name] = describe(owner)
        if not owner.sync_gradients:
            raise CheckpointConfigurationError(
                "save_state() was called in the middle of gradient accumulation (accelerator.sync_gradients is "
                "False): save after the optimizer step of a full accumulation cycle."
            )
        _refuse_pending_gradients(owner)
        if checkpoint_config(owner).check_finite:
            check_finite_state([list(model.parameters()) for model in prepared_models(owner)], "model parameters")
            check_finite_state([raw_optimizer(opt).state for opt in prepared_optimizers(owner)], "optimizer state")
    return descriptors


def _resolve_destination(primary: Any, output_dir: Any,
                         checkpoint_limit: int | None) -> tuple[Path, int | None, str | None]:
    """The local directory the checkpoint is published in, the retention limit, and the object-store URL it is then
    committed to (``save_state("s3://...")``: the local directory is its copy in the cache)."""
    project = primary.project_configuration
    remote = None
    if project.automatic_checkpoint_naming:
        # As native Accelerate: automatic naming decides the directory.
        path = Path(primary.project_dir) / "checkpoints" / f"checkpoint_{primary.save_iteration}"
        if checkpoint_limit is None:
            checkpoint_limit = project.total_limit
    elif output_dir is None:
        raise CheckpointConfigurationError(
            "save_state() needs an output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True) is set"
        )
    elif is_url(output_dir):
        remote = str(output_dir).rstrip("/")
        split_url(remote)  # a URL naming no checkpoint is refused here
        path = _remote.local_copy(primary, remote)
    else:
        path = Path(output_dir)
    if checkpoint_limit is not None and checkpoint_limit < 1:
        raise CheckpointConfigurationError(f"checkpoint_limit/total_limit must be at least 1, got {checkpoint_limit}")
    return path.expanduser().absolute(), checkpoint_limit, remote


def _settings(owners: Any, async_save: bool | None) -> tuple[dict[str, Any], bool, dict[str, Any], dict[str, Any]]:
    """This rank's participants, whether the save runs in the background, the policies and the hook counts every
    rank must agree on; each Accelerator's configuration (environment included) is read here."""
    group = read_configs(participants(owners))
    configs = {name: checkpoint_config(owner) for name, owner in group.items()}
    background = any(c.async_save for c in configs.values()) if async_save is None else bool(async_save)
    group_keys(group)  # one key for the group's one manifest
    policies = {name: {"finite": c.check_finite, "checksum": c.checksum, "lock_timeout": c.lock_timeout,
                       "overwrite": c.overwrite, "keys": c.keys.key_ids()} for name, c in configs.items()}
    hooks = {name: [len(save_state_pre_hooks(o)), len(load_state_pre_hooks(o))] for name, o in group.items()}
    return group, background, policies, hooks


def _rank_templates(group: dict[str, Any]) -> list[str]:
    return sorted({f"{name}/{t}" if name else t for name, owner in group.items() for t in rank_files(owner)})


def _staging_pool(owner: Any) -> StagingPool | None:
    """The Accelerator's pool of reused staging buffers (``reuse_staging_memory``), created on first use."""
    config = checkpoint_config(owner)
    if config.reuse_staging_memory and config.staging_pool is None:
        config.staging_pool = StagingPool()
    return config.staging_pool if config.reuse_staging_memory else None


#: The Accelerate front end's terms of the shared transaction (``core.transaction``).
TERMS = Terms(
    native="native Accelerate",
    instead=("A protected save replaces its destination as a whole; save to a new directory (a checkpoint directory of "
             "its own, e.g. OUTPUT/checkpoint-N)."),
    elsewhere="save to a new directory",
)


def transaction(path: Path, run_id: str, lock_timeout: float, overwrite: str = "replace", *, automatic: bool = False,
                protected: dict[str, Path] | None = None, cache: bool = False,
                private_patterns: list[re.Pattern[str]] | None = None) -> Transaction:
    """Rank 0's side of one save of this front end (constructed inside a phase): the shared transaction with
    Accelerate's terms; ``cache``: the local copy of a save to an object store (replaced without a warning);
    ``automatic``: automatic checkpoint naming (an existing directory is refused, as native does)."""
    return Transaction(path, run_id, store=local_store(), terms=TERMS if not cache else replace(TERMS, loud=False),
                       lock_timeout=lock_timeout,
                       policy=Policy(overwrite=overwrite, automatic=automatic, protected=protected or {},
                                     private_patterns=tuple(private_patterns or ())))


def _publish(reservation: Transaction, owners: dict[str, Any], descriptors: dict[str, Any], integrity: str,
             rows: dict[str, dict[str, Any]], steps: dict[str, int] | None = None, lineage: dict[str, Any] | None = None,
             progress: dict[str, Any] | None = None) -> str:
    """Rank 0: the publish of the shared transaction with this front end's proof and manifest fields."""
    rank_templates = sorted({t for owner in owners.values() for t in rank_files(owner)})

    def check(staging: Path, rows: dict[str, dict[str, Any]]) -> None:
        for name, owner in owners.items():
            check_required_files(owner, staging / name, range(owner.num_processes), read_custom=False)
        # The publish proof, from the files themselves (what every verification re-checks): each rank of the saving
        # world wrote its per-rank files and its DCP payloads.
        check_rank_coverage(staging, rows, descriptors, rank_templates)

    fields: dict[str, Any] = {
        "components": descriptors,
        "steps": steps if steps is not None else {name: owner.step for name, owner in owners.items()},
        # Optional (older manifests lack it): checkpoint number and optimizer steps taken, for people (CLI, logs).
        "progress": progress if progress is not None else progress_record(reservation.final, owners),
        "versions": installed_versions(),
        # How per-rank state maps onto another world size on an elastic resume (``accelerate.elastic``).
        "rank_state": {"policy": RESHARD_POLICY, "files": rank_templates},
    }
    if lineage:
        fields["resharded_from"] = lineage
    return str(reservation.publish(rows, fields, integrity=integrity, signer=group_keys(owners).signer, check=check))


def protected_directories(owner: Any) -> dict[str, Path]:
    """Directories a save never replaces (nor one that contains them): the working directory, the Accelerator's
    project directory, the home directory."""
    found = {"the working directory": Path.cwd()}
    if getattr(owner, "project_dir", None):
        found["the project directory"] = Path(owner.project_dir).expanduser().absolute()
    try:
        found["the home directory"] = Path.home()
    except (KeyError, RuntimeError):  # no home (a service account)
        pass
    return found


def _give_back(iterations: dict[int, tuple[Any, int]], lineages: dict[str, Any], group: dict[str, Any]) -> None:
    """After an asynchronous save failed: give back what it consumed, as a failed synchronous save does: the
    reserved checkpoint number and the elastic-resume lineage the next save records (unless training moved on:
    another save advanced the number, another resume set a lineage)."""
    for owner, iteration in iterations.values():
        if owner.project_configuration.iteration == iteration + 1:
            owner.project_configuration.iteration = iteration
    for name, owner in group.items():
        if lineages[name] and checkpoint_config(owner).resharded_from is None:
            checkpoint_config(owner).resharded_from = lineages[name]


@with_metadata_cache  # the publish proof parses each .metadata once
def _finish(group: Any, owners: dict[str, Any], staging: Path, templates: list[str], integrity: str,
            reservation: Transaction | None, descriptors: dict[str, Any], run_id: str, path: Path,
            limit: int | None, steps: dict[str, int], world: int, record: dict[str, str] | None = None,
            lineage: dict[str, Any] | None = None, written: dict[Path, tuple[int, str]] | None = None,
            progress: dict[str, Any] | None = None, remote: str | None = None, replace_remote: bool = True) -> str:
    """Steps 5-6 over ``group`` (None: the default group): hash and flush, publish (noted in ``record`` at once),
    retention; then, for a save to an object store (``remote``), the upload and commit there (retention there, the
    local copy alone kept in the cache), or, with a mirror, its upload (in the background for a synchronous save)."""
    for name, owner in owners.items():
        # This rank's own files only: rank 0 checks every file (shared ones included) before publishing.
        run_phase(lambda owner=owner, target=staging / name: check_required_files(
            owner, target, (owner.process_index,), read_custom=False, shared=False),
            "Checking this rank's staged files", group)
    # Every rank hashes and flushes what it wrote (on a shared filesystem only the writer's fsync is reliable).
    rows = gather_rows(run_phase(lambda: own_rows(staging, templates, integrity, written),
                                  "Hashing and flushing the staged checkpoint", group), world, group)
    published: str = on_main(lambda: _publish(reservation, owners, descriptors, integrity,  # type: ignore[arg-type]
                                              rows, steps, lineage, progress), f"Publishing {path}", group)
    if record is not None:
        record["published"] = published
    _faults.point("save:after-rename")
    # A save to an object store keeps one local copy (the cache).
    retain(reservation, published, 1 if remote is not None else limit, keys=group_keys(owners), group=group)
    if rank(group) == 0:  # once per save, not once per rank
        logger.info("Published checkpoint %s (%s)", published,
                    progress_text(progress or progress_record(path, owners), steps))
    if remote is not None:
        return _remote.replicate(Path(published), remote, run_id, limit, replace=replace_remote, group=group)
    mirror = _remote.mirror_url(next(iter(owners.values())), Path(published))
    if mirror is not None:
        if group is None:  # a synchronous save: training goes on while the mirror uploads
            _remote.start_mirror(list(owners.values()), Path(published), run_id, limit)
        else:  # already in the background: upload there
            _remote.replicate(Path(published), mirror, run_id, limit, replace=True, group=group)
    return published


def save_training_checkpoint(
    owners: Any,
    output_dir: str | Path | None = None,
    *,
    checkpoint_limit: int | None = None,
    safe_serialization: bool = True,
    async_save: bool | None = None,
    **kwargs: Any,
) -> Path | str | _async.AsyncCheckpoint:
    """Atomically save one Accelerator, or ``{component: Accelerator}`` as one checkpoint; returns its path.

    Collective: every rank calls it. Either a complete, verified checkpoint is published at the returned path
    and older complete checkpoints of the same run beyond ``checkpoint_limit`` (default: ``total_limit`` with
    automatic naming) are pruned, or every rank raises the same error and nothing is published.

    ``async_save`` (default: ``configure_checkpointing(async_save=...)``): return once this rank's state is
    copied to host memory (CUDA: the copies enqueued on the current stream), with an ``AsyncCheckpoint`` handle (a
    path-like; ``.wait()``, ``.done()``); the checkpoint is the state at that moment, whatever the script does next.
    The rest of the transaction runs in the background. A save in flight is always waited for first (its error
    raised).
    """
    check_arrival(owners, "save_training_checkpoint", output_dir)  # no collective yet: a call on some ranks only is explained
    # Everything that can differ between ranks (environment, configuration, arguments) is read inside a rank phase.
    group, background, policies, hooks = run_phase(lambda: _settings(owners, async_save),
                                                   "Checking checkpoint participants and settings")
    _async.settle(list(group.values()))  # at most one save in flight: wait, or raise its error (on every rank)
    run_phase(lambda: [require_supported_versions(path_of(owner)) for owner in group.values()],
              "Checking the installed releases against the evidence")
    primary = next(iter(group.values()))
    path, limit, remote = run_phase(lambda: _resolve_destination(primary, output_dir, checkpoint_limit),
                                    "Resolving the path")
    descriptors = run_phase(lambda: _preflight(group), "Checkpoint preflight")
    agree({"path": str(path), "remote": remote, "mirror": checkpoint_config(primary).mirror, "limit": limit,
           "policies": policies, "hooks": hooks, "async": bool(background),
           "arguments": [bool(safe_serialization), sorted(kwargs)]}, "the checkpoint path and policies")
    agree(descriptors, "the training configuration")
    run_ids = sorted({checkpoint_config(o).run_id for o in group.values()} - {None})
    agree(run_ids, "the run id")
    if len(run_ids) > 1:
        raise CheckpointConfigurationError(
            f"These Accelerators were restored from different runs {run_ids}: save them separately."
        )
    run_id: str = on_main(lambda: run_ids[0] if run_ids else new_id(), "Choosing the run id")
    iterations = {id(o): (o, o.project_configuration.iteration) for o in group.values()}
    lineages = {name: checkpoint_config(o).resharded_from for name, o in group.items()}  # consumed by a publish
    integrity = "full" if any(checkpoint_config(o).checksum == "full" for o in group.values()) else "metadata"
    templates = _rank_templates(group)
    automatic = bool(primary.project_configuration.automatic_checkpoint_naming)
    if remote is not None:  # the rule on disk, applied to the URL: the local copy in the cache is always replaceable
        on_main(lambda: _remote.refuse_existing(remote, automatic=automatic,
                                                overwrite=checkpoint_config(primary).overwrite),
                f"Checking {remote}")
    reservation = run_phase(lambda: transaction(
        path, run_id, checkpoint_config(primary).lock_timeout,
        "replace" if remote is not None else checkpoint_config(primary).overwrite,
        automatic=automatic and remote is None, protected=protected_directories(primary),
        cache=remote is not None,
        private_patterns=[rank_file_pattern(t.rsplit("/", 1)[-1]) for t in templates]) if rank() == 0 else None,
        "Preparing the directory lock")
    published: str | None = None
    handle: _async.AsyncCheckpoint | None = None
    done: dict[str, str] = {}  # the synchronous tail notes its publish here (before retention)
    try:
        staging = Path(on_main(lambda: str(reservation.open()), f"Reserving {path}"))  # type: ignore[union-attr]
        steps = {name: owner.step for name, owner in group.items()}
        progress = progress_record(path, group)  # at staging time, as steps: an asynchronous save must not race training
        comm = run_phase(background_group, "Creating the background process group") if background else None
        with _async.capture_dcp_saves(bool(background), staging, _staging_pool(primary)) as capture:
            for name, owner in group.items():
                target = staging / name
                save = native_method(owner, "save_state")

                def native_save(owner: Any = owner, target: Path = target, save: Any = save) -> None:
                    # fsdp_routing: FSDP2 optimizer state is written by accelerate-txn's writer (no dummy step)
                    with automatic_naming_off(owner), synchronized_hooks(owner), fsdp_routing(owner):
                        save(str(target), safe_serialization=safe_serialization, **kwargs)

                run_phase(native_save, f"Saving {name or 'the checkpoint'} into {staging}")
                # After every rank's native save returned: per-rank data-loader state (native writes one file
                # from every rank, last writer wins).
                run_phase(lambda owner=owner, target=target: write_loader_states(owner, target),
                          "Saving per-rank data-loader state")
                _faults.point("save:after-native-save")
        finish = functools.partial(_finish, owners=group, staging=staging, templates=templates, integrity=integrity,
                                   reservation=reservation, descriptors=descriptors, run_id=run_id, path=path,
                                   limit=limit, steps=steps, world=world_size(), written=capture.hashes,
                                   progress=progress, remote=remote,
                                   replace_remote=checkpoint_config(primary).overwrite == "replace",
                                   lineage={name: lineage for name, lineage in lineages.items() if lineage}
                                   or None)
        if background:
            _async.install_exit_handling()
            handle = _async.AsyncCheckpoint(path, list(group.values()),
                                            functools.partial(_give_back, iterations, lineages, group))
            handle.start(capture.writes, finish, reservation.close if reservation is not None else lambda: None, comm,
                         fence=copy_fence())
        else:
            published = finish(None, record=done)
    except BaseException:
        if done:  # published, then interrupted during retention: the checkpoint stands, and so does its run id
            for owner in group.values():
                checkpoint_config(owner).run_id = run_id
        elif handle is None:
            for owner, iteration in iterations.values():
                owner.project_configuration.iteration = iteration
        raise
    finally:
        if reservation is not None and handle is None:
            reservation.close()
    for owner in group.values():
        checkpoint_config(owner).run_id = run_id
        checkpoint_config(owner).resharded_from = None  # recorded by this save (or the one in flight)
    # Native save_state advanced each iteration counter once per call: keep exactly one advance.
    for owner, iteration in iterations.values():
        owner.project_configuration.iteration = iteration + 1
    if handle is not None:
        return handle
    return published if remote is not None else Path(published)  # type: ignore[arg-type, return-value]
