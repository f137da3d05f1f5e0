"""FSDP2 (``fully_shard``, DTensor parameters): layout, eligibility, and the sharded optimizer restore.

Accelerate's FSDP2 ``SHARDED_STATE_DICT`` checkpoints are DCP directories like FSDP1's (``pytorch_model_fsdp_<i>``,
``optimizer_<i>``), keyed by parameter names, each tensor saved with its global shape; the protected transaction
(staging, hashes, manifest, verification before mutation) is the same. What differs is here:

* :func:`layout`: optimizer groups as parameter names and each parameter's global shape, dtype, ``requires_grad``
  and DTensor placements; :func:`mesh_record` (the device mesh and, N-D, its dimension names: recorded in the
  descriptor).
* :func:`unsupported_fsdp2`: what the protected path can restore shard by shard: every parameter a DTensor on one
  mesh of all ranks (1-D FSDP, HSDP, FSDP2 + tensor parallelism: any ``ParallelismConfig`` mesh), with placements
  whose every local shard is one box of the global tensor (:func:`unsupported_placements`: ``Shard``,
  ``Replicate``, and the strided shard ``fully_shard`` makes of a dimension TP already split). DCP records each
  such box as one chunk, a replicated box once (its save planner deduplicates replicas), and the publish-time
  coverage check proves the chunks tile each tensor exactly once; a restore on the same mesh reads every box back
  into the shard it came from, a restore on another mesh (``allow_reshard``) reads by global offsets.
* :func:`load_fsdp2_optimizer`: the optimizer restore. Native Accelerate builds its DCP read template from the
  *live* optimizer (``get_optimizer_state_dict``, which steps a fresh optimizer once with zero gradients to create
  state) and applies it with ``set_optimizer_state_dict``. Here the template is built from the checkpoint's own
  metadata: every parameter-shaped entry is allocated ``empty_like`` its live DTensor parameter (so each rank
  allocates and DCP reads only its local shard: peak memory about one optimizer shard), 0-dim and scalar entries
  whole; then the state is handed to ``optimizer.load_state_dict`` by parameter name. No dummy step, no state
  from the live optimizer: a fresh optimizer and one saved before its first step restore exactly.
* :func:`save_fsdp2_optimizer`: the optimizer save (routed during a protected save). Native Accelerate's writer
  calls ``get_optimizer_state_dict``, which steps an optimizer that has no state yet once at lr 0: a save before
  the first step leaves AdamW at ``step=1`` with zero moments, so the saving run's next update differs from an
  unsaved run's. This writer saves ``optimizer.state_dict()`` keyed by parameter name, in the same DCP format
  (same entries, shapes, dtypes, chunks; tested), and changes nothing. Consequence: a protected FSDP2 checkpoint
  saved before the first step holds no optimizer state, and *native* Accelerate cannot load it (its template
  expects state: "Missing key in checkpoint state_dict: optimizer.state...", accelerate #3971); the protected
  loader restores it exactly.
* :func:`validate_fsdp2_optimizer` runs the same checks as the FSDP1 loader (every entry for a
  parameter this optimizer trains, parameter-shaped or 0-dim, groups aligned by names, completeness per the
  general rule of ``optimizer_state``) from metadata alone, in the restore preflight, before anything changes;
  :func:`verify_restored_fsdp2` checks the result.

Validated versions: the FSDP2 path is taken only on the rows of ``validated.json`` marked ``"fsdp2": true``
(``runtime.versions.FSDP2_VALIDATED``; each passed at least tests/fsdp/test_fsdp2.py, real 2-process gloo runs, with
that pair installed: docs/versions.md records what ran on each); elsewhere FSDP2 runs native Accelerate with a
warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..core.manifest import read_dcp_metadata
from ..core.ranks import run_phase
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from .dcp_optimizer import align_groups, check_entries, numbered_groups, read_state, saved_groups, state_entries
from .dcp_reader import DirectReader
from .internals import WRAPPER_NAME_PARTS, has_load_state_dict_pre_hooks, unflatten_state_dict
from .optimizer_state import raw_optimizer


def original_class(module: Any) -> type | None:
    """The user's class of a module ``fully_shard`` class-swapped (to ``FSDP<Name>``, bases ``(FSDPModule, Name)``),
    or None for any other module."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    return next((base for base in type(module).__bases__ if not issubclass(base, FSDPModule)), None)


def canonical_name(name: str) -> str:
    """A parameter's name as DCP state dicts record it (wrapper modules left out)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAME_PARTS)


def named_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    """Canonical name -> live parameter (a DTensor under FSDP2)."""
    return {canonical_name(name): parameter for name, parameter in model.named_parameters()}


def _placements(parameter: Any) -> list[str] | None:
    from torch.distributed.tensor import DTensor

    return [str(p) for p in parameter.placements] if isinstance(parameter, DTensor) else None


def mesh_record(model: Any) -> dict[str, Any]:
    """What the descriptor records of the model's device mesh: ``mesh`` (its shape) and, for an N-D mesh (HSDP
    ``dp_replicate`` x ``dp_shard``, with ``tp``, ...), ``mesh_dims`` (its dimension names, ``None`` for an
    unnamed one). A 1-D mesh records its shape only, as every protected FSDP2 checkpoint before N-D meshes did."""
    mesh = _first_mesh(model)
    if mesh is None:
        return {"mesh": None}
    record: dict[str, Any] = {"mesh": list(mesh.shape)}
    if mesh.ndim > 1:
        names = mesh.mesh_dim_names
        record["mesh_dims"] = list(names) if names is not None else [None] * mesh.ndim
    return record


def _first_mesh(model: Any) -> Any:
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            return parameter.device_mesh
    return None


def mesh_dim_names(model: Any) -> list[str] | None:
    """The names of the mesh dimensions the model's DTensor parameters live on, e.g. ``["dp_shard_cp", "tp"]`` for
    FSDP2 + TP from Accelerate's ``ParallelismConfig`` (None without DTensor parameters or without names)."""
    mesh = _first_mesh(model)
    names = None if mesh is None else mesh.mesh_dim_names
    return list(names) if names else None


def layout(model: Any, optimizer: torch.optim.Optimizer | None) -> tuple[list[list[str]], dict[str, Any]]:
    """Optimizer groups as parameter names, and name -> (global shape, dtype, requires_grad, placements)."""
    named = named_parameters(model)
    by_id = {id(parameter): name for name, parameter in named.items()}
    groups = ([[by_id.get(id(p), "<not in model>") for p in group["params"]] for group in optimizer.param_groups]
              if optimizer is not None else [])
    shapes = {name: (tuple(p.shape), p.dtype, p.requires_grad, _placements(p)) for name, p in named.items()}
    return groups, shapes


def unsupported_placements(name: str, parameter: Any) -> str | None:
    """Why DCP cannot store and restore this DTensor parameter's shards exactly, or None. Local, no collective.

    Supported: ``Shard`` and ``Replicate`` on any mesh dimension (each rank's local shard is one box of the global
    tensor, which DCP records as one chunk; replicas of a box are written once), and the strided shard
    ``fully_shard`` makes of a dimension tensor parallelism already split (torch's ``_StridedShard(dim, sf)`` on
    the data-parallel mesh dimension, ``Shard(dim)`` on the later ones, ``sf`` their product: FSDP2 + TP). Each
    rank's piece of such a "right-to-left" sharding is still one box, and torch computes it so (uneven splits
    included; tests/fsdp/test_fsdp2_tp.py checks every box against the gathered tensor). Refused: ``Partial`` (a
    pending reduction, not a state), and any other placement, whose pieces may not be boxes. Only public names
    are read: the placement's class (``Shard``, ``Replicate`` exactly), ``is_partial()``, and the strided
    shard's ``dim``/``split_factor`` attributes."""
    import math

    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(parameter.placements)
    mesh = parameter.device_mesh
    for index, placement in enumerate(placements):
        if type(placement) in (Shard, Replicate):
            continue
        if placement.is_partial():
            return (f"FSDP2 parameter {name} has a Partial placement ({placement}) on mesh dimension {index}: a "
                    "pending reduction is not a saved state.")
        dim, factor = getattr(placement, "dim", None), getattr(placement, "split_factor", None)
        later = [mesh.size(i) for i in range(index + 1, len(placements))
                 if type(placements[i]) is Shard and placements[i].dim == dim]
        earlier = [p for p in placements[:index] if type(p) is not Replicate and getattr(p, "dim", None) == dim]
        if not (isinstance(dim, int) and isinstance(factor, int) and later and factor == math.prod(later)
                and not earlier):
            return (f"FSDP2 parameter {name} has placements {list(map(str, placements))} on a mesh of shape "
                    f"{list(mesh.shape)}: protected FSDP2 checkpoints restore Shard and Replicate placements and "
                    "fully_shard's strided sharding over tensor parallelism (FSDP2 + TP), where every rank's shard "
                    f"is one box of the tensor; {placement} on mesh dimension {index} is none of these.")
    return None


def unsupported_fsdp2(models: list[Any], world_size: int) -> str | None:
    """Why the protected path cannot restore these FSDP2 models (of a world of ``world_size`` ranks) shard by
    shard, or None: every parameter a DTensor on one mesh over all ranks (1-D FSDP, HSDP, FSDP2 + TP; any
    ``ParallelismConfig`` mesh), with placements DCP stores exactly (:func:`unsupported_placements`). Local, no
    collective."""
    from torch.distributed.tensor import DTensor

    for model in models:
        for name, parameter in named_parameters(model).items():
            if not isinstance(parameter, DTensor):
                return (f"FSDP2 parameter {name} is not a DTensor (not sharded by fully_shard): protected FSDP2 "
                        "checkpoints need every parameter sharded.")
            shape = list(parameter.device_mesh.shape)
            if parameter.device_mesh.size() != world_size:
                return (f"Unsupported FSDP2 mesh: protected FSDP2 checkpoints need a device mesh over all "
                        f"{world_size} ranks (1-D, or N-D from a ParallelismConfig); parameter {name} lives on a "
                        f"mesh of shape {shape} ({parameter.device_mesh.size()} ranks: a custom sub-mesh).")
            reason = unsupported_placements(name, parameter)
            if reason:
                return reason
    return None


# --- optimizer restore ------------------------------------------------------------------------------------------


def _trained(model: Any, optimizer: torch.optim.Optimizer) -> tuple[list[list[str]], dict[str, Any]]:
    """Live groups as names, and name -> live parameter for every parameter the optimizer trains."""
    named = named_parameters(model)
    by_id = {id(parameter): name for name, parameter in named.items()}
    groups: list[list[str]] = []
    for index, group in enumerate(optimizer.param_groups):
        names = []
        for parameter in group["params"]:
            if id(parameter) not in by_id:
                raise CheckpointConfigurationError(
                    f"Optimizer group {index} trains a parameter that is not in its prepared model: prepare the model "
                    "and its optimizer together (accelerator.prepare(model, optimizer)).")
            names.append(by_id[id(parameter)])
        groups.append(names)
    return groups, {name: named[name] for names in groups for name in names}


def validate_fsdp2_optimizer(model: Any, optimizer: torch.optim.Optimizer, directory: Path, allow_reorder: bool
                             ) -> tuple[Any, dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """Every check of one FSDP2 optimizer checkpoint (``directory``: its ``optimizer_<i>``) against the live model,
    from metadata and the (small) group entries only, changing nothing; local, no collective (the protected load's
    preflight runs it on every rank). Returns (metadata, aligned saved groups, entries, name -> live parameter)."""
    optimizer = raw_optimizer(optimizer)
    expected, parameters = _trained(model, optimizer)
    metadata = read_dcp_metadata(directory)
    saved = saved_groups(metadata, directory)
    align_groups(saved, expected, optimizer, allow_reorder=allow_reorder)
    entries = state_entries(metadata)
    check_entries(entries, {name: tuple(p.shape) for name, p in parameters.items()}, saved["param_groups"])
    return metadata, saved, entries, parameters


def _in_place(live: dict[str, Any] | None, name: str, key: str, like: Any, dtype: Any) -> Any:
    """The live optimizer state tensor ``key`` of parameter ``name`` when DCP can read into it in place (a DTensor
    laid out like its parameter, of the saved dtype, with a contiguous local shard), else None."""
    from torch.distributed.tensor import DTensor

    value = (live or {}).get(name, {}).get(key)
    if (isinstance(value, DTensor) and isinstance(like, DTensor) and value.shape == like.shape
            and value.dtype == dtype and value.placements == like.placements
            and value.device_mesh == like.device_mesh and value.to_local().is_contiguous()
            and value.to_local().shape == like.to_local().shape):
        return value
    return None


def _template(metadata: Any, parameters: dict[str, Any], live: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DCP read template, from the checkpoint's metadata: parameter-shaped entries as DTensors laid out like
    their live parameter (only the local shard is read: into the optimizer's own state tensor of ``live`` where it
    fits, else into a fresh local shard), 0-dim entries whole, scalars and group options filled in by DCP."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat: dict[str, Any] = {}
    for key, stored in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if not isinstance(stored, TensorStorageMetadata):
            flat[key] = None
        elif len(path) >= 4 and path[1] == "state" and stored.size:
            like, dtype = parameters[str(path[2])], stored.properties.dtype
            reused = _in_place(live, str(path[2]), str(path[-1]), like, dtype)
            flat[key] = reused if reused is not None else torch.empty_like(like, dtype=dtype)
        else:
            flat[key] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
    return unflatten_state_dict(flat, {key: metadata.planner_data[key] for key in flat})


def load_fsdp2_optimizer(optimizer: Any, model: Any, input_dir: str, index: int, *, allow_reorder: bool) -> None:
    """Restore optimizer ``index`` (of ``model``) from ``input_dir/optimizer_<index>`` (FSDP2): validate, read
    each rank's local shards into a template built from the checkpoint metadata, load by parameter name.
    Collective; the same error on every rank; nothing changes before every entry was validated."""
    optimizer = raw_optimizer(optimizer)
    directory = Path(input_dir) / f"optimizer_{index}"
    metadata, saved, _entries, parameters = run_phase(
        lambda: validate_fsdp2_optimizer(model, optimizer, directory, allow_reorder), "Validating the FSDP2 optimizer checkpoint")
    # Every check on every rank has passed (the restore preflight, then the phase above): DCP may read into the
    # optimizer's own state tensors in place, as native Accelerate does (old and new moments never coexist and no
    # fresh memory is faulted in); a read that fails part way marks the Accelerator failed, as every failure during
    # a restore does. Pre-hooks of custom optimizers may need the old state: then it is kept and not reused.
    hooks = has_load_state_dict_pre_hooks(optimizer)
    live = None if hooks else {name: dict(optimizer.state.get(p, {})) for name, p in parameters.items()}
    if not hooks:
        optimizer.state.clear()
    state = run_phase(lambda: _template(metadata, parameters, live), "Allocating this rank's optimizer state")
    live = None  # entries not reused are released here
    read_state(state, directory, None, "Reading this rank's optimizer state")
    loaded = state.get("optimizer", {}).get("state", {})
    by_id = {id(parameter): name for name, parameter in parameters.items()}
    ids, groups = numbered_groups(optimizer, saved["param_groups"])
    per_parameter = {ids[pid]: dict(loaded[name]) for pid, name in by_id.items() if name in loaded and pid in ids}
    run_phase(lambda: optimizer.load_state_dict({"state": per_parameter, "param_groups": groups}),
              "Loading the FSDP2 optimizer state")


def load_fsdp2_model(model: Any, directory: str | Path, *, cpu_offload: bool = False,
                     broadcast_from_rank0: bool = False) -> Any:
    """Restore an FSDP2 model from its DCP directory (``pytorch_model_fsdp_<i>``) as Accelerate 1.13-1.15's
    sharded ``load_fsdp_model`` does: the model's sharded state dict (``get_model_state_dict`` with these
    options), read by DCP, set back with ``set_model_state_dict``; each tensor read straight into the parameter's
    local shard (:class:`~accelerate_txn.fsdp.dcp_reader.DirectReader`) where DCP's reader would first read it into
    fresh memory. Collective. Returns what ``set_model_state_dict`` returns (missing and unexpected keys)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=cpu_offload,
                               broadcast_from_rank0=broadcast_from_rank0)
    state = {"model": get_model_state_dict(model, options=options)}
    load(state, storage_reader=DirectReader.create(str(directory)), planner=DefaultLoadPlanner())
    return set_model_state_dict(model, state["model"], options=options)


def verify_restored_fsdp2(model: Any, optimizer: Any, directory: Path) -> None:
    """After a restore, every parameter with saved state has live state with every key the checkpoint recorded."""
    optimizer = raw_optimizer(optimizer)
    entries = state_entries(read_dcp_metadata(directory))
    absent: list[str] = []
    incomplete: list[str] = []
    for name, parameter in named_parameters(model).items():
        if name not in entries:
            continue
        live = optimizer.state.get(parameter) or {}
        if not live:
            absent.append(name)
        elif set(entries[name]) - set(live):
            incomplete.append(f"{name} lacks {sorted(set(entries[name]) - set(live))}")
    if absent:
        raise CheckpointIntegrityError(
            f"The optimizer was not restored: {len(absent)} parameters with saved state in {directory} have no live "
            f"optimizer state (e.g. {sorted(absent)[:3]}). Training would silently continue from empty moments.")
    if incomplete:
        raise CheckpointIntegrityError(f"The optimizer was restored incompletely from {directory}: "
                                       f"{sorted(incomplete)[:3]}.")


# --- optimizer save ---------------------------------------------------------------------------------------------


def optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as ``get_optimizer_state_dict`` (sharded, no offload) gives
    it: ``optimizer.state_dict()`` with parameter ids replaced by canonical names, DTensor values as they are.
    Unlike ``get_optimizer_state_dict`` it never steps an optimizer that has no state yet (torch initialises such
    state with one ``step()`` at lr 0, which leaves ``step=1`` and changes Adam's bias correction for the run that
    saved)."""
    by_id = {id(parameter): name for name, parameter in named_parameters(model).items()}
    ordered = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    missing = [index for index, parameter in enumerate(ordered) if id(parameter) not in by_id]
    if missing:
        raise CheckpointConfigurationError(
            "The FSDP2 optimizer trains a parameter that is not in its prepared model: prepare the model and its "
            "optimizer together (accelerator.prepare(model, optimizer)).")
    names = [by_id[id(parameter)] for parameter in ordered]
    state = optimizer.state_dict()
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                         for group in state["param_groups"]],
    }


def save_fsdp2_optimizer(optimizer: Any, model: Any, output_dir: str, index: int) -> None:
    """Write optimizer ``index`` as Accelerate's FSDP2 sharded save does (``optimizer_<index>``, DCP, each rank its
    local shards), from :func:`optimizer_state_dict`. Collective."""
    import os

    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    directory = os.path.join(output_dir, f"optimizer_{index}")
    os.makedirs(directory, exist_ok=True)
    state = optimizer_state_dict(model, raw_optimizer(optimizer))
    save({"optimizer": state}, storage_writer=FileSystemWriter(directory), planner=DefaultSavePlanner())
