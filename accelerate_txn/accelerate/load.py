"""``load_training_checkpoint``: verify everything on every rank, then restore.

Nothing (model, optimizer, scheduler, scaler, RNG, dataloader, custom object, counters) changes before every
check on every rank has passed: the manifest (bounded, no symbolic links) and the tree against its inventory
(rank 0: exact file set, sizes, DCP metadata schemas and payload listing), every recorded content hash (each
rank re-hashes the files it reads, in parallel), every file the restore reads is listed, every pickled file read
safely (``weights_only``), the library versions, and the saved training configuration against the live one
(every rank). With automatic selection a candidate that fails an integrity check is skipped for the next older
one. Then native ``load_state`` restores each component with FSDP1 sharded model and optimizer loads routed
through accelerate-txn (see ``fsdp.fsdp1``), custom objects from the state read in the preflight, RNG is
applied explicitly, and the optimizer restore is verified. A failure after the first mutation marks the
Accelerator failed (``optimizer.step()`` and saving raise) until a load succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core import faults as _faults
from ..core import quarantine
from ..core.manifest import (
    MANIFEST,
    check_dcp_inventory,
    check_hashes,
    check_structure,
    hashed_names,
    read_manifest,
    with_metadata_cache,
    writer_rank,
)
from ..core.ranks import agree, digest, on_main, rank, run_phase, world_size
from ..core.remote import is_url
from ..core.select import CHECKPOINT_NAME, numbered_checkpoints, refuse_transient
from ..core.signing import check_legacy
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError, NoCheckpointError
from ..fsdp.internals import uninitialise_grad_scaler
from ..fsdp.optimizer_state import group_tuples_kept, raw_optimizer
from ..runtime import async_save as _async
from ..runtime.accelerate_internals import (
    custom_objects,
    custom_state_loader,
    load_state_pre_hooks,
    prepared_models,
    prepared_optimizers,
    prepared_schedulers,
    save_state_pre_hooks,
)
from ..runtime.versions import checkpoint_compatibility, require_supported_versions
from ..store import local_store, object_store
from ..store.base import Hold, new_id
from . import remote as _remote
from .arrival import check_arrival
from .config import checkpoint_config, group_keys, mark_failed, read_configs
from .descriptor import check_resume, describe, full_on_both, is_fsdp_full, is_fsdp_sharded, participants, path_of
from .elastic import plan_ranks
from .finite import check_finite_state
from .gradients import pending_gradient
from .loader_state import apply_loader_states
from .native import fsdp_routing, native_method, synchronized_hooks
from .optimizers import validate_optimizer_checkpoint, verify_restored
from .required import Preflight, check_inventory_covers, check_required_files, private_patterns, rank_files, saved_world_size
from .resume_changes import continue_live_schedules
from .rng import RNG_FILE, apply_rng, derive_rng
from .selection import checkpoint_candidates

logger = logging.getLogger(__name__)


def _candidates(primary: Any, group: dict[str, Any], input_dir: Any) -> tuple[list[str], bool]:
    """Rank 0: the checkpoints to try, best first, and whether they were chosen automatically."""
    if is_url(input_dir):
        url = str(input_dir).rstrip("/")
        mark = quarantine.remote_mark(object_store(url), url)  # an explicit path still loads: said, not refused
        if mark is not None:
            quarantine.explicit_load_warning(url, mark)
        return [url], False
    if input_dir is not None:
        path = Path(input_dir).expanduser().absolute()
        if not path.is_dir():
            raise NoCheckpointError(f"Checkpoint directory {path} does not exist")
        refuse_transient(path)
        quarantine.warn_if_set_aside(path)
        return [str(path)], False
    if not primary.project_configuration.automatic_checkpoint_naming:
        raise CheckpointConfigurationError(
            "load_state() needs an input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True) is set"
        )
    root = Path(primary.project_dir) / "checkpoints"
    found, reasons = checkpoint_candidates(root, group)
    mirror = checkpoint_config(primary).mirror
    if mirror is not None:  # a checkpoint quarantined in either tier is skipped in both (core.quarantine)
        found, remote, aside = quarantine.across_tiers(found, _remote.remote_candidates(mirror), object_store(mirror), root)
        return _across_tiers(found, reasons + aside, remote, root, mirror), True
    if not found:
        skipped = f"; skipped {'; '.join(reasons)}" if reasons else ""
        raise NoCheckpointError(f"No complete checkpoint to resume from in {root}{skipped}. Start training from "
                                "scratch, or restore an intact copy.")
    return [str(path) for path in found], True


def _across_tiers(found: list[Path], reasons: list[str], remote: list[tuple[int, str]], root: Path,
                  mirror: str) -> list[str]:
    """Candidates of both tiers, newest first: for each checkpoint number the local copy (when it is complete)
    before the mirror's; local manifest-less (legacy) checkpoints after every complete one."""
    ranked: list[tuple[int, int, str]] = []
    legacy = []
    for path in found:
        number = _remote.number_of(path.name)
        if number is None or not (path / MANIFEST).is_file():
            legacy.append(str(path))
        else:
            ranked.append((number, 1, str(path)))
    ranked += [(number, 0, url) for number, url in remote]
    candidates = [candidate for _n, _tier, candidate in sorted(ranked, reverse=True)] + legacy
    if not candidates:
        skipped = f"; skipped {'; '.join(reasons)}" if reasons else ""
        raise NoCheckpointError(f"No complete checkpoint to resume from in {root} nor in the mirror {mirror}{skipped}. "
                                "Start training from scratch, or restore an intact copy.")
    return candidates


def _fetch_and_verify(url: str, root: Path, group: dict[str, Any], templates: list[str],
                      holding: list[Hold]) -> tuple[dict[str, Any] | None, dict[str, Preflight], Path]:
    """The local copy of ``url`` in the cache ``root``, verified like a local checkpoint. A copy found already in the
    cache (not fsynced when downloaded: the restore checks every byte) that fails is downloaded again, once. The
    hold on the copy (no other job sharing the cache removes it while held) is appended to ``holding``: the caller
    releases it after the restore."""
    path, reused, hold = _remote.fetch(url, root, keys=group_keys(group))
    holding.append(hold)
    try:
        manifest, found = _verify(path, group, templates)
    except CheckpointIntegrityError as exc:
        if not reused:
            raise
        if rank() == 0:
            logger.warning("The cached copy %s of %s failed verification (%s): downloading it again", path, url, exc)
        hold.release()  # every rank, before the new download may replace the copy
        path, _, hold = _remote.fetch(url, root, reuse=False, keys=group_keys(group))
        holding.append(hold)
        manifest, found = _verify(path, group, templates)
    return manifest, found, path


def _templates(group: dict[str, Any]) -> list[str]:
    return sorted({t for owner in group.values() for t in rank_files(owner)})


def _check_manifest(path: Path, manifest: dict[str, Any] | None, group: dict[str, Any]) -> None:
    """Rank 0: the authenticator (with verification keys), the manifest, the tree against its inventory, DCP
    metadata, and the versions policy."""
    if manifest is None:
        check_legacy(path, group_keys(group))  # with verification keys, a manifest-less one is refused
        return
    if set(manifest.get("components", {})) != set(group):
        raise CheckpointConfigurationError(
            f"{path} holds components {sorted(manifest.get('components', {}))}; this load names {sorted(group)}. "
            "Restore the complete named group it was saved with."
        )
    check_structure(path, manifest, private_patterns=[p for o in group.values() for p in private_patterns(o)],
                    keys=group_keys(group))
    check_dcp_inventory(path, manifest)
    reason = checkpoint_compatibility(manifest.get("versions") or {})
    if reason:
        raise CheckpointConfigurationError(f"Cannot load {path}: {reason}")


def _check_own_hashes(path: Path, manifest: dict[str, Any] | None, templates: list[str]) -> None:
    """Every rank re-hashes the recorded files it is responsible for (its own shards; rank 0 the shared files)."""
    if manifest is None:
        return
    world, me = world_size(), rank()
    names = [name for name in hashed_names(manifest, full=True)
             if writer_rank(name, world, templates) == me]
    check_hashes(path, manifest, names)


def _check_live(path: Path, manifest: dict[str, Any] | None, group: dict[str, Any],
                descriptors: dict[str, Any]) -> dict[str, Preflight]:
    """Every rank: gradients, legacy policy, configuration, and this rank's required files (read safely)."""
    for owner in group.values():
        pending = pending_gradient(prepared_models(owner))  # zeroed or applied by a step: not carried into the resume
        if pending is not None:
            raise CheckpointConfigurationError(
                f"load_state() found accumulated gradients (e.g. {pending}): backward() wrote them after the last "
                "optimizer.step(), and the restored run would apply them. Call optimizer.zero_grad() before restoring."
            )
    accepted: dict[str, list[Any]] = {}  # per component: the named changes this resume accepts
    if manifest is None:
        if not all(checkpoint_config(owner).allow_legacy for owner in group.values()):
            raise CheckpointIntegrityError(
                f"{path} has no completion manifest and allow_legacy=False: load a checkpoint saved by accelerate-txn"
            )
    else:
        for name, current in descriptors.items():
            config = checkpoint_config(group[name])
            accepted[name] = check_resume(
                manifest["components"][name], current,
                legacy_metadata_keys=config.legacy_metadata_keys if config.allow_legacy else (),
                legacy_metadata_groups=config.legacy_metadata_groups if config.allow_legacy else (),
                accept_changes=config.accept_changes,
                where=str(path / name), warn=rank() == 0,
                # A full checkpoint (FULL_STATE_DICT saved and resumed) holds whole tensors: another world size
                # resumes as natively, per-rank state following the elastic policy, without the opt-in.
                allow_reshard=config.allow_reshard or full_on_both(manifest["components"][name], current),
            ).accepted
    states = {}
    for name, owner in group.items():
        config = checkpoint_config(owner)
        saved_world = saved_world_size(manifest, name, path / name)
        if manifest is None:  # legacy: as many ranks as consecutive RNG files
            if saved_world < owner.num_processes and not config.allow_reshard:
                raise CheckpointIntegrityError(
                    f"Missing RNG state: {path / name / RNG_FILE.format(rank=saved_world)} (this checkpoint has no "
                    "manifest, so a deleted file cannot be told from a smaller world size). If it was saved on "
                    f"{saved_world} ranks, opt in to elastic resume with "
                    "configure_checkpointing(accelerator, allow_reshard=True) (docs/elastic.md)."
                )
            if saved_world > owner.num_processes and not config.allow_reshard:
                raise CheckpointConfigurationError(
                    f"{path / name} (no manifest) holds RNG state for {saved_world} ranks and this run has "
                    f"{owner.num_processes}: a world-size change is refused before anything is restored. Resume on "
                    f"{saved_world} ranks, or opt in to elastic resume with "
                    "configure_checkpointing(accelerator, allow_reshard=True) (docs/elastic.md)."
                )
        plan = plan_ranks(saved_world, owner.num_processes, config.reshard_rank_map)
        # Rank 0 checks every saved rank's files; each rank also reads those of the saved rank it restores from.
        ranks = range(plan.saved_world) if rank() == 0 else (plan.source(owner.process_index),)
        states[name] = check_required_files(owner, path / name, ranks)
        states[name].plan = plan
        states[name].changes = accepted.get(name, [])
    if manifest is not None:
        for name, state in states.items():
            check_inventory_covers(path, manifest, {f"{name}/{file}" if name else file for file in state.names})
    for name, owner in group.items():
        if is_fsdp_sharded(owner):  # FULL_STATE_DICT: native reads the full files
            validate_optimizer_checkpoint(owner, path / name)
    return states


@contextlib.contextmanager
def _custom_objects_from(states: dict[int, Any], owner: Any) -> Iterator[None]:
    """Native ``load_state`` unpickles custom objects with ``weights_only=False``: hand it the state the preflight
    read safely instead (unless the user trusts the files: ``trust_custom_objects=True``)."""
    if checkpoint_config(owner).trust_custom_objects or not custom_objects(owner):
        yield
        return

    def load_custom_state(obj: Any, path: Any, index: int = 0, *args: Any, **kwargs: Any) -> None:
        obj.load_state_dict(states[index])

    with custom_state_loader(load_custom_state):
        yield


def _own_rng(owner: Any, found: Preflight) -> dict[str, Any]:
    """This rank's RNG state under the per-rank plan: its source rank's, or derived from it (a new rank)."""
    me = owner.process_index
    state = found.rng[found.plan.source(me)]
    return derive_rng(state, me) if me in found.plan.derived else state


def _restore(path: Path, group: dict[str, Any], found: dict[str, Preflight], kwargs: dict[str, Any]) -> None:
    for name, owner in group.items():
        directory = path / name
        load = native_method(owner, "load_state")
        checkpoint_config(owner).rank_plan = found[name].plan  # private per-rank state hooks read it

        def native_load(owner: Any = owner, directory: Path = directory, load: Any = load,
                        custom: dict[int, Any] = found[name].custom) -> None:
            with fsdp_routing(owner), synchronized_hooks(owner), _custom_objects_from(custom, owner):
                if owner.scaler is not None and path_of(owner) == "fsdp2":
                    # Accelerate's FSDP2 load re-initialises the scaler from scaler.pt and asserts it was not
                    # initialised: after any fp16 step, or an earlier load in this process, it would fail part way.
                    uninitialise_grad_scaler(owner.scaler)
                with group_tuples_kept(prepared_optimizers(owner) if is_fsdp_full(owner) else ()):
                    load(str(directory), **kwargs)

        run_phase(native_load, f"Restoring {directory}")
        _faults.point("load:during-restore")
        skipped = run_phase(lambda owner=owner, state=found[name]: apply_loader_states(
            owner, state.loaders[state.plan.source(owner.process_index)],
            replay=owner.process_index not in state.plan.derived), "Restoring per-rank data-loader state")
        if skipped and rank() == 0:
            warnings.warn(
                f"{directory}: the data order of data loader(s) {skipped} was not restored: their generators differ "
                "from the ones the checkpoint records (the data-loader setup changed, e.g. an accepted sampler "
                "change, or a DataLoader generator= added or removed). They continue as native Accelerate would.",
                RuntimeWarning, stacklevel=2)
        owner.step = found[name].rng[found[name].plan.source(owner.process_index)]["step"]  # shared by every rank
        if is_fsdp_sharded(owner):
            run_phase(lambda owner=owner, directory=directory: [
                verify_restored(model, optimizer, directory / f"optimizer_{index}")
                for index, (model, optimizer) in enumerate(zip(prepared_models(owner), prepared_optimizers(owner)))
            ], "Verifying the optimizer restore")
        schedules = [change.schedule for change in found[name].changes if change.schedule is not None]
        if schedules:  # an accepted schedule change: the first step after the resume follows the live schedule
            run_phase(lambda owner=owner, schedules=schedules: continue_live_schedules(
                prepared_schedulers(owner), schedules), "Continuing with the live learning-rate schedule")
        if checkpoint_config(owner).check_finite:
            run_phase(lambda owner=owner: (
                check_finite_state([list(m.parameters()) for m in prepared_models(owner)], "restored model parameters"),
                check_finite_state([raw_optimizer(o).state for o in prepared_optimizers(owner)], "restored optimizer state"),
            ), "Finite check")
    # Native Accelerate swallows RNG errors: apply the pre-validated state ourselves (the last component's,
    # as native sequential loads would leave it) and let a failure raise.
    last = next(reversed(found.values()))
    run_phase(lambda: apply_rng(_own_rng(next(iter(group.values())), last)), "Restoring RNG state")


@with_metadata_cache  # each .metadata is parsed once per load
def load_training_checkpoint(owners: Any, input_dir: str | Path | None = None, **kwargs: Any) -> Path:
    """Verify a checkpoint completely, then restore one Accelerator or ``{component: Accelerator}`` from it.

    Collective: every rank calls it. With automatic naming and no ``input_dir`` the newest complete checkpoint
    is selected. On a verification failure every rank raises the same error and nothing changed; on a failure
    during the restore itself every rank raises and the Accelerators are marked failed until a load succeeds.
    Returns the restored checkpoint's path; for an object-store checkpoint (``s3://...``), the path of the verified
    local copy the restore read (its name is the checkpoint's; the log line names the URL and the copy).
    """
    check_arrival(owners, "load_training_checkpoint", input_dir)  # no collective yet: a call on some ranks only is explained
    # Everything that can differ between ranks (environment, configuration, arguments) is read inside a rank phase.
    group = run_phase(lambda: read_configs(participants(owners)), "Checking checkpoint participants")
    _async.settle(list(group.values()))  # an asynchronous save in flight is published (or raises) first
    run_phase(lambda: [require_supported_versions(path_of(owner)) for owner in group.values()],
              "Checking the installed releases against the evidence")
    primary = next(iter(group.values()))
    candidates, automatic = on_main(lambda: _candidates(primary, group, input_dir), "Selecting the checkpoint")
    templates = _templates(group)
    # The checkpoint being restored is held in use from before its verification to the end of the restore
    # (``store.base.Hold``): retention, prune and another job's cache clean-up leave it alone meanwhile, so every file
    # the verification passed is still there when the restore reads it.
    holding: list[Hold] = []
    try:
        for index, candidate in enumerate(candidates):
            path = Path(candidate)
            try:
                if is_url(candidate):  # downloaded into the cache (each file verified), then checked like a local one
                    manifest, found, path = _fetch_and_verify(candidate, _remote.cache_root(primary), group, templates,
                                                              holding)
                else:
                    holding.append(local_store().hold(path))
                    run_phase(holding[-1].acquire, f"Holding {path} in use")
                    manifest, found = _verify(path, group, templates)
            except (CheckpointIntegrityError, NoCheckpointError) as exc:  # NoCheckpointError: a mirror's went away
                _release(holding)
                if not automatic or index == len(candidates) - 1:
                    raise
                if rank() == 0:
                    logger.warning("Skipping checkpoint %s: %s", candidate, exc)
                continue
            break
        if manifest is None:
            run_phase(lambda: warnings.warn(
                f"{path} has no completion manifest (legacy or native checkpoint): every file the restore reads was "
                "checked and read safely, but that it was completely written cannot be proven. The next save writes "
                "a manifest.", RuntimeWarning, stacklevel=4,
            ) if rank() == 0 else None, "Legacy warning")
        _restore_or_mark(path, group, found, kwargs)
    finally:
        _release(holding)
    return _after_restore(primary, group, found, manifest, path, candidates, candidate, automatic)


def _release(holding: list[Hold]) -> None:
    while holding:
        holding.pop().release()


def _restore_or_mark(path: Path, group: dict[str, Any], found: dict[str, Preflight], kwargs: dict[str, Any]) -> None:
    """The restore; a failure part-way marks every Accelerator failed (until a load succeeds)."""
    try:
        _restore(path, group, found, kwargs)
    except BaseException:
        for owner in group.values():
            mark_failed(owner, True)
        raise
    finally:
        for owner in group.values():
            checkpoint_config(owner).rank_plan = None


def _after_restore(primary: Any, group: dict[str, Any], found: dict[str, Preflight], manifest: dict[str, Any] | None,
                   path: Path, candidates: list[str], candidate: str, automatic: bool) -> Path:
    plans = {name: state.plan for name, state in found.items()}
    for name, owner in group.items():
        checkpoint_config(owner).resharded_from = (
            {"checkpoint": str(path), **plans[name].record()} if plans[name].resharded else None)
    if rank() == 0:
        for name, plan in plans.items():
            if plan.resharded:
                logger.warning("Elastic resume of %s: %s", path / name if name else path, plan.describe())
        for name, state in found.items():  # one line per load (and component): what changed on purpose
            if state.changes:
                logger.warning("Resumed %s with changes: %s", path / name if name else path,
                               "; ".join(change.accepted_line() for change in state.changes))
    run_id = manifest["run_id"] if manifest else on_main(new_id, "Choosing a run id")
    match = CHECKPOINT_NAME.fullmatch(path.name)
    # Past every existing checkpoint_N, not just the restored one: a newer sibling that was skipped (corrupt) must
    # not make the next automatic save collide with it.
    numbered = Path(primary.project_dir) / "checkpoints" if automatic else path.parent
    remote_numbers = [n for n in (_remote.number_of(c.rstrip("/").rpartition("/")[2]) for c in candidates
                                  if is_url(c)) if n is not None]
    taken = on_main(lambda: max([n for n, _ in numbered_checkpoints(numbered)] + remote_numbers, default=-1),
                    "Numbering")
    for owner in group.values():
        mark_failed(owner, False)
        checkpoint_config(owner).run_id = run_id
        if owner.project_configuration.automatic_checkpoint_naming and match:
            owner.project_configuration.iteration = max(owner.save_iteration, int(match.group(1)) + 1, taken + 1)
    if rank() == 0:  # the restored optimizers' own step counts (``save.optimizer_steps``), as the next save records
        from .save import progress_record, progress_text

        progress = progress_text(progress_record(path, group), {name: o.step for name, o in group.items()})
        if is_url(candidate):  # the return value is the verified local copy the restore read: the line names both
            logger.info("Resumed from checkpoint %s, restored from its verified local copy %s (%s)", candidate, path,
                        progress)
        else:
            logger.info("Resumed from checkpoint %s (%s)", path, progress)
    return path


def _verify(path: Path, group: dict[str, Any], templates: list[str]) -> tuple[dict[str, Any] | None,
                                                                                dict[str, Preflight]]:
    """Every check of one candidate, on every rank; raises the same error everywhere on the first failure."""
    manifest = run_phase(lambda: (refuse_transient(path), read_manifest(path))[1], f"Reading the manifest of {path}")
    descriptors = run_phase(lambda: {name: describe(o, require_model_ids=manifest is not None)
                                     for name, o in group.items()}, "Describing the live training configuration")
    hooks = {name: [len(save_state_pre_hooks(o)), len(load_state_pre_hooks(o))] for name, o in group.items()}
    policies = {name: [checkpoint_config(o).allow_legacy, checkpoint_config(o).check_finite,
                       checkpoint_config(o).trust_custom_objects, checkpoint_config(o).allow_reshard,
                       sorted((checkpoint_config(o).reshard_rank_map or {}).items()),
                       list(checkpoint_config(o).accept_changes), checkpoint_config(o).keys.key_ids()]
                for name, o in group.items()}
    agree({"path": str(path), "manifest": digest(manifest).hex(), "hooks": hooks, "policies": policies},
          "the checkpoint to load")
    agree(descriptors, "the training configuration")
    run_phase(lambda: _check_manifest(path, manifest, group) if rank() == 0 else None, f"Verifying {path}")
    run_phase(lambda: _check_own_hashes(path, manifest, templates), f"Verifying the content hashes of {path}")
    found = run_phase(lambda: _check_live(path, manifest, group, descriptors), f"Checking {path} against this run")
    return manifest, found
