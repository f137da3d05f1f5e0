"""Sharded FSDP1 model restore straight into each rank's flat-parameter shard, without FSDP1's all-gathers.

Why not native Accelerate: its ``load_fsdp_model`` builds DCP's read template with ``model.state_dict()`` (an
all-gather of every flat parameter), reads each original parameter's dim-0 chunk into it, and then
``model.load_state_dict`` runs FSDP1's ``_sharded_pre_load_state_dict_hook``, which all-gathers every chunk again
and unshards every flat parameter to copy them in: the model crosses the network twice and is materialised whole.

Here every rank computes, from its flat parameters (``geometry``), the boxes of every original parameter that fall
in its own flat range (the geometry the protected optimizer restore and the collective-free capture use), and
hands DCP a ``ShardedTensor`` per original parameter whose local shards are *views of the flat parameter's local
shard* (a box of row-major elements is contiguous in the flat shard). DCP reads the overlapping parts of whatever
was saved (native dim-0 chunks, the capture's flat-range boxes, another world size's layout), each stored chunk
that lands whole in one destination read with one ``preadv`` (``dcp_reader.DirectReader``). Padding elements are
never written. Persistent buffers (full tensors in the checkpoint) are read into the live buffers, as native does.
The only collectives are DCP's own plan exchange and this module's agreement flags.

Exactly where the result is native's bit for bit: the layouts ``fsdp1_layout.exact_units`` accepts (FULL_SHARD or
SHARD_GRAD_OP over the whole group, currently sharded, no parameter mixed precision, no shared, zero-size or 0-dim
or ignored parameters, geometry equal to FSDP's own record), with SHARDED_STATE_DICT without DTensor output, no
buffer mixed precision, no user state-dict or load-state-dict hooks (they could change what native loads), and a
checkpoint that holds every parameter and persistent buffer with the live shape. Anything else (or any rank that
declines) runs Accelerate's native load on every rank.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core.manifest import read_dcp_metadata
from ..core.ranks import any_rank, run_phase
from .dcp_optimizer import read_state
from .fsdp1_layout import (
    Unit,
    exact_units,
    has_user_load_state_dict_hooks,
    has_user_state_dict_hooks,
    persistent_state_buffers,
)
from .geometry import boxes
from .internals import lazy_init, local_shard, shard_metadata, sharded_tensor, uses_dtensor_state_dict

logger = logging.getLogger(__name__)
#: The directories of the model loads that took the direct path in this process (tests and benchmarks count them).
DIRECT_LOADS: list[str] = []


def _eligible(fsdp_plugin: Any, model: Any) -> list[Unit] | None:
    """The model's FSDP1 units when the direct read reproduces native's load exactly, else None (local)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    if (not isinstance(model, FSDP) or fsdp_plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT
            or uses_dtensor_state_dict(fsdp_plugin.state_dict_config)):
        return None
    if has_user_state_dict_hooks(model) or has_user_load_state_dict_hooks(model):
        return None
    lazy_init(model)  # native's template (model.state_dict()) runs it first too; it sets the local shards
    if any(getattr(unit.mixed_precision, "buffer_dtype", None) is not None for unit in FSDP.fsdp_modules(model)):
        return None  # buffers kept in a low precision: native's state dict casts them back
    return exact_units(model)


def _sharded(member: Any, data: torch.Tensor, position: int, rank: int, group: Any) -> Any:
    """``member`` as a ShardedTensor whose local shards are views of ``data`` (the flat local shard; the member's
    piece starts at ``data[position]``) and whose global metadata lists every rank's boxes. No collective."""
    device = str(data.device)
    shards_metadata, shards = [], []
    for holder, piece in sorted(member.pieces.items()):
        global_holder = dist.get_global_rank(group, holder) if group is not None else holder
        for offsets, sizes, flat_start in boxes(member.shape, piece.start, piece.stop):
            box = shard_metadata(list(offsets), list(sizes), f"rank:{global_holder}/{device}")
            shards_metadata.append(box)
            if holder == rank:
                begin = position + flat_start - piece.start
                shards.append(local_shard(data[begin:begin + math.prod(sizes)].view(sizes), box))
    return sharded_tensor(shards, shards_metadata, member.shape, data.dtype, group)


def _plan(units: list[Unit], model: Any, directory: Path, group: Any) -> dict[str, Any] | None:
    """DCP's destination: ``{"model": {fqn: ShardedTensor over the flat shard, buffer name: live buffer}}``, or
    None where the checkpoint lacks an entry or stores another shape (native then reports it as it does). Local."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = read_dcp_metadata(directory).state_dict_metadata
    rank = dist.get_rank(group)

    def matches(name: str, shape: tuple[int, ...]) -> bool:
        entry = stored.get(f"model.{name}")
        return isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(shape)

    state: dict[str, Any] = {}
    for unit in units:
        data = unit.flat.detach()  # the local shard's storage: writing into it updates the original parameters
        for member in unit.members:
            if not matches(member.fqn, member.shape):
                return None
            piece = member.pieces.get(rank)
            state[member.fqn] = _sharded(member, data, piece.shard_offset if piece is not None else 0, rank, group)
    for name, buffer in persistent_state_buffers(model).items():
        if name in state or not matches(name, tuple(buffer.shape)):
            return None
        state[name] = buffer.detach()
    return {"model": state}


def load_fsdp1_model(fsdp_plugin: Any, model: Any, directory: str | Path) -> bool:
    """Restore an FSDP1 model from its DCP directory (``pytorch_model_fsdp_<i>``) by reading each rank's elements
    of every original parameter straight into its flat parameter's local shard (see the module docstring).
    Collective over the model's process group; every rank takes the same path. Returns False, having changed
    nothing, where the result would not equal native's exactly: the caller then runs Accelerate's native load."""
    group = getattr(model, "process_group", None)
    units = run_phase(lambda: _eligible(fsdp_plugin, model), "Checking the FSDP1 model layout", group)
    if any_rank(units is None, group):
        return False
    state = run_phase(lambda: _plan(units, model, Path(directory), group),
                      "Mapping this rank's model shard", group)
    if any_rank(state is None, group):
        return False
    with torch.no_grad():
        read_state(state, Path(directory), group, "Reading this rank's model shard")
    DIRECT_LOADS.append(str(directory))
    logger.debug("FSDP1 model restored from %s straight into the flat-parameter shards", directory)
    return True
