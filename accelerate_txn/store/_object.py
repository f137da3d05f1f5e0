"""What the object stores (``store.s3``, ``store.azure``, ``store.gcs``) do alike: chunked, hashed uploads (parts in
parallel where the store assembles them), verified downloads into a hidden temporary file, and the errors they raise
in the same words.

Only the store implementations of this package use it; each keeps its own client calls and error mapping.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError, CheckpointIntegrityError
from .base import HASH, hash_file, new_hasher

#: ``progress(bytes_uploaded_so_far)``: called from the calling thread after each part the store acknowledged.
Progress = Callable[[int], None]


class ObjectUrl:
    """What the stores' URL classes (``S3Url``, ``AzureUrl``, ``GcsUrl``: frozen dataclasses of a root, the bucket or
    container, and a ``key``) share: the prefix of everything under a URL, a child URL parsed with the same rules, and
    the URL as text. A subclass names its scheme (``SCHEME``) and its root field, and provides ``parse``."""

    SCHEME = ""
    ROOT = "bucket"
    key: str

    @property
    def prefix(self) -> str:
        """The name prefix of everything under this URL (``"run/checkpoint_1/"``; ``""`` for the root)."""
        return f"{self.key}/" if self.key else ""

    def child(self, relative: str) -> Any:
        """The URL of ``relative`` (``"a/b.bin"``) under this one; parsed with the same rules."""
        return type(self).parse(f"{self}/{relative}")  # type: ignore[attr-defined]

    def __str__(self) -> str:
        root = getattr(self, self.ROOT)
        return f"{self.SCHEME}{root}/{self.key}" if self.key else f"{self.SCHEME}{root}"


def key_problem(key: str, forbidden: str, length: int, limit: str) -> str | None:
    """What is wrong with an object key (``None``: nothing): a character of ``forbidden``, a control character, an
    empty, ``.`` or ``..`` segment, or a ``length`` (as the store counts it) over 1024 (``limit`` says in what)."""
    if any(char in key for char in forbidden):
        quoted = [f"'{char}'" for char in forbidden]
        return f"contains {', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else f"contains {quoted[0]}"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in key):
        return "contains a control character"
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        return "has an empty, '.' or '..' path segment"
    if length > 1024:
        return f"is longer than {limit}"
    return None


def chunk_size_for(size: int, chunk_size: int, max_chunks: int) -> int:
    """The chunk size to upload ``size`` bytes with: ``chunk_size``, grown in whole MiB where the file would
    otherwise need more than ``max_chunks`` chunks."""
    needed = -(-size // max_chunks)
    if needed <= chunk_size:
        return chunk_size
    return -(-needed // 2**20) * 2**20


def read_head(stream: Any, size: int, chunk_size: int, single_request_size: int) -> tuple[bytes, bytes]:
    """The first two reads of an upload of ``size`` bytes: up to ``single_request_size`` the whole file is the
    first read (if it grew since it was measured, the second read finds more and it goes in chunks, this read its
    first). An empty second read means one request."""
    limit = chunk_size if size > single_request_size else max(chunk_size, size)
    first = stream.read(limit)
    second = stream.read(chunk_size) if len(first) == limit else b""
    return first, second


def digest_of(data: bytes) -> str:
    """The XXH3-128 hex digest of ``data``."""
    hasher = new_hasher(HASH)
    hasher.update(data)
    return str(hasher.hexdigest())


def chunks(stream: Any, head: list[bytes], chunk_size: int) -> Iterator[bytes]:
    """The chunks of ``stream``: the ones already read (``head``, emptied as they are handed out, so that no chunk
    outlives its upload), then the rest, ``chunk_size`` bytes each."""
    last = chunk_size
    while head:
        chunk = head.pop(0)
        last = len(chunk)
        yield chunk
        del chunk
    if last < chunk_size:
        return
    while True:
        chunk = stream.read(chunk_size)
        if not chunk:
            return
        yield chunk


def upload_in_parallel(parts: Iterable[bytes], send: Callable[[int, bytes], int], *, concurrency: int,
                       thread_name_prefix: str, progress: Progress | None) -> tuple[int, str]:
    """Hash each of ``parts`` in order and hand it to ``send(number, part)`` (numbered from 0, run in a pool of
    ``concurrency`` threads, returning the bytes the store acknowledged); return ``(bytes acknowledged, XXH3-128
    hex digest)``. At most ``concurrency`` parts are in flight, so memory is bounded; ``progress`` is called from
    the calling thread after each acknowledged part. The first failure is raised after the pool stopped."""
    hasher = new_hasher(HASH)
    acknowledged = 0

    def collect(finished: set[Future[int]]) -> None:
        nonlocal acknowledged
        for future in finished:
            acknowledged += future.result()
            if progress is not None:
                progress(acknowledged)

    with ThreadPoolExecutor(concurrency, thread_name_prefix=thread_name_prefix) as pool:
        pending: set[Future[int]] = set()
        try:
            for number, part in enumerate(parts):
                hasher.update(part)
                pending.add(pool.submit(send, number, part))
                del part  # the future holds the only reference: memory is bounded by the parts in flight
                if len(pending) >= concurrency:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    collect(finished)
            finished, pending = wait(pending)
            collect(finished)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return acknowledged, str(hasher.hexdigest())


def exists_error(url: object) -> CheckpointExistsError:
    """The error of a create-only write refused because ``url`` exists with other content."""
    return CheckpointExistsError(
        f"{url} already exists (another writer committed it first); it was left as it is and nothing was "
        f"written. Save under another name, or delete the existing checkpoint first if it is yours to "
        f"replace.")


def check_readable(url: object, size: int | None, limit: int) -> int:
    """``size`` of the object ``url`` to read bounded, refused (:class:`CheckpointIntegrityError`) if it is
    missing (``None``) or larger than ``limit`` bytes."""
    if size is None:
        raise CheckpointIntegrityError(f"{url} does not exist.")
    if size > limit:
        raise CheckpointIntegrityError(f"{url} holds {size} bytes, more than the {limit} allowed here; it is not "
                                       f"a file this library wrote.")
    return size


def check_read(url: object, data: bytes, size: int) -> bytes:
    """``data`` read from ``url``, refused if it is not the ``size`` bytes the object held when it was measured."""
    if len(data) != size:
        raise CheckpointIntegrityError(f"{url} changed while it was read ({len(data)} bytes instead of {size}).")
    return bytes(data)


def missing_message(url: object, size: int, what: str) -> str:
    """The message of a download whose object (``what``: "object", "blob") the checkpoint lists and the store
    has not."""
    return (f"{url} does not exist: the checkpoint lists it ({size} bytes) but the object store has no such "
            f"{what}. The checkpoint is incomplete; restore from another one.")


def check_size(url: object, found: int | None, size: int, missing: str) -> None:
    """Refuse (:class:`CheckpointIntegrityError`) an object to download that is missing (``found`` is ``None``:
    ``missing`` is the message) or does not hold the ``size`` bytes the checkpoint lists."""
    if found is None:
        raise CheckpointIntegrityError(missing)
    if found != size:
        raise CheckpointIntegrityError(
            f"{url} holds {found} bytes where the checkpoint lists {size}: it was truncated, extended or "
            f"replaced. The checkpoint is damaged; restore from another one.")


def download_verified(url: object, local: Path, fetch: Callable[[Path], None], *, size: int, digest: str | None,
                      sync: bool) -> None:
    """Download through ``fetch(temporary)`` into a hidden temporary file beside ``local``
    (``.NAME.download-<id>``), hash it from that file, fsync it (unless ``sync=False``) and rename it onto ``local``
    only if it holds ``size`` bytes with the XXH3-128 ``digest`` (``None``: the size only); otherwise
    :class:`CheckpointIntegrityError` naming the URL. ``fetch`` raises the store's own errors, and
    :func:`local_failure` where the local side failed. On any failure the temporary file is removed: nothing is
    left under either name, and an existing ``local`` is untouched."""
    temporary = local.with_name(f".{local.name}.download-{uuid.uuid4().hex}")
    try:
        fetch(temporary)
        try:
            received, found_digest = hash_file(temporary, HASH, flush=sync)
        except CheckpointIntegrityError as exc:  # the downloaded file itself vanished or was replaced
            raise local_failure(url, local, exc) from exc
        if received != size or (digest is not None and found_digest != digest):
            raise CheckpointIntegrityError(
                f"{url} does not hold the content the checkpoint lists: {received} bytes with XXH3-128 "
                f"{found_digest}, expected {size} bytes with {digest}. It was altered or replaced; restore from "
                f"another checkpoint.")
        try:
            os.replace(temporary, local)
        except OSError as exc:
            raise local_failure(url, local, exc) from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def local_failure(url: object, local: Path, exc: BaseException) -> CheckpointError:
    """The error of a download that failed on the local side: the object store is not at fault."""
    return CheckpointError(
        f"Downloading {url} failed on the local disk, not in the object store: writing {local} failed ({exc}). The "
        f"local directory {local.parent} changed while it was written (another process removed it, e.g. a job "
        "sharing this cache directory) or the disk failed. Check the local disk and load again; give concurrent "
        "jobs separate cache directories (configure_checkpointing(accelerator, cache_dir=...)) if this repeats.")
