"""Which files an Accelerator's checkpoint must contain, and their check (no process group).

Derived from the live Accelerator, so it also applies to legacy (manifest-less) checkpoints: every model and
optimizer, scheduler, scaler, custom object, stateful dataloader, every rank's RNG file and every registered
private state must be present (RNG and private state also readable) before anything is restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._config import checkpoint_config
from ._descriptor import backend
from ._manifest import check_dcp_payloads
from ._rng import read_rng_file
from .errors import CheckpointIntegrityError


def _indexed(stem: str, suffix: str, index: int) -> str:
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def _need(path: Path, what: str) -> None:
    # Existence and non-emptiness only: their contents are verified by the manifest's sha256 (these are control
    # files). For a legacy checkpoint nothing more can be proven without unpickling them.
    if not path.is_file():
        raise CheckpointIntegrityError(f"Missing {what}: {path}")
    if path.stat().st_size == 0:
        raise CheckpointIntegrityError(f"Empty {what}: {path} (truncated)")


def check_required_files(accelerator: Any, directory: Path, ranks: range | tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Verify the files of ``accelerator``'s state in ``directory``; returns the validated RNG state per rank."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointIntegrityError(f"Checkpoint directory {directory} does not exist")
    if backend(accelerator) == "FSDP":
        for index in range(len(accelerator._models)):
            check_dcp_payloads(directory / f"pytorch_model_fsdp_{index}")
            check_dcp_payloads(directory / f"optimizer_{index}")
    else:
        for index in range(len(accelerator._models)):
            candidates = [directory / _indexed("model", ".safetensors", index),
                          directory / _indexed("pytorch_model", ".bin", index)]
            if not any(path.is_file() for path in candidates):
                raise CheckpointIntegrityError(f"Missing model weights: none of {[str(p) for p in candidates]}")
        for index in range(len(accelerator._optimizers)):
            _need(directory / _indexed("optimizer", ".bin", index), "optimizer state")
    for index in range(len(accelerator._schedulers)):
        _need(directory / _indexed("scheduler", ".bin", index), "LR scheduler state")
    for index, loader in enumerate(accelerator._dataloaders):
        if getattr(loader, "use_stateful_dataloader", False):
            _need(directory / _indexed("dl_state_dict", ".bin", index), "stateful dataloader state")
    if accelerator.scaler is not None:
        _need(directory / "scaler.pt", "gradient scaler state")
    for index in range(len(accelerator._custom_objects)):
        _need(directory / f"custom_checkpoint_{index}.pkl", "registered custom object state")
    validators = checkpoint_config(accelerator).validators
    states = {}
    for rank in ranks:
        for validator in validators.values():
            validator(directory, rank)
        states[rank] = read_rng_file(directory, rank)
    return states
