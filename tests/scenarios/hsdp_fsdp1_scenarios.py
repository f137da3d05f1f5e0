"""FSDP1 hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) scenarios run inside launched gloo ranks on CPU.

4 ranks are 2 replicas x 2 shards: ``fsdp_accelerator(sharding_strategy="HYBRID_SHARD")`` makes nodes of 2
consecutive ranks (shard groups {0, 1}, {2, 3}; replica groups {0, 2}, {1, 3}). Each rank trains on its own
batches, so the replicas stay equal only through FSDP's all-reduce over the replica group.

``same_mesh``: train, save a protected checkpoint A (and the same state asynchronously, A_async), then on a fresh
model and optimizer (other initial values): a copy of A whose payload written by a rank of the second replica is
damaged is refused on every rank before anything changes, and A itself restores exactly (parameters, optimizer
state, RNG, step).
``resume``: restore a checkpoint saved under another sharding (first without the opt-in: refused before anything
changes), then re-save the restored live state (tests/fsdp/test_hsdp_fsdp1.py compares it with the saved one).
``main``: a rank of the kill -9 test (tests/scenarios/crash_scenarios.py's run, on a 2 x 2 hybrid model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import accelerate_txn
from tests.scenarios import crash_scenarios
from tests.scenarios.scenarios import _build, _error, _local_state, _same, _train


def _groups(model: Any) -> dict[str, list[int]]:
    """The shard and replica groups of the model's FSDP1 units (the same for every unit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from accelerate_txn.fsdp.internals import inter_node_group

    seen = {(tuple(dist.get_process_group_ranks(unit.process_group)),
             tuple(dist.get_process_group_ranks(inter_node_group(unit))) if inter_node_group(unit) else ())
            for unit in FSDP.fsdp_modules(model)}
    assert len(seen) == 1, seen
    ((shard, replicate),) = seen
    return {"shard": list(shard), "replicate": list(replicate),
            "strategies": sorted({unit.sharding_strategy.name for unit in FSDP.fsdp_modules(model)})}


def _damage_a_second_replica_payload(source: Path, target: Path) -> str:
    """Copy ``source`` to ``target`` and flip one byte in the middle of the largest DCP payload that a rank of the
    second replica (rank 2 or 3) wrote; its path relative to ``target``."""
    shutil.copytree(source, target)
    payloads = sorted((path for folder in ("pytorch_model_fsdp_0", "optimizer_0")
                       for path in (target / folder).glob("__[23]_*.distcp") if path.stat().st_size),
                      key=lambda path: path.stat().st_size)
    victim = payloads[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return str(victim.relative_to(target))


def same_mesh(root: str, strategy: str) -> dict[str, Any]:
    checkpoint, damaged = Path(root) / "A", Path(root) / "damaged"
    accelerator, model, optimizer, scheduler = _build(0, sharding_strategy=strategy)
    rank = accelerator.process_index
    obs: dict[str, Any] = {"groups": _groups(model)}
    _train(accelerator, model, optimizer, scheduler, 3, seed=1)
    torch.randn(rank + 1)  # per-rank RNG streams differ
    expected = _local_state(model, optimizer)
    rng, step, lr = torch.get_rng_state(), accelerator.step, scheduler.get_last_lr()
    obs["rng"] = rng
    obs["save_error"] = _error(lambda: accelerator.save_state(str(checkpoint)))
    # The same state saved asynchronously (DCP writes over a background group of every rank).
    accelerate_txn.configure_checkpointing(accelerator, async_save=True)
    obs["async_error"] = _error(lambda: (accelerator.save_state(str(Path(root) / "A_async")),
                                         accelerate_txn.wait_for_checkpoint(accelerator)))
    accelerate_txn.configure_checkpointing(accelerator, async_save=False)

    fresh, fresh_model, fresh_optimizer, fresh_scheduler = _build(7, sharding_strategy=strategy)
    if rank == 0:
        obs["damaged_file"] = _damage_a_second_replica_payload(checkpoint, damaged)
    dist.barrier()
    before = _local_state(fresh_model, fresh_optimizer)
    before_rng = torch.get_rng_state()
    obs["damaged_refusal"] = _error(lambda: fresh.load_state(str(damaged)))
    obs["damaged_changed"] = _same(before, _local_state(fresh_model, fresh_optimizer))
    obs["damaged_rng_untouched"] = torch.equal(torch.get_rng_state(), before_rng)
    obs["damaged_step_untouched"] = fresh.step == 0

    obs["load_error"] = _error(lambda: fresh.load_state(str(checkpoint)))
    obs["differences"] = _same(expected, _local_state(fresh_model, fresh_optimizer))
    obs["optimizer_entries"] = len(_local_state(fresh_model, fresh_optimizer)["optim"])
    obs["rng_exact"] = torch.equal(torch.get_rng_state(), rng)
    obs["step_exact"] = fresh.step == step
    obs["lr_exact"] = fresh_scheduler.get_last_lr() == lr
    # Training goes on from the restored state: replicas stay equal (the replica all-reduce still runs).
    _train(fresh, fresh_model, fresh_optimizer, fresh_scheduler, 1, seed=5)
    obs["after_step"] = {name: p.detach().clone() for name, p in fresh_model.named_parameters()}
    return obs


def resume(source: str, out_dir: str, strategy: str | None, refuse_first: bool) -> dict[str, Any]:
    """Restore ``source`` under ``strategy`` (None: FULL_SHARD) on this world size, re-save it to ``out_dir``."""
    accelerator, model, optimizer, scheduler = _build(7, sharding_strategy=strategy)
    obs: dict[str, Any] = {"rank": dist.get_rank(), "groups": _groups(model)}
    if refuse_first:
        before = _local_state(model, optimizer)
        obs["refusal"] = _error(lambda: accelerator.load_state(source))
        obs["untouched"] = _same(before, _local_state(model, optimizer)) == [] and accelerator.step == 0
    accelerate_txn.configure_checkpointing(accelerator, allow_reshard=True)
    obs["load_error"] = _error(lambda: accelerator.load_state(source))
    obs.update(rng=torch.get_rng_state(), step=accelerator.step, lr=scheduler.get_last_lr())
    accelerate_txn.configure_checkpointing(accelerator, allow_reshard=False)
    obs["save_error"] = _error(lambda: accelerator.save_state(out_dir))  # the restored live state
    manifest = json.loads((Path(out_dir) / accelerate_txn.MANIFEST).read_text())
    obs["resharded_from"] = manifest.get("resharded_from")
    _train(accelerator, model, optimizer, scheduler, 1, seed=9)  # training goes on under the new sharding
    obs["finite_after_step"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return obs


# --- kill -9 (tests/scenarios/crash_harness.py starts the ranks) ---------------------------------------------------------

def _hybrid_auto(root: Path, seed: int) -> tuple:
    return _build(seed, sharding_strategy="HYBRID_SHARD", project_dir=str(root), automatic_checkpoint_naming=True,
                  total_limit=crash_scenarios.TOTAL_LIMIT)


def main(spec_path: str) -> None:
    """Entry point of one rank of the kill -9 test: tests/scenarios/crash_scenarios.py's run on a 2 x 2 HYBRID_SHARD model
    (its module-level builder rebound in this rank process only)."""
    crash_scenarios._auto = _hybrid_auto
    crash_scenarios.main(spec_path)
