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

The same file holds each prepared loader's data order (``"order"``, see ``accelerate.data_order``): written whenever the
Accelerator has prepared loaders, stateful or not. A file without it (an earlier accelerate-txn) restores no order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.manifest import LOADER_FILE
from ..errors import CheckpointIntegrityError
from ..runtime.accelerate_internals import prepared_dataloaders
from .data_order import check_order_records, order_records, restore_order
from .rng import load_weights_only


@dataclass
class SavedLoaders:
    """One saved rank's per-rank loader file, read and checked: stateful loaders' states (None: restore them from the
    shared native file) and data-order records (None: the file predates them)."""

    states: dict[int, Any] | None
    order: dict[int, dict[str, Any]] | None


def _stateful(accelerator: Any) -> list[tuple[int, Any]]:
    return [(index, loader) for index, loader in enumerate(prepared_dataloaders(accelerator))
            if getattr(loader, "use_stateful_dataloader", False)]


def _shared_name(index: int) -> str:
    return "dl_state_dict.bin" if index == 0 else f"dl_state_dict_{index}.bin"


def write_loader_states(accelerator: Any, directory: Path) -> None:
    """This rank's stateful loaders' states and every prepared loader's data order into its own file; rank 0 also
    rewrites the shared native files. Run after every rank's native save returned (a phase boundary), so no native
    write is still in progress. A loader that cannot resume in exactly the same order is named once (rank 0)."""
    if not prepared_dataloaders(accelerator):
        return
    loaders = _stateful(accelerator)
    states = {index: loader.state_dict() for index, loader in loaders}
    order = order_records(accelerator, warn=accelerator.process_index == 0)
    directory = Path(directory)
    torch.save({"loaders": states, "order": order}, directory / LOADER_FILE.format(rank=accelerator.process_index))
    if accelerator.process_index == 0:
        for index, state in states.items():
            target = directory / _shared_name(index)
            temporary = target.with_name(target.name + ".rank0")
            torch.save(state, temporary)
            os.replace(temporary, target)


def read_loader_states(accelerator: Any, directory: Path, rank: int) -> SavedLoaders | None:
    """Saved rank ``rank``'s per-rank loader file (read safely and checked), or None if the checkpoint has none (then
    the shared native file is what restores stateful loaders, and no data order is restored). Raises if a stateful
    loader has no saved state, or the data-order records are malformed."""
    path = Path(directory) / LOADER_FILE.format(rank=rank)
    if not prepared_dataloaders(accelerator) or (not path.exists() and not path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_file():
        raise CheckpointIntegrityError(f"{path} is not a regular file")
    state = load_weights_only(path)
    saved = state.get("loaders") if isinstance(state, dict) else None
    loaders = _stateful(accelerator)
    if not isinstance(saved, dict) or any(index not in saved for index, _loader in loaders):
        raise CheckpointIntegrityError(
            f"{path} does not hold the state of every stateful data loader of this run (loaders "
            f"{[index for index, _ in loaders]}): it was altered, or the data loaders changed."
        )
    order = state.get("order")
    return SavedLoaders(states=saved if loaders else None,
                        order=None if order is None else check_order_records(accelerator, order, str(path)))


def apply_loader_states(accelerator: Any, saved: SavedLoaders | None, *, replay: bool = True) -> list[int]:
    """Load per-rank states into this rank's stateful loaders, then restore every loader's data order (after native
    ``load_state``). ``replay``: see ``data_order.restore_order``. Returns the loaders whose order was not restored."""
    if saved is None:
        return []
    if saved.states is not None:
        for index, loader in _stateful(accelerator):
            loader.load_state_dict(saved.states[index])
    return restore_order(accelerator, saved.order, replay=replay)
