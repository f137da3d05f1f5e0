"""S3-compatible object storage: the primitives a checkpoint protocol without rename is built from.

An object store has no rename, no directory and no lock, so "complete or it does not exist" is rebuilt from what
it does offer (docs/storage.md):

* **Create-only writes.** :meth:`S3Store.write_new` is the commit of a manifest: one ``PutObject`` with
  ``If-None-Match: *``. The store accepts it only if no object of that key exists; a second writer gets
  :class:`~accelerate_txn.errors.CheckpointExistsError` and the first writer's content stays. The same condition
  is sent on ``CompleteMultipartUpload`` by :meth:`S3Store.upload_file` with ``create_only=True``.
* **Uploads hashed as they are sent.** :meth:`S3Store.upload_file` reads a local file once, hashes each part
  (XXH3-128, the manifest's hash) as it is handed to the client, and returns ``(size, digest)`` of exactly the
  bytes uploaded. Large files go as multipart uploads, parts in parallel; an upload that fails is aborted. One
  killed by ``kill -9`` stays open on the server, invisible to listings and reads, until
  :meth:`S3Store.abort_incomplete_uploads` removes it.
* **Downloads verified before they exist.** :meth:`S3Store.download_file` writes to a hidden temporary name beside
  the destination and renames it into place only after the size and the digest matched; otherwise it raises
  :class:`~accelerate_txn.errors.CheckpointIntegrityError` naming the URL and leaves nothing under either name.
* **Deletion commit key first.** :meth:`S3Store.delete_prefix` deletes the keys named in ``first`` (the manifest)
  one by one, each confirmed by the store, before it lists and deletes the rest, so a deletion cut short never
  leaves a checkpoint that looks complete.

Credentials, endpoint and region come only from the client library's own configuration (botocore's: the
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``
environment variables, ``~/.aws/config`` profiles, instance roles); this module defines no variable of its own.

The client is s3fs (fsspec), an optional dependency (``pip install 'accelerate-txn[s3]'``) imported when the
first :class:`S3Store` is created. It was chosen over obstore on measurement (docs/storage.md): both honour
``If-None-Match`` on a single ``PutObject``, but only s3fs sends it on ``CompleteMultipartUpload`` (obstore turns a
conditional put into one ``PutObject``, at most 5 GiB, held in memory) and only s3fs lists and aborts leftover
multipart uploads. The calls used are s3fs's public synchronous ones (``call_s3``, ``cat_file``, ``get_file``); the
parts of an upload run in a thread pool, each thread blocking on s3fs's own event loop. s3fs hands botocore only
the parameters botocore's S3 model knows and drops the rest without a word, so a botocore older than S3's
conditional writes (1.35.2) would turn every create-only write into an overwrite: the store checks the model
before its first conditional write and refuses such a client.

:class:`S3Store` implements :class:`.base.ObjectStore`; the checkpoint protocol on it (manifest last and
create-only, per-transaction keys, retention manifest first) is ``core.remote``'s.

Which process may call what is the caller's decision (the protocol's: rank 0 commits and deletes); nothing here
holds state between calls except the client. A failing call raises and leaves the store as the method's
docstring says.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import CheckpointConfigurationError, CheckpointExistsError, CheckpointIntegrityError
from ._object import (
    ObjectUrl,
    Progress,
    check_read,
    check_readable,
    check_size,
    chunk_size_for,
    chunks,
    digest_of,
    download_verified,
    exists_error,
    key_problem,
    local_failure,
    missing_message,
    read_head,
    upload_in_parallel,
)
from .base import require_clients

logger = logging.getLogger(__name__)

SCHEME = "s3://"
#: The smallest part S3 accepts in a multipart upload (every part but the last).
MIN_PART_SIZE = 5 * 2**20
#: At most this many parts in one multipart upload (S3's limit): larger files get larger parts.
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * 2**20
#: With the default part size, a file up to this size goes in one ``PutObject`` (s3fs sends up to 100 MiB so): one
#: request instead of a multipart upload's three or more, and nothing for the store to assemble.
DEFAULT_SINGLE_REQUEST_SIZE = 64 * 2**20
DEFAULT_CONCURRENCY = 8
#: Keys per ``DeleteObjects`` request (S3's limit).
_DELETE_BATCH = 1000
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]\Z")
_EXISTS_CODES = frozenset({"PreconditionFailed", "412"})
_CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "409"})


@dataclass(frozen=True)
class S3Url(ObjectUrl):
    """A location in S3: a bucket and a key (no leading or trailing slash; ``""`` is the bucket's root).

    As a prefix, ``s3://bucket/run/checkpoint_1`` holds the keys that start with ``run/checkpoint_1/`` (never
    those of ``run/checkpoint_10``)."""

    SCHEME = SCHEME
    ROOT = "bucket"
    bucket: str
    key: str = ""

    @classmethod
    def parse(cls, url: str | S3Url) -> S3Url:
        """Parse ``s3://BUCKET[/KEY]``; a trailing ``/`` is dropped. Refuses (``CheckpointConfigurationError``)
        anything else, and keys with empty, ``.`` or ``..`` segments, ``?`` or ``#`` (s3fs reads ``?versionId=``)
        or control characters: each would name another object than the one the user sees."""
        if isinstance(url, S3Url):
            return url
        if not isinstance(url, str) or not url.startswith(SCHEME):
            raise CheckpointConfigurationError(
                f"Not an S3 URL: {url!r}. Expected s3://BUCKET/PREFIX, e.g. s3://my-bucket/run/checkpoint_1.")
        bucket, _, key = url[len(SCHEME):].partition("/")
        key = key.rstrip("/")
        if not _BUCKET.match(bucket):
            raise CheckpointConfigurationError(
                f"{url!r} does not name a valid bucket ({bucket!r}): a bucket name has 3 to 63 letters, digits, "
                f"dots, hyphens or underscores. Expected s3://BUCKET/PREFIX.")
        problem = key_problem(key, "?#", len(key.encode()), "S3's 1024 bytes")
        if problem is not None:
            raise CheckpointConfigurationError(f"The key of {url!r} {problem}; name the object plainly, e.g. "
                                               f"s3://{bucket}/run/checkpoint_1.")
        return cls(bucket, key)


@dataclass(frozen=True)
class IncompleteUpload:
    """A multipart upload that was started and neither completed nor aborted: invisible to reads and listings,
    but stored (and billed) until aborted."""

    url: S3Url
    upload_id: str
    initiated: datetime | None


def _import_s3fs() -> Any:
    try:
        import s3fs
    except ImportError as exc:
        raise CheckpointConfigurationError(
            "Checkpoints in S3 (s3:// URLs) need the s3fs client, which is not installed here: "
            "pip install 'accelerate-txn[s3]'") from exc
    return s3fs


def _s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs exception (s3fs raises a built-in exception whose ``__cause__`` is
    botocore's ``ClientError``, which carries the parsed response)."""
    for error in (exc, exc.__cause__, exc.__context__):
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            return None if code is None else str(code)
    return None


def part_size_for(size: int, part_size: int) -> int:
    """The part size to upload ``size`` bytes with: ``part_size``, grown in whole MiB where the file would
    otherwise need more than :data:`MAX_PARTS` parts."""
    return chunk_size_for(size, part_size, MAX_PARTS)


class S3Store:
    """Operations on S3-compatible storage through s3fs; see the module docstring for each one's guarantee.

    ``part_size``: the size of each part of a multipart upload (at least :data:`MIN_PART_SIZE`).
    ``single_request_size``: a file up to this size goes in one ``PutObject``, held in memory whole; by default
    :data:`DEFAULT_SINGLE_REQUEST_SIZE` with the default part size, else ``part_size``. ``concurrency``: parts of
    one upload in flight at once; an upload holds about ``concurrency + 2`` parts in memory. Downloads use s3fs's
    own parallel ranged reads. ``filesystem``: an ``s3fs.S3FileSystem`` configured by the caller; by default one
    configured from the standard AWS environment and profiles.
    """

    name = "s3"

    def __init__(self, *, part_size: int = DEFAULT_PART_SIZE, concurrency: int = DEFAULT_CONCURRENCY,
                 filesystem: Any = None, single_request_size: int | None = None) -> None:
        if part_size < MIN_PART_SIZE:
            raise CheckpointConfigurationError(
                f"part_size={part_size} is below S3's minimum part size of {MIN_PART_SIZE} bytes (5 MiB).")
        if concurrency < 1:
            raise CheckpointConfigurationError(f"concurrency={concurrency}: at least 1 request must be in flight.")
        require_clients("s3", "the S3 store (s3:// URLs)")
        if filesystem is None:
            # No instance cache: an S3FileSystem resolves the endpoint and credentials when it is created, and the
            # environment may have changed since fsspec cached one. No listings cache: listings must be fresh.
            filesystem = _import_s3fs().S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        self.fs = filesystem
        self.part_size = part_size
        if single_request_size is None:
            single_request_size = DEFAULT_SINGLE_REQUEST_SIZE if part_size == DEFAULT_PART_SIZE else part_size
        self.single_request_size = max(part_size, single_request_size)
        self.concurrency = concurrency
        self._conditions_checked = False

    def _require_conditional_writes(self) -> None:
        """Refuse a client that would drop ``IfNoneMatch``: s3fs passes botocore only the parameters its service
        model knows and silently drops the others, so with a botocore older than S3's conditional writes (August
        2024) a create-only write would overwrite without a word."""
        if self._conditions_checked:
            return
        model = self.fs.s3.meta.service_model
        missing = [operation for operation in ("PutObject", "CompleteMultipartUpload")
                   if "IfNoneMatch" not in model.operation_model(operation).input_shape.members]
        if missing:
            raise CheckpointConfigurationError(
                f"The installed botocore does not know S3's conditional writes (IfNoneMatch on {', '.join(missing)}), "
                f"so s3fs would drop the condition and a create-only write could overwrite another writer's "
                f"checkpoint. Upgrade the client: pip install -U 'accelerate-txn[s3]' s3fs aiobotocore botocore")
        self._conditions_checked = True

    def _call(self, method: str, url: S3Url, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, Bucket=url.bucket, **kwargs)

    # -- writes ------------------------------------------------------------------------------------------------

    def write_new(self, url: str | S3Url, data: bytes) -> None:
        """Create the object ``url`` holding exactly ``data`` (the commit of a manifest), or raise leaving the
        store as it was. If ``url`` exists, raises :class:`CheckpointExistsError` and its content stays, unless it
        already holds exactly ``data``: then this writer's own earlier request landed (a retry after a lost
        response) and the call succeeds. A manifest names its transaction, so two writers never write equal
        bytes."""
        url = S3Url.parse(url)
        self._require_conditional_writes()
        try:
            self._call("put_object", url, Key=url.key, Body=data, IfNoneMatch="*")
        except Exception as exc:
            code = _s3_error_code(exc)
            if code in _CONFLICT_CODES:
                raise CheckpointExistsError(
                    f"{url} is being written by another writer at this moment, so this one was refused and nothing "
                    f"was written. Two saves are using one name: give each its own output location.") from exc
            if code not in _EXISTS_CODES and not isinstance(exc, FileExistsError):
                raise
            if self._holds(url, data):
                return
            raise exists_error(url) from exc

    def _holds(self, url: S3Url, data: bytes) -> bool:
        size = self.size(url)
        return size == len(data) and (size == 0 or self.fs.cat_file(str(url), start=0, end=size) == data)

    def upload_file(self, local: str | os.PathLike[str], url: str | S3Url, *, create_only: bool = False,
                    progress: Progress | None = None) -> tuple[int, str]:
        """Upload the local file ``local`` to ``url``; return ``(size, XXH3-128 hex digest)`` of the bytes sent.

        The file is read once, sequentially; each part is hashed as it is handed to the client. A file larger
        than ``single_request_size`` goes as a multipart upload with up to ``concurrency`` parts in flight; the
        object appears only when the upload completes. If anything fails the upload is aborted and the error raised
        (the key is as it was). A process killed mid-upload leaves an incomplete upload and no object
        (:meth:`abort_incomplete_uploads`). ``create_only``: refuse (:class:`CheckpointExistsError`, the existing
        object kept) if ``url`` exists when the upload completes. ``progress``: called with the bytes
        acknowledged so far after each part.
        """
        url = S3Url.parse(url)
        if create_only:
            self._require_conditional_writes()
        with open(local, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            part_size = part_size_for(size, self.part_size)
            # One PutObject up to single_request_size (a file grown since fstat goes as a multipart upload).
            first, second = read_head(stream, size, part_size, self.single_request_size)
            if not second:  # one part: a single PutObject
                condition = {"IfNoneMatch": "*"} if create_only else {}
                digest = digest_of(first)
                try:
                    self._call("put_object", url, Key=url.key, Body=first, **condition)
                except Exception as exc:
                    self._raise_exists_if_so(exc, url)
                    raise
                if progress is not None:
                    progress(len(first))
                return len(first), digest
            return self._upload_multipart(stream, [first, second], url, part_size, create_only, progress)

    def _upload_multipart(self, stream: Any, head: list[bytes], url: S3Url, part_size: int, create_only: bool,
                          progress: Progress | None) -> tuple[int, str]:
        upload_id = self._call("create_multipart_upload", url, Key=url.key)["UploadId"]
        try:
            etags: dict[int, str] = {}

            def send(number: int, part: bytes) -> int:
                reply = self._call("upload_part", url, Key=url.key, UploadId=upload_id, PartNumber=number + 1,
                                   Body=part)
                etags[number + 1] = reply["ETag"]
                return len(part)

            acknowledged, digest = upload_in_parallel(chunks(stream, head, part_size), send,
                                                      concurrency=self.concurrency,
                                                      thread_name_prefix="accelerate-txn-s3", progress=progress)
            parts = [{"PartNumber": number, "ETag": etags[number]} for number in sorted(etags)]
            condition = {"IfNoneMatch": "*"} if create_only else {}
            try:
                self._call("complete_multipart_upload", url, Key=url.key, UploadId=upload_id,
                           MultipartUpload={"Parts": parts}, **condition)
            except Exception as exc:
                self._raise_exists_if_so(exc, url)
                raise
        except BaseException:
            self._abort_quietly(url, upload_id)
            raise
        return acknowledged, digest

    def _raise_exists_if_so(self, exc: Exception, url: S3Url) -> None:
        code = _s3_error_code(exc)
        if code in _EXISTS_CODES or code in _CONFLICT_CODES or isinstance(exc, FileExistsError):
            raise CheckpointExistsError(
                f"{url} already exists or is being written by another writer; the upload was refused and the "
                f"existing object left as it is. Give each save its own output location.") from exc

    def _abort_quietly(self, url: S3Url, upload_id: str) -> None:
        try:
            self._call("abort_multipart_upload", url, Key=url.key, UploadId=upload_id)
        except Exception as exc:  # the upload's own error is the one to raise; this one is only left behind
            logger.warning("Aborting the multipart upload %s of %s failed (%s); abort_incomplete_uploads removes it",
                           upload_id, url, exc)

    # -- reads -------------------------------------------------------------------------------------------------

    def size(self, url: str | S3Url) -> int | None:
        """The size of the object ``url`` in bytes; ``None`` if there is none."""
        url = S3Url.parse(url)
        try:
            return int(self._call("head_object", url, Key=url.key)["ContentLength"])
        except FileNotFoundError:
            return None

    def read_bytes(self, url: str | S3Url, *, limit: int) -> bytes:
        """The content of the object ``url``, refused (:class:`CheckpointIntegrityError`) if it is missing or
        larger than ``limit`` bytes (a manifest is read bounded)."""
        url = S3Url.parse(url)
        size = check_readable(url, self.size(url), limit)
        return check_read(url, self.fs.cat_file(str(url), start=0, end=size) if size else b"", size)

    def list(self, url: str | S3Url) -> dict[str, int]:
        """Every object under ``url`` (keys starting with ``url``'s key and ``/``): its key relative to ``url``
        mapped to its size. Incomplete multipart uploads are not objects and are not listed."""
        url = S3Url.parse(url)
        found: dict[str, int] = {}
        token: dict[str, str] = {}
        while True:
            reply = self._call("list_objects_v2", url, Prefix=url.prefix, **token)
            for entry in reply.get("Contents", []):
                key = entry["Key"]
                if key.startswith(url.prefix) and key != url.prefix:  # the prefix filter is the server's: check it
                    found[key[len(url.prefix):]] = int(entry["Size"])
            if not reply.get("IsTruncated"):
                return found
            token = {"ContinuationToken": reply["NextContinuationToken"]}

    def download_file(self, url: str | S3Url, local: str | os.PathLike[str], *, size: int,
                      digest: str | None, sync: bool = True, listed: bool = False) -> None:
        """Download ``url`` to the local file ``local`` if it holds exactly ``size`` bytes with the XXH3-128
        ``digest`` (``None``: the size only, for a checkpoint saved with ``checksum="metadata"``); otherwise raise
        :class:`CheckpointIntegrityError` naming the URL.

        The object's size is checked first (a wrong one is refused before anything is downloaded), unless the caller
        has just checked it in a listing (``listed``: one request fewer per file; the size is still checked after the
        download). The bytes go to a hidden temporary file beside ``local`` (``.NAME.download-<id>``) through s3fs's
        own download (ranged reads in parallel for large objects), are hashed from that file (in the page cache),
        fsynced (unless ``sync=False``: a copy whose every byte is verified again before use need not survive a power
        loss), and renamed onto ``local`` only after both checks passed. On any failure the temporary file is
        removed: nothing is left under either name, and an existing ``local`` is untouched."""
        url = S3Url.parse(url)
        local = Path(local)
        missing = missing_message(url, size, "object")
        if not listed:
            check_size(url, self.size(url), size, missing)

        def fetch(temporary: Path) -> None:
            try:
                self.fs.get_file(str(url), str(temporary))
            except FileNotFoundError as exc:
                if _local_side(exc, temporary):
                    raise local_failure(url, local, exc) from exc
                raise CheckpointIntegrityError(missing) from None
            if not temporary.is_file():  # the local directory went away under the download
                raise local_failure(url, local, FileNotFoundError(2, "No such file or directory", str(temporary)))

        download_verified(url, local, fetch, size=size, digest=digest, sync=sync)

    # -- deletion and leftovers --------------------------------------------------------------------------------

    def delete_prefix(self, url: str | S3Url, *, first: Sequence[str] = ()) -> int:
        """Delete every object under ``url``; return how many were listed for deletion (``first`` not counted).

        The keys in ``first`` (relative to ``url``: pass the manifest) are deleted before anything else, one
        request each, in order, each acknowledged by the store before the next request. Only then are the other
        objects listed and deleted in batches. A deletion cut short at any instant therefore leaves either the
        complete checkpoint or one without its manifest, which is never complete. Missing keys are not an error.
        Incomplete multipart uploads are not touched (:meth:`abort_incomplete_uploads`)."""
        url = S3Url.parse(url)
        for relative in first:
            self._call("delete_object", url, Key=url.child(relative).key)
        keys = [url.prefix + relative for relative in self.list(url)]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start:start + _DELETE_BATCH]
            reply = self._call("delete_objects", url, Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True})
            errors = reply.get("Errors") or []
            if errors:
                shown = ", ".join(f"{error.get('Key')} ({error.get('Code')})" for error in errors[:5])
                raise OSError(f"Deleting under {url} failed for {len(errors)} object(s): {shown}; run the deletion "
                              f"again (its manifest is already gone, so the checkpoint is not complete).")
        return len(keys)

    def delete(self, url: str | S3Url) -> None:
        """Delete the object ``url``; returns after the store acknowledged it. A missing object is not an error."""
        url = S3Url.parse(url)
        self._call("delete_object", url, Key=url.key)

    def incomplete_uploads(self, url: str | S3Url) -> list[str]:
        """Keys under ``url`` (relative to it) with a multipart upload started and never completed nor aborted."""
        url = S3Url.parse(url)
        return sorted({upload.url.key[len(url.prefix):] for upload in self.list_incomplete_uploads(url)})

    def list_incomplete_uploads(self, url: str | S3Url) -> list[IncompleteUpload]:
        """The multipart uploads under ``url`` that were started and never completed nor aborted."""
        url = S3Url.parse(url)
        found = []
        markers: dict[str, str] = {}
        while True:
            reply = self._call("list_multipart_uploads", url, Prefix=url.prefix, **markers)
            for upload in reply.get("Uploads", []):
                key = upload["Key"]
                if key.startswith(url.prefix):  # the prefix filter is the server's: check it
                    found.append(IncompleteUpload(S3Url(url.bucket, key), upload["UploadId"], upload.get("Initiated")))
            if not reply.get("IsTruncated"):
                return found
            markers = {"KeyMarker": reply["NextKeyMarker"], "UploadIdMarker": reply["NextUploadIdMarker"]}

    def abort_incomplete_uploads(self, url: str | S3Url) -> list[IncompleteUpload]:
        """Abort every incomplete multipart upload under ``url``; return those aborted. Only for leftovers: an
        upload still in progress (a live writer's) fails when aborted, so the caller must know that none is."""
        aborted = []
        for upload in self.list_incomplete_uploads(url):
            try:
                self._call("abort_multipart_upload", upload.url, Key=upload.url.key, UploadId=upload.upload_id)
            except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
                continue
            aborted.append(upload)
        return aborted


def _local_side(exc: OSError, temporary: Path) -> bool:
    """Whether a ``FileNotFoundError`` of a download is the local side's (the file or directory it writes into
    is missing), not the object store's (no such key)."""
    if exc.filename is not None and str(exc.filename) == str(temporary):
        return True
    return not temporary.parent.is_dir()
