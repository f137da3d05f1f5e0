"""Sharded FSDP1 optimizer restore built from the checkpoint's own DCP metadata.

Why not native Accelerate: its loader builds the DCP read template from the *live* optimizer state, so a
resume into a freshly created optimizer (no state yet) reads nothing and restores nothing, silently
(Accelerate 1.13-1.15); on 1.7-1.12 it fails on checkpoints those versions wrote. Here the destination is
allocated from the checkpoint's metadata: this rank's dim-0 chunk (``torch.chunk`` layout, as FSDP's sharded
optimizer state is saved) for per-parameter tensors, full tensors only for scalars. Every entry is checked
against the live model's parameter names and shapes before any payload is read, parameter groups are aligned
by parameter names, Adam/AdamW state completeness is checked, and only then is the optimizer changed.

Peak memory is still above one shard: ``FSDP.optim_state_dict_to_load`` all-gathers each parameter's state
(tracked as a separate issue: memory-bounded sharded optimizer restore).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._config import raw_optimizer
from ._descriptor import parameter_layout
from ._manifest import read_dcp_metadata
from ._ranks import run_phase
from .errors import CheckpointConfigurationError, CheckpointIntegrityError

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _destination(metadata: Any, shapes: dict[str, Any], group: Any) -> dict[str, Any]:
    """Allocate this rank's chunks on CPU, straight from the checkpoint metadata (validated as we go)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat: dict[str, Any] = {}
    for key, stored in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if not path or path[0] != "optimizer":
            raise CheckpointIntegrityError(f"Unexpected entry {key!r} in the optimizer checkpoint")
        if not isinstance(stored, TensorStorageMetadata):
            flat[key] = None  # bytes (param group options): DCP fills them in
            continue
        size = tuple(stored.size)
        per_parameter = len(path) >= 4 and path[1] == "state"
        if per_parameter:
            name = path[2]
            if name not in shapes:
                raise CheckpointConfigurationError(
                    f"The optimizer checkpoint holds state for parameter {name!r}, which the live model does not have"
                )
            if (size or path[-1] in _MOMENTS) and size != tuple(shapes[name][0]):
                raise CheckpointConfigurationError(
                    f"Optimizer state {key}: checkpoint shape {list(size)}, live parameter shape {list(shapes[name][0])}"
                )
        if not size or not per_parameter:
            flat[key] = torch.empty(size, dtype=stored.properties.dtype, device="cpu")
            continue
        chunk = max(1, math.ceil(size[0] / world))
        shards, local = [], []
        for shard_rank, offset in enumerate(range(0, size[0], chunk)):
            lengths = [min(chunk, size[0] - offset), *size[1:]]
            placement = f"rank:{dist.get_global_rank(group, shard_rank) if group is not None else shard_rank}/cpu"
            shard = ShardMetadata([offset] + [0] * (len(size) - 1), lengths, placement)
            shards.append(shard)
            if shard_rank == rank:
                local.append(Shard(torch.empty(lengths, dtype=stored.properties.dtype, device="cpu"), shard))
        properties = TensorProperties(dtype=stored.properties.dtype, requires_grad=False)
        flat[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            local, ShardedTensorMetadata(shards, torch.Size(size), properties), process_group=group,
        )
    return unflatten_state_dict(flat, metadata.planner_data)


def align_groups(state: dict[str, Any], expected: list[list[str]], optimizer: torch.optim.Optimizer,
                 *, allow_reorder: bool) -> None:
    """Match saved parameter groups to the live optimizer's by parameter names; check Adam completeness."""
    state.setdefault("state", {})  # DCP omits empty dicts: a checkpoint taken before the first step
    saved = state.get("param_groups")
    if not isinstance(saved, list):
        raise CheckpointIntegrityError("The optimizer checkpoint has no parameter groups")
    if len(saved) != len(expected):
        raise CheckpointConfigurationError(
            f"The optimizer checkpoint has {len(saved)} parameter groups; the live optimizer has {len(expected)}"
        )
    if not allow_reorder and [list(group["params"]) for group in saved] != expected:
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
                "group membership changed"
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
    names_in_groups = {name for names in expected for name in names}
    stray = sorted(set(state["state"]) - names_in_groups)
    if stray:
        raise CheckpointIntegrityError(f"The optimizer checkpoint holds state for parameters outside its groups: {stray[:5]}")
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in aligned:
            required = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
            for name in group["params"]:
                values = state["state"].get(name)
                if values is None:
                    continue  # no update yet for this parameter
                absent = required - set(values)
                if absent:
                    raise CheckpointIntegrityError(f"Adam state of {name!r} lacks {sorted(absent)} in the checkpoint")
                if not isinstance(values["step"], torch.Tensor) or values["step"].ndim != 0:
                    raise CheckpointIntegrityError(f"Adam state of {name!r} has an invalid step")
    state["param_groups"] = aligned


def saved_state_names(directory: Path) -> set[str]:
    """Parameter names that have optimizer state in a DCP optimizer directory."""
    metadata = read_dcp_metadata(directory)
    return {str(path[2]) for path in metadata.planner_data.values()
            if len(path) >= 4 and path[0] == "optimizer" and path[1] == "state"}


def load_sharded_optimizer(accelerator: Any, optimizer: Any, model: Any, input_dir: str, index: int,
                           *, allow_reorder: bool | None = None) -> None:
    """Restore optimizer ``index`` of ``accelerator`` from ``input_dir/optimizer_<index>``. Collective over the
    model's process group; the same error is raised on every rank; the optimizer is untouched on failure."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    optimizer = raw_optimizer(optimizer)
    group = model.process_group
    directory = Path(input_dir) / f"optimizer_{index}"
    if allow_reorder is None:
        allow_reorder = not accelerator._schedulers

    def prepare() -> tuple[list[list[str]], dict[str, Any], Any]:
        expected, shapes = parameter_layout(model, optimizer)
        metadata = read_dcp_metadata(directory)
        return expected, shapes, _destination(metadata, shapes, group)

    expected, _shapes, state = run_phase(prepare, "Preparing the FSDP optimizer restore", group)
    # Our destination is already sharded: the default flattening drops empty local shards (ranks that own no
    # rows of a small parameter) and then fails on the schema.
    run_phase(lambda: load(state, storage_reader=FileSystemReader(str(directory)), process_group=group,
                           planner=DefaultLoadPlanner(flatten_sharded_tensors=False)),
              "Reading the FSDP optimizer checkpoint", group)
    saved = state.pop("optimizer")
    run_phase(lambda: align_groups(saved, expected, optimizer, allow_reorder=allow_reorder),
              "Validating the FSDP optimizer checkpoint", group)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True),
                              ShardedOptimStateDictConfig(offload_to_cpu=True)):
        # Release superseded moments first so old and new state never coexist (plain torch optimizers only:
        # load pre-hooks of custom ones may need the old state).
        if not optimizer._optimizer_load_state_dict_pre_hooks:
            optimizer.state.clear()
        local = run_phase(lambda: FSDP.optim_state_dict_to_load(model, optimizer, saved),
                          "Converting the FSDP optimizer state", group)
        saved.clear()  # the converted copy is all that is needed now
        run_phase(lambda: optimizer.load_state_dict(local), "Loading the FSDP optimizer state", group)


def verify_restored(model: Any, optimizer: Any, directory: Path) -> None:
    """After a restore, every parameter with saved state (and a non-empty local shard) has live state."""
    optimizer = raw_optimizer(optimizer)
    from torch.distributed.fsdp._common_utils import _get_param_to_fqns

    saved = saved_state_names(directory)
    live: set[str] = set()
    local_names: set[str] = set()
    for parameter, fqns in _get_param_to_fqns(model).items():
        if parameter.numel() > 0:
            local_names.update(fqns)
        if optimizer.state.get(parameter):
            live.update(fqns)
    absent = sorted((saved & local_names) - live)
    if absent:
        raise CheckpointIntegrityError(
            f"The optimizer was not restored: {len(absent)} parameters with saved state in {directory} have no live "
            f"optimizer state (e.g. {absent[:3]}). Training would silently continue from empty moments."
        )
