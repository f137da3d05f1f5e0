"""Collective-free FSDP1 sharded state dicts for protected saves (asynchronous: staged copies; synchronous: views).

Native FSDP1 builds its ``SHARDED_STATE_DICT`` model and optimizer state dicts in the caller with collectives:
``model.state_dict()`` unshards (all-gathers) every flat parameter and re-chunks each original parameter along
dim 0; ``FSDP.optim_state_dict`` all-gathers every optimizer state tensor and chunks it the same way. During a
protected save these two calls are intercepted in the saving thread instead:

* the caller takes this rank's *local* data only (its boxes of every original parameter and of its
  parameter-shaped optimizer state, each a contiguous tensor; the persistent buffers, the scalar state and the
  group options): no collective over the training group. An asynchronous save (``runtime.async_save``)
  copies them into host memory (training moves on during the write); a synchronous save takes *views* of the
  live flat-parameter shards, buffers and optimizer state (no staging memory, no copy: it writes them before
  ``save_state`` returns, and nothing mutates them meanwhile). The 0-dim state (``step``) and the group options
  are copied either way (a few bytes);
* the DCP save (in the background thread, or in the caller right before the wrapped ``dcp.save``) builds from
  them the state dicts native FSDP1 would have passed to DCP: the same nested keys, every original parameter
  (and its parameter-shaped optimizer state) a ``ShardedTensor`` of its global shape. Its shards are this
  rank's flat range of the parameter as row-major boxes, and its global metadata lists every rank's boxes,
  computed locally from the flat-parameter geometry (``fsdp.geometry.flat_members``, the same geometry the
  protected optimizer restore reads into), so the ``ShardedTensor`` is created without a collective
  (``fsdp.internals.sharded_tensor``). DCP writes it over the background group (asynchronous) or over the
  group DCP's own save uses (synchronous: the default one).

DCP stores each saved box with its offsets, and every reader (native Accelerate's template of dim-0 chunks, the
protected restore's flat-range boxes) reads the overlapping parts, so the files load with both; the DCP entries
(keys, global shapes, dtypes) equal a native save's (tests/runtime/test_async_save.py and tests/fsdp/test_sync_capture.py check
all three). DCP's default writer clones a view whose storage is larger than it, one tensor at a time as it writes.

Every rank must take the same path (a rank building natively runs collectives the others would never join), so
the ranks agree with one 4-byte all-reduce before the caller returns: on the background group (idle then) for an
asynchronous save, on the default group (where native FSDP1 would gather at this point) for a synchronous one.
Anything this module cannot reproduce exactly is left to native FSDP1 (the collective path, staged and written in
the background when asynchronous): another state-dict type or ``_use_dtensor``, a unit not sharded over the whole
group or not currently sharded, parameter mixed precision, shared or zero-size or 0-dim parameters, parameters
outside flat parameters, user state-dict hooks, optimizer state that is not parameter-shaped tensors and scalars,
and any layout where the computed geometry disagrees with FSDP's own record.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .fsdp1_layout import exact_units, has_user_state_dict_hooks, persistent_state_buffers
from .geometry import Member, boxes
from .host_memory import staged_tensor
from .internals import (
    local_shard,
    original_params,
    shard_metadata,
    sharded_tensor,
    uses_dtensor_state_dict,
)
from .optimizer_state import raw_optimizer

logger = logging.getLogger(__name__)
_SCALARS = (bool, int, float, type(None))
# Private torch attributes are reached only through ``fsdp.internals`` (flat-parameter layout, state-dict hooks,
# persistent buffers, FSDP name cleaning). A change in any of them shows as a declined capture (native FSDP1 path)
# or as a failing tests/runtime/test_async_save.py, which compares the files with a synchronous save's.


@dataclass
class Deferred:
    """A state dict to be built when DCP writes it (in the background from staged local copies, or synchronously
    from views of the live local data): ``build(group)`` returns it."""

    build: Callable[[Any], dict[str, Any]]
    what: str


def materialize(value: Any, group: Any) -> Any:
    """``value`` with every :class:`Deferred` replaced by the state dict it builds (containers rebuilt)."""
    if isinstance(value, Deferred):
        return value.build(group)
    if isinstance(value, dict):
        return type(value)((key, materialize(item, group)) for key, item in value.items())
    return value


# ------------------------------------------------------------------------------------------------- eligibility
def _world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _sharded_settings(model: Any, optimizer_side: bool) -> bool:
    """The model's state-dict type is SHARDED_STATE_DICT without DTensor output (what this module reproduces)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    try:
        settings = FSDP.get_state_dict_type(model)
    except (AssertionError, RuntimeError, ValueError):  # submodules disagree
        return False
    config = settings.optim_state_dict_config if optimizer_side else settings.state_dict_config
    return (settings.state_dict_type == StateDictType.SHARDED_STATE_DICT
            and not uses_dtensor_state_dict(config))


def _local_boxes(member: Member, rank: int, data: torch.Tensor, position: int, copy: bool) -> list[torch.Tensor]:
    """This rank's boxes of ``member`` (its flat elements start at ``data[position]``), each contiguous. With
    ``copy`` (asynchronous) host copies with their own storage: DCP writes them as they are (a view of a larger
    storage it would clone first) while training moves on. Without (synchronous) views of ``data`` itself: the
    save writes them before it returns, and nothing mutates ``data`` meanwhile."""
    piece = member.pieces.get(rank)
    if piece is None:
        return []
    views = [data[position + flat_start - piece.start:][:math.prod(sizes)].view(sizes)
             for _offsets, sizes, flat_start in boxes(member.shape, piece.start, piece.stop)]
    return [staged_tensor(view) for view in views] if copy else views


def _placement(holder: int, device: torch.device) -> str:
    """A box's placement: ``holder``'s device of the same type as this rank's local ``device`` (the ShardedTensor
    checks a local box's placement against its tensor's device; CUDA placements follow FSDP1's own rank-to-device
    rule), e.g. ``rank:1/cpu`` or ``rank:1/cuda:1``."""
    if device.type == "cpu":
        return f"rank:{holder}/cpu"
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    return f"rank:{holder}/{device.type}:{holder % max(count, 1)}"


def _boxed(member: Member, local: list[torch.Tensor], dtype: torch.dtype, group: Any) -> Any:
    """``member`` as a ShardedTensor: ``local`` (:func:`_local_boxes`) as this rank's shards, every rank's boxes
    in the global metadata. No collective."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    device = local[0].device if local else torch.device("cpu")
    shards_metadata, shards = [], []
    for holder, piece in sorted(member.pieces.items()):
        global_holder = dist.get_global_rank(group, holder) if group is not None else holder
        for index, (offsets, sizes, _start) in enumerate(boxes(member.shape, piece.start, piece.stop)):
            box = shard_metadata(list(offsets), list(sizes),
                                 f"rank:{global_holder}/{local[index].device}" if holder == rank
                                 else _placement(global_holder, device))
            shards_metadata.append(box)
            if holder == rank:
                shards.append(local_shard(local[index], box))
    return sharded_tensor(shards, shards_metadata, member.shape, dtype, group)


# --------------------------------------------------------------------------------------------------- the model
def capture_model(model: Any, copy: bool = True) -> Deferred | None:
    """This rank's model state, to be built collective-free (None: let native FSDP1 build it): with ``copy``
    staged in host memory for the background, else views of the live flat parameters and buffers (a synchronous
    save, which writes them before it returns)."""
    if not _sharded_settings(model, optimizer_side=False) or has_user_state_dict_hooks(model):
        return None
    units = exact_units(model)
    if units is None:
        return None
    rank, _world_size = _world()
    shards: list[tuple[Member, list[torch.Tensor], torch.dtype]] = []
    for unit in units:
        data = unit.flat.detach()
        for member in unit.members:
            piece = member.pieces.get(rank)
            position = piece.shard_offset if piece is not None else 0
            shards.append((member, _local_boxes(member, rank, data, position, copy), unit.flat.dtype))
    buffers = {name: staged_tensor(buffer) if copy else buffer.detach()
               for name, buffer in persistent_state_buffers(model).items()}

    def build(group: Any) -> dict[str, Any]:
        state: dict[str, Any] = {member.fqn: _boxed(member, local, dtype, group) for member, local, dtype in shards}
        state.update(buffers)
        return state

    return Deferred(build, "the FSDP1 model state")


# ----------------------------------------------------------------------------------------------- the optimizer
def capture_optimizer(model: Any, optimizer: Any, copy: bool = True) -> Deferred | None:
    """This rank's optimizer state as ``FSDP.optim_state_dict`` would key it (None: native FSDP1): with ``copy``
    its parameter-shaped state staged in host memory, else views of the live state tensors (a synchronous save).
    0-dim state (``step``) and the group options are copied either way: a few bytes."""
    if not _sharded_settings(model, optimizer_side=True):
        return None
    optimizer = raw_optimizer(optimizer)
    units = exact_units(model)
    if units is None:
        return None
    rank, _world_size = _world()
    # Live optimizer parameter -> [(member, where its local piece starts in the parameter's local state)].
    owned: dict[int, list[tuple[Member, int]]] = {}
    for unit in units:
        if unit.orig_params:
            for parameter, member in zip(original_params(unit.flat), unit.members):
                owned[id(parameter)] = [(member, 0)]
        else:
            owned[id(unit.flat)] = [(member, member.pieces[rank].shard_offset if rank in member.pieces else 0)
                                    for member in unit.members]
    # Per (fqn): this rank's entry, parameter-shaped values as boxes (copied or views; ranks holding none of a parameter
    # with use_orig_params have no state for it and write no entry; DCP merges the ranks' entries).
    entries: dict[str, dict[str, tuple[str, Any]]] = {}
    groups: list[dict[str, Any]] = []
    from .host_memory import staged_copy

    for group in optimizer.param_groups:
        fqns: list[str] = []
        for parameter in group["params"]:
            members = owned.get(id(parameter))
            if members is None:
                return None  # trains a parameter outside the model's flat parameters
            fqns += [member.fqn for member, _ in members]
            values = optimizer.state.get(parameter) or {}
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    staged: tuple[str, Any] = ("value", staged_tensor(value))
                elif isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == parameter.numel():
                    staged = ("shard", value)
                elif isinstance(value, _SCALARS):
                    staged = ("value", value)
                else:
                    return None
                for member, position in members:
                    if staged[0] == "shard":
                        if parameter.numel() == 0:
                            continue  # use_orig_params, none of this parameter here
                        local = _local_boxes(member, rank, value.detach(), position, copy)
                        entries.setdefault(member.fqn, {})[key] = ("shard", (local, value.dtype))
                    elif not (parameter.numel() == 0 and len(members) == 1):
                        entries.setdefault(member.fqn, {})[key] = staged
        groups.append({**{key: staged_copy(value) for key, value in group.items() if key != "params"},
                       "params": fqns})

    def build(process_group: Any) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for members in owned.values():
            for member, _position in members:
                entry = entries.get(member.fqn)
                if not entry:
                    continue
                state[member.fqn] = {
                    key: _boxed(member, *value, process_group) if kind == "shard" else value
                    for key, (kind, value) in entry.items()}
        return {"state": state, "param_groups": groups}

    return Deferred(build, "the FSDP1 optimizer state")


# --------------------------------------------------------------------------------------------------- the hooks
_installed: list[bool] = []


def _agreed(capture: Callable[[], Deferred | None], what: str, staged: bool) -> Deferred | None:
    """``capture()`` if it succeeded on every rank, else None everywhere: a rank that built its state dict
    natively (collectives over the training group) while another captured locally would hang both. One 4-byte
    all-reduce, in the caller's thread: for an asynchronous save (``staged``) on the background group (idle: the
    previous save was settled before this one started); for a synchronous save on the default group, the group
    native FSDP1's own gathers would use at this very point (the caller runs nothing else on it meanwhile)."""
    from ..core.ranks import any_rank, background_group

    try:
        deferred = capture()
    except Exception as exc:  # never fail a save over the fast path: native FSDP1 builds it instead
        logger.warning("accelerate-txn: capturing %s locally failed (%s: %s); FSDP1 builds it natively (with "
                       "collectives) instead.", what, type(exc).__name__, exc)
        deferred = None
    if any_rank(deferred is None, group=background_group() if staged else None):
        logger.debug("accelerate-txn: %s is built by native FSDP1 (not staged locally on every rank)", what)
        return None
    return deferred


def install(capturing: Callable[[], bool | None], model_state_dict: tuple[Any, str]) -> None:
    """Once: while a protected save runs in this thread (``capturing()`` is True for an asynchronous save, False
    for a synchronous one, None outside a protected save), Accelerate's FSDP1 model state dict (``model_state_dict``:
    the (module, name) the front end's internals layer gives, ``runtime.accelerate_internals.model_state_dict_point``) and
    ``FSDP.optim_state_dict`` return a :class:`Deferred` when this module can build them collective-free: from host
    copies when asynchronous, from views of the live tensors when synchronous. Everything else passes through."""
    if _installed:
        return
    import wrapt
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def model_state_dict_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        staged = capturing()
        if staged is not None:
            model = args[0] if args else kwargs.get("model")
            adapter_only = args[1] if len(args) > 1 else kwargs.get("adapter_only", False)
            options = args[2] if len(args) > 2 else kwargs.get("sd_options")
            if options is None and not adapter_only:
                deferred = _agreed(lambda: capture_model(model, copy=staged), "the FSDP1 model state dict", staged)
                if deferred is not None:
                    return deferred
        return wrapped(*args, **kwargs)

    def optim_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        staged = capturing()
        if staged is not None:
            names = ("model", "optim", "optim_state_dict", "group")
            bound = dict(zip(names, args))
            bound.update(kwargs)
            if bound.get("optim_state_dict") is None and bound.get("group") is None and set(bound) <= set(names):
                deferred = _agreed(lambda: capture_optimizer(bound["model"], bound["optim"], copy=staged),
                                   "the FSDP1 optimizer state dict", staged)
                if deferred is not None:
                    return deferred
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(*model_state_dict, model_state_dict_wrapper)
    wrapt.wrap_function_wrapper(FSDP, "optim_state_dict", optim_state_dict)
    _installed.append(True)
