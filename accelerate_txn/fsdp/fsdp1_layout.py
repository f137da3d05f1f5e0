"""When an FSDP1 model's sharded state can be read or written from each rank's flat-parameter shard alone, exactly
as native FSDP1 would produce or consume it: the eligibility shared by the collective-free paths.

Used by the collective-free save (``fsdp.capture``: asynchronous and synchronous FSDP1 saves) and the protected
model restore (``fsdp.fsdp1_model``).

Reproduced exactly: FULL_SHARD or SHARD_GRAD_OP units sharded over the whole group, currently sharded (the flat
parameter's data is its local shard), without parameter mixed precision, hybrid sharding, shared, zero-size or
0-dim parameters, parameters outside flat parameters (ignored modules), and with a computed geometry equal to
FSDP's own record of each rank's shard (``geometry.flat_members``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .geometry import GeometryMismatch, Member, flat_members
from .internals import (
    clean_fsdp_name,
    flat_local_shard,
    flat_param,
    inter_node_group,
    load_state_dict_hooks,
    original_params,
    param_to_fqns,
    persistent_buffers,
    state_dict_hooks,
    uses_orig_params,
)


@dataclass
class Unit:
    """One FSDP1 unit's flat parameter and where each of its members' elements live on every rank."""

    flat: Any
    members: list[Member]
    orig_params: bool  # use_orig_params: the optimizer sees the original parameters


def _foreign(hooks: list[Any]) -> bool:
    """Any hook not registered by FSDP itself."""
    for hook in hooks:
        owner = getattr(hook, "__module__", "") or getattr(getattr(hook, "func", None), "__module__", "")
        if not str(owner).startswith("torch.distributed.fsdp"):
            return True
    return False


def has_user_state_dict_hooks(model: Any) -> bool:
    """User hooks that change a module's state dict (FSDP registers its own; those are expected)."""
    return any(_foreign(state_dict_hooks(module)) for module in model.modules())


def has_user_load_state_dict_hooks(model: Any) -> bool:
    """User ``load_state_dict`` pre- or post-hooks anywhere in the model (they could change what native loads)."""
    return any(_foreign(load_state_dict_hooks(module)) for module in model.modules())


def persistent_state_buffers(model: Any) -> dict[str, Any]:
    """State-dict name (FSDP prefixes removed) -> every persistent buffer of the model (not sharded by FSDP1)."""
    found: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        for name, buffer in persistent_buffers(module):
            found[clean_fsdp_name(f"{prefix}.{name}" if prefix else name)] = buffer
    return found


def exact_units(model: Any) -> list[Unit] | None:
    """Every FSDP1 unit's flat parameter and its members' geometry on every rank (ranks of the default group), or
    None if the layout is one the shard-local paths do not reproduce exactly (see the module docstring). Local."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world < 2 or not isinstance(model, FSDP):
        return None
    names = param_to_fqns(model)
    units: list[Unit] = []
    covered: set[int] = set()
    for unit in FSDP.fsdp_modules(model):
        flat = flat_param(unit)
        if flat is None:
            continue
        orig_params = uses_orig_params(unit)
        if (unit.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
                or dist.get_world_size(unit.process_group) != world
                or inter_node_group(unit) is not None):
            return None
        local = flat_local_shard(flat)
        if local is None or flat.data_ptr() != local.data_ptr() or flat.numel() != local.numel():
            return None  # unsharded right now (inside summon_full_params, or no reshard after forward)
        mixed = getattr(unit.mixed_precision, "param_dtype", None)
        if mixed is not None and mixed != flat.dtype:
            return None
        if orig_params:
            params = original_params(flat)
            if any(len(names.get(p, ())) != 1 for p in params):
                return None  # shared parameters
            fqns = [names[p][0] for p in params]
            covered.update(id(p) for p in params)
        else:
            fqns = list(names.get(flat, ()))
        covered.add(id(flat))
        try:
            members = flat_members(flat, fqns, world, rank)
        except GeometryMismatch:
            return None
        if any(not member.shape or math.prod(member.shape) == 0 for member in members):
            return None
        units.append(Unit(flat, members, orig_params))
    if any(id(p) not in covered for p in model.parameters()):
        return None  # parameters FSDP does not shard (ignored modules)
    return units
