"""Per-rank data-loader state: each rank's position saved in its own file, not overwritten by another rank's.

Native Accelerate has every rank ``torch.save`` its stateful data loader's state to the *same* file
(``dl_state_dict.bin``): the last writer wins, and two concurrent writers can leave a file mixing both
(accelerate #4164/#4165). In a protected save, after every rank's native save has returned:

* every rank writes its own loaders' states to :data:`LOADER_FILE` (``dataloader_states_<rank>.pt``), hashed and
  fsynced by that rank like its RNG file;
* rank 0 rewrites the shared ``dl_state_dict*.bin`` with its own states (written whole, then renamed over the
  native file), so the file native ``load_state`` reads is one rank's state, never a torn mixture.

On restore native ``load_state`` first loads the shared file into every rank's loaders; then each rank loads the
per-rank state of the saved rank it takes its state from (``accelerate.elastic``): its own without a world-size change.
Checkpoints without per-rank files (saved natively or by an earlier accelerate-txn) keep the shared file's state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..core.manifest import LOADER_FILE
from ..errors import CheckpointIntegrityError
from .internals import prepared_dataloaders
from .rng import load_weights_only


def _stateful(accelerator: Any) -> list[tuple[int, Any]]:
    return [(index, loader) for index, loader in enumerate(prepared_dataloaders(accelerator))
            if getattr(loader, "use_stateful_dataloader", False)]


def _shared_name(index: int) -> str:
    return "dl_state_dict.bin" if index == 0 else f"dl_state_dict_{index}.bin"


def write_loader_states(accelerator: Any, directory: Path) -> None:
    """This rank's stateful loaders' states into its own file; rank 0 also rewrites the shared native files.
    Run after every rank's native save returned (a phase boundary), so no native write is still in progress."""
    loaders = _stateful(accelerator)
    if not loaders:
        return
    states = {index: loader.state_dict() for index, loader in loaders}
    directory = Path(directory)
    torch.save({"loaders": states}, directory / LOADER_FILE.format(rank=accelerator.process_index))
    if accelerator.process_index == 0:
        for index, state in states.items():
            target = directory / _shared_name(index)
            temporary = target.with_name(target.name + ".rank0")
            torch.save(state, temporary)
            os.replace(temporary, target)


def read_loader_states(accelerator: Any, directory: Path, rank: int) -> dict[int, Any] | None:
    """Saved rank ``rank``'s loader states (read safely), or None if the checkpoint has no per-rank file (then
    the shared native file is what restores the loaders). Raises if a stateful loader has no saved state."""
    loaders = _stateful(accelerator)
    path = Path(directory) / LOADER_FILE.format(rank=rank)
    if not loaders or (not path.exists() and not path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_file():
        raise CheckpointIntegrityError(f"{path} is not a regular file")
    state = load_weights_only(path)
    saved = state.get("loaders") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or any(index not in saved for index, _loader in loaders):
        raise CheckpointIntegrityError(
            f"{path} does not hold the state of every stateful data loader of this run (loaders "
            f"{[index for index, _ in loaders]}): it was altered, or the data loaders changed."
        )
    return saved


def apply_loader_states(accelerator: Any, states: dict[int, Any] | None) -> None:
    """Load per-rank states into this rank's stateful loaders (after native ``load_state``)."""
    if states is None:
        return
    for index, loader in _stateful(accelerator):
        loader.load_state_dict(states[index])
