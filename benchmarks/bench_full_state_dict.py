"""Protected vs native Accelerate ``FULL_STATE_DICT`` save and load (FSDP1 and FSDP2), time and peak memory, in one
invocation.

``FULL_STATE_DICT`` is Accelerate's FSDP1 default and the Trainer's default: native ``save_state`` gathers the whole
model and optimizer state on rank 0, which writes ``pytorch_model_fsdp.bin`` and ``optimizer.bin``. The protected
path runs that same native save inside the library's transaction (staging directory, every file hashed with
XXH3-128 and fsynced by the rank that wrote it, manifest last, atomic rename); its load re-hashes every file on the
rank that wrote it, then native ``load_state`` reads the files. The question here: what the transaction adds to
native's time, and whether rank 0's peak memory stays native's (issue 45).

2 ranks, gloo, CPU, the CPU harness (``accelerate_txn.testing.fsdp_accelerator(state_dict_type="FULL_STATE_DICT")``;
FSDP1's full gather with the harness's fix of two torch bugs only CPU meets), ``Linear(2048)`` layers (each an FSDP
unit) as ``bench_checkpoint.py``, AdamW after one step. For each FSDP version and model size, in one launch: the
same Accelerator saves natively (instance opted out, ``unpatch_accelerate_fsdp``) and protected
(``patch_accelerate_fsdp``), in alternating order per repeat (native first on even repeats), each followed by the
``load_state`` of what it just saved into the stepped optimizer (every file read once before: both in the page
cache). Each ``save_state`` and ``load_state`` is timed between barriers (rank 0's wall time) and each rank's
resident set is sampled every millisecond while it runs (``bench_checkpoint._PeakRss``): the peak, and the peak's
growth over the resident set just before the call. Ratios are medians of the per-repeat ratios protected/native.
One unmeasured pair runs first (``--warmup``): the first protected call imports and builds what later calls reuse,
which would otherwise count as the protected path's memory in whichever repeat ran it.

Against the hardware, in the same run: after both modes of each repeat, each rank writes with ``dd if=/dev/zero
bs=16M conv=fdatasync`` as many bytes as it wrote of that repeat's protected checkpoint (rank 0: the full model and
optimizer files, its RNG state and the manifest; rank 1: its RNG state), concurrently, timed between barriers.
Bandwidth: checkpoint bytes / wall time.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/bench_full_state_dict.py --sizes 12 50 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("save", "load")
MODES = ("native", "protected")


def written_bytes(path: str, rank: int) -> tuple[int, int]:
    """``(total, what this rank wrote)`` of the full checkpoint under ``path``: rank ``R`` writes
    ``random_states_R.pkl``; rank 0 also every other file (the full model and optimizer files, the manifest)."""
    total = own = 0
    for directory, _, names in os.walk(path):
        for name in names:
            size = os.path.getsize(os.path.join(directory, name))
            total += size
            if name.startswith("random_states_"):
                own += size if name == f"random_states_{rank}.pkl" else 0
            elif rank == 0:
                own += size
    return total, own


def worker(root: str, million: int, repeats: int, fsdp_version: int, warmup: int = 1) -> dict[str, Any]:
    import torch

    import accelerate_txn
    from accelerate_txn.testing import fsdp_accelerator
    from benchmarks.bench_checkpoint import _local, _PeakRss, prepared, timed_dd_write, warm

    accelerator = fsdp_accelerator(fsdp_version=fsdp_version, state_dict_type="FULL_STATE_DICT")
    model, optimizer = prepared(accelerator, million, fsdp_version)
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rank = accelerator.process_index
    parameters = sum(_local(p).numel() for p in model.parameters()) * accelerator.num_processes
    state_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters()) + sum(
        _local(v).numel() * v.element_size() for s in optimizer.optimizer.state.values() for v in s.values()
        if torch.is_tensor(v))
    times: dict[str, list[float]] = {f"{p}_{m}": [] for p in PHASES for m in MODES}
    times["dd_write"] = []
    peak: dict[str, list[int]] = {key: [] for key in times if not key.startswith("dd")}
    growth: dict[str, list[int]] = {key: [] for key in peak}
    base: dict[str, list[int]] = {key: [] for key in peak}
    sizes: dict[str, list[int]] = {"native": [], "protected": [], "rank_protected": []}
    for index in range(warmup + repeats):
        repeat = index - warmup  # negative: a warm-up pair, not recorded
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            if mode == "native":
                accelerate_txn.unpatch_accelerate_fsdp(accelerator)
            else:
                accelerate_txn.patch_accelerate_fsdp(accelerator)
            path = os.path.join(root, f"{mode}_{index}")
            for phase in PHASES:
                if phase == "load" and rank == 0:
                    warm(path)  # both modes' files in the page cache (the protected save read them once: hashed)
                gc.collect()
                accelerator.wait_for_everyone()
                start = time.perf_counter()
                with _PeakRss() as sampled:
                    if phase == "save":
                        accelerator.save_state(path)
                    else:
                        accelerator.load_state(path)
                    accelerator.wait_for_everyone()
                if repeat < 0:
                    continue
                times[f"{phase}_{mode}"].append(time.perf_counter() - start)
                peak[f"{phase}_{mode}"].append(sampled.peak)
                growth[f"{phase}_{mode}"].append(sampled.growth)
                base[f"{phase}_{mode}"].append(sampled.base)
                if phase == "save":
                    total, own = written_bytes(path, rank)
                    sizes[mode].append(total)
                    if mode == "protected":
                        sizes["rank_protected"].append(own)
            accelerator.wait_for_everyone()
            if rank == 0:
                shutil.rmtree(path)
        if repeat < 0:
            continue
        # The disk's durable write of the same bytes, each rank what it wrote, concurrently.
        target = os.path.join(root, f"dd_{rank}")
        times["dd_write"].append(timed_dd_write(accelerator, target, sizes["rank_protected"][-1]))
        os.remove(target)
        accelerator.wait_for_everyone()
    ratios = {f"{phase}_time": statistics.median(p / n for p, n in zip(times[f"{phase}_protected"],
                                                                        times[f"{phase}_native"]))
              for phase in PHASES}
    ratios.update({f"{phase}_peak": statistics.median(p / n for p, n in zip(peak[f"{phase}_protected"],
                                                                             peak[f"{phase}_native"]))
                   for phase in PHASES})
    per_repeat = {
        "save_native": [b / t for b, t in zip(sizes["native"], times["save_native"])],
        "save_protected": [b / t for b, t in zip(sizes["protected"], times["save_protected"])],
        "dd_write": [b / t for b, t in zip(sizes["protected"], times["dd_write"])],
    }
    return {"parameters": parameters, "fsdp_version": fsdp_version, "rank": rank, "state_bytes": state_bytes,
            "ratios": ratios,
            "times": {key: statistics.median(values) for key, values in times.items()},
            "peak": {key: statistics.median(values) for key, values in peak.items()},
            "growth": {key: statistics.median(values) for key, values in growth.items()},
            "checkpoint_bytes": {mode: statistics.median(values) for mode, values in sizes.items()},
            "bandwidth": {key: statistics.median(values) for key, values in per_repeat.items()},
            "save_dd": statistics.median(s / d for s, d in zip(per_repeat["save_protected"], per_repeat["dd_write"])),
            "raw": {"times": times, "peak": peak, "growth": growth, "base": base, "bytes": sizes,
                    "bandwidth": per_repeat}}


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f}"


def report(rows: list[dict[str, Any]]) -> None:
    """The tables docs/benchmarks.md records: time and rank 0's peak memory against native, each rank's peak RSS and
    its growth."""
    print("Time (rank 0, median of the per-repeat ratios; seconds: per-mode medians) and rank 0's peak RSS against "
          "native (median of the per-repeat ratios):")
    print("| FSDP | model | save, x native | protected - native s | dd fdatasync s (same bytes) | load, x native "
          "| rank 0 save peak, x native | rank 0 load peak, x native |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        rank0 = row["ranks"][0]
        times, ratios, peak = rank0["times"], rank0["ratios"], rank0["peak"]
        print(f"| {row['fsdp_version']} | {rank0['parameters'] / 1e6:.0f}M "
              f"| {ratios['save_time']:.2f} ({times['save_protected']:.2f} s vs {times['save_native']:.2f} s) "
              f"| {times['save_protected'] - times['save_native']:+.2f} | {times['dd_write']:.2f} "
              f"| {ratios['load_time']:.2f} ({times['load_protected']:.2f} s vs {times['load_native']:.2f} s) "
              f"| {ratios['save_peak']:.3f} ({_mib(peak['save_protected'])} vs {_mib(peak['save_native'])} MiB) "
              f"| {ratios['load_peak']:.3f} ({_mib(peak['load_protected'])} vs {_mib(peak['load_native'])} MiB) |")
    print()
    print("Peak RSS, MiB, median of the repeats (growth over the RSS just before the call in parentheses); state: the "
          "rank's parameter and optimizer shards:")
    print("| FSDP | model | rank | state MiB | save native | save protected | load native | load protected |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        for result in row["ranks"]:
            cells = [f"{_mib(result['peak'][key])} (+{_mib(result['growth'][key])})"
                     for key in ("save_native", "save_protected", "load_native", "load_protected")]
            print(f"| {row['fsdp_version']} | {result['parameters'] / 1e6:.0f}M | {result['rank']} "
                  f"| {_mib(result['state_bytes'])} | " + " | ".join(cells) + " |")
    print()
    print("Against the hardware (rank 0; GB/s: checkpoint bytes / wall time, medians of the repeats):")
    print("| FSDP | model | checkpoint GB | native save GB/s | protected save GB/s | dd fdatasync GB/s "
          "| protected / dd |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        rank0 = row["ranks"][0]
        bandwidth = rank0["bandwidth"]
        print(f"| {row['fsdp_version']} | {rank0['parameters'] / 1e6:.0f}M "
              f"| {rank0['checkpoint_bytes']['protected'] / 1e9:.2f} | {bandwidth['save_native'] / 1e9:.3f} "
              f"| {bandwidth['save_protected'] / 1e9:.3f} | {bandwidth['dd_write'] / 1e9:.3f} "
              f"| {rank0['save_dd']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[12, 50], help="model sizes in millions of parameters")
    parser.add_argument("--repeats", "--pairs", dest="repeats", type=int, default=3,
                        help="alternating native/protected pairs (each followed by the dd baseline)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured pairs first (the protected path's first use imports and allocates once)")
    parser.add_argument("--fsdp-versions", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ranks import benchmarks.bench_full_state_dict
    from accelerate_txn.testing import launch

    load_before = os.getloadavg()
    rows = []
    for fsdp_version in args.fsdp_versions:
        for million in args.sizes:
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
                ranks = launch("benchmarks.bench_full_state_dict:worker", 2,
                               args=(root, million, args.repeats, fsdp_version, args.warmup), timeout=1800)
            rows.append({"million": million, "fsdp_version": fsdp_version, "ranks": ranks})
    load_after = os.getloadavg()
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}; {args.repeats} repeats "
          f"after {args.warmup} unmeasured; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    report(rows)
    if args.json:
        import accelerate
        import torch

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                        "accelerate": accelerate.__version__,
                        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                        "load_average_before": load_before, "load_average_after": load_after},
            "repeats": args.repeats, "warmup": args.warmup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
