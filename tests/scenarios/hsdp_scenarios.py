"""HSDP (FSDP2 on a 2 x 2 mesh) ranks of tests/fsdp/test_hsdp_fsdp2.py's ``kill -9`` test.

``save_twice``: train, record this rank's state (its local shards, optimizer groups, scheduler, RNG, step) as the
reference of ``checkpoint_0``, save it, train on and save again, where the test's ``ACCELERATE_TXN_KILL_AT`` kills a
rank of the second replica. ``resume_newest``: a fresh job on the same mesh selects the newest complete checkpoint
and compares what it restored with that checkpoint's reference, bitwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from accelerate.parallelism_config import ParallelismConfig

from tests.scenarios.crash_fsdp2 import local_state
from tests.scenarios.remote_scenarios import _build_for
from tests.scenarios.scenarios import _same


def _build(root: str, seed: int) -> tuple[Any, ...]:
    return _build_for(2, seed, project_dir=root, automatic_checkpoint_naming=True,
                      parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))


def _train(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, steps: int) -> None:
    for _ in range(steps):
        accelerator.backward(model(torch.randn(4, 16)).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _capture(accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    raw = getattr(optimizer, "optimizer", optimizer)
    return {"local": local_state(model, optimizer),
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in raw.param_groups],
            "scheduler": getattr(scheduler, "scheduler", scheduler).state_dict(),
            "rng": torch.get_rng_state(), "step": accelerator.step}


def _reference(root: str) -> Path:
    return Path(root) / f"reference.rank{os.environ['RANK']}.pt"


def save_twice(root: str) -> None:
    accelerator, model, optimizer, scheduler = _build(root, seed=1)
    _train(accelerator, model, optimizer, scheduler, 2)
    torch.save(_capture(accelerator, model, optimizer, scheduler), _reference(root))
    accelerator.save_state()
    _train(accelerator, model, optimizer, scheduler, 1)
    accelerator.save_state()  # rank 3 is killed in here


def resume_newest(root: str) -> dict[str, Any]:
    accelerator, model, optimizer, scheduler = _build(root, seed=9)
    accelerator.load_state()
    got = _capture(accelerator, model, optimizer, scheduler)
    expected = torch.load(_reference(root), weights_only=False)  # this test's own file
    problems = _same(expected["local"], got["local"])
    problems += [part for part in ("groups", "scheduler", "step") if expected[part] != got[part]]
    problems += [] if torch.equal(expected["rng"], got["rng"]) else ["rng"]
    return {"selected": f"checkpoint_{accelerator.project_configuration.iteration - 1}", "differences": problems}
