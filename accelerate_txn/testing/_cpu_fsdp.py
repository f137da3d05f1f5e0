"""FSDP on CPU: the plugin the CPU harness runs, and forcing it onto an ``Accelerator``.

Accelerate never selects FSDP on CPU by itself: ``Accelerator(cpu=True)`` in a gloo process group is
``MULTI_CPU``. :func:`force_fsdp` then sets ``distributed_type`` (on the Accelerator's state and on
``PartialState``), the FSDP plugin and the device; FSDP1 and FSDP2 then prepare, train, save and load on CPU.

One implementation, two callers: :func:`accelerate_txn.testing.fsdp_accelerator` (a test builds the Accelerator
itself) and the launcher's worker (``_worker.py``), which applies :func:`plugin_for_script` and
:func:`force_fsdp` to every ``Accelerator`` an unmodified script constructs.

Import rule: the worker loads this file by its path, not as ``accelerate_txn.testing._cpu_fsdp``. Importing
anything under ``accelerate_txn`` runs the package's ``__init__``, which installs accelerate-txn's checkpoint patch,
and whether that patch is installed is the script's own decision (its ``import accelerate_txn``). So this module
imports the standard library only at import time and torch and Accelerate inside its functions; the library's
error type is imported (absolutely: there is no parent package when loaded by path) only to refuse, and a refusal
ends the script anyway.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

UNSUPPORTED_STATE_DICT_TYPES = {
    "LOCAL_STATE_DICT": "accelerate-txn does not protect LOCAL_STATE_DICT checkpoints (each rank's flat shard in a "
                        "file of its own, readable only by the same world and wrapping): its saves run native, "
                        "unprotected, with a WARNING, and a launcher run is a test of the protected path.",
}
"""``state_dict_type`` values the launcher refuses (:func:`~accelerate_txn.testing.run_script` and ``python -m
accelerate_txn.testing run``), with the reason. :func:`~accelerate_txn.testing.fsdp_accelerator` builds them (a test
of the native fallback)."""

STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT")
"""The ``state_dict_type`` values the CPU harness runs (FSDP2 has no ``LOCAL_STATE_DICT``). FSDP1's
``FULL_STATE_DICT`` runs with the fix of pytorch#188990 (:func:`full_state_dict_on_cpu`)."""


class _KeepScriptPolicy:
    def __repr__(self) -> str:
        return "KEEP_SCRIPT_POLICY"


KEEP_SCRIPT_POLICY: Any = _KeepScriptPolicy()
"""``auto_wrap`` of :func:`plugin_for_script` when the launcher was given none: the script's plugin keeps its own
policy; without a plugin of the script, ``torch.nn.Linear`` is wrapped (as :func:`fsdp_accelerator` does)."""


def state_dict_kind(state_dict_type: Any) -> str:
    """``"SHARDED_STATE_DICT"`` for the string, the ``StateDictType`` member or its name in any case."""
    return str(getattr(state_dict_type, "name", state_dict_type)).upper()


def configuration_error(message: str) -> Exception:
    """The library's ``CheckpointConfigurationError`` (imported here, on a refusal only: see the module docstring)."""
    from accelerate_txn.errors import CheckpointConfigurationError

    return CheckpointConfigurationError(message)


REFUSAL_FILE_ENV = "ACCELERATE_TXN_LAUNCHER_REFUSAL_FILE"
"""The environment variable naming the file where a launcher's worker writes a refusal of the harness (one line: what
is refused and the fix) before it exits with status 2; the launcher reports it once for the whole job."""


def is_refusal(error: BaseException) -> bool:
    """Whether ``error``, raised by one of this module's functions, is a refusal of the harness: a
    ``CheckpointConfigurationError``, imported by :func:`configuration_error` when it refuses (this module's other
    errors are Accelerate's and torch's own)."""
    errors = sys.modules.get("accelerate_txn.errors")
    return errors is not None and isinstance(error, errors.CheckpointConfigurationError)


def refuse_unsupported(state_dict_type: Any, what: str, fix: str) -> None:
    """Raise ``CheckpointConfigurationError`` naming ``what`` and ``fix`` if the harness cannot run this type."""
    kind = state_dict_kind(state_dict_type)
    if kind in UNSUPPORTED_STATE_DICT_TYPES:
        raise configuration_error(f"{what} cannot run on this CPU harness: {UNSUPPORTED_STATE_DICT_TYPES[kind]} {fix}")


def full_state_dict_on_cpu() -> None:
    """Let FSDP1 gather a ``FULL_STATE_DICT`` on CPU as it does on GPUs, in this process: two places where torch
    (2.13 measured) takes "copy to the CPU" for granted, and a copy that is a no-op on CPU leaves live memory shared.

    * The model: Accelerate saves a ``FULL_STATE_DICT`` with ``offload_to_cpu=True`` on more than one process, and
      FSDP1's ``FlatParamHandle.to_cpu`` then "moves" the unsharded flat parameter to the CPU (a no-op there) and
      frees the unsharded storage the parameter views still use: rank 0 reads freed memory (SIGSEGV, or a
      ``setStorage ... out of bounds`` error). pytorch#188989; the fix here is upstream's (pull request #188990):
      ``to_cpu`` does nothing for a flat parameter already on the CPU.
    * The optimizer: ``FSDP.optim_state_dict`` all-gathers each state (``exp_avg``, then ``exp_avg_sq``, ...) into
      one reused buffer and, with ``offload_to_cpu=True`` (Accelerate's full optimizer config), keeps
      ``value.cpu()`` of its views, a copy on a GPU and the buffer itself on CPU: every state of a unit ends as the
      last one gathered (a saved ``exp_avg`` equal to ``exp_avg_sq``). Here the gathered values are cloned on CPU,
      as torch does without the offload (``_optim_utils._unflatten_orig_param_states``).

    The files Accelerate then writes are those of the GPU path. Idempotent; a torch without these functions is left
    alone (the harness then runs what torch does)."""
    try:
        from torch.distributed.fsdp import _flat_param, _optim_utils
    except ImportError:  # pragma: no cover - a torch without FSDP1's flat parameters
        return
    handle = getattr(_flat_param, "FlatParamHandle", None)
    original = getattr(handle, "to_cpu", None)
    if original is not None and not getattr(original, "cpu_harness_fix", False):
        @contextlib.contextmanager
        def to_cpu(self: Any) -> Iterator[None]:
            if self.flat_param.device.type == "cpu":
                yield  # already on the CPU: nothing to move, nothing to free
                return
            with original(self):
                yield

        to_cpu.cpu_harness_fix = True  # type: ignore[attr-defined]
        handle.to_cpu = to_cpu
    unflatten = getattr(_optim_utils, "_unflatten_orig_param_states", None)
    if unflatten is not None and not getattr(unflatten, "cpu_harness_fix", False):
        import functools
        import inspect

        names = list(inspect.signature(unflatten).parameters)

        @functools.wraps(unflatten)
        def unflatten_with_copies(*args: Any, **kwargs: Any) -> Any:
            bound = dict(zip(names, args), **kwargs)
            info = bound.get("fsdp_param_info")
            if bound.get("cpu_offload") and getattr(getattr(info, "state", None), "compute_device",
                                                     None) is not None and info.state.compute_device.type == "cpu":
                bound["cpu_offload"] = False  # the values are cloned: no view of the reused buffer survives
            return unflatten(**bound)

        unflatten_with_copies.cpu_harness_fix = True  # type: ignore[attr-defined]
        _optim_utils._unflatten_orig_param_states = unflatten_with_copies


def check_state_dict_type(state_dict_type: Any, fsdp_version: int, what: str) -> None:
    """Raise ``CheckpointConfigurationError`` naming ``what`` unless the harness builds this type for this FSDP
    version (:data:`STATE_DICT_TYPES`; FSDP2 has no ``LOCAL_STATE_DICT``)."""
    kind = state_dict_kind(state_dict_type)
    if kind not in STATE_DICT_TYPES:
        raise configuration_error(f"{what}: use one of {', '.join(STATE_DICT_TYPES)}.")
    if kind == "LOCAL_STATE_DICT" and fsdp_version == 2:
        raise configuration_error(f"{what}: LOCAL_STATE_DICT does not exist on FSDP2; use SHARDED_STATE_DICT or "
                                  "FULL_STATE_DICT.")


def auto_wrap_fields(auto_wrap: type | None, fsdp_version: int) -> dict[str, Any]:
    """The plugin fields that make FSDP wrap every ``auto_wrap`` module in a unit of its own (``None``: none, the
    model is one unit).

    FSDP1 takes a ``ModuleWrapPolicy``. Accelerate's FSDP2 preparation honours only its transformer-based and
    size-based policies (any other callable wraps nothing but the root), so FSDP2 gets the transformer-based one
    with the class's name, which Accelerate looks up in the model at ``prepare`` (a model without such a module
    is refused there, naming the class).
    """
    if auto_wrap is None:
        return {"auto_wrap_policy": None, "transformer_cls_names_to_wrap": None}
    if fsdp_version == 1:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return {"auto_wrap_policy": ModuleWrapPolicy({auto_wrap}), "transformer_cls_names_to_wrap": None}
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    return {"auto_wrap_policy": transformer_auto_wrap_policy, "transformer_cls_names_to_wrap": [auto_wrap.__name__]}


HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
"""FSDP1's hybrid sharding strategies: shard inside a node, replicate across nodes."""

RANKS_PER_NODE_ENV = "ACCELERATE_TXN_CPU_RANKS_PER_NODE"
"""The environment variable that sets how many ranks one emulated node holds for FSDP1 hybrid sharding on CPU (the
launcher's ``ranks_per_node``); without it, half the ranks (two replicas)."""


def make_plugin(*, fsdp_version: int = 1, state_dict_type: str = "SHARDED_STATE_DICT", use_orig_params: bool = True,
                cpu_offload: bool = False, auto_wrap: type | None = None, sharding_strategy: str | None = None) -> Any:
    """A ``FullyShardedDataParallelPlugin`` that runs on CPU: no ``sync_module_states`` and no
    ``cpu_ram_efficient_loading`` (both need an accelerator device). The caller has refused unsupported types.
    ``sharding_strategy`` (FSDP1 only): a ``ShardingStrategy`` name, ``None`` for Accelerate's default."""
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffload

    fsdp1 = fsdp_version == 1
    if sharding_strategy is not None and not fsdp1:
        raise configuration_error(
            f"sharding_strategy={sharding_strategy!r} is FSDP1's setting; FSDP2 hybrid sharding is a "
            "ParallelismConfig(dp_replicate_size=..., dp_shard_size=...) (parallelism_config=).")
    return FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_version,
        state_dict_type=state_dict_type,
        use_orig_params=use_orig_params if fsdp1 else None,  # FSDP2 has neither: None spares Accelerate's warning
        **auto_wrap_fields(auto_wrap, fsdp_version),
        cpu_offload=CPUOffload(offload_params=cpu_offload) if fsdp1 else cpu_offload,
        sync_module_states=False if fsdp1 else None,
        cpu_ram_efficient_loading=False,
        **({"sharding_strategy": sharding_strategy.upper()} if sharding_strategy is not None else {}),
    )


def hybrid_ranks_per_node(plugin: Any, world_size: int, ranks_per_node: int | None = None) -> int | None:
    """For an FSDP1 plugin with a hybrid sharding strategy, the ranks of one emulated node (``ranks_per_node``, else
    :data:`RANKS_PER_NODE_ENV`, else half the world: two replicas), checked to divide ``world_size``; else None."""
    strategy = getattr(getattr(plugin, "sharding_strategy", None), "name", None)
    if plugin.fsdp_version != 1 or strategy not in HYBRID_STRATEGIES:
        if ranks_per_node is not None:
            raise configuration_error(
                f"ranks_per_node={ranks_per_node} applies to FSDP1 hybrid sharding only (sharding_strategy "
                f"{' or '.join(HYBRID_STRATEGIES)}); this plugin shards with {strategy}. Leave it out.")
        return None
    if ranks_per_node is None:
        # Read as core.environment reads the library's variables (this module imports none of the library: see
        # its docstring): spaces ignored, unset or empty for the default, anything else named in the error.
        given = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
        if given and not given.isdigit():
            raise configuration_error(
                f"The environment variable {RANKS_PER_NODE_ENV} is {os.environ.get(RANKS_PER_NODE_ENV)!r}: use a "
                f"positive whole number of ranks per emulated node that divides the {world_size} ranks; unset or "
                f"empty: half the ranks. Set an accepted value, or unset it for the default.")
        ranks_per_node = int(given) if given else max(1, world_size // 2)
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise configuration_error(
            f"FSDP1 {strategy} on CPU: {ranks_per_node} ranks per node do not divide the {world_size} ranks into "
            f"equal nodes; give ranks_per_node (the shard group's size, {RANKS_PER_NODE_ENV}) a divisor of "
            f"{world_size}.")
    return ranks_per_node


@contextlib.contextmanager
def cpu_devices_per_node(count: int) -> Iterator[None]:
    """Inside: ``torch.cpu.device_count()`` returns ``count``. FSDP1 hybrid sharding without a process group builds
    its shard (intra-node) groups of ``device_count()`` consecutive ranks and its replicate (inter-node) groups
    across them (``torch.distributed.fsdp._init_utils._init_intra_and_inter_node_groups``), as on a GPU node of
    ``count`` devices; on CPU the count is 1, so every rank would be a node of its own (and FSDP would fall back
    to NO_SHARD)."""
    import torch

    original = torch.cpu.device_count
    torch.cpu.device_count = lambda: count  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cpu.device_count = original  # type: ignore[assignment]


def emulate_nodes(accelerator: Any, ranks_per_node: int) -> None:
    """Make ``accelerator.prepare`` build FSDP1 hybrid units over nodes of ``ranks_per_node`` consecutive ranks:
    shard groups {0..k-1}, {k..2k-1}, ...; replica groups {0, k, ...}, {1, k+1, ...} (the layout torch gives
    ``ranks_per_node`` GPUs per node). Only the model preparation sees the emulated device count."""
    import functools

    prepare_model = accelerator.prepare_model

    @functools.wraps(prepare_model)
    def prepare_on_nodes(*args: Any, **kwargs: Any) -> Any:
        with cpu_devices_per_node(ranks_per_node):
            return prepare_model(*args, **kwargs)

    accelerator.prepare_model = prepare_on_nodes


def hybrid_nodes(accelerator: Any, plugin: Any, ranks_per_node: int | None = None) -> None:
    """After :func:`force_fsdp`: for an FSDP1 ``plugin`` with ``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2``, the ranks
    form emulated nodes of ``ranks_per_node`` ranks (:func:`hybrid_ranks_per_node`, :func:`emulate_nodes`): sharded
    inside a node, replicated across nodes, as Accelerate's FSDP1 preparation builds it on GPU nodes. Nothing for
    any other plugin (``ranks_per_node`` given for one is refused)."""
    per_node = hybrid_ranks_per_node(plugin, accelerator.num_processes, ranks_per_node)
    if per_node is not None:
        emulate_nodes(accelerator, per_node)


def plugin_for_script(plugin: Any, *, fsdp_version: int | None = None, state_dict_type: str | None = None,
                      auto_wrap: Any = KEEP_SCRIPT_POLICY) -> Any:
    """The FSDP plugin of an ``Accelerator`` a script constructs under the launcher.

    ``plugin`` is the script's own ``fsdp_plugin`` argument, or ``None``. The launcher's settings (``None``: not
    given) override it; what the launcher leaves open comes from the script's plugin; without one, the defaults of
    :func:`fsdp_accelerator` (FSDP1, ``SHARDED_STATE_DICT``, every ``torch.nn.Linear`` wrapped). ``auto_wrap``:
    a module class, ``None`` (no policy: the model is one FSDP unit), or :data:`KEEP_SCRIPT_POLICY`. Whatever the
    script asked for, ``sync_module_states`` and ``cpu_ram_efficient_loading`` are off (both need a GPU). Refuses
    a ``fsdp_version`` that contradicts the script's plugin and a state-dict type the harness cannot run.
    """
    if plugin is None:
        kind = state_dict_type or "SHARDED_STATE_DICT"
        refuse_unsupported(kind, f"state_dict_type {kind}", "Use SHARDED_STATE_DICT (the default) or FULL_STATE_DICT.")
        if auto_wrap is KEEP_SCRIPT_POLICY:
            import torch

            auto_wrap = torch.nn.Linear
        return make_plugin(fsdp_version=fsdp_version or 1, state_dict_type=kind, auto_wrap=auto_wrap)
    if fsdp_version is not None and plugin.fsdp_version != fsdp_version:
        raise configuration_error(
            f"The script passes Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version="
            f"{plugin.fsdp_version}, ...)) but the launcher was asked for FSDP{fsdp_version}. Leave out the "
            "launcher's fsdp_version (--fsdp-version) to run the script's own, or make the version the script "
            "builds its plugin with configurable (a transformers Trainer or TRL script: the \"version\" of its "
            "--fsdp_config, 2 when not given).")
    if state_dict_type is not None:
        # set_state_dict_type keeps a config it finds: a FULL config under a SHARDED type would break the save.
        plugin.state_dict_config = None
        plugin.optim_state_dict_config = None
        plugin.set_state_dict_type(state_dict_type)
    refuse_unsupported(
        plugin.state_dict_type,
        f"The script's FullyShardedDataParallelPlugin with state_dict_type {state_dict_kind(plugin.state_dict_type)} "
        "(given, or set by the script's configuration)",
        "Override it with the launcher's state_dict_type='SHARDED_STATE_DICT' or 'FULL_STATE_DICT' (--state-dict-type "
        "SHARDED_STATE_DICT), the configurations accelerate-txn protects (a transformers Trainer or TRL script: or "
        "its --fsdp_config's \"state_dict_type\": \"SHARDED_STATE_DICT\").")
    if auto_wrap is not KEEP_SCRIPT_POLICY:
        for name, value in auto_wrap_fields(auto_wrap, plugin.fsdp_version).items():
            setattr(plugin, name, value)
    if plugin.fsdp_version == 1:
        plugin.sync_module_states = False
    plugin.cpu_ram_efficient_loading = False
    return plugin


def parallelism_for_cpu(parallelism_config: Any) -> Any:
    """The ``ParallelismConfig`` an ``Accelerator`` would use: the one given, else the one Accelerate builds from
    the environment ``accelerate launch --parallelism_config_*`` sets (``ACCELERATE_USE_PARALLELISM_CONFIG=true``
    and ``PARALLELISM_CONFIG_DP_REPLICATE_SIZE`` etc.), else None. The caller constructs its ``Accelerator``
    without it (Accelerate refuses a ``ParallelismConfig`` on ``MULTI_CPU``) and gives it to :func:`force_fsdp`."""
    if parallelism_config is not None:
        return parallelism_config
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()


@contextlib.contextmanager
def no_parallelism_environment() -> Iterator[None]:
    """Construct an ``Accelerator`` in here: Accelerate's own reading of ``ACCELERATE_USE_PARALLELISM_CONFIG`` would
    build a ``ParallelismConfig`` it then refuses on CPU (:func:`parallelism_for_cpu` has read it already)."""
    saved = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


def replicate_parallel_for_accelerate() -> bool:
    """Give ``transformers.integrations.tensor_parallel`` the ``ReplicateParallel`` Accelerate 1.15's FSDP2 + TP
    preparation imports, where the installed transformers has none; True if it was added.

    ``Accelerator._prepare_tp`` (Accelerate 1.15, FSDP2 with ``tp_size > 1``) imports
    ``transformers.integrations.tensor_parallel.ReplicateParallel`` for every model, and uses it to make each
    parameter the model's tensor-parallel plan left alone a ``Replicate()`` DTensor on the ``tp`` mesh. Newer
    transformers (5.24 measured; its tensor-parallel API moved to ``transformers.distributed``) have no such class:
    on GPUs too, ``prepare`` then fails with an ``ImportError`` before anything is sharded. The stand-in does what
    transformers 4.5x's did
    (``distribute_module`` with inputs made ``Replicate()`` DTensors and outputs made local again). Nothing changes
    where transformers has the class, or is not installed (Accelerate's own ``ImportError`` then stands)."""
    try:
        import transformers.integrations.tensor_parallel as tensor_parallel
    except ImportError:
        return False
    if hasattr(tensor_parallel, "ReplicateParallel"):
        return False

    class ReplicateParallel:
        """transformers 4.5x's ``ReplicateParallel``, as far as Accelerate 1.15 uses it (``prepare_module_tp``)."""

        @staticmethod
        def _input(module: Any, inputs: Any, mesh: Any) -> Any:
            from torch.distributed.tensor import DTensor, Replicate

            first = inputs[0]
            if not isinstance(first, DTensor):
                first = DTensor.from_local(first, mesh, (Replicate(),), run_check=False)
            return (first, *inputs[1:])

        @staticmethod
        def _output(module: Any, outputs: Any, mesh: Any) -> Any:
            return outputs.to_local() if hasattr(outputs, "to_local") else outputs

        def prepare_module_tp(self, module: Any, device_mesh: Any) -> Any:
            from torch.distributed.tensor import distribute_module

            return distribute_module(module, device_mesh, input_fn=self._input, output_fn=self._output)

    tensor_parallel.ReplicateParallel = ReplicateParallel
    return True


def force_fsdp(accelerator: Any, plugin: Any, parallelism_config: Any = None) -> None:
    """Turn ``accelerator`` (built with ``cpu=True``) into an FSDP Accelerator using ``plugin`` on CPU: every rank,
    right after construction and before ``prepare``. ``parallelism_config``: an Accelerate ``ParallelismConfig``
    (HSDP ``dp_replicate_size`` x ``dp_shard_size``, ``tp_size``, ...): its device mesh is built on CPU and
    checked by Accelerate's own validation, as ``Accelerator(parallelism_config=...)`` does on GPUs. With ``tp_size >
    1`` the model is tensor-parallelised by the script before ``prepare`` (``parallelize_module`` on
    ``accelerator.torch_device_mesh["tp"]``), and :func:`replicate_parallel_for_accelerate` lets Accelerate 1.15's
    FSDP2 + TP preparation run beside a transformers without ``ReplicateParallel``."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.device = torch.device("cpu")
    if plugin.fsdp_version == 1:
        full_state_dict_on_cpu()  # a FULL_STATE_DICT gather on CPU, as on GPUs (also after set_state_dict_type)
    if parallelism_config is not None:
        if plugin.fsdp_version != 2:
            raise configuration_error(
                "A ParallelismConfig (HSDP, tensor or context parallelism) needs FSDP2: Accelerate builds its device "
                "mesh for fully_shard only. Use fsdp_version=2 (--fsdp-version 2), or FSDP1's "
                "sharding_strategy='HYBRID_SHARD' for hybrid sharding with FSDP1.")
        accelerator.state.parallelism_config = parallelism_config
        if parallelism_config.tp_enabled:
            replicate_parallel_for_accelerate()
        accelerator.state.device_mesh = parallelism_config.get_device_mesh("cpu")
        parallelism_config._validate_accelerator(accelerator)
    # PartialState too (the state TrainingArguments keeps): a gloo PartialState's device is "cpu:<local rank>",
    # and FSDP1 refuses a device_id with an index on CPU when a copy of it reaches the Accelerator (bf16 does).
    partial = PartialState()
    partial.distributed_type = DistributedType.FSDP
    partial.device = torch.device("cpu")
