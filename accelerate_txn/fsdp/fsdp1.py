"""Sharded FSDP1 optimizer restore built from the checkpoint's own DCP metadata.

Why not native Accelerate: its loader builds the DCP read template from the *live* optimizer state, so a
resume into a freshly created optimizer (no state yet) reads nothing and restores nothing, silently
(Accelerate 1.13-1.15); on 1.7-1.12 it can fail on checkpoints those versions wrote.

Here every rank computes, from its FSDP flat parameters (``geometry``), which elements of each original
parameter it holds, allocates its local optimizer state once, and lets DCP read exactly those elements (as
boxes of the saved original-shape tensors) straight into place: no rank reads or receives another rank's
state and nothing is all-gathered, so peak memory is about one optimizer shard.

Which optimizers: any whose per-parameter state is tensors shaped like the parameter plus scalars (0-dim
tensors, Python numbers, ``None``): Adam/AdamW, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD,
Rprop and others of that form. The rule is read from the state itself (``optimizer_state``: the live state
on save, the DCP metadata on load), never from a list of classes.

Before anything changes, every saved entry is checked against the live model (a parameter this optimizer
trains; parameter-shaped or 0-dim), parameter groups are aligned by parameter names, and completeness is
checked from the checkpoint's own metadata: within a saved group, every parameter with state has the same set
of state keys, and after the restore every such parameter holds those keys again (:func:`verify_restored_fsdp1`).
:func:`validate_fsdp1_optimizer` runs these checks in the restore preflight for the direct path and for
the conversion fallback alike. Layouts the geometry cannot map fall back to FSDP's ``optim_state_dict_to_load``
(:func:`load_by_conversion`), which all-gathers each parameter's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core.manifest import read_dcp_metadata
from ..core.ranks import any_rank, run_phase
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from .dcp_optimizer import align_groups, check_entries, numbered_groups, read_state, saved_groups, shape_problem, state_entries
from .geometry import GeometryMismatch, Member, boxes, flat_members
from .internals import (
    flat_param,
    has_load_state_dict_pre_hooks,
    local_shard,
    original_params,
    original_shapes,
    param_to_fqns,
    shard_metadata,
    sharded_tensor,
    unflatten_state_dict,
    uses_orig_params,
)
from .optimizer_state import raw_optimizer


def _destination(metadata: Any, shapes: dict[str, Any], group: Any) -> dict[str, Any]:
    """Allocate this rank's chunks on CPU, straight from the checkpoint metadata (validated as we go)."""
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
            problem = shape_problem(str(name), str(path[-1]), stored, shapes[name][0])
            if problem:
                raise CheckpointConfigurationError(problem)
        if not size or not per_parameter:
            flat[key] = torch.empty(size, dtype=stored.properties.dtype, device="cpu")
            continue
        chunk = max(1, math.ceil(size[0] / world))
        shards, local = [], []
        for shard_rank, offset in enumerate(range(0, size[0], chunk)):
            lengths = [min(chunk, size[0] - offset), *size[1:]]
            placement = f"rank:{dist.get_global_rank(group, shard_rank) if group is not None else shard_rank}/cpu"
            shard = shard_metadata([offset] + [0] * (len(size) - 1), lengths, placement)
            shards.append(shard)
            if shard_rank == rank:
                local.append(local_shard(torch.empty(lengths, dtype=stored.properties.dtype, device="cpu"), shard))
        flat[key] = sharded_tensor(local, shards, size, stored.properties.dtype, group)
    return unflatten_state_dict(flat, metadata.planner_data)


@dataclass
class _Owner:
    """One live optimizer parameter (a flat parameter, or an original one with ``use_orig_params``) and the
    original parameters whose elements make up its local state tensors."""

    parameter: torch.nn.Parameter
    numel: int
    positions: dict[str, int] = field(default_factory=dict)  # member fqn -> where its local piece starts


def _owners(model: Any, optimizer: torch.optim.Optimizer, group: Any) -> dict[str, tuple[_Owner, Member]]:
    """fqn -> (live optimizer parameter holding it, its geometry on every rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = param_to_fqns(model)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    result: dict[str, tuple[_Owner, Member]] = {}
    for unit in FSDP.fsdp_modules(model):
        flat = flat_param(unit)
        if flat is None:
            continue
        if uses_orig_params(unit):
            fqns = [names[p][0] for p in original_params(flat)]
        else:
            fqns = list(names[flat])
        members = flat_members(flat, fqns, world, rank)
        if uses_orig_params(unit):
            for parameter, member in zip(original_params(flat), members):
                owner = _Owner(parameter, parameter.numel())
                if rank in member.pieces:
                    owner.positions[member.fqn] = 0
                if id(parameter) in in_optimizer:
                    result[member.fqn] = (owner, member)
        else:
            owner = _Owner(flat, flat.numel())
            for member in members:
                piece = member.pieces.get(rank)
                if piece is not None:
                    owner.positions[member.fqn] = piece.shard_offset
                if id(flat) in in_optimizer:
                    result[member.fqn] = (owner, member)
    return result


def _plan(metadata: Any, owners: dict[str, tuple[_Owner, Member]], group: Any,
          reusable: dict[int, dict[str, torch.Tensor]] | None = None
          ) -> tuple[dict[str, Any], dict[int, dict[str, torch.Tensor]]]:
    """Allocate every rank-local state tensor once and describe, for DCP, which boxes of each saved tensor land
    where in it. ``reusable``: the fresh optimizer's own (already released) local state tensors, read into in
    place, so a flat shard's padding keeps the value the optimizer initialised it with (Adagrad: its initial
    accumulator; padding is never saved). Returns (DCP load state dict, owner id -> {state key -> local tensor})."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank = dist.get_rank(group)
    local: dict[int, dict[str, torch.Tensor]] = {}
    flat: dict[str, Any] = {}
    for key, stored in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if len(path) < 4 or path[1] != "state":
            continue
        if not isinstance(stored, TensorStorageMetadata):  # a Python scalar or None: DCP fills it in
            flat[key] = None
            continue
        fqn, name, dtype = str(path[2]), str(path[-1]), stored.properties.dtype
        owner, member = owners[fqn]
        if not stored.size:  # a 0-dim entry ("step"): stored whole, read whole by every rank
            flat[key] = torch.empty((), dtype=dtype)
            continue
        states = local.setdefault(id(owner.parameter), {})
        destination = states.get(name)
        if destination is None:
            destination = _reuse((reusable or {}).get(id(owner.parameter), {}).get(name), owner.numel, dtype)
            if destination is None:
                destination = torch.zeros(owner.numel, dtype=dtype)  # zeros: a flat shard's padding stays zero
            states[name] = destination
        elif destination.dtype != dtype:
            raise CheckpointIntegrityError(f"Optimizer state {key} is {dtype}, other parameters of its flat "
                                           f"parameter store {destination.dtype}")
        shards_metadata, shards = [], []
        for holder, piece in sorted(member.pieces.items()):
            position = owner.positions.get(fqn, 0)
            for offsets, sizes, flat_start in boxes(member.shape, piece.start, piece.stop):
                box = shard_metadata(list(offsets), list(sizes), f"rank:{_global_rank(group, holder)}/cpu")
                shards_metadata.append(box)
                if holder == rank:
                    begin = position + flat_start - piece.start
                    view = destination[begin:begin + math.prod(sizes)].view(sizes)
                    shards.append(local_shard(view, box))
        flat[key] = sharded_tensor(shards, shards_metadata, stored.size, dtype, group)
    return unflatten_state_dict(flat, {key: metadata.planner_data[key] for key in flat}), local


def _reuse(live: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    if (live is None or live.dtype != dtype or live.numel() != numel or live.device.type != "cpu"
            or not live.is_contiguous()):
        return None
    return live.view(-1)


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _assemble(loaded: dict[str, Any], local: dict[int, dict[str, torch.Tensor]],
              owners: dict[str, tuple[_Owner, Member]], entries: dict[str, dict[str, Any]]
              ) -> dict[int, dict[str, Any]]:
    """owner id -> the optimizer state of that live parameter on this rank."""
    saved_state = loaded.get("state", {})
    result: dict[int, dict[str, Any]] = {}
    by_owner: dict[int, list[str]] = {}
    for fqn, (owner, _member) in owners.items():
        # Every live parameter with local elements gets state, including a flat shard that holds only padding
        # on this rank (zeros, as FSDP's own conversion gives it): its members' state lives on other ranks.
        if owner.numel > 0:
            by_owner.setdefault(id(owner.parameter), []).append(fqn)
    for owner_id, fqns in by_owner.items():
        with_state = [fqn for fqn in fqns if fqn in entries]
        if not with_state:
            continue  # not updated yet
        if len(with_state) != len(fqns) or len({frozenset(entries[f]) for f in with_state}) != 1:
            raise CheckpointIntegrityError(
                f"The optimizer checkpoint holds state for only some of {fqns}, or different entries for them; "
                "they share one optimizer parameter and must all have the same state")
        # Local tensors are flat; the live parameter may not be (NO_SHARD keeps original shapes).
        shape = next(owner.parameter.shape for owner, _member in (owners[f] for f in fqns))
        state: dict[str, Any] = {name: tensor.view(shape) for name, tensor in local.get(owner_id, {}).items()}
        for name in entries[with_state[0]]:
            if name in state:
                continue
            values = [saved_state.get(fqn, {}).get(name) for fqn in with_state]
            first = values[0]
            if any(not _same_value(first, other) for other in values[1:]):
                raise CheckpointIntegrityError(f"Optimizer state {name!r} differs between {with_state}, which share "
                                               "one flat parameter")
            state[name] = first
        result[owner_id] = state
    return result


def _same_value(first: Any, other: Any) -> bool:
    if isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor):
        return torch.equal(first, other)
    return first == other


def _validated(model: Any, optimizer: torch.optim.Optimizer, directory: Path,
               owners: dict[str, tuple[_Owner, Member]] | None, allow_reorder: bool
               ) -> tuple[Any, dict[str, Any], dict[str, dict[str, Any]]]:
    """Every check of one optimizer checkpoint against the live model, from metadata and the (small) group
    entries only; local, no collective. ``owners`` None: the conversion fallback (shapes from the live layout).
    Returns (DCP metadata, saved groups aligned to the live ones, fqn -> {state key -> stored metadata})."""
    expected, shapes = parameter_layout(model, optimizer)
    metadata = read_dcp_metadata(directory)
    saved = saved_groups(metadata, directory)
    align_groups(saved, expected, optimizer, allow_reorder=allow_reorder)
    if owners is not None:
        trained = {fqn: member.shape for fqn, (_owner, member) in owners.items()}
    else:
        trained = {fqn: tuple(shapes[fqn][0]) for names in expected for fqn in names if fqn in shapes}
    entries = state_entries(metadata)
    check_entries(entries, trained, saved["param_groups"])
    return metadata, saved, entries


def validate_fsdp1_optimizer(model: Any, optimizer: Any, directory: Path, allow_reorder: bool) -> None:
    """Check one FSDP1 optimizer checkpoint (``directory``: its ``optimizer_<i>``) against the live model and
    optimizer (entries, shapes, groups, completeness) without changing anything and without collectives: the
    protected load runs this on every rank before the restore touches any state, for the direct path and the
    conversion fallback alike."""
    optimizer = raw_optimizer(optimizer)
    try:
        owners: dict[str, tuple[_Owner, Member]] | None = _owners(model, optimizer, model.process_group)
    except GeometryMismatch:
        owners = None  # the conversion fallback will load it: the same checks from the live layout
    _validated(model, optimizer, Path(directory), owners, allow_reorder)


def _untouched(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """State the fresh optimizer gave parameters with no local elements (eager optimizers such as Adagrad
    initialise every parameter): nothing of it is in the checkpoint for this rank, so it stays as it is."""
    return {id(parameter): dict(optimizer.state[parameter]) for group in optimizer.param_groups
            for parameter in group["params"] if parameter.numel() == 0 and optimizer.state.get(parameter)}


def load_fsdp1_optimizer(optimizer: Any, model: Any, input_dir: str, index: int, *, allow_reorder: bool) -> None:
    """Restore optimizer ``index`` (of ``model``) from ``input_dir/optimizer_<index>``, reading only this
    rank's elements of each saved tensor straight into its final place (peak ~ one optimizer shard; no
    all-gather). Collective over the model's process group; the same error is raised on every rank; nothing
    changes before every entry was validated. Falls back to FSDP's own conversion for layouts it cannot map
    (e.g. shared parameters)."""
    optimizer = raw_optimizer(optimizer)
    group = model.process_group
    directory = Path(input_dir) / f"optimizer_{index}"

    def geometry() -> dict[str, tuple[_Owner, Member]] | None:
        try:
            return _owners(model, optimizer, group)
        except GeometryMismatch:
            return None

    owners = run_phase(geometry, "Mapping FSDP shards", group)
    if any_rank(owners is None, group):
        load_by_conversion(optimizer, model, directory, allow_reorder)
        return
    metadata, saved, entries = run_phase(
        lambda: _validated(model, optimizer, directory, owners, allow_reorder),
        "Validating the FSDP optimizer checkpoint", group)
    kept = _untouched(optimizer)
    reusable: dict[int, dict[str, torch.Tensor]] = {}
    # Release superseded moments first so old and new never coexist (plain torch optimizers only: load
    # pre-hooks of custom ones may need the old state); their tensors are read into in place.
    if not has_load_state_dict_pre_hooks(optimizer):
        reusable = {id(p): {k: v for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
                    for p, s in optimizer.state.items() if p.numel() > 0}
        optimizer.state.clear()
    state, local = run_phase(lambda: _plan(metadata, owners, group, reusable),
                             "Allocating this rank's optimizer state", group)
    reusable.clear()
    read_state(state, directory, group, "Reading this rank's optimizer state")
    per_owner = run_phase(lambda: _assemble(state.get("optimizer", {}), local, owners, entries),
                          "Assembling the optimizer state", group)
    per_owner = {**kept, **per_owner}
    ids, groups = numbered_groups(optimizer, saved["param_groups"])
    state_dict = {"state": {ids[key]: value for key, value in per_owner.items() if key in ids},
                  "param_groups": groups}
    run_phase(lambda: optimizer.load_state_dict(state_dict), "Loading the FSDP optimizer state", group)


def load_by_conversion(optimizer: torch.optim.Optimizer, model: Any, directory: Path, allow_reorder: bool) -> None:
    """Layout-agnostic fallback: validate (as the preflight did), read this rank's dim-0 chunks, then let FSDP
    convert (all-gathers each parameter's state, so peak memory is a few times the shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    group = model.process_group

    def prepare() -> tuple[Any, Any]:
        metadata, aligned, _entries = _validated(model, optimizer, directory, None, allow_reorder)
        _expected, shapes = parameter_layout(model, optimizer)
        return aligned, _destination(metadata, shapes, group)

    aligned, state = run_phase(prepare, "Validating the FSDP optimizer checkpoint", group)
    read_state(state, directory, group, "Reading the FSDP optimizer checkpoint")
    saved = state.pop("optimizer")
    saved.setdefault("state", {})
    saved["param_groups"] = aligned["param_groups"]  # aligned (and checked) from the same entries before reading
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True),
                              ShardedOptimStateDictConfig(offload_to_cpu=True)):
        if not has_load_state_dict_pre_hooks(optimizer):
            optimizer.state.clear()
        local = run_phase(lambda: FSDP.optim_state_dict_to_load(model, optimizer, saved),
                          "Converting the FSDP optimizer state", group)
        saved.clear()
        run_phase(lambda: optimizer.load_state_dict(local), "Loading the FSDP optimizer state", group)


def verify_restored_fsdp1(model: Any, optimizer: Any, directory: Path) -> None:
    """After a restore, every parameter with saved state (and a non-empty local shard) has live state with
    every key the checkpoint recorded for it (FSDP2 models: :func:`.fsdp2.verify_restored_fsdp2`)."""
    optimizer = raw_optimizer(optimizer)
    entries = state_entries(read_dcp_metadata(directory))
    absent: list[str] = []
    incomplete: list[str] = []
    for parameter, fqns in param_to_fqns(model).items():
        if parameter.numel() == 0:
            continue
        live = optimizer.state.get(parameter) or {}
        for fqn in fqns:
            if fqn not in entries:
                continue
            if not live:
                absent.append(fqn)
            elif set(entries[fqn]) - set(live):
                incomplete.append(f"{fqn} lacks {sorted(set(entries[fqn]) - set(live))}")
    if absent:
        absent.sort()
        raise CheckpointIntegrityError(
            f"The optimizer was not restored: {len(absent)} parameters with saved state in {directory} have no live "
            f"optimizer state (e.g. {absent[:3]}). Training would silently continue from empty moments."
        )
    if incomplete:
        raise CheckpointIntegrityError(
            f"The optimizer was restored incompletely from {directory}: {sorted(incomplete)[:3]}."
        )


def parameter_layout(model: Any, optimizer: torch.optim.Optimizer) -> tuple[list[list[str]], dict[str, Any]]:
    """Optimizer groups as parameter names, and every parameter's original (unsharded) shape and dtype."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names = param_to_fqns(model)
    strangers = sum(parameter not in names for group in optimizer.param_groups for parameter in group["params"])
    if strangers:
        raise CheckpointConfigurationError(
            f"{strangers} parameters of the optimizer are not parameters of the FSDP1 model {type(model).__name__}: "
            "FSDP1 replaced the model's parameters when it wrapped the model (use_orig_params=False), so the "
            "optimizer updates parameters the model no longer uses, and neither this save nor a native one can map "
            "its state. Pass use_orig_params=True (FullyShardedDataParallelPlugin(use_orig_params=True), "
            "fsdp_use_orig_params: true in the accelerate config, accelerate launch's default) to prepare the model "
            "and optimizer in one accelerator.prepare(model, optimizer) call, or prepare the model first and build "
            "the optimizer on its prepared parameters."
        )
    groups = [[name for parameter in group["params"] for name in names[parameter]] for group in optimizer.param_groups]
    shapes: dict[str, Any] = {}
    for parameter, fqns in names.items():
        for name in fqns:
            shapes[name] = (tuple(parameter.shape), parameter.dtype, parameter.requires_grad)
    for unit in FSDP.fsdp_modules(model):
        flat = flat_param(unit)
        if flat is None:
            continue
        if uses_orig_params(unit):
            pairs = [(name, shape) for parameter, shape in zip(original_params(flat), original_shapes(flat))
                     for name in names[parameter]]
        else:
            pairs = list(zip(names[flat], original_shapes(flat)))
        for name, shape in pairs:
            _old, dtype, requires_grad = shapes.get(name, (None, flat.dtype, flat.requires_grad))
            shapes[name] = (tuple(shape), dtype, requires_grad)
    return groups, shapes

