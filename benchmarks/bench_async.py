"""Asynchronous protected save vs native synchronous ``save_state`` on the same FSDP model, in one invocation.

``--fsdp-version 1`` (default): FSDP1, the asynchronous save stages each rank's local flat-parameter and optimizer
shards without collectives (``accelerate_txn.fsdp.capture``); ``--fsdp-version 2``: Accelerate's FSDP2
(``fully_shard`` per ``Linear``, DTensor parameters; model and optimizer prepared together).

2 ranks (``--world-size``), gloo, CPU. Each repeat measures, in rotating order (so drift in the machine's load and
the position in the sequence affect every mode alike):

* native ``save_state`` (instance opted out): its wall time is both its blocking time and its time to publication;
* an asynchronous protected save, then ``wait_for_checkpoint``: blocking time (until ``save_state`` returned, the
  slower rank) and total time to publication, by default (staged into fresh memory) and with
  ``reuse_staging_memory=True`` (into the previous save's buffers; the pool is filled once before the repeats);
* training steps: ``--steps`` steps with no save in flight, then an asynchronous protected save followed by
  ``--steps`` steps; the steps that started while this rank's background write was still running are compared
  with the steps without a save (median step time); and the CPU time the background thread used
  (``AsyncCheckpoint.cpu_seconds``): the work that competes with training when no core is spare.

Reports medians and the median of the per-repeat ratios (targets of issue 10: blocking <= 0.15x native, total
<= 1.15x native, training steps during the background write <= 1.10x).

    .venv/bin/python benchmarks/bench_async.py --sizes 50 200 --repeats 3 [--fsdp-version 2] [--json out.json]

``--json`` writes one row per model size (``million``, ``fsdp_version``, ``world_size``, ``ranks``: each rank's
medians and ratios), which ``benchmarks/plots.py`` draws.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _barrier_time(accelerator: Any, start: float) -> float:
    """Seconds since ``start`` on the slower rank (one all-reduce, after the measured interval)."""
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return float(elapsed.item())


def worker(root: str, million: int, repeats: int, steps: int, fsdp_version: int = 1) -> dict[str, Any]:
    import accelerate_txn
    from accelerate_txn import configure_checkpointing, wait_for_checkpoint
    from accelerate_txn.accelerate.config import checkpoint_config
    from accelerate_txn.testing import fsdp_accelerator
    from benchmarks.bench_checkpoint import prepared

    accelerator = fsdp_accelerator(fsdp_version=fsdp_version)
    model, optimizer = prepared(accelerator, million, fsdp_version)
    batch = torch.randn(8, 2048)

    def step() -> float:
        start = time.perf_counter()
        accelerator.backward(model(batch).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()
    # FSDP1 (use_orig_params): local views, one shard per rank; FSDP2: DTensors report their global size
    parameters = sum(p.numel() for p in model.parameters()) * (accelerator.num_processes if fsdp_version == 1 else 1)
    times: dict[str, list[float]] = {"native": [], "blocking": [], "total": [], "blocking_reuse": [],
                                     "total_reuse": [], "step_idle": [], "step_during": [], "background_cpu": []}
    ratios: dict[str, list[float]] = {"blocking": [], "total": [], "blocking_reuse": [], "total_reuse": [], "step": []}
    steps_during: list[int] = []
    counter = iter(range(10**6))

    def path() -> str:
        return os.path.join(root, f"save_{next(counter)}")

    config = checkpoint_config(accelerator)
    pool: list[Any] = []  # the reused buffers, kept aside while the default (fresh memory) save is measured

    def protected(reuse: bool) -> tuple[float, float]:
        accelerate_txn.patch_accelerate_fsdp(accelerator)
        configure_checkpointing(accelerator, async_save=True, reuse_staging_memory=reuse)
        if reuse and pool:
            config.staging_pool = pool[0]
        start = time.perf_counter()
        accelerator.save_state(path())
        blocking = _barrier_time(accelerator, start)
        wait_for_checkpoint(accelerator)
        total = _barrier_time(accelerator, start)
        if reuse:
            pool[:] = [config.staging_pool]
            configure_checkpointing(accelerator, reuse_staging_memory=False)
        return blocking, total

    protected(reuse=True)  # the pool starts empty: its buffers are allocated once, before the measured saves
    for repeat in range(repeats):
        measured: dict[str, Any] = {}
        modes = ("native", "async", "reuse")
        for mode in modes[repeat % 3:] + modes[:repeat % 3]:  # each mode first, middle and last once in 3 repeats
            accelerator.wait_for_everyone()
            if mode == "native":
                accelerate_txn.unpatch_accelerate_fsdp(accelerator)
                start = time.perf_counter()
                accelerator.save_state(path())
                measured[mode] = _barrier_time(accelerator, start)
            else:
                measured[mode] = protected(reuse=mode == "reuse")
        native = measured["native"]
        times["native"].append(native)
        for suffix, mode in (("", "async"), ("_reuse", "reuse")):
            blocking, total = measured[mode]
            times[f"blocking{suffix}"].append(blocking)
            times[f"total{suffix}"].append(total)
            ratios[f"blocking{suffix}"].append(blocking / native)
            ratios[f"total{suffix}"].append(total / native)
        # Training with and without a background write, back to back.
        accelerator.wait_for_everyone()
        idle = [step() for _ in range(steps)]
        accelerate_txn.patch_accelerate_fsdp(accelerator)
        handle = accelerator.save_state(path())
        during = []
        for _ in range(steps):
            running = not handle.done()
            elapsed = step()
            if running:
                during.append(elapsed)
        wait_for_checkpoint(accelerator)
        times["background_cpu"].append(handle.cpu_seconds)
        steps_during.append(len(during))
        times["step_idle"].append(statistics.median(idle))
        if during:
            times["step_during"].append(statistics.median(during))
            ratios["step"].append(statistics.median(during) / statistics.median(idle))
        accelerator.wait_for_everyone()
        if accelerator.process_index == 0:
            for name in os.listdir(root):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        accelerator.wait_for_everyone()
    return {"parameters": parameters, "steps_during": steps_during,
            "times": {key: statistics.median(values) if values else None for key, values in times.items()},
            "ratios": {key: statistics.median(values) if values else None for key, values in ratios.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[50], help="model sizes in millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="training steps with and without a save in flight")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks (1: FSDP1 builds its sharded state dict without cross-rank gathers)")
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=1)
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ranks import benchmarks.bench_async
    from accelerate_txn.testing import launch

    rows = []
    for million in args.sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
            results = launch("benchmarks.bench_async:worker", args.world_size,
                             args=(root, million, args.repeats, args.steps, args.fsdp_version), timeout=1800)
        rows.append({"million": million, "fsdp_version": args.fsdp_version, "world_size": args.world_size,
                     "ranks": results})
    load = os.getloadavg()
    print(f"FSDP{args.fsdp_version}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} "
          f"CPUs; {args.world_size} rank(s); {args.repeats} repeats")
    print("| model | native save s | async blocking s (x native) | async to publication s (x native) "
          "| with reused staging memory: blocking s (x native) | to publication s (x native) "
          "| step s idle | step s during write (x idle) | steps during write | background thread CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        rank0 = row["ranks"][0]
        t, r = rank0["times"], rank0["ratios"]
        during = "n/a" if t["step_during"] is None else f"{t['step_during']:.3f} ({r['step']:.2f}x)"
        print(f"| {rank0['parameters'] / 1e6:.0f}M | {t['native']:.2f} | {t['blocking']:.2f} ({r['blocking']:.2f}x) "
              f"| {t['total']:.2f} ({r['total']:.2f}x) | {t['blocking_reuse']:.2f} ({r['blocking_reuse']:.2f}x) "
              f"| {t['total_reuse']:.2f} ({r['total_reuse']:.2f}x) | {t['step_idle']:.3f} | {during} "
              f"| {rank0['steps_during']} | {t['background_cpu']:.2f} |")
    if args.json:  # one row per size: million, fsdp_version, world_size, ranks (each rank's worker() result)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
