"""FSDP2 ranks of the crash-consistency tests: the run of tests/scenarios/crash_scenarios.py on Accelerate's FSDP2.

Started by tests/scenarios/crash_harness.py with ``entry="tests.scenarios.crash_fsdp2"``
(tests/core/test_crash_fsdp2.py). Everything (the spec, training, the reference written before every save, the kill
points, the restart's exact comparison, the directory report) is tests/scenarios/crash_scenarios.py's; this module
only chooses, for this rank process, the FSDP2 model (``fsdp_version=2``: ``fully_shard`` per ``Linear``, DTensor
parameters, model, optimizer and scheduler prepared together) and records the DTensors' local shards, which are what
this rank saves and must restore bitwise (a DTensor itself cannot be compared or reloaded outside its process group).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios import crash_scenarios
from tests.scenarios.scenarios import warmup_lambda

ENTRY = __name__


def _local(value: Any) -> Any:
    """A detached copy of this rank's shard: the local tensor of a DTensor, the tensor itself otherwise."""
    if hasattr(value, "to_local"):
        return value.to_local().detach().clone()
    return value.detach().clone() if torch.is_tensor(value) else value


def local_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the parameters and optimizer state, keyed by parameter name (the FSDP2 form of
    ``tests.scenarios.scenarios._local_state``, which ``crash_scenarios.capture`` and ``differences`` use)."""
    names = {id(p): name for name, p in model.named_parameters()}
    raw = getattr(optimizer, "optimizer", optimizer)
    return {
        "params": {name: _local(p) for name, p in model.named_parameters()},
        "optim": {names[id(p)]: {k: _local(v) for k, v in s.items()} for p, s in raw.state.items() if s},
    }


def build(root: Path, seed: int) -> tuple:
    """The crash run's accelerator (automatic naming, retention) with an FSDP2 model, optimizer and scheduler; every
    save asynchronous when the sweep runs with ``--async``, of the sweep's ``--state-dict-type``."""
    accelerator = fsdp_accelerator(fsdp_version=2, project_dir=str(root), automatic_checkpoint_naming=True,
                                   total_limit=crash_scenarios.TOTAL_LIMIT,
                                   state_dict_type=crash_scenarios.state_dict_type())
    torch.manual_seed(seed)
    raw = TinyModel(width=16)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
    model, optimizer, scheduler = accelerator.prepare(raw, optimizer, scheduler)  # FSDP2: prepared together
    if crash_scenarios.asynchronous():  # the sweep's --async: every save asynchronous (local-shard staging)
        import accelerate_txn

        accelerate_txn.configure_checkpointing(accelerator, async_save=True)
    return accelerator, model, optimizer, scheduler


def main(spec_path: str) -> None:
    """Entry point of one FSDP2 rank: ``crash_scenarios.main`` with the FSDP2 model and local-shard capture.

    The two module-level names are rebound in this rank process only (it runs nothing else), before the run.
    """
    crash_scenarios._auto = build
    crash_scenarios._local_state = local_state
    crash_scenarios.main(spec_path)
