"""Protected vs native Accelerate checkpoint save/load on the same FSDP model, in one invocation.

2 ranks, gloo, CPU. For each model size: native ``save_state`` (instance opted out) and the protected one,
then native ``load_state`` and the protected one into an optimizer that has already stepped (a resume native
can do), then the protected one into an optimizer with no state (the real resume; native restores nothing
there). Reports per-phase wall-time medians, the ratio protected/native, and each rank's peak resident-memory
growth during ``load_state`` next to its own optimizer-shard bytes. ``--fsdp-version 2`` runs the same on
Accelerate's FSDP2 (``fully_shard`` per ``Linear``, DTensor parameters; model and optimizer prepared together).

Against the hardware, in the same run and the same pairs rotation: after both modes of each repeat, both ranks
concurrently run ``dd if=/dev/zero of=<root>/dd_<rank> bs=16M iflag=count_bytes count=<bytes> conv=fdatasync``
(the disk's synchronous write bandwidth), then read that file back with ``dd of=/dev/null bs=16M`` (it is in the
page cache then), each timed as wall time between barriers like the saves. ``<bytes>`` is the rank's share of the
protected checkpoint that repeat saved: its own DCP shards (``__{rank}_*.distcp``, model and optimizer) plus an
equal share of every other file (manifest, RNG states, metadata; the remainder of the division to rank 0), so the
ranks' dd files add up to exactly the checkpoint's bytes. Bandwidths are checkpoint bytes / wall time (per mode:
the bytes of the checkpoint that mode saved); the fractions (protected save / dd write, protected stepped load /
page-cache read) are medians of the per-repeat ratios. Peak RSS growth is also sampled during each
``save_state``; protected minus native is reported against the rank's state bytes (its parameter shard plus its
optimizer shard).

Each load is measured twice, for both modes: after a restart (every file of the checkpoint written back and dropped
from the page cache, ``posix_fadvise(DONTNEED)``: the restore reads the disk; baseline ``dd iflag=direct`` of the dd
file, also dropped) and in the page cache (every file read once before: the baseline is the page-cache ``dd``).
The protected save writes its DCP files with ``O_DIRECT`` (``fsdp.dcp_writer``): they are not in the page cache after
the save, native's are, so a load straight after the save would compare a disk read with a memory copy.

    .venv/bin/python benchmarks/bench_checkpoint.py --sizes 50 --repeats 3
    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/bench_checkpoint.py --sizes 50 --repeats 3
    .venv/bin/python benchmarks/bench_checkpoint.py --sizes 50 --repeats 3 --fsdp-version 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


def _rss() -> int:
    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples this process's resident set every millisecond while active."""

    def __enter__(self) -> _PeakRss:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _model(million: int) -> torch.nn.Module:
    width = 2048
    layers = max(1, round(million * 1e6 / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-4, centered=True, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-4),
    "nadam": lambda params: torch.optim.NAdam(params, lr=1e-4),
}


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``value``: the local tensor of an FSDP2 DTensor, the tensor itself otherwise."""
    return value.to_local() if hasattr(value, "to_local") else value


_DISTCP = re.compile(r"__(\d+)_\d+\.distcp")
DD_BLOCK = "16M"


def checkpoint_bytes(path: str, rank: int, world_size: int) -> tuple[int, int]:
    """``(total, this rank's share)`` of the files under ``path``: the rank's own ``__{rank}_*.distcp`` shards plus
    an equal share of every other file (the remainder of the division to rank 0), so the shares add up to the
    total."""
    total = own = distcp = 0
    for directory, _, names in os.walk(path):
        for name in names:
            size = os.path.getsize(os.path.join(directory, name))
            total += size
            match = _DISTCP.fullmatch(name)
            if match:
                distcp += size
                if int(match.group(1)) == rank:
                    own += size
    rest = total - distcp
    return total, own + rest // world_size + (rest % world_size if rank == 0 else 0)


def _files(path: str) -> list[str]:
    return [os.path.join(directory, name) for directory, _, names in os.walk(path) for name in names]


def evict(path: str) -> None:
    """Every file under ``path`` out of the page cache (written back first: ``fadvise(DONTNEED)`` drops only
    clean pages), as after a restart: the next read comes from the disk."""
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path: str) -> None:
    """Every file under ``path`` read once, so that it is in the page cache."""
    buffer = bytearray(16 << 20)
    for name in _files(path):
        with open(name, "rb", buffering=0) as stream:
            while stream.readinto(buffer):
                pass


def _dd(*arguments: str) -> None:
    subprocess.run(["dd", *arguments, "status=none"], check=True)


def timed_dd_write(accelerator: Any, target: str, count: int) -> float:
    """Seconds for every rank to write ``count`` bytes to its own ``target`` with ``dd`` (fdatasync before it exits),
    concurrently: the disk's durable write of what each rank wrote. Leaves ``target`` in place."""
    accelerator.wait_for_everyone()
    start = time.perf_counter()
    _dd("if=/dev/zero", f"of={target}", f"bs={DD_BLOCK}", "iflag=count_bytes", f"count={count}", "conv=fdatasync")
    accelerator.wait_for_everyone()
    return time.perf_counter() - start


def prepared(accelerator: Any, million: int, fsdp_version: int,
             optimizer: Any = lambda params: torch.optim.AdamW(params, lr=1e-4)) -> tuple[Any, Any]:
    """The benchmark model (:func:`_model`) and its ``optimizer`` prepared by ``accelerator``, seeded: FSDP1 builds the
    optimizer on the wrapped model, FSDP2 prepares both together (Accelerate swaps the optimizer's parameters)."""
    torch.manual_seed(0)
    if fsdp_version == 1:
        model = accelerator.prepare(_model(million))
        return model, accelerator.prepare(optimizer(model.parameters()))
    raw_model = _model(million)
    return accelerator.prepare(raw_model, optimizer(raw_model.parameters()))


def worker(root: str, million: int, repeats: int, optimizer_name: str = "adamw",
           fsdp_version: int = 1) -> dict[str, Any]:
    import accelerate_txn
    from accelerate_txn.testing import fsdp_accelerator

    accelerator = fsdp_accelerator(fsdp_version=fsdp_version)
    model, optimizer = prepared(accelerator, million, fsdp_version, OPTIMIZERS[optimizer_name])
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    raw = optimizer.optimizer
    shard_bytes = sum(_local(v).numel() * v.element_size() for s in raw.state.values() for v in s.values()
                      if torch.is_tensor(v))
    parameters = sum(_local(p).numel() for p in model.parameters()) * accelerator.num_processes
    param_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    rank, world_size = accelerator.process_index, accelerator.num_processes
    times: dict[str, list[float]] = {key: [] for key in ("save_native", "save_protected", "load_native", "load_protected",
                                                         "load_cold_native", "load_cold_protected",
                                                         "dd_write", "dd_read", "dd_cold_read")}
    growth: dict[str, list[int]] = {"load_native": [], "load_protected": [], "load_fresh_protected": [],
                                    "save_native": [], "save_protected": []}
    sizes: dict[str, list[int]] = {"native": [], "protected": [], "rank_protected": []}
    for repeat in range(repeats):
        # Alternating pairs: each repeat measures both modes back to back, in alternating order, so drift in the
        # machine's load (page cache, other processes) affects both alike.
        for mode in (("native", "protected") if repeat % 2 == 0 else ("protected", "native")):
            if mode == "native":
                accelerate_txn.unpatch_accelerate_fsdp(accelerator)
            else:
                accelerate_txn.patch_accelerate_fsdp(accelerator)
            path = os.path.join(root, f"{mode}_{repeat}")
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            with _PeakRss() as peak:
                accelerator.save_state(path)
            accelerator.wait_for_everyone()
            times[f"save_{mode}"].append(time.perf_counter() - start)
            growth[f"save_{mode}"].append(peak.growth)
            total, share = checkpoint_bytes(path, rank, world_size)
            sizes[mode].append(total)
            if mode == "protected":
                sizes["rank_protected"].append(share)
            # The restore after a restart: nothing of the checkpoint in the page cache.
            if rank == 0:
                evict(path)
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            accelerator.load_state(path)
            accelerator.wait_for_everyone()
            times[f"load_cold_{mode}"].append(time.perf_counter() - start)
            # The restore of a checkpoint in the page cache (every byte read once before).
            if rank == 0:
                warm(path)
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            with _PeakRss() as peak:
                accelerator.load_state(path)
                accelerator.wait_for_everyone()
            times[f"load_{mode}"].append(time.perf_counter() - start)
            growth[f"load_{mode}"].append(peak.growth)
            accelerator.wait_for_everyone()
            if mode == "protected":
                # The real resume: a fresh optimizer (no state yet). Native restores nothing here, so only the
                # protected restore is measured; its growth is all new memory.
                raw.state.clear()
                gc.collect()
                with _PeakRss() as peak:
                    accelerator.load_state(path)
                    accelerator.wait_for_everyone()
                growth["load_fresh_protected"].append(peak.growth)
            if accelerator.process_index == 0:
                shutil.rmtree(path)
        # The hardware baseline of this repeat: both ranks write their share of the protected checkpoint's bytes
        # with dd (fdatasync before dd exits), then read it back from the page cache.
        target = os.path.join(root, f"dd_{rank}")
        times["dd_write"].append(timed_dd_write(accelerator, target, sizes["rank_protected"][-1]))
        start = time.perf_counter()
        _dd(f"if={target}", "of=/dev/null", f"bs={DD_BLOCK}")
        accelerator.wait_for_everyone()
        times["dd_read"].append(time.perf_counter() - start)
        evict(target)
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        _dd(f"if={target}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct")
        accelerator.wait_for_everyone()
        times["dd_cold_read"].append(time.perf_counter() - start)
        os.remove(target)
        accelerator.wait_for_everyone()
    # Bandwidths, per repeat: checkpoint bytes (all ranks) / wall time; dd moved the protected checkpoint's bytes.
    per_repeat = {
        "save_native": [b / t for b, t in zip(sizes["native"], times["save_native"])],
        "save_protected": [b / t for b, t in zip(sizes["protected"], times["save_protected"])],
        "load_protected": [b / t for b, t in zip(sizes["protected"], times["load_protected"])],
        "dd_write": [b / t for b, t in zip(sizes["protected"], times["dd_write"])],
        "dd_read": [b / t for b, t in zip(sizes["protected"], times["dd_read"])],
        "load_cold_protected": [b / t for b, t in zip(sizes["protected"], times["load_cold_protected"])],
        "dd_cold_read": [b / t for b, t in zip(sizes["protected"], times["dd_cold_read"])],
    }
    fractions = {
        "save_dd": statistics.median(s / d for s, d in zip(per_repeat["save_protected"], per_repeat["dd_write"])),
        "load_read": statistics.median(lo / r for lo, r in zip(per_repeat["load_protected"], per_repeat["dd_read"])),
        "cold_load_read": statistics.median(lo / r for lo, r in zip(per_repeat["load_cold_protected"],
                                                                     per_repeat["dd_cold_read"])),
        "save_growth_state": statistics.median((p - n) / (param_bytes + shard_bytes)
                                               for p, n in zip(growth["save_protected"], growth["save_native"])),
    }
    ratios = {phase: statistics.median(p / n for p, n in zip(times[f"{phase}_protected"], times[f"{phase}_native"]))
              for phase in ("save", "load", "load_cold")}
    return {"parameters": parameters, "shard_bytes": shard_bytes, "optimizer": optimizer_name,
            "fsdp_version": fsdp_version, "ratios": ratios,
            "times": {key: statistics.median(values) for key, values in times.items()},
            "growth": {key: max(values) for key, values in growth.items()},
            "param_bytes": param_bytes, "state_bytes": param_bytes + shard_bytes,
            "checkpoint_bytes": {mode: statistics.median(values) for mode, values in sizes.items()},
            "bandwidth": {key: statistics.median(values) for key, values in per_repeat.items()},
            "fractions": fractions,
            "raw": {"times": times, "growth": growth, "bytes": sizes, "bandwidth": per_repeat}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[50], help="model sizes in millions of parameters")
    parser.add_argument("--repeats", "--pairs", dest="repeats", type=int, default=3,
                        help="alternating native/protected pairs (each followed by the dd baseline)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=1,
                        help="Accelerate FSDP version of the benchmarked model (2: fully_shard, DTensor)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ranks import benchmarks.bench_checkpoint
    from accelerate_txn.testing import launch

    rows = []
    for million in args.sizes:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
            results = launch("benchmarks.bench_checkpoint:worker", 2,
                             args=(root, million, args.repeats, args.optimizer, args.fsdp_version), timeout=1800)
        rows.append({"million": million, "ranks": results})
    print(f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}; optimizer {args.optimizer}; "
          f"FSDP{args.fsdp_version}")
    print("| model | phase | native s | protected s | median of pair ratios |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        rank0 = row["ranks"][0]
        for phase, shown in (("save", "save"), ("load", "load (in the page cache)"),
                             ("load_cold", "load (after a restart: from the disk)")):
            native, protected = rank0["times"][f"{phase}_native"], rank0["times"][f"{phase}_protected"]
            print(f"| {rank0['parameters'] / 1e6:.0f}M | {shown} | {native:.2f} | {protected:.2f} | "
                  f"{rank0['ratios'][phase]:.2f} |")
    print()
    print("Peak RSS growth during load_state, MiB (ratio to the rank's own optimizer shard):")
    print("| model | rank | own optimizer shard | native, stepped optimizer | protected, stepped optimizer "
          "| protected, fresh optimizer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        for rank, result in enumerate(row["ranks"]):
            shard = result["shard_bytes"]
            cells = [f"{result['growth'][key] / 2**20:.0f} ({result['growth'][key] / shard:.2f}x)"
                     for key in ("load_native", "load_protected", "load_fresh_protected")]
            print(f"| {result['parameters'] / 1e6:.0f}M | {rank} | {shard / 2**20:.0f} | " + " | ".join(cells) + " |")
    print()
    print("Against the hardware (GB/s: checkpoint bytes / wall time, rank 0, median of the repeats; load: the protected "
          "load into a stepped optimizer; fractions: medians of the per-repeat ratios; save growth: peak RSS growth "
          "during save_state, max over repeats, worst rank; (protected-native)/state: median over repeats, worst "
          "rank, of that growth difference over the rank's parameter + optimizer shard bytes):")
    print("| model | ranks | bytes | native save GB/s | protected save GB/s | dd fdatasync GB/s | protected/dd "
          "| load GB/s | page-cache read GB/s | load/read | cold load GB/s | disk read GB/s | cold load/read "
          "| save growth native MiB | protected MiB | (protected-native)/state |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        rank0 = row["ranks"][0]
        bandwidth, fractions = rank0["bandwidth"], rank0["fractions"]
        native_growth = max(result["growth"]["save_native"] for result in row["ranks"])
        protected_growth = max(result["growth"]["save_protected"] for result in row["ranks"])
        difference = max(result["fractions"]["save_growth_state"] for result in row["ranks"])
        print(f"| {rank0['parameters'] / 1e6:.0f}M | {len(row['ranks'])} "
              f"| {rank0['checkpoint_bytes']['protected'] / 1e9:.2f} GB "
              f"| {bandwidth['save_native'] / 1e9:.3f} | {bandwidth['save_protected'] / 1e9:.3f} "
              f"| {bandwidth['dd_write'] / 1e9:.3f} | {fractions['save_dd']:.2f} "
              f"| {bandwidth['load_protected'] / 1e9:.3f} | {bandwidth['dd_read'] / 1e9:.3f} "
              f"| {fractions['load_read']:.2f} | {bandwidth['load_cold_protected'] / 1e9:.3f} "
              f"| {bandwidth['dd_cold_read'] / 1e9:.3f} | {fractions['cold_load_read']:.2f} "
              f"| {native_growth / 2**20:.0f} | {protected_growth / 2**20:.0f} "
              f"| {difference:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
