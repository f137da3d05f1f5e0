"""Checkpoints in object storage against the client library's own bulk copies, on a loopback S3 server, in one run.

The server is moto's ``ThreadedMotoServer`` in a child process (``benchmarks/loopback_s3.py``). Three ratios
(issue 20), each the median of the per-repeat ratios, the modes of a repeat in rotating order so that drift in the
machine's load affects them alike:

1. **Upload** (this process): the library's upload of a published checkpoint, as a save does it
   (``core.remote.upload`` of every file of the inventory, split by ``core.remote.shares``, then
   ``core.remote.commit``, the manifest written last and create-only), against s3fs's own bulk copy of the same
   directory (``fs.put(local_dir, url, recursive=True)``). Once as one rank uploading the whole inventory (one
   share), once as two ranks (two shares uploaded in parallel, one thread each, sharing the process). Ratio:
   the library's throughput over s3fs's (target at least 0.9).
2. **Mirrored save** (2 ranks, FSDP1, gloo, CPU): wall time of ``accelerator.save_state(path)`` with
   ``configure_checkpointing(acc, mirror="s3://...")`` against the same save without a mirror; only the call is
   timed (the slower rank's), the upload runs in the background and ``wait_for_checkpoint`` is called after the
   timed region, before the next save. Ratio: mirrored over local (target at most 1.05), ``--save-repeats`` pairs.
   One save of each kind is made before the repeats (the first mirrored save creates the background process group
   and the S3 client).
3. **Restore from the remote tier** (the same 2 ranks): ``acc.load_state("s3://.../checkpoint_N")`` into an empty
   cache (``configure_checkpointing(acc, cache_dir=<fresh directory>)``: manifest and listing checked, each rank
   downloads its share of the files, each verified, then the protected local restore of the copy) against s3fs's
   bulk download of the checkpoint's transaction prefix (``fs.get(url/.txn-<run>-<txid>, local_dir,
   recursive=True)``, rank 0, the other rank waiting) plus ``acc.load_state`` of the local published copy of the
   same checkpoint. Ratio: remote over baseline (target at most 1.1).

The model is a stack of ``Linear(2048)`` (``bench_checkpoint._model``), AdamW after one step; ``--million 8``
gives a checkpoint of about 100 MB (model and optimizer shards of both ranks).

    .venv/bin/python benchmarks/bench_remote.py --million 8 --repeats 7 --save-repeats 15 --json benchmarks/results/remote.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BUCKET = "bench-remote"
TARGETS = {"upload": (">=", 0.9), "mirrored_save": ("<=", 1.05), "restore": ("<=", 1.1)}


def _rotated(modes: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    shift = repeat % len(modes)
    return modes[shift:] + modes[:shift]


def _tree_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def worker(root: str, parent: str, million: int, repeats: int, save_repeats: int) -> dict[str, Any]:
    """Ratios 2 and 3 in each of 2 ranks; returns this rank's times and the last published local checkpoint."""
    import s3fs
    import torch

    from accelerate_txn import configure_checkpointing, wait_for_checkpoint
    from accelerate_txn.core import remote
    from accelerate_txn.core.manifest import read_manifest
    from accelerate_txn.store.s3 import S3Store
    from accelerate_txn.testing import fsdp_accelerator
    from benchmarks.bench_async import _barrier_time
    from benchmarks.bench_checkpoint import _model

    acc = fsdp_accelerator()
    torch.manual_seed(0)
    model = acc.prepare(_model(million))
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    acc.backward(model(torch.randn(8, 2048)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parameters = sum(p.numel() for p in model.parameters()) * acc.num_processes  # FSDP1 use_orig_params: local views
    mirror = f"{parent}/mirror"
    checkpoints = Path(root) / "checkpoints"
    counter = iter(range(10**6))
    store = S3Store()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)

    def save(mirrored: bool) -> tuple[float, Path]:
        configure_checkpointing(acc, mirror=mirror if mirrored else "")
        path = checkpoints / f"checkpoint_{next(counter)}"
        acc.wait_for_everyone()
        start = time.perf_counter()
        acc.save_state(str(path))
        elapsed = _barrier_time(acc, start)
        wait_for_checkpoint(acc)  # the background upload, outside the timed region
        acc.wait_for_everyone()
        return elapsed, path

    def discard(path: Path, mirrored: bool) -> None:
        acc.wait_for_everyone()
        if acc.process_index == 0:
            shutil.rmtree(path)
            if mirrored:
                store.delete_prefix(remote.join(mirror, path.name), first=["checkpoint_manifest.json"])
        acc.wait_for_everyone()

    warmup = {}
    for mirrored in (False, True):
        warmup["mirrored" if mirrored else "local"], path = save(mirrored)
        discard(path, mirrored)
    saves: dict[str, list[float]] = {"local": [], "mirrored": []}
    ratios: dict[str, list[float]] = {"mirrored_save": [], "restore": []}
    kept: Path | None = None
    for repeat in range(save_repeats):
        measured = {}
        for mode in _rotated(("local", "mirrored"), repeat):
            measured[mode], path = save(mode == "mirrored")
            if mode == "mirrored" and repeat == save_repeats - 1:
                kept = path  # its remote copy is the one restored below
            else:
                discard(path, mode == "mirrored")
        for mode, seconds in measured.items():
            saves[mode].append(seconds)
        ratios["mirrored_save"].append(measured["mirrored"] / measured["local"])
    assert kept is not None
    configure_checkpointing(acc, mirror="")
    url = remote.join(mirror, kept.name)
    manifest = read_manifest(kept)
    assert manifest is not None
    prefix = remote.join(url, remote.data_dir(manifest))
    checkpoint_bytes = sum(int(row["size"]) for row in manifest["files"].values())

    def restore_remote(label: str) -> float:
        cache = Path(root) / f"cache-{label}"
        configure_checkpointing(acc, cache_dir=str(cache))
        acc.wait_for_everyone()
        start = time.perf_counter()
        acc.load_state(url)
        elapsed = _barrier_time(acc, start)
        acc.wait_for_everyone()
        if acc.process_index == 0:
            shutil.rmtree(cache)
        return elapsed

    def restore_baseline(label: str) -> tuple[float, float]:
        into = Path(root) / f"get-{label}"
        acc.wait_for_everyone()
        start = time.perf_counter()
        if acc.process_index == 0:
            fs.get(prefix, str(into), recursive=True)
        downloaded = _barrier_time(acc, start)
        acc.load_state(str(kept))
        elapsed = _barrier_time(acc, start)
        acc.wait_for_everyone()
        if acc.process_index == 0:
            got = _tree_bytes(into)
            if got != checkpoint_bytes:
                raise RuntimeError(f"s3fs's get brought {got} bytes, the checkpoint holds {checkpoint_bytes}")
            shutil.rmtree(into)
        return elapsed, downloaded

    restore_remote("warmup")
    restore_baseline("warmup")
    restores: dict[str, list[float]] = {"remote": [], "baseline": [], "baseline_download": []}
    for repeat in range(repeats):
        measured = {}
        for mode in _rotated(("remote", "baseline"), repeat):
            if mode == "remote":
                measured[mode] = restore_remote(str(repeat))
            else:
                measured[mode], download = restore_baseline(str(repeat))
                restores["baseline_download"].append(download)
        restores["remote"].append(measured["remote"])
        restores["baseline"].append(measured["baseline"])
        ratios["restore"].append(measured["remote"] / measured["baseline"])
    return {"parameters": parameters, "checkpoint": str(kept), "checkpoint_bytes": checkpoint_bytes,
            "files": len(manifest["files"]), "warmup_save": warmup, "save": saves, "restore": restores,
            "ratios": ratios}


def upload_ratio(directory: Path, parent: str, repeats: int) -> dict[str, Any]:
    """Ratio 1, in this process: the library's upload (one share, two shares in parallel) against s3fs's put."""
    import s3fs

    from accelerate_txn.core import remote
    from accelerate_txn.core.manifest import read_manifest
    from accelerate_txn.store.s3 import S3Store

    store = S3Store()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    manifest = read_manifest(directory)
    assert manifest is not None
    payload = sum(int(row["size"]) for row in manifest["files"].values())
    on_disk = _tree_bytes(directory)  # the inventory and the manifest: what s3fs's put sends

    def library(ranks: int) -> float:
        url = f"{parent}/upload-{uuid.uuid4().hex[:8]}/checkpoint_1"
        split = remote.shares(manifest["files"], ranks)
        start = time.perf_counter()
        with ThreadPoolExecutor(ranks) as pool:
            sent = sum(pool.map(lambda share: remote.upload(store, directory, url, manifest, share), split))
        remote.commit(store, url, manifest, replace=False)
        elapsed = time.perf_counter() - start
        if sent != payload:
            raise RuntimeError(f"the library's upload sent {sent} bytes, expected {payload}")
        store.delete_prefix(url, first=["checkpoint_manifest.json"])
        return elapsed

    def client() -> float:
        url = f"{parent}/put-{uuid.uuid4().hex[:8]}/checkpoint_1"
        start = time.perf_counter()
        fs.put(str(directory), url, recursive=True)
        elapsed = time.perf_counter() - start
        stored = store.list(url)
        if sum(stored.values()) != on_disk:
            raise RuntimeError(f"s3fs's put stored {sum(stored.values())} bytes of {on_disk}")
        store.delete_prefix(url)
        return elapsed

    modes = {"s3fs": client, "library_1_share": lambda: library(1), "library_2_shares": lambda: library(2)}
    for run in modes.values():  # warm-up: connections, the event loop, the page cache
        run()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    ratios: dict[str, list[float]] = {"library_1_share": [], "library_2_shares": []}
    for repeat in range(repeats):
        for mode in _rotated(tuple(modes), repeat):
            times[mode].append(modes[mode]())
        for mode in ratios:
            ratios[mode].append(times["s3fs"][-1] / times[mode][-1])  # throughput ratio: same bytes
    return {"bytes": on_disk, "payload_bytes": payload, "times": times, "ratios": ratios,
            "MBps": {mode: on_disk / statistics.median(values) / 1e6 for mode, values in times.items()}}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--million", type=int, default=8, help="model size in millions of parameters")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the upload and restore measurements")
    parser.add_argument("--save-repeats", type=int, default=15,
                        help="repeats of the save measurement (a save of tens of MB on a busy machine is noisy)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ranks import benchmarks.bench_remote
    from accelerate_txn.store.s3 import S3Store
    from accelerate_txn.testing import launch
    from benchmarks.loopback_s3 import loopback_s3

    load_before = os.getloadavg()
    with loopback_s3(), tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        S3Store().fs.mkdir(BUCKET)
        parent = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
        ranks = launch("benchmarks.bench_remote:worker", 2, args=(root, parent, args.million, args.repeats, args.save_repeats),
                       timeout=1800)
        upload = upload_ratio(Path(ranks[0]["checkpoint"]), parent, args.repeats)
    load_after = os.getloadavg()
    rank0 = ranks[0]
    results = {
        "million": args.million, "parameters": rank0["parameters"], "checkpoint_bytes": rank0["checkpoint_bytes"],
        "files": rank0["files"], "repeats": args.repeats, "save_repeats": args.save_repeats, "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": load_after,
        "versions": {name: _version(name) for name in ("torch", "accelerate", "s3fs", "botocore", "moto")},
        "ratios": {
            "upload": statistics.median(upload["ratios"]["library_1_share"]),
            "upload_2_shares": statistics.median(upload["ratios"]["library_2_shares"]),
            "mirrored_save": statistics.median(rank0["ratios"]["mirrored_save"]),
            "restore": statistics.median(rank0["ratios"]["restore"]),
        },
        "targets": TARGETS, "upload": upload, "ranks": ranks,
    }
    r, t = results["ratios"], rank0
    med = statistics.median
    print(f"{results['parameters'] / 1e6:.1f}M parameters, checkpoint {results['checkpoint_bytes'] / 1e6:.0f} MB in "
          f"{results['files']} files; {args.repeats} repeats ({args.save_repeats} for the saves); {os.cpu_count()} CPUs; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("| ratio | library | client baseline | median of per-repeat ratios | target |")
    print("| --- | --- | --- | --- | --- |")
    up = upload["MBps"]
    print(f"| upload, 1 share (throughput) | {up['library_1_share']:.0f} MB/s | {up['s3fs']:.0f} MB/s (s3fs put) "
          f"| {r['upload']:.2f} | >= 0.9 |")
    print(f"| upload, 2 shares in parallel (throughput) | {up['library_2_shares']:.0f} MB/s | {up['s3fs']:.0f} MB/s "
          f"(s3fs put) | {r['upload_2_shares']:.2f} | >= 0.9 |")
    print(f"| mirrored save, blocking | {med(t['save']['mirrored']):.2f} s | {med(t['save']['local']):.2f} s (local "
          f"save) | {r['mirrored_save']:.2f} | <= 1.05 |")
    print(f"| restore from the remote tier | {med(t['restore']['remote']):.2f} s | {med(t['restore']['baseline']):.2f} s "
          f"(s3fs get {med(t['restore']['baseline_download']):.2f} s + local restore) | {r['restore']:.2f} | <= 1.1 |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
