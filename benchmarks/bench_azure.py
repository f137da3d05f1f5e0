"""Azure Blob clients against a loopback Azurite: which one can make a checkpoint commit create-only, and how fast
each moves checkpoint-sized files.

Azurite (the npm package, installed by ``tests.support.azurite`` into ``.azurite/``) runs in memory on 127.0.0.1 on a
free port, in its own process. For each client:

* **create-only, one request**: ``If-None-Match: *`` on ``Put Blob`` of a small blob, written twice; the second must
  be refused (the exception is recorded) and the first content kept.
* **create-only, large**: the same for a 12 MiB blob; whether the client sent it as staged blocks (``Put Block`` +
  ``Put Block List``) is read from the committed block list.
* **leftovers**: whether the client can list blobs that have staged blocks and no commit.
* **throughput**: upload, then download, of ``--files`` files of ``--mib`` MiB, median of ``--repeats`` rounds,
  MB/s (10^6 bytes) of payload. azure-storage-blob: ``upload_blob``/``download_blob`` per file (8 parallel
  requests each), the files at once from 4 threads; obstore: ``put_async``/``get_async`` of every file at once;
  accelerate-txn's ``AzureStore``: ``upload_file``/``download_file`` (blocks in parallel, hashed and verified), one
  file after another and 4 at once.

Needs the ``azure`` and ``test`` extras, node and npm, plus obstore (not a dependency of the library)::

    .venv/bin/pip install -c constraints.txt obstore==0.12.1
    .venv/bin/python benchmarks/bench_azure.py --files 4 --mib 32 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.azurite import ACCOUNT, KEY, LISTENING, azurite_binary

CONTAINER = "bench-azure"


def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return f"refused: {type(exc).__module__}.{type(exc).__name__}"
    return "ACCEPTED (overwrote)"


class SdkClient:
    name = "azure-storage-blob"

    def __init__(self, connection: str, endpoint: str) -> None:
        from azure.storage.blob import BlobServiceClient

        self.container = BlobServiceClient.from_connection_string(connection).get_container_client(CONTAINER)
        self.blocks = BlobServiceClient.from_connection_string(  # large blobs in 4 MiB blocks
            connection, max_single_put_size=4 * 2**20, max_block_size=4 * 2**20).get_container_client(CONTAINER)

    def put_create(self, key: str, data: bytes, large: bool) -> None:
        container = self.blocks if large else self.container
        container.get_blob_client(key).upload_blob(data, overwrite=False, max_concurrency=4)

    def lists_leftovers(self) -> bool:
        return True  # list_blobs(include=["uncommittedblobs"])

    def upload(self, files: list[Path], prefix: str) -> None:
        def one(path: Path) -> None:
            with open(path, "rb") as stream:
                self.container.get_blob_client(f"{prefix}/{path.name}").upload_blob(stream, overwrite=True,
                                                                                   max_concurrency=8)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, files))

    def download(self, files: list[Path], prefix: str, into: Path) -> None:
        def one(path: Path) -> None:
            with open(into / path.name, "wb") as stream:
                self.container.get_blob_client(f"{prefix}/{path.name}").download_blob(max_concurrency=8).readinto(stream)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, files))


class ObstoreClient:
    name = "obstore"

    def __init__(self, connection: str, endpoint: str) -> None:
        import obstore
        from obstore.store import AzureStore

        self.obstore = obstore
        self.store = AzureStore(CONTAINER, account_name=ACCOUNT, account_key=KEY, endpoint=f"{endpoint}/{ACCOUNT}",
                                client_options={"allow_http": True})

    def put_create(self, key: str, data: bytes, large: bool) -> None:
        self.obstore.put(self.store, key, data, mode="create", **({"chunk_size": 4 * 2**20} if large else {}))

    def lists_leftovers(self) -> bool:
        return False

    def upload(self, files: list[Path], prefix: str) -> None:
        async def run() -> None:
            await asyncio.gather(*(self.obstore.put_async(self.store, f"{prefix}/{f.name}", f) for f in files))
        asyncio.run(run())

    def download(self, files: list[Path], prefix: str, into: Path) -> None:
        async def one(path: Path) -> None:
            result = await self.obstore.get_async(self.store, f"{prefix}/{path.name}")
            with open(into / path.name, "wb") as stream:
                async for chunk in result.stream():
                    stream.write(chunk)
        async def run() -> None:
            await asyncio.gather(*(one(f) for f in files))
        asyncio.run(run())


class TxnClient:
    def __init__(self, connection: str, endpoint: str, parallel: int) -> None:
        from accelerate_txn.store.azure import AzureStore

        self.store = AzureStore()
        self.parallel = parallel
        self.name = f"AzureStore, {'one file after another' if parallel == 1 else f'{parallel} files at once'}"
        self.digests: dict[str, tuple[int, str]] = {}

    def put_create(self, key: str, data: bytes, large: bool) -> None:
        if not large:
            self.store.write_new(f"az://{CONTAINER}/{key}", data)
            return
        with tempfile.NamedTemporaryFile() as handle:
            handle.write(data)
            handle.flush()
            AzureStore = type(self.store)
            AzureStore(block_size=4 * 2**20, single_request_size=4 * 2**20).upload_file(
                handle.name, f"az://{CONTAINER}/{key}", create_only=True)

    def lists_leftovers(self) -> bool:
        return True

    def upload(self, files: list[Path], prefix: str) -> None:
        def one(path: Path) -> None:
            self.digests[path.name] = self.store.upload_file(path, f"az://{CONTAINER}/{prefix}/{path.name}")
        with ThreadPoolExecutor(self.parallel) as pool:
            list(pool.map(one, files))

    def download(self, files: list[Path], prefix: str, into: Path) -> None:
        def one(path: Path) -> None:
            size, digest = self.digests[path.name]
            self.store.download_file(f"az://{CONTAINER}/{prefix}/{path.name}", into / path.name, size=size,
                                     digest=digest)
        with ThreadPoolExecutor(self.parallel) as pool:
            list(pool.map(one, files))


def _blocks(connection: str, key: str) -> int:
    from azure.storage.blob import BlobServiceClient

    committed, _ = BlobServiceClient.from_connection_string(connection).get_blob_client(CONTAINER, key).get_block_list()
    return len(committed)


def measure(client: Any, connection: str, files: list[Path], repeats: int, scratch: Path) -> dict[str, Any]:
    key = f"create-{uuid.uuid4().hex}"
    client.put_create(key, b"first", False)
    small = _error(lambda: client.put_create(key, b"second", False))
    large_key = f"create-large-{uuid.uuid4().hex}"
    client.put_create(large_key, os.urandom(12 * 2**20), True)
    blocks = _blocks(connection, large_key)
    large = _error(lambda: client.put_create(large_key, os.urandom(12 * 2**20), True))
    total = sum(f.stat().st_size for f in files)
    up, down = [], []
    for _ in range(repeats):
        prefix = f"round-{uuid.uuid4().hex}"
        started = time.perf_counter()
        client.upload(files, prefix)
        up.append(total / (time.perf_counter() - started) / 1e6)
        into = Path(tempfile.mkdtemp(dir=scratch))
        started = time.perf_counter()
        client.download(files, prefix, into)
        down.append(total / (time.perf_counter() - started) / 1e6)
        for path in files:
            assert (into / path.name).read_bytes() == path.read_bytes(), path
    return {"client": client.name, "second_create_only_put": small, "large_create_only_sent_as":
            f"{blocks} committed blocks" if blocks else "one Put Blob", "second_create_only_large": large,
            "lists_leftovers": client.lists_leftovers(), "upload_MBps": round(statistics.median(up)),
            "download_MBps": round(statistics.median(down)), "upload_rounds": [round(v) for v in up],
            "download_rounds": [round(v) for v in down]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    process = subprocess.Popen([str(azurite_binary()), "--blobHost", "127.0.0.1", "--blobPort", "0",
                                "--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck", "--silent"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        endpoint = None
        for line in process.stdout:
            found = LISTENING.search(line)
            if found:
                endpoint = found.group(1)
                break
        if endpoint is None:
            raise SystemExit("Azurite did not start")
        connection = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                      f"BlobEndpoint={endpoint}/{ACCOUNT};")
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(connection).create_container(CONTAINER)
        results = []
        with tempfile.TemporaryDirectory() as scratch:
            files = []
            for index in range(args.files):
                path = Path(scratch) / f"shard_{index}.distcp"
                path.write_bytes(os.urandom(args.mib * 2**20))
                files.append(path)
            clients: list[Any] = [SdkClient(connection, endpoint)]
            try:
                clients.append(ObstoreClient(connection, endpoint))
            except ImportError:
                print("obstore is not installed: skipped", file=sys.stderr)
            clients += [TxnClient(connection, endpoint, 1), TxnClient(connection, endpoint, 4)]
            for client in clients:
                results.append(measure(client, connection, files, args.repeats, Path(scratch)))
                print(json.dumps(results[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"files": args.files, "mib": args.mib, "repeats": args.repeats,
                                             "results": results}, indent=2) + "\n")
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
