"""Which files an Accelerator's restore reads, and reading them safely before anything changes (no process group).

Derived from the live Accelerator, so it also applies to legacy (manifest-less) checkpoints: every model and
optimizer, scheduler, scaler, sampler, stateful data loader, custom object, every rank's RNG file and every
registered private state must be present and readable before anything is restored. Every pickled file is read
here with ``torch.load(weights_only=True)`` (plus the NumPy types Accelerate itself allows): a corrupt or crafted
file is refused in the preflight, and nothing in a checkpoint runs code. Custom objects are then restored from
the state read here (see ``accelerate.load``), not unpickled again by Accelerate, unless the user opted in to full
unpickling with ``configure_checkpointing(acc, trust_custom_objects=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.manifest import LOADER_FILE, RANK_FILES, check_dcp_payloads, dcp_payload_names, rank_file_pattern
from ..errors import CheckpointIntegrityError
from ..runtime.accelerate_internals import (
    custom_objects,
    prepared_dataloaders,
    prepared_models,
    prepared_optimizers,
    prepared_schedulers,
)
from .config import checkpoint_config
from .descriptor import backend, is_fsdp_full
from .loader_state import SavedLoaders, read_loader_states
from .rng import RNG_FILE, load_weights_only, read_rng_file


def _indexed(stem: str, suffix: str, index: int) -> str:
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


@dataclass
class Preflight:
    """What the preflight read: RNG state per rank, custom-object states by index, and the relative names of every
    file the restore will read (checked against the manifest's inventory)."""

    rng: dict[int, dict[str, Any]] = field(default_factory=dict)
    custom: dict[int, Any] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    loaders: dict[int, SavedLoaders | None] = field(default_factory=dict)  # saved rank -> per-rank loader file
    plan: Any = None  # the per-rank state plan (``accelerate.elastic.RankPlan``), set by the restore preflight
    changes: list[Any] = field(default_factory=list)  # accepted resume changes (``resume_changes.Change``)


def _need(directory: Path, name: str, what: str, found: Preflight) -> Path:
    path = directory / name
    if path.is_symlink() or not path.is_file():
        raise CheckpointIntegrityError(f"Missing {what}: {path}")
    if path.stat().st_size == 0:
        raise CheckpointIntegrityError(f"Empty {what}: {path} (truncated)")
    found.names.add(name)
    return path


def _read(directory: Path, name: str, what: str, found: Preflight) -> Any:
    return load_weights_only(_need(directory, name, what, found))


def private_patterns(accelerator: Any) -> list[Any]:
    """Name patterns of the per-rank files this Accelerator writes (for the inventory's extra-file check)."""
    return [rank_file_pattern(template) for template in (*RANK_FILES, *checkpoint_config(accelerator).private_states)]


def rank_files(accelerator: Any) -> tuple[str, ...]:
    """Per-rank file-name templates (``{rank}``): Accelerate's RNG file and every registered private state."""
    return (*RANK_FILES, *checkpoint_config(accelerator).private_states)


def check_required_files(accelerator: Any, directory: Path, ranks: range | tuple[int, ...], *,
                         read_custom: bool = True, shared: bool = True) -> Preflight:
    """Check and safely read the files of ``accelerator``'s state in ``directory`` for ``ranks`` (saved ranks).

    ``read_custom``: read custom-object states for this process (the restore applies them). Per-rank files are
    read for every rank in ``ranks``; shared files once, or not at all with ``shared=False`` (a save's per-rank
    check: rank 0 checks every file before publishing).
    """
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        raise CheckpointIntegrityError(f"Checkpoint directory {directory} does not exist")
    found = Preflight()
    config = checkpoint_config(accelerator)
    if shared:
        _check_shared_files(accelerator, directory, found, read_custom)
    for rank in ranks:
        for template, validator in config.validators.items():
            validator(directory, rank)
            found.names.add(template.format(rank=rank))
        found.rng[rank] = read_rng_file(directory, rank)
        found.names.add(RNG_FILE.format(rank=rank))
        found.loaders[rank] = read_loader_states(accelerator, directory, rank)
        if found.loaders[rank] is not None:
            found.names.add(LOADER_FILE.format(rank=rank))
    return found


def _check_shared_files(accelerator: Any, directory: Path, found: Preflight, read_custom: bool) -> None:
    """Model and optimizer payloads, scheduler, sampler, data-loader, scaler and custom-object files."""
    config = checkpoint_config(accelerator)
    if is_fsdp_full(accelerator):
        # Accelerate's FULL_STATE_DICT layout (rank 0 writes both): the hashes in the manifest prove their content;
        # they are not unpickled here (each is the whole model or optimizer: native reads them in the restore).
        for index in range(len(prepared_models(accelerator))):
            _need(directory, _indexed("pytorch_model_fsdp", ".bin", index), "full model state (FULL_STATE_DICT)", found)
        for index in range(len(prepared_optimizers(accelerator))):
            _need(directory, _indexed("optimizer", ".bin", index), "full optimizer state (FULL_STATE_DICT)", found)
    elif backend(accelerator) == "FSDP":
        for index in range(len(prepared_models(accelerator))):
            for folder in (f"pytorch_model_fsdp_{index}", f"optimizer_{index}"):
                if (directory / folder).is_symlink():
                    raise CheckpointIntegrityError(f"{directory / folder} is a symbolic link, not checkpoint data")
                metadata = check_dcp_payloads(directory / folder)
                found.names.add(f"{folder}/.metadata")
                found.names.update(f"{folder}/{name}" for name in dcp_payload_names(metadata))
    else:
        for index in range(len(prepared_models(accelerator))):
            candidates = [_indexed("model", ".safetensors", index), _indexed("pytorch_model", ".bin", index)]
            present = [name for name in candidates if (directory / name).is_file()]
            if not present:
                raise CheckpointIntegrityError(f"Missing model weights: none of {[str(directory / c) for c in candidates]}")
            _need(directory, present[0], "model weights", found)
        for index in range(len(prepared_optimizers(accelerator))):
            _read(directory, _indexed("optimizer", ".bin", index), "optimizer state", found)
    for index in range(len(prepared_schedulers(accelerator))):
        _read(directory, _indexed("scheduler", ".bin", index), "LR scheduler state", found)
    for index, loader in enumerate(prepared_dataloaders(accelerator)):
        if _reads_sampler(loader):
            _read(directory, _indexed("sampler", ".bin", index), "data-loader sampler state", found)
        if getattr(loader, "use_stateful_dataloader", False):
            _read(directory, _indexed("dl_state_dict", ".bin", index), "stateful data-loader state", found)
    if accelerator.scaler is not None:
        _read(directory, "scaler.pt", "gradient scaler state", found)
    for index in range(len(custom_objects(accelerator))):
        name = f"custom_checkpoint_{index}.pkl"
        if read_custom and not config.trust_custom_objects:
            state = _read(directory, name, "registered custom object state", found)
            found.custom[index] = state
        else:
            _need(directory, name, "registered custom object state", found)
    stray = sorted(path.name for path in directory.glob("custom_checkpoint_*.pkl")
                   if path.name not in {f"custom_checkpoint_{i}.pkl" for i in range(len(custom_objects(accelerator)))})
    if stray:
        raise CheckpointIntegrityError(
            f"{directory} holds {stray[0]}, but this Accelerator registered {len(custom_objects(accelerator))} custom "
            "object(s): Accelerate would refuse it mid-restore. Register the same objects as when it was saved."
        )


def legacy_world_size(directory: Path) -> int:
    """The world size of a manifest-less checkpoint: its consecutive ``random_states_<rank>.pkl`` files."""
    count = 0
    while (Path(directory) / RNG_FILE.format(rank=count)).is_file():
        count += 1
    if count == 0:
        raise CheckpointIntegrityError(f"Missing RNG state: {Path(directory) / RNG_FILE.format(rank=0)}")
    return count


def saved_world_size(manifest: dict[str, Any] | None, component: str, directory: Path) -> int:
    """How many ranks saved ``component``: the manifest's descriptor, or a legacy checkpoint's RNG files."""
    if manifest is None:
        return legacy_world_size(directory)
    descriptor = manifest.get("components", {}).get(component)
    world = descriptor.get("world_size") if isinstance(descriptor, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointIntegrityError(f"{directory}: the manifest records an invalid world size {world!r}")
    return world


def _reads_sampler(loader: Any) -> bool:
    """Whether native ``load_state`` reads ``sampler.bin`` for this data loader (as Accelerate decides it)."""
    try:
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
    except ImportError:  # pragma: no cover - every supported Accelerate has both
        return False
    dataset = getattr(loader, "dataset", None)
    get_sampler = getattr(loader, "get_sampler", None)
    return (isinstance(dataset, IterableDatasetShard) and get_sampler is not None
            and isinstance(get_sampler(), SeedableRandomSampler))


def check_inventory_covers(directory: Path, manifest: dict[str, Any], names: set[str]) -> None:
    """Every file the restore reads is in the manifest's inventory (so its content was proven)."""
    missing = sorted(names - set(manifest.get("files", {})))
    if missing:
        raise CheckpointIntegrityError(
            f"{Path(directory) / missing[0]} is read by the restore but not listed in the manifest's inventory "
            f"({len(missing)} such file(s)): the manifest does not prove this checkpoint complete. Restore an intact "
            "copy."
        )
