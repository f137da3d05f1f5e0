"""CPU test harness: a real Accelerate FSDP1 (or FSDP2) setup on CPU with gloo, and a multi-process launcher.

Accelerate never selects FSDP on CPU by itself. :func:`fsdp_accelerator` builds ``Accelerator(cpu=True)`` in a
gloo process group and then forces ``distributed_type``, the FSDP plugin and the device, so FSDP
checkpointing can be exercised without GPUs. :func:`launch` runs a function in ``world_size`` real processes
(the environment torchrun would give them) with a hard timeout: a hang fails instead of stalling.

Used by accelerate-txn's own tests and the demo; users may use it to test their checkpointing code.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing
import os
import pickle
import signal
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

UNSUPPORTED_STATE_DICT_TYPES = {
    "FULL_STATE_DICT": "Accelerate's native FULL_STATE_DICT save kills rank 0 with a segmentation fault on CPU "
                       "with gloo (a crash, not an exception: the job would hang or die without a message).",
}
"""``state_dict_type`` values :func:`fsdp_accelerator` refuses, with the reason."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice): a rendezvous port for a launch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fsdp_accelerator(
    *,
    use_orig_params: bool = True,
    state_dict_type: str = "SHARDED_STATE_DICT",
    cpu_offload: bool = False,
    auto_wrap: type[torch.nn.Module] | None = torch.nn.Linear,
    project_dir: str | Path | None = None,
    automatic_checkpoint_naming: bool = False,
    total_limit: int | None = None,
    gradient_accumulation_steps: int = 1,
    fsdp_version: int = 1,
    project_config: Any = None,
    **accelerator_kwargs: Any,
) -> Any:
    """A real ``Accelerator`` using FSDP on CPU (gloo). Call once per process, in every rank.

    Pass either ``project_config`` (an Accelerate ``ProjectConfiguration``) or the shortcuts ``project_dir``,
    ``automatic_checkpoint_naming`` and ``total_limit``, not both. ``state_dict_type``: ``"SHARDED_STATE_DICT"``
    (what the protected path handles) or ``"LOCAL_STATE_DICT"``; ``"FULL_STATE_DICT"`` is refused because its
    native save crashes the saving process on CPU (see :data:`UNSUPPORTED_STATE_DICT_TYPES`). ``fsdp_version=2``:
    Accelerate's FSDP2 (``fully_shard``, DTensor parameters); prepare the model and its optimizer together.
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import DistributedType, ProjectConfiguration
    from torch.distributed.fsdp import CPUOffload

    from .errors import CheckpointConfigurationError

    kind = str(getattr(state_dict_type, "name", state_dict_type)).upper()
    if kind in UNSUPPORTED_STATE_DICT_TYPES:
        raise CheckpointConfigurationError(
            f"fsdp_accelerator(state_dict_type={state_dict_type!r}) cannot run on this CPU harness: "
            f"{UNSUPPORTED_STATE_DICT_TYPES[kind]} Use state_dict_type='SHARDED_STATE_DICT' (the default, the "
            "configuration accelerate-txn protects), or test FULL_STATE_DICT on GPUs with a real launcher."
        )
    shortcuts = {"project_dir": project_dir, "automatic_checkpoint_naming": automatic_checkpoint_naming,
                 "total_limit": total_limit}
    given = sorted(name for name, value in shortcuts.items() if value not in (None, False))
    if project_config is not None and given:
        raise CheckpointConfigurationError(
            f"fsdp_accelerator: pass project_config or {', '.join(given)}, not both (they configure the same "
            "ProjectConfiguration); put those settings into your ProjectConfiguration."
        )

    policy = None
    if auto_wrap is not None:
        import functools

        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({auto_wrap}) if fsdp_version == 1 else functools.partial(
            lambda module, kind: isinstance(module, kind), kind=auto_wrap)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_version,
        state_dict_type=state_dict_type,
        use_orig_params=use_orig_params,
        auto_wrap_policy=policy,
        cpu_offload=CPUOffload(offload_params=cpu_offload) if fsdp_version == 1 else cpu_offload,
        sync_module_states=False,
        cpu_ram_efficient_loading=False,
    )
    project = project_config if project_config is not None else ProjectConfiguration(
        project_dir=str(project_dir) if project_dir is not None else None,
        automatic_checkpoint_naming=automatic_checkpoint_naming,
        total_limit=total_limit,
    )
    accelerator = Accelerator(cpu=True, project_config=project,
                              gradient_accumulation_steps=gradient_accumulation_steps, **accelerator_kwargs)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.device = torch.device("cpu")
    return accelerator


class TinyModel(torch.nn.Module):
    """A small MLP whose layers FSDP wraps one by one (``auto_wrap=torch.nn.Linear``)."""

    def __init__(self, width: int = 16, depth: int = 3, odd_rows: int = 5) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1)]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, odd_rows)  # rows not divisible by the world size: padded shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def start_ranks(code: str, world_size: int = 2, *, env: dict[str, str] | None = None) -> list[Any]:
    """Start ``world_size`` separate interpreters running ``python -c code`` with torchrun's environment (one
    rendezvous port, ``RANK``/``WORLD_SIZE``/...), for tests that kill a job: unlike :func:`launch`, a rank that
    dies is the point, so the caller owns the ``subprocess.Popen`` objects (and must kill and wait for them)."""
    import subprocess
    import sys

    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), **(env or {})}
    return [subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(world_size)]


def _entry(target: str, rank: int, world_size: int, port: int, args: Sequence[Any], env: dict[str, str],
           results: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "OMP_NUM_THREADS": "1", **env})
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # launch() asks for stacks before killing a hang
    # FSDP1/ShardedTensor deprecation notices drown test output; library warnings stay visible.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(_get_pg_default_device|Multiple backends are registered).*")
    try:
        module, name = target.split(":")
        function = getattr(importlib.import_module(module), name)
        value = function(*args)
        payload = pickle.dumps(value)  # eagerly: a Queue pickles in a feeder thread, where errors vanish
        results.put((rank, True, payload))
    except BaseException:  # report everything, including DCP's CheckpointException
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class LaunchError(AssertionError):
    """A launched rank failed or the launch timed out."""


def launch(target: str | Callable[..., Any], world_size: int = 2, *, args: Sequence[Any] = (),
           timeout: float = 240.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``target(*args)`` (``"module:function"`` or an importable function) in ``world_size`` processes.

    Returns each rank's return value (rank order). Raises :class:`LaunchError` with every failing rank's
    traceback, or when ``timeout`` seconds pass (all processes are then killed).
    """
    if callable(target):
        target = f"{target.__module__}:{target.__qualname__}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_entry, args=(target, rank, world_size, port, tuple(args), env or {}, results),
                                 daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    collected: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchError(f"{target} did not finish within {timeout:.0f}s on {world_size} ranks "
                                  f"(finished: {sorted(collected)}): a rank is hanging")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
                collected[rank] = (ok, value)
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise LaunchError(f"{target}: rank(s) {dead} died with exit codes "
                                      f"{[processes[r].exitcode for r in dead]}") from None
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        alive = [process for process in processes if process.is_alive()]
        for process in alive:
            os.kill(process.pid, signal.SIGUSR1)  # dump every thread's stack to stderr (see _entry)
        if alive:
            alive[0].join(timeout=2.0)  # give the stack dumps a moment to be written
        for process in alive:
            process.kill()
            process.join()
    failures = {rank: value for rank, (ok, value) in collected.items() if not ok}
    if failures:
        raise LaunchError("\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())))
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]
