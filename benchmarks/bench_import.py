"""Cost of ``import accelerate_txn`` in a fresh interpreter, with and without cached bytecode.

Each sample is one fresh interpreter that times ``import accelerate_txn`` itself (``time.perf_counter`` around
the import statement, interpreter start-up excluded) and prints it. Two cases, alternating sample by sample so
drift in the machine's load affects both alike:

* ``bytecode``: the package's ``.pyc`` files exist (compiled once with ``compileall`` before the samples), the
  usual case after the first import of a writable install;
* ``no bytecode``: nothing of the package is cached, as in a read-only install or with
  ``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__``: every module of the package is compiled from source in
  every sample.

How the no-bytecode case is made sure: the package's source files (no ``__pycache__``) are copied to a temporary
directory that goes first on ``sys.path``, and the interpreter runs with ``-B`` (``PYTHONDONTWRITEBYTECODE``), so
no sample writes a ``.pyc`` that a later one could read. ``PYTHONDONTWRITEBYTECODE=1`` alone is not enough in a
checkout: it stops writing, not reading, so the ``__pycache__`` of an earlier import would be used.
``-X pycache_prefix=<empty dir>`` would work for the package but also sends every standard-library module to the
empty cache, which measures compiling the standard library, not a read-only install of this package (whose
interpreter ships its standard library compiled). Each sample checks, after its timed import, that every
``accelerate_txn`` module came from the copy and that no ``.pyc`` existed for it (``cache_from_source``), and the
benchmark checks at the end that the copy still holds no ``__pycache__``.

Both cases run ``python -E -s -S``: no environment variables, no user site, and no ``site`` (whose ``.pth`` files
may import modules first, e.g. an editable install's finder imports ``pathlib``; with ``-S`` nothing the import
needs is already loaded, an upper bound for a regular install). The import must not need site-packages: it
imports the standard library only (Accelerate is patched when it is imported).

    .venv/bin/python benchmarks/bench_import.py --repeats 40 [--json benchmarks/results/import.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1] / "accelerate_txn"
TARGET_MS = 50.0

# Timed: the import statement only. Checked afterwards: where every module of the package came from, whether a
# cached .pyc existed for it, and which heavy modules the import pulled in.
_SAMPLE = """\
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
import accelerate_txn
elapsed = time.perf_counter() - start
import importlib.util, json, os
root = {root!r}
ours = {{name: module.__file__ for name, module in list(sys.modules.items())
         if name.split(".")[0] == "accelerate_txn"}}
foreign = [name for name, path in ours.items() if not (path or "").startswith(root + os.sep)]
cached = [name for name, path in ours.items() if os.path.exists(importlib.util.cache_from_source(path))]
heavy = sorted(name for name in ("torch", "accelerate", "numpy", "wrapt", "pathlib", "typing")
               if name in sys.modules)
print(json.dumps({{"seconds": elapsed, "modules": sorted(ours), "foreign": foreign, "cached": cached,
                   "heavy": heavy}}))
"""


def _copy_package(package: Path, destination: Path) -> Path:
    root = destination / "src"
    shutil.copytree(package, root / "accelerate_txn", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def _sample(root: Path, bytecode: bool) -> dict[str, Any]:
    flags = ["-E", "-s", "-S"] + ([] if bytecode else ["-B"])
    result = subprocess.run([sys.executable, *flags, "-c", _SAMPLE.format(root=str(root))], capture_output=True,
                            text=True, timeout=120, check=True)
    sample = json.loads(result.stdout)
    if sample["foreign"]:
        raise RuntimeError(f"modules imported from outside the copy {root}: {sample['foreign']}")
    if bytecode and len(sample["cached"]) != len(sample["modules"]):
        raise RuntimeError(f"bytecode case: no .pyc for {sorted(set(sample['modules']) - set(sample['cached']))}")
    if not bytecode and sample["cached"]:
        raise RuntimeError(f"no-bytecode case: a .pyc exists for {sample['cached']}")
    return sample


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(value * 1000 for value in seconds)
    deciles = statistics.quantiles(ms, n=10)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "p10_ms": deciles[0], "p90_ms": deciles[-1],
            "max_ms": ms[-1]}


def measure(repeats: int, package: Path = PACKAGE) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        compiled = _copy_package(package, Path(scratch) / "bytecode")
        source_only = _copy_package(package, Path(scratch) / "source")
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(compiled)], check=True, timeout=120)
        _sample(compiled, bytecode=True)  # one unmeasured run each: the OS page cache holds both copies
        _sample(source_only, bytecode=False)
        seconds: dict[str, list[float]] = {"bytecode": [], "no_bytecode": []}
        last: dict[str, Any] = {}
        for repeat in range(repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            for bytecode in order:
                last = _sample(compiled if bytecode else source_only, bytecode)
                seconds["bytecode" if bytecode else "no_bytecode"].append(last["seconds"])
        written = sorted(str(path) for path in source_only.rglob("__pycache__"))
        if written:
            raise RuntimeError(f"no-bytecode case: bytecode was written: {written}")
    load = os.getloadavg()
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "repeats": repeats,
            "load_average": list(load), "modules": last["modules"], "heavy_imported": last["heavy"],
            "target_ms": TARGET_MS, "cases": {case: {**_summary(values), "samples_ms": [v * 1000 for v in values]}
                                              for case, values in seconds.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40, help="fresh interpreters per case (at least 2)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--package", type=Path, default=PACKAGE,
                        help="the accelerate_txn directory to measure, e.g. an older version's (default: this one)")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2")
    results = measure(args.repeats, args.package.resolve())
    load = results["load_average"]
    print(args.package.resolve())
    print(f"Python {results['python']}; {results['cpus']} CPUs; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; {args.repeats} fresh interpreters per case (python -E -s -S)")
    print(f"imports {len(results['modules'])} modules of accelerate_txn: {', '.join(results['modules'])}")
    print(f"of torch, accelerate, numpy, wrapt, pathlib, typing it imports: {results['heavy_imported'] or 'none'}")
    print("| case | median ms | min | p10 | p90 | max | target |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, label in (("bytecode", "cached bytecode"), ("no_bytecode", "no bytecode (compiled from source)")):
        s = results["cases"][case]
        print(f"| {label} | {s['median_ms']:.1f} | {s['min_ms']:.1f} | {s['p10_ms']:.1f} | {s['p90_ms']:.1f} "
              f"| {s['max_ms']:.1f} | under {TARGET_MS:.0f} ms |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
