"""``make test-gpu``: the protected path on a real CUDA device with NCCL, in one prepared process.

Not part of ``make test`` or CI (they have no GPU). Where no CUDA device exists it prints why it skipped and
exits 0. Otherwise it runs, in one process (world size 1, NCCL, FSDP1 ``SHARDED_STATE_DICT``, so FSDP uses
``NO_SHARD``), and exits non-zero on the first failed check:

1. a protected round trip on CUDA: train, ``save_state`` (a manifest is published), a fresh model and optimizer,
   ``load_state``, parameters and optimizer state bitwise equal;
2. the same with FSDP parameter CPU offload (``use_orig_params=True``);
3. CUDA RNG: the CUDA generator state saved with the checkpoint is restored (the next ``torch.rand`` on the device
   equals the one drawn right after the save);
4. FSDP2 asynchronous saves with ``reuse_staging_memory``: two back-to-back saves (training in between) staged
   into the same pinned host buffers (DTensor local shards kept as host DTensors), each restores exactly the
   state it saved, although the script writes into every parameter through ``.data`` right after the second
   ``save_state`` returned (the copies are enqueued on the current stream; the host did not wait for them).

    .venv/bin/python tests/scripts/gpu_check.py [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor, a DTensor's whole value (world size 1: its local shard)."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone().cpu()


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    raw = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": {n: _host(p) for n, p in model.named_parameters()},
            "optim": {names[id(p)]: {k: _host(v) if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in raw.state.items() if s}}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    if set(a["optim"]) != set(b["optim"]):
        return [*bad, "optimizer state keys differ"]
    for name, entries in a["optim"].items():
        for key, value in entries.items():
            other = b["optim"][name].get(key)
            same = torch.equal(value, other) if torch.is_tensor(value) and torch.is_tensor(other) else value == other
            if not same:
                bad.append(f"optim {name}.{key}")
    return bad


def _build(seed: int, cpu_offload: bool, fsdp_version: int = 1) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from torch.distributed.fsdp import CPUOffload

    AcceleratorState._reset_state(True)  # one process builds several Accelerators in turn
    if fsdp_version == 1:
        plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT", use_orig_params=True,
                                                cpu_offload=CPUOffload(offload_params=cpu_offload))
    else:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(seed)
    raw = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    if fsdp_version == 2:  # FSDP2: model and optimizer prepared together
        model, optimizer = accelerator.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
        return accelerator, model, optimizer
    model = accelerator.prepare(raw)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _train(accelerator: Any, model: Any, optimizer: Any, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 64, device=accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _round_trip(root: Path, cpu_offload: bool) -> dict[str, Any]:
    accelerator, model, optimizer = _build(0, cpu_offload)
    device = accelerator.device
    _train(accelerator, model, optimizer, 3)
    path = root / f"checkpoint_offload_{cpu_offload}"
    accelerator.save_state(str(path))
    expected = _state(model, optimizer)
    expected_cuda = torch.rand(4, device="cuda")
    fresh, model2, optimizer2 = _build(7, cpu_offload)
    torch.cuda.manual_seed(12345)
    fresh.load_state(str(path))
    return {"backend": fresh.distributed_type.name, "device": str(device),
            "manifest": (path / "checkpoint_manifest.json").is_file(),
            "differences": _differences(expected, _state(model2, optimizer2)),
            "cuda_rng_restored": bool(torch.equal(torch.rand(4, device="cuda"), expected_cuda))}


def _fsdp2_async_reuse(root: Path) -> dict[str, Any]:
    from accelerate_txn import configure_checkpointing
    from accelerate_txn.accelerate.config import checkpoint_config

    accelerator, model, optimizer = _build(0, False, fsdp_version=2)
    configure_checkpointing(accelerator, async_save=True, reuse_staging_memory=True)
    expected, handles = [], []
    for index in range(2):
        _train(accelerator, model, optimizer, 2)
        expected.append(_state(model, optimizer))
        handles.append(accelerator.save_state(str(root / f"fsdp2_async_{index}")))  # the 2nd waits for the 1st
    for parameter in model.parameters():  # enqueued right after save_state returned: after its copies on the stream
        parameter.data.add_(1.0)
    _train(accelerator, model, optimizer, 1)  # training mutates the sources while the second save is written
    paths = [handle.wait() for handle in handles]
    pool = checkpoint_config(accelerator).staging_pool
    buffers = [b for spare in pool._previous.values() for b in spare] if pool is not None else []
    observed: dict[str, Any] = {"backend": accelerator.distributed_type.name,
                                "staged_buffers": len(buffers), "all_pinned": all(b.is_pinned() for b in buffers)}
    for index, path in enumerate(paths):
        fresh, model2, optimizer2 = _build(7, False, fsdp_version=2)
        fresh.load_state(str(path))
        observed[f"differences_{index}"] = _differences(expected[index], _state(model2, optimizer2))
    return observed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="write the observations here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device is visible (torch.cuda.is_available() is False); this check needs a GPU.")
        return 0
    from accelerate_txn.testing import free_port

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "ACCELERATE_USE_FSDP": "true"})
    import accelerate_txn  # noqa: F401  (wraps save_state/load_state)

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    failures = []
    with tempfile.TemporaryDirectory() as directory:
        for offload in (False, True):
            name = f"round_trip{'_cpu_offload' if offload else ''}"
            try:
                observed = _round_trip(Path(directory), offload)
            except Exception as exc:  # report every check, then fail
                observed = {"error": f"{type(exc).__name__}: {exc}"}
            results[name] = observed
            if observed.get("error") or not observed["manifest"] or observed["differences"] or not (
                    observed["cuda_rng_restored"]) or observed["backend"] != "FSDP":
                failures.append(name)
        try:
            observed = _fsdp2_async_reuse(Path(directory))
        except Exception as exc:
            observed = {"error": f"{type(exc).__name__}: {exc}"}
        results["fsdp2_async_reuse"] = observed
        if observed.get("error") or observed["differences_0"] or observed["differences_1"] or not (
                observed["staged_buffers"] and observed["all_pinned"]) or observed["backend"] != "FSDP":
            failures.append("fsdp2_async_reuse")
    print(json.dumps(results, indent=1))
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    if failures:
        print(f"FAILED: {failures}", file=sys.stderr)
        return 1
    print("OK: protected round trips on CUDA (with and without parameter CPU offload), CUDA RNG restored, FSDP2 "
          "asynchronous saves into reused pinned staging memory restore exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
