"""Reading DCP optimizer checkpoints, shared by the FSDP1 and FSDP2 restores: the saved entries and parameter
groups from the checkpoint's own metadata, the checks of those entries against the live optimizer (before any
payload is read), a safe load planner, and ``optimizer.load_state_dict``'s numbering."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.manifest import read_dcp_metadata
from ..core.ranks import run_phase
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from .dcp_reader import DirectReader
from .internals import store_loaded_bytes, unflatten_state_dict


def shape_problem(fqn: str, name: str, stored: Any, shape: tuple[int, ...]) -> str | None:
    """A saved per-parameter tensor entry must be 0-dim or shaped like its (original) parameter."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if isinstance(stored, TensorStorageMetadata) and stored.size and tuple(stored.size) != tuple(shape):
        return (f"Optimizer state optimizer.state.{fqn}.{name}: checkpoint shape {list(stored.size)}, live parameter "
                f"shape {list(shape)} (only parameter-shaped tensors and scalars can be restored shard by shard)")
    return None


def align_groups(state: dict[str, Any], expected: list[list[str]], optimizer: torch.optim.Optimizer,
                 *, allow_reorder: bool) -> None:
    """Match saved parameter groups to the live optimizer's by parameter names (reordered and empty groups),
    check their options belong to this optimizer type, and keep tensor options on their runtime device."""
    state.setdefault("state", {})  # DCP omits empty dicts: a checkpoint taken before the first step
    saved = state.get("param_groups")
    if not isinstance(saved, list):
        raise CheckpointIntegrityError("The optimizer checkpoint has no parameter groups")
    if len(saved) != len(expected):
        raise CheckpointConfigurationError(
            f"The optimizer checkpoint has {len(saved)} parameter groups; the live optimizer has {len(expected)}"
        )
    memberships = sorted(sorted(map(str, group["params"])) for group in saved)
    same_members = memberships == sorted(sorted(map(str, names)) for names in expected)
    if not allow_reorder and same_members and [list(group["params"]) for group in saved] != expected:
        raise CheckpointConfigurationError(
            "Optimizer parameter groups are ordered differently from the checkpoint, and an LR scheduler depends on "
            "group order: build the optimizer's groups in the order they were saved"
        )
    remaining, aligned = list(saved), []
    for index, names in enumerate(expected):
        match = next((i for i, group in enumerate(remaining) if sorted(group["params"]) == sorted(names)), None)
        if match is None:
            raise CheckpointConfigurationError(
                f"Live optimizer group {index} ({len(names)} parameters) matches no parameter group in the checkpoint: "
                f"group membership changed ({_membership_change(saved, expected)}). Build the optimizer over the "
                "parameters it trained when the checkpoint was saved (the same requires_grad and groups), or start "
                "a new run from the model weights alone"
            )
        group = dict(remaining.pop(match), params=list(names))
        missing = set(optimizer.defaults) - set(group)
        if missing:
            raise CheckpointConfigurationError(
                f"Optimizer checkpoint group {index} lacks options {sorted(missing)} of {type(optimizer).__name__}: "
                "it was saved by another optimizer type"
            )
        current = optimizer.param_groups[index]
        for key, value in group.items():
            # Tensor options (capturable Adam's lr) stay on their runtime device; DCP loads on CPU.
            if isinstance(value, torch.Tensor):
                if isinstance(current.get(key), torch.Tensor):
                    group[key] = value.to(current[key].device)
                elif key == "lr" and group.get("capturable", False) and current["params"]:
                    group[key] = value.to(current["params"][0].device)
        aligned.append(group)
    state["param_groups"] = aligned


def _membership_change(saved: list[dict[str, Any]], expected: list[list[str]], shown: int = 5) -> str:
    """Which parameters the checkpoint's groups and the live optimizer's do not share, a few of each."""
    before = {str(name) for group in saved for name in group["params"]}
    now = {str(name) for names in expected for name in names}

    def some(names: set[str]) -> str:
        ordered = sorted(names)
        return ", ".join(ordered[:shown]) + (f" and {len(ordered) - shown} more" if len(ordered) > shown else "")

    parts = [f"trained when saved, not now: {some(before - now)}" if before - now else "",
             f"trained now, not when saved: {some(now - before)}" if now - before else ""]
    return "; ".join(part for part in parts if part) or "the same parameters, grouped differently"


def saved_state_names(directory: Path) -> set[str]:
    """Parameter names that have optimizer state in a DCP optimizer directory."""
    metadata = read_dcp_metadata(directory)
    return {str(path[2]) for path in metadata.planner_data.values()
            if len(path) >= 4 and path[0] == "optimizer" and path[1] == "state"}


class SafePlanner:
    """DCP load planner factory: no re-flattening of our sharded destination, and non-tensor entries (parameter
    group options) read with ``weights_only=True`` instead of DCP's default unrestricted unpickling."""

    @staticmethod
    def create() -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class SafeLoadPlanner(DefaultLoadPlanner):
            def load_bytes(self, read_item: Any, value: Any) -> None:
                store_loaded_bytes(self, read_item, torch.load(value, weights_only=True))

        # Our destination is already sharded: the default flattening drops empty local shards (ranks that own
        # no rows of a small parameter) and then fails on the schema.
        return SafeLoadPlanner(flatten_sharded_tensors=False)


def read_state(state: dict[str, Any], directory: Path, group: Any, what: str) -> None:
    """Read this rank's entries of ``state`` (collective over ``group``), each tensor straight into its destination
    where it can be (:class:`~accelerate_txn.fsdp.dcp_reader.DirectReader`)."""
    from torch.distributed.checkpoint import load

    run_phase(lambda: load(state, storage_reader=DirectReader.create(str(directory)), process_group=group,
                           planner=SafePlanner.create()), what, group)


def saved_groups(metadata: Any, directory: Path) -> dict[str, Any]:
    """Read only the parameter-group entries (small) of the optimizer checkpoint, locally (no collective, so it
    is safe inside a rank phase)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat: dict[str, Any] = {}
    for key, stored in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if len(path) >= 2 and path[0] == "optimizer" and path[1] == "param_groups":
            flat[key] = (torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
                         if isinstance(stored, TensorStorageMetadata) else None)
    state = unflatten_state_dict(flat, {key: metadata.planner_data[key] for key in flat})
    with warnings.catch_warnings():  # DCP announces every single-process load; here it is deliberate
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        load(state, storage_reader=FileSystemReader(str(directory)), planner=SafePlanner.create(), no_dist=True)
    return state.get("optimizer", {})


def state_entries(metadata: Any) -> dict[str, dict[str, Any]]:
    """fqn -> {state key -> stored metadata} of an optimizer checkpoint (from its metadata alone)."""
    entries: dict[str, dict[str, Any]] = {}
    for key in metadata.state_dict_metadata:
        path = metadata.planner_data[key]
        if not path or path[0] != "optimizer":
            raise CheckpointIntegrityError(f"Unexpected entry {key!r} in the optimizer checkpoint")
        if len(path) >= 4 and path[1] == "state":
            entries.setdefault(str(path[2]), {})[str(path[-1])] = metadata.state_dict_metadata[key]
    return entries


def check_saved_state(entries: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """No state outside the saved groups, and within each saved group every parameter with state has the same
    state keys (a parameter may have none yet). Which keys is read from the checkpoint, not from the optimizer
    class: groups with other hyperparameters (amsgrad, momentum, centered) may hold other keys."""
    stray = sorted(set(entries) - {name for group in groups for name in group["params"]})
    if stray:
        raise CheckpointIntegrityError(f"The optimizer checkpoint holds state for parameters outside its groups: {stray[:5]}")
    for index, saved in enumerate(groups):
        with_state = [fqn for fqn in saved["params"] if fqn in entries]
        expected = set().union(*(entries[fqn] for fqn in with_state)) if with_state else set()
        for fqn in with_state:
            absent = expected - set(entries[fqn])
            if absent:
                raise CheckpointIntegrityError(
                    f"Optimizer state of {fqn!r} lacks {sorted(absent)} in the checkpoint, which other parameters of "
                    f"its group {index} have: the checkpoint is incomplete or altered")


def check_entries(entries: dict[str, dict[str, Any]], trained: dict[str, tuple[int, ...]],
                   groups: list[dict[str, Any]]) -> None:
    """Validate every saved state entry against the live model before reading any payload: a parameter this
    optimizer trains (``trained``: fqn -> original shape), parameter-shaped or 0-dim, and complete."""
    for fqn, values in entries.items():
        if fqn not in trained:
            raise CheckpointConfigurationError(
                f"The optimizer checkpoint holds state for parameter {fqn!r}, which this optimizer does not train")
        for name, stored in values.items():
            problem = shape_problem(fqn, name, stored, trained[fqn])
            if problem:
                raise CheckpointConfigurationError(problem)
    check_saved_state(entries, groups)


def numbered_groups(optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]
                    ) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """``optimizer.load_state_dict``'s numbering: id(live parameter) -> index, and the saved groups' options with
    the live groups' parameters (saved groups already aligned to live ones by parameter names)."""
    ids: dict[int, int] = {}
    groups = []
    for live, aligned in zip(optimizer.param_groups, saved_groups):
        params = []
        for parameter in live["params"]:
            ids.setdefault(id(parameter), len(ids))
            params.append(ids[id(parameter)])
        groups.append({**{k: v for k, v in aligned.items() if k != "params"}, "params": params})
    return ids, groups

