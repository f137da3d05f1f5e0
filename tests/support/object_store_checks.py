"""What the S3 store's tests (tests/store/test_store_object.py), the Azure store's (tests/store/test_store_azure.py)
and the Google Cloud Storage store's (tests/store/test_store_gcs.py) check alike: each check takes the store under
test, a fresh prefix of its own and the store's chunk size; the store's own assertions (the server's request log,
multipart uploads or staged blocks) stay in its test file."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from accelerate_txn.errors import CheckpointError, CheckpointExistsError, CheckpointIntegrityError

MANIFEST = "checkpoint_manifest.json"


def payload(tmp_path: Path, size: int, name: str = "payload.bin") -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


def leftovers(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def _nothing() -> None:
    pass


def check_second_commit_refused(store: Any, manifest: Any, written: Callable[[], None] = _nothing,
                                refused: Callable[[], None] = _nothing) -> None:
    """The first create-only commit wins; the second raises naming the URL, and the first's content stays.
    ``written`` and ``refused``: the store's own checks, run after the first write and after the refusal."""
    store.write_new(manifest, b'{"transaction_id": "first"}')
    written()
    with pytest.raises(CheckpointExistsError) as caught:
        store.write_new(manifest, b'{"transaction_id": "second"}')
    assert f"{manifest} already exists (another writer committed it first)" in str(caught.value)
    assert "nothing was written" in str(caught.value)
    refused()
    assert store.read_bytes(manifest, limit=1024) == b'{"transaction_id": "first"}'


def check_commit_repeated_with_the_same_bytes(store: Any, prefix: Any) -> None:
    # A retry whose first request landed finds its own bytes: that is this writer's commit, not another's.
    manifest = prefix.child(MANIFEST)
    store.write_new(manifest, b'{"transaction_id": "mine"}')
    store.write_new(manifest, b'{"transaction_id": "mine"}')
    assert store.read_bytes(manifest, limit=1024) == b'{"transaction_id": "mine"}'


def check_create_only_upload_refused(store: Any, url: Any, tmp_path: Path, chunk: int,
                                     written: Callable[[], None] = _nothing,
                                     refused: Callable[[], None] = _nothing, *, size: int | None = None) -> None:
    """A create-only upload of a multi-chunk file (or of ``size`` bytes) onto an existing object is refused and the
    first one kept (``written``, ``refused``: the store's own checks after the first upload and after the refusal)."""
    size = 2 * chunk + 100 if size is None else size
    first, first_data = payload(tmp_path, size, "first.bin")
    second, _ = payload(tmp_path, size, "second.bin")
    size, digest = store.upload_file(first, url, create_only=True)
    written()
    with pytest.raises(CheckpointExistsError, match=re.escape(f"{url} already exists")):
        store.upload_file(second, url, create_only=True)
    refused()
    store.download_file(url, tmp_path / "back.bin", size=size, digest=digest)
    assert (tmp_path / "back.bin").read_bytes() == first_data


def check_chunked_round_trip(store: Any, url: Any, tmp_path: Path, chunk: int,
                             uploaded: Callable[[], None]) -> None:
    """A 3-chunk upload returns the size and hash of its bytes, reports progress per chunk and downloads back.
    ``uploaded``: the store's own check that the server holds a 3-chunk object."""
    path, data = payload(tmp_path, 2 * chunk + 12345)
    acknowledged: list[int] = []
    size, digest = store.upload_file(path, url, progress=acknowledged.append)
    assert (size, digest) == (len(data), xxhash.xxh3_128_hexdigest(data))
    assert len(acknowledged) == 3 and max(acknowledged) == len(data)
    uploaded()
    (tmp_path / "down").mkdir()
    store.download_file(url, tmp_path / "down" / "shard.distcp", size=size, digest=digest)
    assert (tmp_path / "down" / "shard.distcp").read_bytes() == data
    assert leftovers(tmp_path / "down") == ["shard.distcp"]


def check_empty_file_round_trip(store: Any, prefix: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert store.upload_file(empty, prefix.child("empty")) == (0, xxhash.xxh3_128_hexdigest(b""))
    store.download_file(prefix.child("empty"), tmp_path / "empty-back", size=0, digest=xxhash.xxh3_128_hexdigest(b""))
    assert (tmp_path / "empty-back").read_bytes() == b""


def check_damaged_object_refused(store: Any, url: Any, tmp_path: Path, chunk: int, damage: str,
                                 replace: Callable[[bytes], None], *, listed_too: bool = False) -> None:
    """A replaced object (``replace(bytes)``: another writer, or bit rot) is refused naming the URL, leaving no file
    and an existing one as it was. ``listed_too``: also with the size trusted from a listing."""
    path, data = payload(tmp_path, chunk + 777)
    size, digest = store.upload_file(path, url)
    altered = bytearray(data)
    if damage == "flipped byte":
        altered[len(data) // 2] ^= 0x01
    else:
        del altered[-1]
    replace(bytes(altered))
    (tmp_path / "down").mkdir()
    destination = tmp_path / "down" / "shard.distcp"
    expected = ("does not hold the content the checkpoint lists" if damage == "flipped byte"
                else f"holds {size - 1} bytes where the checkpoint lists {size}")
    with pytest.raises(CheckpointIntegrityError, match=re.escape(expected)) as caught:
        store.download_file(url, destination, size=size, digest=digest)
    assert str(url) in str(caught.value)
    assert leftovers(tmp_path / "down") == []
    destination.write_bytes(b"an older copy")  # a failed download leaves an existing file as it was
    with pytest.raises(CheckpointIntegrityError):
        store.download_file(url, destination, size=size, digest=digest)
    assert destination.read_bytes() == b"an older copy"
    if listed_too:
        # Listed sizes are trusted for the first check only: the hash still refuses the flipped byte.
        with pytest.raises(CheckpointIntegrityError,
                           match=re.escape("does not hold the content the checkpoint lists")):
            store.download_file(url, destination, size=size, digest=digest, listed=True)
        assert destination.read_bytes() == b"an older copy"
    assert leftovers(tmp_path / "down") == ["shard.distcp"]


def check_local_failure_named(store: Any, prefix: Any, tmp_path: Path, what: str | None = None) -> None:
    """A download whose local directory is gone names the local side, not the object store (``what``: the store's
    word for an object, checked absent from the message)."""
    source, data = payload(tmp_path, 1000, "scheduler.bin")
    url = prefix.child("scheduler.bin")
    size, digest = store.upload_file(source, url)
    gone = tmp_path / "cache" / "checkpoint_2"  # never created: as if removed under the download
    for listed in (True, False):
        with pytest.raises(CheckpointError) as raised:
            store.download_file(url, gone / "scheduler.bin", size=size, digest=digest, listed=listed)
        message = str(raised.value)
        assert not isinstance(raised.value, CheckpointIntegrityError), message  # the checkpoint is not at fault
        assert "on the local disk, not in the object store" in message and str(gone / "scheduler.bin") in message
        if what is not None:
            assert f"no such {what}" not in message and "incomplete" not in message
    assert store.size(url) == len(data)  # the object is there, as the message says


def check_failed_upload_leaves_nothing(store: Any, url: Any, tmp_path: Path, chunk: int) -> None:
    """An upload the caller gives up (its progress callback raises) raises that error and leaves no object."""
    path, _ = payload(tmp_path, 3 * chunk)

    def fail(acknowledged: int) -> None:
        raise RuntimeError("the caller gave up")

    with pytest.raises(RuntimeError, match="the caller gave up"):
        store.upload_file(path, url, progress=fail)
    assert store.size(url) is None


def kill_uploader_after_its_first_part(uploader_code: str, path: Path, url: Any, part: int, cwd: Path) -> None:
    """Start ``uploader_code`` (``python -c``: uploads ``path`` to ``url`` and prints each acknowledged byte count)
    and SIGKILL it as soon as it reports its first part of ``part`` bytes, mid-upload."""
    import select
    import signal
    import subprocess
    import sys

    uploader = subprocess.Popen([sys.executable, "-c", uploader_code, str(path), str(url)], cwd=cwd, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert uploader.stdout is not None
        ready, _, _ = select.select([uploader.stdout], [], [], 100)  # a hang guard; the line is the signal
        line = uploader.stdout.readline() if ready else ""
        if line.strip() != str(part):
            uploader.kill()
            pytest.fail(f"the uploader did not report its first part: {line!r} {uploader.communicate()[1][-3000:]}")
        os.kill(uploader.pid, signal.SIGKILL)
        assert uploader.wait(timeout=60) == -signal.SIGKILL
    finally:
        if uploader.poll() is None:
            uploader.kill()
            uploader.wait(timeout=60)


def error_without_the_client(client: str, store_module: str, store: str, url_class: str, url: str, cwd: Path) -> str:
    """In a fresh interpreter where the client module ``client`` cannot be imported (its extra not installed):
    importing ``accelerate_txn.<store_module>`` and parsing ``url`` still work, and creating the store raises
    ``CheckpointConfigurationError``, whose message is returned."""
    import subprocess
    import sys

    script = f"""
import sys
sys.modules[{client!r}] = None
import accelerate_txn
from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.{store_module} import {store}, {url_class}
{url_class}.parse({url!r})
try:
    {store}()
except CheckpointConfigurationError as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()
