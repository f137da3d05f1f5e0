"""Test checkpointing without GPUs: real Accelerate FSDP1/FSDP2 on CPU with gloo, in real processes.

Accelerate never selects FSDP on CPU by itself; this harness forces it, so that FSDP checkpointing (saves, loads,
``kill -9`` in the middle of either) runs on a laptop or in CI.

* Your own test code: :func:`fsdp_accelerator` builds the ``Accelerator`` in each rank, :func:`launch` runs a
  function on N ranks with a hard timeout, :func:`start_ranks` starts ranks a test may kill.
* Your unmodified training script: :func:`run_script` (or ``python -m accelerate_txn.testing run``) runs it on N
  CPU processes with FSDP forced on every ``Accelerator`` it constructs; :func:`start_script` when a test kills it.

Used by accelerate-txn's own tests and the demo. Layout (this package only re-exports):

* ``_cpu_fsdp``: the FSDP plugin on CPU and forcing it onto an Accelerator (shared by both ways in);
* ``_harness``: :func:`fsdp_accelerator`, :class:`TinyModel`;
* ``_processes``: :func:`launch`, :func:`start_ranks`, :func:`free_port`, torchrun's environment;
* ``_trainer``: :func:`force_fsdp_trainer` (a transformers ``Trainer`` with FSDP on CPU);
* ``_launcher``: :func:`run_script`, :func:`start_script` (the launcher's side); ``_worker``: each worker process;
  ``_cli``: ``python -m accelerate_txn.testing run``.
"""

from __future__ import annotations

from ._cpu_fsdp import UNSUPPORTED_STATE_DICT_TYPES
from ._harness import TinyModel, fsdp_accelerator
from ._launcher import ScriptJob, ScriptResult, run_script, start_script
from ._processes import LaunchError, free_port, launch, start_ranks
from ._trainer import force_fsdp_trainer

__all__ = [
    "UNSUPPORTED_STATE_DICT_TYPES",
    "LaunchError",
    "ScriptJob",
    "ScriptResult",
    "TinyModel",
    "force_fsdp_trainer",
    "free_port",
    "fsdp_accelerator",
    "launch",
    "run_script",
    "start_ranks",
    "start_script",
]
