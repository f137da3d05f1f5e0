"""``make test-gpu``: the protected path on a real CUDA device with NCCL, in one prepared process.

Not part of ``make test`` or CI (they have no GPU). Where no CUDA device exists it prints why it skipped and
exits 0. Otherwise it runs, in one process (world size 1, NCCL, FSDP1 ``SHARDED_STATE_DICT``, so FSDP uses
``NO_SHARD``), and exits non-zero on the first failed check:

1. a protected round trip on CUDA: train, ``save_state`` (a manifest is published), a fresh model and optimizer,
   ``load_state``, parameters and optimizer state bitwise equal;
2. the same with FSDP parameter CPU offload (``use_orig_params=True``);
3. CUDA RNG: the CUDA generator state saved with the checkpoint is restored (the next ``torch.rand`` on the device
   equals the one drawn right after the save).

    .venv/bin/python tests/gpu_check.py [--output DIR]
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


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    raw = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone().cpu() for n, p in model.named_parameters()},
            "optim": {names[id(p)]: {k: v.clone().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
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


def _build(seed: int, cpu_offload: bool) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from torch.distributed.fsdp import CPUOffload

    AcceleratorState._reset_state(True)  # one process builds several Accelerators in turn
    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT", use_orig_params=True,
                                            cpu_offload=CPUOffload(offload_params=cpu_offload))
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(seed)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _round_trip(root: Path, cpu_offload: bool) -> dict[str, Any]:
    accelerator, model, optimizer = _build(0, cpu_offload)
    device = accelerator.device
    for _ in range(3):
        loss = model(torch.randn(4, 64, device=device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
    print(json.dumps(results, indent=1))
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    if failures:
        print(f"FAILED: {failures}", file=sys.stderr)
        return 1
    print("OK: protected round trips on CUDA (with and without parameter CPU offload) and CUDA RNG restored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
