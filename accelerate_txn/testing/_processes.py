"""Real multi-process jobs on one machine with torchrun's environment: :func:`launch` (a function on every rank,
hard timeout) and :func:`start_ranks` (interpreters a test may kill).

Each rank gets what torchrun gives its workers (:func:`rank_environment`): ``MASTER_ADDR``/``MASTER_PORT`` of
one rendezvous, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``. The launcher of unmodified
scripts (``_launcher.py``) uses the same environment.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ._lifeline import lifeline, watch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice): a rendezvous port for a launch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for rank ``rank`` of a one-machine job rendezvousing on ``127.0.0.1:port``."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}


def start_ranks(code: str, world_size: int = 2, *, env: dict[str, str] | None = None) -> list[Any]:
    """Start ``world_size`` separate interpreters running ``python -c code`` with torchrun's environment (one
    rendezvous port, ``RANK``/``WORLD_SIZE``/...), for tests that kill a job: unlike :func:`launch`, a rank that
    dies is the point, so the caller owns the ``subprocess.Popen`` objects (and must kill and wait for them). They
    have no lifeline: a caller killed with ``kill -9`` leaves them running (a rank that must not outlive it can
    check ``os.getppid()``).
    To start an unmodified training script instead, see :func:`start_script`."""
    import subprocess
    import sys

    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    return [subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             env={**base, **rank_environment(rank, world_size, port), **(env or {}),
                                  "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(world_size)]


def _entry(target: str, rank: int, world_size: int, port: int, args: Sequence[Any], env: dict[str, str],
           results: Any, parent: Any) -> None:
    watch(os.dup(parent.fileno()))  # end with launch()'s process, however it ends (see _lifeline)
    parent.close()
    import torch

    os.environ.update({**rank_environment(rank, world_size, port), "OMP_NUM_THREADS": "1", **env})
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
    traceback, or when ``timeout`` seconds pass (all processes are then killed). The ranks never outlive the
    calling process: when it ends in any way, ``kill -9`` included, each rank kills itself (``_lifeline``).
    """
    if callable(target):
        target = f"{target.__module__}:{target.__qualname__}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    read_end, write_end = lifeline()
    parent = multiprocessing.connection.Connection(read_end, writable=False)  # pickled for spawn as a passed fd
    processes = [context.Process(target=_entry, args=(target, rank, world_size, port, tuple(args), env or {}, results,
                                                      parent), daemon=True) for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
    except BaseException:
        os.close(write_end)  # the ranks started so far end with it
        raise
    finally:
        parent.close()
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
        os.close(write_end)
    failures = {rank: value for rank, (ok, value) in collected.items() if not ok}
    if failures:
        raise LaunchError("\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())))
    return [pickle.loads(collected[rank][1]) for rank in range(world_size)]
