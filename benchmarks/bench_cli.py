"""Offline CLI speed: ``accelerate-txn verify --full`` against ``sha256sum`` over the same files, and the import
cost of ``accelerate_txn`` on top of ``accelerate.accelerator``.

A checkpoint-shaped directory of ``--gib`` GiB (four payload files of random bytes plus small control files) gets a
real manifest; then ``verify --full`` and ``sha256sum`` run in alternating pairs (page cache warm for both), and the
median of the per-pair ratios is reported. Import cost: fresh interpreters import ``accelerate.accelerator``, run a
full garbage collection (so a collection of torch's objects, which would happen anyway, is not charged to us),
then time ``import accelerate_txn``.

    .venv/bin/python benchmarks/bench_cli.py --gib 1 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_IMPORT = ("import time, gc; import accelerate.accelerator; gc.collect(); t = time.perf_counter(); "
           "import accelerate_txn; print(time.perf_counter() - t)")


def _checkpoint(root: Path, gib: float) -> list[Path]:
    from accelerate_txn.core.manifest import PROTOCOL, build_inventory, write_manifest
    from accelerate_txn.store.posix import POSIX

    root.mkdir()
    (root / "pytorch_model_fsdp_0").mkdir()
    payloads = []
    per_file = int(gib * 2**30 / 4)
    for rank in range(4):
        path = root / "pytorch_model_fsdp_0" / f"__{rank}_0.distcp"
        with path.open("wb") as stream:
            for _ in range(per_file // 2**24):
                stream.write(os.urandom(2**24))
        payloads.append(path)
    for rank in range(4):
        (root / f"random_states_{rank}.pkl").write_bytes(os.urandom(16_000))
    write_manifest(root, {"protocol": PROTOCOL, "status": "complete", "run_id": "a" * 32, "transaction_id": "b" * 32,
                          "integrity": "full", "components": {}, "files": build_inventory(root, "full")}, store=POSIX)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "checkpoint_manifest.json")


def _time(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    imports = [float(subprocess.run([sys.executable, "-c", _IMPORT], check=True, capture_output=True, text=True,
                                    env=env).stdout) for _ in range(args.repeats + 1)][1:]  # first run writes .pyc
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
        root = Path(directory) / "checkpoint_1"
        files = _checkpoint(root, args.gib)
        cli = [sys.executable, "-m", "accelerate_txn", "verify", "--full", str(root)]
        sha = ["sha256sum", *map(str, files)]
        _time(sha), _time(cli)  # warm the page cache and the .pyc files
        pairs = []
        for repeat in range(args.repeats):
            order = (cli, sha) if repeat % 2 == 0 else (sha, cli)
            timed = {id(command): _time(command) for command in order}
            pairs.append((timed[id(cli)], timed[id(sha)]))
    print(f"import accelerate_txn after accelerate.accelerator: median {statistics.median(imports) * 1000:.1f} ms "
          f"(min {min(imports) * 1000:.1f}, max {max(imports) * 1000:.1f}; {args.repeats} fresh interpreters)")
    print("| checkpoint | verify --full s | sha256sum s | median of pair ratios |")
    print("| --- | --- | --- | --- |")
    print(f"| {args.gib:g} GiB | {statistics.median(c for c, _ in pairs):.2f} | {statistics.median(s for _, s in pairs):.2f} "
          f"| {statistics.median(c / s for c, s in pairs):.2f} |")


if __name__ == "__main__":
    main()
