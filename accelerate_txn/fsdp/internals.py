"""Every private torch, NumPy and CPython internal accelerate-txn relies on, in one file (shared by the FSDP layer
and every front end; Accelerate's own internals are in :mod:`accelerate_txn.runtime.accelerate_internals`).

The rest of the library reaches torch internals only through these functions (tests/runtime/test_internals.py fails on
a private access anywhere else, and calls every function here on the installed versions). Supporting a new torch
release means reading this file against the new source, and running that test.

Checked against (source of each release read side by side):

* torch 2.7.0 and 2.13.0: everything below is the same in both (FSDP1 ``_FSDPState``/``FlatParameter`` fields,
  ``_get_param_to_fqns``, ``ShardedTensor``, DCP ``_nested_dict``/``_traverse``, ``DefaultLoadPlanner.load_bytes``,
  ``Optimizer._optimizer_load_state_dict_pre_hooks``).
* torch 2.14.1 against 2.13.0 (the sources of both wheels compared file by file): every private piece below, and
  every pickle global ``MetadataUnpickler`` allows, is unchanged: ``fsdp/_common_utils.py``, ``fsdp/api.py``,
  ``checkpoint/metadata.py``, ``_nested_dict.py``, ``_traverse.py``, ``state_dict_saver.py``,
  ``amp/grad_scaler.py`` and ``_state_dict_utils.py`` are identical; ``DefaultLoadPlanner``, ``_StorageInfo``,
  ``FlatParameter``'s fields, ``ShardedTensor._init_from_local_shards_and_global_metadata``, ``DTensor.__new__``/
  ``_spec``, ``_get_default_store`` (and ``ProcessGroup.get_group_store``), the optimizer pre-hook dict,
  ``OneCycleLR._schedule_phases``/``_last_lr`` and ``serialization._get_layout`` read the same. What changed
  around them, none of it on this library's path: FSDP1 ``FlatParamHandle.unshard`` with ``offload_to_cpu`` no
  longer round-trips a flat parameter already on the CPU; DCP's planners also accept the new
  ``CheckpointableTensor`` protocol (``checkpoint/protocol.py``, a plain tensor carrying global-shard fields);
  ``FileSystemWriter(sync_files=True)`` flushes each stream before ``fsync`` and warns (instead of ``os.sync()``)
  where ``fsync`` is unsupported; ``ShardedTensor.cuda()``/``.to()`` go through ``torch.accelerator``;
  ``distributed_c10d`` reorganised backend registration (torchcomms), with the same public calls. No branch.
* torch 2.8.0, 2.9.1, 2.10.0, 2.11.0 and 2.12.1 against 2.13.0 (each wheel's sources, piece by piece, syntax
  trees compared with docstrings dropped): every private piece below, every pickle global ``MetadataUnpickler``
  allows, the DCP reader/writer pieces ``fsdp/dcp_reader.py`` and ``core/hashing.py`` use, and the ``fully_shard``
  class swap read the same, up to annotations and ``assert`` turned into ``raise AssertionError``. Where they
  differ, none needs a branch: torch 2.8 has no ``ProcessGroup.get_group_store`` (:func:`default_store` falls
  back to the unchanged ``_get_default_store``) and no ``Metadata.version`` field (never read here; no new pickle
  global); 2.8 and 2.9 build ``DTensor.__new__`` in Python (same signature, same ``_spec``); 2.8-2.10 write
  FSDP1's ``_apply_to_modules`` prefix test differently (equivalent); from 2.9 ``LRScheduler._last_lr`` aliases
  tensor learning rates; 2.11 and newer return a copied ``Metadata`` from ``dcp.save`` (the ``.metadata`` file is
  the same; the return value is never used here).
* NumPy 1.x and 2.x: the one place where releases differ (``_reconstruct`` moved); see :func:`numpy_reconstruct`.

Where a later release differs, branch here on the installed version (``packaging.version.Version`` of
``torch.__version__``) and note both sides; callers stay unchanged.

Also private, but named rather than accessed (so not here): ``core.manifest.MetadataUnpickler`` allowlists the
pickle globals DCP ``.metadata`` is built from, some of them private (``torch.distributed.checkpoint.filesystem.
_StorageInfo``, ``torch.serialization._get_layout``, ``pathlib._local`` on Python 3.13); tests/runtime/test_internals.py
checks that each of them resolves on the installed versions. ``fsdp.dcp_reader`` likewise names the pickle global of
a ``torch.save`` tensor archive (``torch._utils._rebuild_tensor_v2``); the torch ones are pieces (below).

Not here: attributes with public names that the code uses as they are (``unit.sharding_strategy``,
``unit.cpu_offload``, ``model.process_group``). Imports of torch are lazy: importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..compat.pieces import Piece

# --- FSDP1 flat parameters --------------------------------------------------------------------------------------
# FSDP1 (``FullyShardedDataParallel``) keeps each unit's parameters in one ``FlatParameter`` owned by a
# ``FlatParamHandle``; public torch exposes neither the handle nor the layout of the flat parameter.
# torch 2.7.0 to 2.14.1: ``_FSDPState._handle`` / ``._use_orig_params`` (``_common_utils``), ``_inter_node_pg``
# set only for hybrid sharding (``_init_utils``), ``FlatParameter._params`` (None without use_orig_params),
# ``_shapes``, ``_numels_with_padding``, ``_is_padding_mask``, ``_shard_param_infos`` (``_ShardParamInfo``
# named tuples: in_shard, offset_in_shard, numel_in_shard, intra_param_start_idx, intra_param_end_idx).


def param_to_fqns(model: Any) -> dict[Any, list[str]]:
    """Live parameter (flat, or original with ``use_orig_params``) -> the original parameters' full names."""
    from torch.distributed.fsdp._common_utils import _get_param_to_fqns

    return _get_param_to_fqns(model)


def flat_param(unit: Any) -> Any | None:
    """The ``FlatParameter`` of one FSDP unit, or None for a unit that manages no parameters."""
    handle = unit._handle
    return None if handle is None else handle.flat_param


def uses_orig_params(unit: Any) -> bool:
    """Whether the unit was built with ``use_orig_params=True`` (the optimizer sees the original parameters)."""
    return bool(unit._use_orig_params)


def inter_node_group(unit: Any) -> Any | None:
    """The inter-node process group of a hybrid-sharded unit, None otherwise (the attribute is absent then). Its
    ranks hold the same shard (one per replica); ``unit.process_group`` is then the shard (intra-node) group.
    torch 2.7.0 to 2.15.0: set by ``_init_process_group_state_for_hybrid_shard`` only (from a device mesh's
    outer dimension, the given ``(intra, inter)`` pair, or node groups of ``device_count()`` ranks)."""
    return getattr(unit, "_inter_node_pg", None)


def flat_local_shard(flat: Any) -> Any | None:
    """The flat parameter's own local shard (``FlatParameter._local_shard``; None before sharding). While the unit
    is sharded the flat parameter's data *is* this tensor (same storage)."""
    return getattr(flat, "_local_shard", None)


def lazy_init(model: Any) -> None:
    """FSDP1's lazy initialisation of a root ``FullyShardedDataParallel`` (``_runtime_utils._lazy_init(state,
    module)``, torch 2.7 to 2.14; a no-op once done): what its first forward, ``state_dict`` or ``load_state_dict``
    runs first. It sets each flat parameter's ``_local_shard`` and moves buffers to the compute device; no
    collective."""
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(model, model)


def load_state_dict_hooks(module: Any) -> list[Any]:
    """Every ``load_state_dict`` pre-hook and post-hook registered on one ``nn.Module``
    (``_load_state_dict_pre_hooks``, whose ``_WrappedHook`` entries carry the hook's ``__module__``, and
    ``_load_state_dict_post_hooks``; torch 2.7 to 2.14), FSDP's own included."""
    return [*getattr(module, "_load_state_dict_pre_hooks", {}).values(),
            *getattr(module, "_load_state_dict_post_hooks", {}).values()]


def state_dict_hooks(module: Any) -> list[Any]:
    """Every state-dict hook and pre-hook registered on one ``nn.Module`` (``_state_dict_hooks``,
    ``_state_dict_pre_hooks``; torch 2.7 to 2.14), FSDP's own included."""
    return [*module._state_dict_hooks.values(), *getattr(module, "_state_dict_pre_hooks", {}).values()]


def persistent_buffers(module: Any) -> list[tuple[str, Any]]:
    """(name, buffer) of the buffers this module itself holds and saves in its state dict (``_buffers`` without
    ``_non_persistent_buffers_set``; ``named_buffers`` cannot tell persistent ones apart)."""
    return [(name, buffer) for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set]


def clean_fsdp_name(name: str) -> str:
    """A module-tree name without FSDP1's wrapper prefixes (``_fsdp_wrapped_module.`` and the like), as FSDP names
    state-dict keys (``torch.distributed.fsdp._common_utils.clean_tensor_name``, torch 2.7 to 2.14)."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def uses_dtensor_state_dict(config: Any) -> bool:
    """Whether an FSDP1 state-dict config asks for DTensor output (``StateDictConfig._use_dtensor``, private)."""
    return bool(getattr(config, "_use_dtensor", False))


def original_params(flat: Any) -> list[Any]:
    """The original parameters of a flat parameter (``use_orig_params=True`` only), in flat order."""
    return flat._params


def original_shapes(flat: Any) -> list[Any]:
    """The original (unsharded) shapes of a flat parameter's members, in flat order."""
    return flat._shapes


def numels_with_padding(flat: Any) -> tuple[int, ...]:
    """Element counts of the unsharded flat parameter's segments: members and alignment padding, in order."""
    return flat._numels_with_padding


def padding_mask(flat: Any) -> list[bool]:
    """For each segment of :func:`numels_with_padding`: whether it is alignment padding."""
    return flat._is_padding_mask


def shard_param_infos(flat: Any) -> Any:
    """FSDP's own record of which part of each member this rank's shard holds (one per member)."""
    return flat._shard_param_infos


# --- DCP/ShardedTensor ------------------------------------------------------------------------------------------
# A rank's piece of an optimizer state tensor is described to DCP as a ``ShardedTensor`` built from local shards
# and global metadata without any collective; nested state dicts are rebuilt from DCP's flat keys; the safe load
# planner stores a loaded bytes entry where ``DefaultLoadPlanner.load_bytes`` would.
# torch 2.7.0 to 2.14.1: ``torch.distributed._shard`` (``ShardMetadata``, ``Shard``, ``ShardedTensor``,
# ``ShardedTensorMetadata``, ``TensorProperties``), ``ShardedTensor._init_from_local_shards_and_global_metadata
# (local_shards, sharded_tensor_metadata, process_group=None, ...)``, ``checkpoint._nested_dict.
# unflatten_state_dict(state_dict, mapping)``, ``checkpoint._traverse.set_element(root, path, value)``, and
# ``DefaultLoadPlanner`` attributes ``flatten_state_dict``, ``original_state_dict``, ``mappings``, ``state_dict``.


def shard_metadata(offsets: list[int], sizes: list[int], placement: str) -> Any:
    """One box of a sharded tensor: ``offsets``/``sizes`` per dimension, ``placement`` as ``"rank:<r>/cpu"``."""
    from torch.distributed._shard.metadata import ShardMetadata

    return ShardMetadata(offsets, sizes, placement)


def local_shard(tensor: Any, metadata: Any) -> Any:
    """This rank's data for one box (:func:`shard_metadata`)."""
    from torch.distributed._shard.sharded_tensor import Shard

    return Shard(tensor, metadata)


def sharded_tensor(local_shards: list[Any], shards_metadata: list[Any], size: Any, dtype: Any, group: Any) -> Any:
    """A ``ShardedTensor`` of global ``size`` from this rank's shards and every rank's box, with no collective."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    properties = TensorProperties(dtype=dtype, requires_grad=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, ShardedTensorMetadata(shards_metadata, torch.Size(size), properties), process_group=group)


def local_tensors(tensor: Any) -> list[Any]:
    """This rank's data of ``tensor``: the local shards' tensors of a ``ShardedTensor``, the local tensor of a
    ``DTensor`` (FSDP2; public ``to_local``), else ``[tensor]``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return [tensor.to_local()]
    return [shard.tensor for shard in tensor.local_shards()] if isinstance(tensor, ShardedTensor) else [tensor]


def version_counter(tensor: Any) -> int:
    """torch's in-place version counter of ``tensor`` (``Tensor._version``): every in-place write that goes through
    the dispatcher (``grad += g`` in autograd's gradient accumulation, FSDP's reduce-scatter accumulation,
    ``zero_()``, ``GradScaler.unscale_``), under ``no_grad`` too, increments it; a tensor and its views share one
    counter, a DTensor and its local tensor do not (a write to the local tensor bumps only the local one). The
    pending-gradient rule compares it with its value after the last optimizer step (``accelerate.gradients``).
    Private but stable: the same attribute in torch 2.7.0 to 2.14.1."""
    return int(tensor._version)


def host_dtensor(local: Any, like: Any) -> Any:
    """A ``DTensor`` with ``like``'s sharding spec (mesh, placements, global shape and stride) whose local tensor is
    ``local``, kept where it is: a host copy of a CUDA DTensor stays on the host (public ``DTensor.from_local``
    would move it to the mesh's device). torch's own asynchronous staging (``_state_dict_utils.
    _create_cpu_state_dict``) builds the same object: a CUDA mesh's DTensor over host memory, which DCP writes.
    torch 2.8.0 to 2.14.1: ``DTensor.__new__(local_tensor, spec, *, requires_grad)`` and the ``_spec`` attribute
    (FSDP2 saves take the protected path only on the rows of ``validated.json`` marked ``"fsdp2": true``; read
    this again when another torch is validated for FSDP2)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


#: The module-tree name parts DCP's state dicts leave out of a parameter's name (``checkpoint.state_dict._get_fqns``,
#: torch 2.7.0 to 2.15.0): activation checkpointing's wrapper attribute (``checkpoint_wrapper.
#: _CHECKPOINT_WRAPPED_MODULE``, the ``_CHECKPOINT_PREFIX`` it strips) and ``torch.compile``'s ``OptimizedModule.
#: _orig_mod``. Names only (compared, never accessed); ``_get_fqns`` is a piece of its own.
WRAPPER_NAME_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def unflatten_state_dict(flat: dict[str, Any], mappings: dict[str, Any]) -> dict[str, Any]:
    """Rebuild a nested state dict from DCP's flat keys and their paths (``Metadata.planner_data``)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict as unflatten

    return unflatten(flat, mappings)


def store_loaded_bytes(planner: Any, read_item: Any, value: Any) -> None:
    """Put one loaded non-tensor entry where ``DefaultLoadPlanner.load_bytes`` would (for a planner that loads
    the bytes itself, e.g. with ``weights_only=True``)."""
    from torch.distributed.checkpoint._traverse import set_element

    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], value)
    else:
        planner.state_dict[read_item.dest_index.fqn] = value


def storage_item(reader: Any, index: Any) -> tuple[str, int, int, bool]:
    """Where ``FileSystemReader`` keeps one stored item: (file relative to the checkpoint directory, byte offset,
    byte length, whether a storage transform (an extension such as compression) applies to it).
    torch 2.7.0 to 2.14.1: ``reader.storage_data[index]`` is a ``filesystem._StorageInfo`` with ``relative_path``,
    ``offset``, ``length`` and (from 2.7) ``transform_descriptors``."""
    info = reader.storage_data[index]
    return (info.relative_path, int(info.offset), int(info.length),
            bool(getattr(info, "transform_descriptors", None)))


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """The record ``FileSystemWriter`` returns for one written item (``WriteResult.storage_data``): file relative
    to the checkpoint directory, byte offset, byte length, no storage transform.
    torch 2.7.0 to 2.15: ``filesystem._StorageInfo(relative_path, offset, length, transform_descriptors=None)``
    (a dataclass; ``transform_descriptors`` left out of its pickled state when None)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


# --- torch.distributed: the default process group's store ----------------------------------------------------
# The key-value store the default group was rendezvoused through, which every rank reaches without a collective.
# torch 2.9 to 2.14: public ``ProcessGroup.get_group_store()`` returns the same ``PrefixStore`` as the private
# ``distributed_c10d._get_default_store()``; the private function (torch 2.7 to 2.14) is the fallback where a
# release lacks the method or its group cannot give its store.


def default_store() -> Any:
    """The default process group's key-value store (a process group must be initialised)."""
    import torch.distributed as dist

    getter = getattr(dist.group.WORLD, "get_group_store", None)
    if getter is not None:
        try:
            return getter()
        except (RuntimeError, NotImplementedError):
            pass
    return dist.distributed_c10d._get_default_store()


# --- torch.optim ------------------------------------------------------------------------------------------------
# torch 2.7.0 to 2.14.1: ``Optimizer._optimizer_load_state_dict_pre_hooks`` (an ``OrderedDict``, filled by the
# public ``register_load_state_dict_pre_hook``).


def has_load_state_dict_pre_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer.load_state_dict`` runs pre-hooks (which may need the state it is about to replace)."""
    return bool(optimizer._optimizer_load_state_dict_pre_hooks)


# --- torch.amp.GradScaler ---------------------------------------------------------------------------------------
# ``_scale`` / ``_growth_tracker`` (torch 2.7 to 2.14: None until the first ``scale()`` or ``load_state_dict`` +
# ``_lazy_init_scale_growth_tracker``). Accelerate's FSDP2 ``load_state`` (1.9-1.15; not 1.16) loads ``scaler.pt`` and then
# calls ``_lazy_init_scale_growth_tracker``, which asserts the tracker is not initialised yet: it fails for a
# scaler that already scaled a loss (every fp16 step) or was loaded before in the same process.


def uninitialise_grad_scaler(scaler: Any) -> None:
    """Drop a ``GradScaler``'s live ``_scale``/``_growth_tracker`` so the next ``load_state_dict`` and lazy init
    rebuild them from the loaded state."""
    scaler._scale = None
    scaler._growth_tracker = None


# --- learning-rate schedulers -----------------------------------------------------------------------------------
# torch 2.7.0 to 2.14.1: ``OneCycleLR._schedule_phases`` (a list of dicts with ``end_step``; two phases, three with
# ``three_phase=True``) is where it keeps ``pct_start`` (as the first phase's end step), and
# ``OneCycleLR._anneal_func_type`` its ``anneal_strategy`` ("cos" or "linear"); ``LRScheduler._last_lr`` is what
# ``get_last_lr()`` returns (set by ``step()``, saved and restored with the state dict; from torch 2.9 it aliases
# tensor learning rates instead of copying them, with the same values).


def one_cycle_phases(scheduler: Any) -> list[dict[str, Any]]:
    """A ``OneCycleLR``'s phases (each with its ``end_step``)."""
    return list(scheduler._schedule_phases)


def one_cycle_anneal_strategy(scheduler: Any) -> str:
    """A ``OneCycleLR``'s ``anneal_strategy`` ("cos" or "linear"); ``AttributeError`` where the release keeps it
    elsewhere."""
    return scheduler._anneal_func_type


def set_last_lr(scheduler: Any, values: list[Any]) -> None:
    """Make ``scheduler.get_last_lr()`` return ``values`` (as ``step()`` would after computing them)."""
    scheduler._last_lr = list(values)


# --- Python runtime ---------------------------------------------------------------------------------------------
# threading._register_atexit (CPython 3.9+, checked on 3.10-3.13): hooks that run at interpreter exit before
# non-daemon threads are joined and before atexit, newest first; concurrent.futures registers its own there.


def register_thread_exit_hook(function: Callable[[], None]) -> bool:
    """Run ``function`` at interpreter exit before ``concurrent.futures`` refuses new work; False if unavailable."""
    import threading

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    register(function)
    return True


# --- NumPy ------------------------------------------------------------------------------------------------------
# Accelerate's RNG files pickle NumPy arrays through ``numpy.core.multiarray._reconstruct``, which NumPy 2 moved to
# ``numpy._core.multiarray`` (``numpy.core`` remains as a deprecated alias). Chosen by what the installed NumPy
# provides rather than by its version number, as the import itself is the ground truth.


def numpy_reconstruct() -> Callable[..., Any]:
    """NumPy's array-unpickling helper, for ``torch.serialization.safe_globals``."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return _reconstruct


# --- The evidence ------------------------------------------------------------------------------------------------
# What the library needs of each private torch piece above, checked against the values recorded for every torch
# release that passed its tests (accelerate_txn/evidence.json; ``compat.evidence``): a release that changed none of
# them is protected the day it ships. ``FSDP1`` and ``FSDP2``: the pieces of each path; ``COMMON``: of both. Every
# private function (or class) whose body a protected path runs is a ``code`` piece; ``exists``/``assigns``/
# ``signature`` only where the path names, reads or replaces it without running its body.

_FSDP = "torch.distributed.fsdp"
_DCP = "torch.distributed.checkpoint"
_SHARD = "torch.distributed._shard"
TORCH_COMMON: tuple[Piece, ...] = (
    Piece("torch", f"{_DCP}._nested_dict", "unflatten_state_dict", "code", "rebuilds nested state from DCP's flat keys"),
    Piece("torch", f"{_DCP}._traverse", "set_element", "code", "stores a loaded value at its path in the state"),
    Piece("torch", f"{_DCP}.default_planner", "DefaultLoadPlanner.load_bytes", "code",
          "what a planner does with a non-tensor item (the direct reader replaces it exactly)"),
    Piece("torch", f"{_DCP}.filesystem", "_StorageInfo", "code",
          "where each DCP item lives in its file: built positionally by the direct writer, read by the reader (its "
          "fields and their order)"),
    Piece("torch", f"{_DCP}.filesystem", "_FileSystemWriter.write_data", "code",
          "reproduced by the direct writer (fsdp.dcp_writer) for one file per rank and one thread, and run where it "
          "declines: each rank's file name and the items it holds"),
    Piece("torch", f"{_DCP}.filesystem", "_write_files_from_queue", "code",
          "reproduced by the direct writer: the order of a file's items (bytes first) and how each tensor reaches it"),
    Piece("torch", f"{_DCP}.filesystem", "_write_item", "code",
          "reproduced by the direct writer: how each item is written (a torch.save archive, raw bytes) and the "
          "record of where"),
    Piece("torch", f"{_DCP}.filesystem", "_SerialCpuLoader", "code",
          "reproduced by the direct writer where it delegates a tensor: DCP's CPU copy of it (a view cloned)"),
    Piece("torch", f"{_DCP}.filesystem", "FileSystemReader.read_data", "code",
          "replaced by the direct reader (fsdp.dcp_reader) where it reproduces its result exactly, and run for the "
          "rest: how each item is read into its destination"),
    Piece("torch", "torch._utils", "_rebuild_tensor_v2", "code",
          "the pickle global of every torch.save tensor archive: the direct reader parses its arguments (storage, "
          "offset, size, stride) itself"),
    Piece("torch", f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING", "code",
          "a pickle global of DCP .metadata (allowed by core.manifest): its members decode each tensor's memory format"),
    Piece("torch", "torch.distributed.distributed_c10d", "_get_default_store", "code",
          "called for the default store where ProcessGroup.get_group_store is absent or fails"),
    Piece("torch", "torch.optim.optimizer", "Optimizer.__init__", "assigns",
          "load-state-dict pre-hooks are detected to refuse a restore they would change",
          ("_optimizer_load_state_dict_pre_hooks",)),
    Piece("torch", "torch.optim.lr_scheduler", "OneCycleLR.__init__", "assigns",
          "a resized OneCycleLR schedule is recomputed from its phases",
          ("_schedule_phases", "_anneal_func_type")),
    Piece("torch", "torch.optim.lr_scheduler", "LRScheduler.get_last_lr", "code",
          "set_last_lr writes _last_lr for get_last_lr to return (a resized schedule)"),
    Piece("torch", "torch.amp.grad_scaler", "GradScaler.__init__", "assigns",
          "a restored scaler is reset to its lazily initialised state", ("_scale", "_growth_tracker")),
    Piece("torch", "torch.serialization", "_get_layout", "code",
          "a pickle global of DCP .metadata: called while a checkpoint's metadata is read"),
)
TORCH_FSDP1: tuple[Piece, ...] = (
    Piece("torch", f"{_FSDP}._common_utils", "_get_param_to_fqns", "code",
          "maps flat parameters to their original names"),
    Piece("torch", f"{_FSDP}._common_utils", "_apply_to_modules", "code",
          "called by _get_param_to_fqns: the module traversal and name prefixes the names are built from"),
    Piece("torch", f"{_FSDP}._common_utils", "clean_tensor_name", "code", "FSDP1's parameter names in checkpoints"),
    Piece("torch", f"{_FSDP}._init_utils", "_init_core_state", "assigns",
          "an FSDP unit's handle and use_orig_params", ("_handle", "_use_orig_params")),
    Piece("torch", f"{_FSDP}._init_utils", "_init_process_group_state_for_hybrid_shard", "assigns",
          "a hybrid-sharded unit's replica group (protected HYBRID_SHARD: the number of replicas)",
          ("_inter_node_pg",)),
    Piece("torch", f"{_FSDP}._flat_param", "FlatParameter._init_metadata", "assigns",
          "the layout of a flat parameter: original shapes, padding",
          ("_params", "_shapes", "_numels_with_padding", "_is_padding_mask")),
    Piece("torch", f"{_FSDP}._flat_param", "FlatParamHandle._init_shard_metadata", "code",
          "each original parameter's place in the local flat shard (_shard_param_infos)"),
    Piece("torch", f"{_FSDP}._flat_param", "FlatParamHandle._get_shard_metadata", "code",
          "called by _init_shard_metadata: computes the _shard_param_infos the geometry is checked against"),
    Piece("torch", f"{_FSDP}._flat_param", "_ShardParamInfo", "code",
          "the fields of each _shard_param_infos entry, read by name (in_shard, offset_in_shard, ...)"),
    Piece("torch", f"{_FSDP}._flat_param", "FlatParamHandle.init_flat_param_attributes", "assigns",
          "a flat parameter's local shard (flat_local_shard; run by _lazy_init)", ("_local_shard",)),
    Piece("torch", f"{_FSDP}._state_dict_utils", "_set_use_dtensor", "assigns",
          "where an FSDP1 state-dict config asks for DTensor output (uses_dtensor_state_dict: the direct read and "
          "the capture decline it)", ("_use_dtensor",)),
    Piece("torch", "torch.nn.modules.module", "Module.__init__", "assigns",
          "a module's buffers and its state-dict hooks (persistent_buffers, state_dict_hooks, load_state_dict_hooks: "
          "user hooks decline the direct paths)",
          ("_buffers", "_non_persistent_buffers_set", "_state_dict_hooks", "_state_dict_pre_hooks",
           "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")),
    Piece("torch", f"{_SHARD}.sharded_tensor.api", "ShardedTensor._init_from_local_shards_and_global_metadata", "code",
          "called: builds the ShardedTensors an FSDP1 restore reads into"),
    Piece("torch", f"{_SHARD}.metadata", "ShardMetadata", "code",
          "built for each box of those ShardedTensors (its fields and checks)"),
    Piece("torch", f"{_SHARD}.sharded_tensor.shard", "Shard", "code",
          "built for each local box: keeps the given view of the flat shard"),
    Piece("torch", f"{_SHARD}.sharded_tensor.metadata", "ShardedTensorMetadata", "code",
          "built for each ShardedTensor: its boxes, size and properties"),
    Piece("torch", f"{_SHARD}.sharded_tensor.metadata", "TensorProperties", "code",
          "built for each ShardedTensor: its dtype (and the rest left to their defaults)"),
    Piece("torch", f"{_FSDP}._runtime_utils", "_lazy_init", "code",
          "called: FSDP1's lazy initialisation before the direct model read (sets the local shards)"),
    Piece("torch", f"{_FSDP}._runtime_utils", "_share_state_and_init_handle_attrs", "code",
          "called by _lazy_init: initialises each unit's flat parameter (its local shard), without a collective"),
)
TORCH_FSDP2: tuple[Piece, ...] = (
    Piece("torch", "torch.distributed.tensor._api", "DTensor", "exists",
          "host copies of FSDP2 parameters as DTensors with the live spec (DTensor(local, spec, requires_grad=)): "
          "its constructor is compiled from torch 2.10 on, so there is no body to read"),
    Piece("torch", f"{_DCP}.state_dict", "_get_fqns", "code",
          "the parameter names DCP state dicts record, reproduced by fsdp2.canonical_name (WRAPPER_NAME_PARTS)"),
    Piece("torch", "torch.amp.grad_scaler", "GradScaler._lazy_init_scale_growth_tracker", "code",
          "called by Accelerate's FSDP2 load_state (1.9-1.15) after the scaler is loaded (uninitialise_grad_scaler)"),
)
