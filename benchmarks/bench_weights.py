"""Model-weight I/O benchmark: peak resident-memory growth and throughput, against plain safetensors.

Every measurement runs in a fresh Python process (so one case's freed-but-kept heap cannot hide another's peak)
and is taken twice: with glibc's default malloc and with ``MALLOC_MMAP_THRESHOLD_=65536`` (large blocks are then
returned to the OS on free, which makes peaks repeatable). Peak growth is measured two ways: the kernel's exact
high-water mark (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) and a thread sampling
``/proc/self/statm`` every millisecond; both are relative to the RSS just before the operation.

Cases (the same tensors: ``--size-mib`` of float32 in 16 MiB tensors; shards of ``--shard-mib``):

* ``save_file`` / ``save_file+fsync``: plain ``safetensors.torch.save_file`` of the whole dict to one file.
* ``export`` / ``export bf16``: ``save_diffusers_state_dict`` (fsyncs and publishes atomically), without and with
  a dtype cast.
* ``export_dcp``: ``export_dcp_to_diffusers`` from a DCP directory holding the same tensors (no dict in memory).
* ``load_file``: plain ``safetensors.torch.load_file`` of the single file (tensors touched, so they are resident).
* ``read_diffusers_state_dict``: the validated read of the sharded export (tensors touched).
* ``load_state_dict(load_file)`` / ``load_model_checkpoint``: loading into an allocated model, plain vs validated
  shard by shard.

Loads read files the preparation step wrote, so they run from a warm page cache. Before each measurement the
worker imports the modules the operations import lazily and calls ``os.sync()``, so neither import memory nor
an earlier case's write-back is counted.

Usage: ``python benchmarks/bench_weights.py [--size-mib 1024] [--shard-mib 128] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1024**2
TENSOR_MIB = 16
PAGE = os.sysconf("SC_PAGE_SIZE")
MALLOC_SETTINGS = {"default malloc": {}, "MALLOC_MMAP_THRESHOLD_=65536": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
CASES = [
    "save_file",
    "save_file+fsync",
    "export",
    "export bf16",
    "export_dcp",
    "load_file",
    "read_diffusers_state_dict",
    "load_state_dict(load_file)",
    "load_model_checkpoint",
]


# --------------------------------------------------------------------------------------------- worker side


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _high_water_mark() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class _Sampler:
    """Samples RSS every millisecond in a thread; ``peak`` is the largest sample."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _state(size_mib: int) -> dict[str, Any]:
    import torch

    count = size_mib // TENSOR_MIB
    elements = TENSOR_MIB * MIB // 4
    return {f"blocks.{i}.weight": torch.empty(elements, dtype=torch.float32).fill_(i) for i in range(count)}


class _Model:
    """A module whose state dict has the benchmark's keys and shapes (built lazily: torch imports slowly)."""

    @staticmethod
    def build(size_mib: int) -> Any:
        import torch

        class Blocks(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.blocks = torch.nn.ModuleList()
                for _ in range(size_mib // TENSOR_MIB):
                    block = torch.nn.Module()
                    block.weight = torch.nn.Parameter(torch.zeros(TENSOR_MIB * MIB // 4), requires_grad=False)
                    self.blocks.append(block)

        return Blocks()


class _ConfigOnly:
    def save_config(self, directory: str | os.PathLike[str]) -> None:
        Path(directory, "config.json").write_text("{}")


def _touch(tensors: dict[str, Any]) -> dict[str, Any]:
    """Make every tensor resident (memory-mapped loads are otherwise lazy) without allocating; return them."""
    for value in tensors.values():
        value.view(-1)[:: PAGE // value.element_size()].sum()
    return tensors


def _prepare(work: Path, size_mib: int, shard_mib: int) -> None:
    """Write the inputs of the load and DCP cases (not measured)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from accelerate_txn.weights import save_diffusers_state_dict

    save_file(_state(size_mib), work / "single.safetensors")
    save_diffusers_state_dict(_state(size_mib), _ConfigOnly(), work / "sharded", max_shard_size=shard_mib * MIB)
    dcp.save({"model": _state(size_mib)}, storage_writer=dcp.FileSystemWriter(work / "dcp"), no_dist=True)


def _case(name: str, work: Path, size_mib: int, shard_mib: int) -> tuple[Callable[[], None], list[Any]]:
    """Set up case ``name`` (unmeasured) and return the operation to measure, plus objects to keep alive."""
    import torch
    from safetensors.torch import load_file, save_file

    from accelerate_txn.weights import (
        export_dcp_to_diffusers,
        load_model_checkpoint,
        read_diffusers_state_dict,
        save_diffusers_state_dict,
    )

    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    shard = shard_mib * MIB
    if name == "save_file":
        state = _state(size_mib)
        return lambda: save_file(state, out.with_suffix(".safetensors")), [state]
    if name == "save_file+fsync":
        state = _state(size_mib)

        def save_and_fsync() -> None:
            save_file(state, out.with_suffix(".safetensors"))
            descriptor = os.open(out.with_suffix(".safetensors"), os.O_RDONLY)
            os.fsync(descriptor)
            os.close(descriptor)

        return save_and_fsync, [state]
    if name in ("export", "export bf16"):
        state = _state(size_mib)
        dtype = torch.bfloat16 if name == "export bf16" else None
        # The dict is handed over (the export consumes it), as a caller who gathered it would.
        return lambda: save_diffusers_state_dict(state, _ConfigOnly(), out, shard, dtype=dtype), []
    if name == "export_dcp":
        return lambda: export_dcp_to_diffusers(work / "dcp", _ConfigOnly(), out, shard), []
    kept: list[Any] = []
    if name == "load_file":
        return lambda: kept.append(_touch(load_file(work / "single.safetensors"))), kept
    if name == "read_diffusers_state_dict":
        return lambda: kept.append(_touch(read_diffusers_state_dict(work / "sharded"))), kept
    model = _Model.build(size_mib)
    if name == "load_state_dict(load_file)":
        return lambda: model.load_state_dict(load_file(work / "single.safetensors")), [model]
    if name == "load_model_checkpoint":
        return lambda: load_model_checkpoint(model, work / "sharded"), [model]
    raise SystemExit(f"unknown case {name!r}")


def _worker(name: str, work: Path, size_mib: int, shard_mib: int) -> dict[str, Any]:
    import gc

    # Import what the operations import lazily, so one-off import memory (~40 MiB for DCP) is not counted.
    import torch.distributed.checkpoint  # noqa: F401
    from accelerate.utils import convert_file_size_to_int  # noqa: F401

    operation, _alive = _case(name, work, size_mib, shard_mib)
    os.sync()  # write back earlier cases' dirty pages now, not during this measurement
    gc.collect()
    baseline = _rss()
    exact = _reset_high_water_mark()
    with _Sampler() as sampler:
        start = time.perf_counter()
        operation()
        seconds = time.perf_counter() - start
    return {
        "case": name,
        "seconds": seconds,
        "baseline_mib": baseline / MIB,
        "hwm_growth_mib": (_high_water_mark() - baseline) / MIB if exact else None,
        "sampled_growth_mib": (sampler.peak - baseline) / MIB,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# --------------------------------------------------------------------------------------------- driver side


def _run(args: list[str], env: dict[str, str]) -> str:
    completed = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False, timeout=600
    )
    if completed.returncode:
        raise SystemExit(f"benchmark worker {args} failed:\n{completed.stdout}\n{completed.stderr}")
    return completed.stdout


def _table(results: dict[str, list[dict[str, Any]]], size_mib: int, shard_mib: int) -> str:
    lines = [
        f"State dict: {size_mib} MiB of float32 in {TENSOR_MIB} MiB tensors; shards: {shard_mib} MiB.",
        "",
        "| malloc | case | seconds | MiB/s | peak RSS growth, VmHWM (MiB) | peak RSS growth, sampled (MiB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for setting, rows in results.items():
        for row in rows:
            hwm = "n/a" if row["hwm_growth_mib"] is None else f"{row['hwm_growth_mib']:.0f}"
            lines.append(
                f"| {setting} | {row['case']} | {row['seconds']:.2f} | {size_mib / row['seconds']:.0f} | {hwm} | "
                f"{row['sampled_growth_mib']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="state dict size (default 1024)")
    parser.add_argument("--shard-mib", type=int, default=128, help="max_shard_size (default 128)")
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary directory, removed)")
    parser.add_argument("--cases", nargs="*", default=CASES, help="subset of cases to run")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        work = args.workdir
        if args.worker == "prepare":
            _prepare(work, args.size_mib, args.shard_mib)
        else:
            print(json.dumps(_worker(args.worker, work, args.size_mib, args.shard_mib)))
        return

    repo = Path(__file__).resolve().parents[1]
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    base_env.pop("MALLOC_MMAP_THRESHOLD_", None)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-weights-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = ["--size-mib", str(args.size_mib), "--shard-mib", str(args.shard_mib), "--workdir", str(work)]
    try:
        _run(["--worker", "prepare", *sizes], base_env)
        results: dict[str, list[dict[str, Any]]] = {}
        for setting, extra in MALLOC_SETTINGS.items():
            results[setting] = []
            for case in args.cases:
                row = json.loads(_run(["--worker", case, *sizes], {**base_env, **extra}).strip().splitlines()[-1])
                results[setting].append(row)
                print(f"{setting:30} {case:28} {row['seconds']:6.2f} s  growth {row['sampled_growth_mib']:7.0f} MiB",
                      file=sys.stderr)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(_table(results, args.size_mib, args.shard_mib))


if __name__ == "__main__":
    main()
