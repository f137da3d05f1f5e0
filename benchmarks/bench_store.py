"""Object-store clients against a loopback S3 server: which one can make a checkpoint commit create-only, and how
fast each moves checkpoint-sized files.

The server is moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port), started in a child process so that its
Python request handling does not share the interpreter lock with the client measured (``benchmarks/loopback_s3.py``).
For each client:

* **create-only, one request**: ``If-None-Match: *`` on ``PutObject`` of a small object, written twice; the second
  must be refused (the exception is recorded) and the first content kept.
* **create-only, multipart**: the same for a 12 MiB object in 5 MiB parts. Whether the client really used a
  multipart upload is read from the stored object's ETag (a completed multipart upload's ETag ends in
  ``-<parts>``; a single ``PutObject``'s does not).
* **leftover uploads**: whether the client can list and abort incomplete multipart uploads.
* **throughput**: upload, then download, of ``--files`` files of ``--mib`` MiB each, median of ``--repeats``
  rounds, MB/s (10^6 bytes) of payload. s3fs: ``put``/``get`` of the whole list (its bulk copy); obstore:
  ``put_async``/``get_async`` of every file at once; accelerate-txn's ``S3Store``: ``upload_file`` /
  ``download_file`` one file after another (parts in parallel, hashed and verified), and 4 files at once.

Needs the ``s3`` and ``test`` extras plus obstore (not a dependency of the library)::

    .venv/bin/pip install -c constraints.txt obstore==0.12.1
    .venv/bin/python benchmarks/bench_store.py --files 8 --mib 32 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

BUCKET = "bench-store"
def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return f"refused: {type(exc).__module__}.{type(exc).__name__}"
    return "ACCEPTED (overwrote)"


class S3fsClient:
    name = "s3fs"

    def __init__(self) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)

    def put_create(self, key: str, data: bytes, multipart: bool) -> None:
        self.fs.pipe_file(f"{BUCKET}/{key}", data, mode="create", chunksize=5 * 2**20 if multipart else 50 * 2**20)

    def lists_leftovers(self) -> bool:
        return callable(getattr(self.fs, "list_multipart_uploads", None)) and callable(getattr(self.fs, "abort_mpu", None))

    def upload(self, files: list[Path], prefix: str) -> None:
        self.fs.put([str(f) for f in files], [f"{BUCKET}/{prefix}/{f.name}" for f in files])

    def download(self, files: list[Path], prefix: str, into: Path) -> None:
        self.fs.get([f"{BUCKET}/{prefix}/{f.name}" for f in files], [str(into / f.name) for f in files])


class ObstoreClient:
    name = "obstore"

    def __init__(self) -> None:
        import obstore
        from obstore.store import S3Store

        self.obstore = obstore
        self.store = S3Store(BUCKET)  # endpoint and credentials from the AWS_* environment (+ AWS_ALLOW_HTTP)

    def put_create(self, key: str, data: bytes, multipart: bool) -> None:
        self.obstore.put(self.store, key, data, mode="create", use_multipart=multipart, chunk_size=5 * 2**20)

    def lists_leftovers(self) -> bool:
        return any(callable(getattr(self.obstore, name, None)) for name in ("list_multipart_uploads", "abort_multipart"))

    def upload(self, files: list[Path], prefix: str) -> None:
        async def run() -> None:
            await asyncio.gather(*(self.obstore.put_async(self.store, f"{prefix}/{f.name}", f) for f in files))
        asyncio.run(run())

    def download(self, files: list[Path], prefix: str, into: Path) -> None:
        async def one(f: Path) -> None:
            reply = await self.obstore.get_async(self.store, f"{prefix}/{f.name}")
            with (into / f.name).open("wb") as out:
                async for chunk in reply.stream():
                    out.write(chunk)

        async def run() -> None:
            await asyncio.gather(*(one(f) for f in files))
        asyncio.run(run())


class TxnClient:
    def __init__(self, at_once: int = 1) -> None:
        from accelerate_txn.store.s3 import S3Store

        self.name = "accelerate-txn S3Store (s3fs)" + (f", {at_once} files at once" if at_once > 1 else "")
        self.at_once = at_once
        self.store = S3Store()
        self.small = S3Store(part_size=5 * 2**20)
        self.digests: dict[str, tuple[int, str]] = {}

    def put_create(self, key: str, data: bytes, multipart: bool) -> None:
        if not multipart:
            self.store.write_new(f"s3://{BUCKET}/{key}", data)
            return
        with tempfile.NamedTemporaryFile(dir=os.environ.get("BENCH_DIR")) as local:
            local.write(data)
            local.flush()
            self.small.upload_file(local.name, f"s3://{BUCKET}/{key}", create_only=True)

    def lists_leftovers(self) -> bool:
        return True  # list_incomplete_uploads / abort_incomplete_uploads

    def upload(self, files: list[Path], prefix: str) -> None:
        def one(f: Path) -> None:
            self.digests[f.name] = self.store.upload_file(f, f"s3://{BUCKET}/{prefix}/{f.name}")

        with ThreadPoolExecutor(self.at_once) as pool:
            list(pool.map(one, files))

    def download(self, files: list[Path], prefix: str, into: Path) -> None:
        def one(f: Path) -> None:
            size, digest = self.digests[f.name]
            self.store.download_file(f"s3://{BUCKET}/{prefix}/{f.name}", into / f.name, size=size, digest=digest)

        with ThreadPoolExecutor(self.at_once) as pool:
            list(pool.map(one, files))


def _capabilities(client: Any, fs: Any) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    small, big = f"caps/{run}/{client.name}/small", f"caps/{run}/{client.name}/big"
    data = os.urandom(12 * 2**20)
    client.put_create(small, b"first", multipart=False)
    second_small = _error(lambda: client.put_create(small, b"second", multipart=False))
    client.put_create(big, data, multipart=True)
    etag = fs.info(f"{BUCKET}/{big}")["ETag"].strip('"')
    second_big = _error(lambda: client.put_create(big, os.urandom(12 * 2**20), multipart=True))
    return {
        "create_only_put": second_small,
        "create_only_put_kept_first": fs.cat_file(f"{BUCKET}/{small}") == b"first",
        "create_only_large_request": f"multipart ({etag.rsplit('-', 1)[1]} parts)" if "-" in etag else "single PutObject",
        "create_only_large": second_big,
        "create_only_large_kept_first": fs.cat_file(f"{BUCKET}/{big}") == data,
        "lists_and_aborts_leftover_uploads": client.lists_leftovers(),
    }


def _throughput(client: Any, fs: Any, files: list[Path], repeats: int, scratch: Path) -> dict[str, float]:
    total = sum(f.stat().st_size for f in files)
    up, down = [], []
    for repeat in range(repeats):
        prefix = f"throughput/{uuid.uuid4().hex}"
        into = scratch / f"down-{repeat}"
        into.mkdir()
        start = time.perf_counter()
        client.upload(files, prefix)
        up.append(time.perf_counter() - start)
        start = time.perf_counter()
        client.download(files, prefix, into)
        down.append(time.perf_counter() - start)
        for f in files:  # every byte came back
            if xxhash.xxh3_128_hexdigest((into / f.name).read_bytes()) != xxhash.xxh3_128_hexdigest(f.read_bytes()):
                raise RuntimeError(f"{client.name}: {f.name} came back different")
            (into / f.name).unlink()
        into.rmdir()
        fs.rm(f"{BUCKET}/{prefix}", recursive=True)
    return {"upload_MBps": total / statistics.median(up) / 1e6, "download_MBps": total / statistics.median(down) / 1e6,
            "upload_s": up, "download_s": down}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: import benchmarks.*
    from benchmarks.loopback_s3 import loopback_s3

    with loopback_s3():
        clients = [S3fsClient(), ObstoreClient(), TxnClient(), TxnClient(at_once=4)]
        fs = clients[0].fs
        fs.mkdir(BUCKET)
        results: dict[str, Any] = {"files": args.files, "mib": args.mib, "repeats": args.repeats, "clients": {}}
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
            scratch = Path(directory)
            files = []
            for index in range(args.files):
                path = scratch / f"shard_{index}.bin"
                path.write_bytes(os.urandom(args.mib * 2**20))
                files.append(path)
            for client in clients:
                results["clients"][client.name] = {**_capabilities(client, fs),
                                                   **_throughput(client, fs, files, args.repeats, scratch)}
    print(f"{args.files} files x {args.mib} MiB, median of {args.repeats}, moto {_version('moto')}, "
          f"s3fs {_version('s3fs')}, obstore {_version('obstore')}, {os.cpu_count()} CPUs")
    print("| client | create-only PutObject (2nd write) | large create-only sent as | create-only large (2nd write) "
          "| lists/aborts leftover uploads | upload MB/s | download MB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in results["clients"].items():
        print(f"| {name} | {row['create_only_put']} | {row['create_only_large_request']} | {row['create_only_large']} "
              f"| {'yes' if row['lists_and_aborts_leftover_uploads'] else 'no'} | {row['upload_MBps']:.0f} "
              f"| {row['download_MBps']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
