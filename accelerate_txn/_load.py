"""``load_training_checkpoint``: verify everything on every rank, then restore.

Nothing (model, optimizer, scheduler, scaler, RNG, dataloader, custom object, counters) changes before every
check on every rank has passed: the manifest and its inventory (rank 0, checksums per integrity mode), every
required file of every rank, the library versions, and the saved training configuration against the live
one (every rank). Then native ``load_state`` restores each component with FSDP1 sharded model and optimizer
loads routed through accelerate-txn (see ``_fsdp_optimizer``), RNG is applied explicitly, and the optimizer
restore is verified. A failure after the first mutation marks the Accelerator failed (``optimizer.step()``
and saving raise) until a load succeeds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ._config import checkpoint_config, mark_failed, raw_optimizer
from ._descriptor import backend, compare_descriptor, describe, participants
from ._finite import check_finite_state
from ._fsdp_optimizer import validate_optimizer_checkpoint, verify_restored
from ._manifest import read_manifest, verify_manifest
from ._native import fsdp_routing, native_method, synchronized_hooks
from ._ranks import agree, digest, on_main, rank, run_phase
from ._required import check_required_files
from ._rng import apply_rng
from ._select import CHECKPOINT_NAME, latest_training_checkpoint
from ._staging import new_id
from ._versions import checkpoint_compatibility
from .errors import CheckpointConfigurationError, CheckpointIntegrityError, NoCheckpointError


def _resolve_source(primary: Any, group: dict[str, Any], input_dir: Any) -> Path:
    if input_dir is not None:
        path = Path(input_dir).expanduser().absolute()
        if not path.is_dir():
            raise NoCheckpointError(f"Checkpoint directory {path} does not exist")
        return path
    if not primary.project_configuration.automatic_checkpoint_naming:
        raise CheckpointConfigurationError(
            "load_state() needs an input_dir unless ProjectConfiguration(automatic_checkpoint_naming=True) is set"
        )
    root = Path(primary.project_dir) / "checkpoints"
    chosen = latest_training_checkpoint(root, group)
    if chosen is None:
        raise NoCheckpointError(f"No checkpoint to resume from in {root}")
    return Path(chosen)


def _check_manifest(path: Path, manifest: dict[str, Any] | None, group: dict[str, Any]) -> None:
    """Rank 0: the manifest, its inventory (all recorded hashes) and the versions policy."""
    if manifest is None:
        return
    if set(manifest.get("components", {})) != set(group):
        raise CheckpointConfigurationError(
            f"{path} holds components {sorted(manifest.get('components', {}))}; this load names {sorted(group)}. "
            "Restore the complete named group it was saved with."
        )
    verify_manifest(path, manifest, full=True)
    reason = checkpoint_compatibility(manifest.get("versions") or {})
    if reason:
        raise CheckpointConfigurationError(f"Cannot load {path}: {reason}")


def _check_live(path: Path, manifest: dict[str, Any] | None, group: dict[str, Any],
                descriptors: dict[str, Any]) -> dict[str, dict[int, Any]]:
    """Every rank: gradients, legacy policy, configuration, and this rank's required files."""
    for owner in group.values():
        pending = [n for model in owner._models for n, p in model.named_parameters() if p.grad is not None]
        if pending:
            raise CheckpointConfigurationError(
                f"load_state() found accumulated gradients (e.g. {pending[0]}): call "
                "optimizer.zero_grad(set_to_none=True) before restoring."
            )
    if manifest is None:
        if not all(checkpoint_config(owner).allow_legacy for owner in group.values()):
            raise CheckpointIntegrityError(
                f"{path} has no completion manifest and allow_legacy=False: load a checkpoint saved by accelerate-txn"
            )
    else:
        for name, current in descriptors.items():
            config = checkpoint_config(group[name])
            compare_descriptor(
                manifest["components"][name], current,
                legacy_metadata_keys=config.legacy_metadata_keys if config.allow_legacy else (),
                legacy_metadata_groups=config.legacy_metadata_groups if config.allow_legacy else (),
                where=str(path / name), warn=rank() == 0,
            )
    everyone = rank() == 0  # rank 0 checks every rank's files; each rank also reads its own
    states = {name: check_required_files(owner, path / name,
                                         range(owner.num_processes) if everyone else (owner.process_index,))
              for name, owner in group.items()}
    for name, owner in group.items():
        if backend(owner) == "FSDP":
            validate_optimizer_checkpoint(owner, path / name)
    return states


def _restore(path: Path, group: dict[str, Any], rng: dict[str, dict[int, Any]], kwargs: dict[str, Any]) -> None:
    for name, owner in group.items():
        directory = path / name
        load = native_method(owner, "load_state")

        def native_load(owner: Any = owner, directory: Path = directory, load: Any = load) -> None:
            with fsdp_routing(owner), synchronized_hooks(owner):
                load(str(directory), **kwargs)

        run_phase(native_load, f"Restoring {directory}")
        state = rng[name][owner.process_index]
        owner.step = state["step"]
        if backend(owner) == "FSDP":
            run_phase(lambda owner=owner, directory=directory: [
                verify_restored(model, optimizer, directory / f"optimizer_{index}")
                for index, (model, optimizer) in enumerate(zip(owner._models, owner._optimizers))
            ], "Verifying the optimizer restore")
        if checkpoint_config(owner).check_finite:
            run_phase(lambda owner=owner: (
                check_finite_state([list(m.parameters()) for m in owner._models], "restored model parameters"),
                check_finite_state([raw_optimizer(o).state for o in owner._optimizers], "restored optimizer state"),
            ), "Finite check")
    # Native Accelerate swallows RNG errors: apply the pre-validated state ourselves (the last component's,
    # as native sequential loads would leave it) and let a failure raise.
    last = next(reversed(rng.values()))
    run_phase(lambda: apply_rng(last[next(iter(group.values())).process_index]), "Restoring RNG state")


def load_training_checkpoint(owners: Any, input_dir: str | Path | None = None, **kwargs: Any) -> Path:
    """Verify a checkpoint completely, then restore one Accelerator or ``{component: Accelerator}`` from it.

    Collective: every rank calls it. With automatic naming and no ``input_dir`` the newest complete checkpoint
    is selected. On a verification failure every rank raises the same error and nothing changed; on a failure
    during the restore itself every rank raises and the Accelerators are marked failed until a load succeeds.
    Returns the restored checkpoint's path.
    """
    group = run_phase(lambda: participants(owners), "Checking checkpoint participants")
    primary = next(iter(group.values()))
    path = Path(on_main(lambda: str(_resolve_source(primary, group, input_dir)), "Selecting the checkpoint"))
    manifest = run_phase(lambda: read_manifest(path), f"Reading the manifest of {path}")
    descriptors = run_phase(lambda: {name: describe(o, require_model_ids=manifest is not None)
                                     for name, o in group.items()}, "Describing the live training configuration")
    hooks = {name: [len(o._save_model_state_pre_hook), len(o._load_model_state_pre_hook)] for name, o in group.items()}
    policies = {name: [checkpoint_config(o).allow_legacy, checkpoint_config(o).check_finite] for name, o in group.items()}
    agree({"path": str(path), "manifest": digest(manifest).hex(), "hooks": hooks, "policies": policies},
          "the checkpoint to load")
    agree(descriptors, "the training configuration")
    run_phase(lambda: _check_manifest(path, manifest, group) if rank() == 0 else None, f"Verifying {path}")
    rng = run_phase(lambda: _check_live(path, manifest, group, descriptors), f"Checking {path} against this run")
    if manifest is None:
        run_phase(lambda: warnings.warn(
            f"{path} has no completion manifest (legacy or native checkpoint): its files were checked, but that it "
            "was completely written cannot be proven. The next save writes a manifest.", RuntimeWarning, stacklevel=4,
        ) if rank() == 0 else None, "Legacy warning")
    try:
        _restore(path, group, rng, kwargs)
    except BaseException:
        for owner in group.values():
            mark_failed(owner, True)
        raise
    run_id = manifest["run_id"] if manifest else on_main(new_id, "Choosing a run id")
    match = CHECKPOINT_NAME.fullmatch(path.name)
    for owner in group.values():
        mark_failed(owner, False)
        checkpoint_config(owner).run_id = run_id
        if owner.project_configuration.automatic_checkpoint_naming and match:
            owner.project_configuration.iteration = max(owner.save_iteration, int(match.group(1)) + 1)
    return path
