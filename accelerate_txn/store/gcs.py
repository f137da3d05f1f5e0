"""Google Cloud Storage: the same primitives as ``store.s3`` and ``store.azure``, from what GCS offers.

An object store has no rename, no directory and no lock; "complete or it does not exist" is rebuilt as on S3
(docs/storage.md):

* **Create-only writes.** :meth:`GcsStore.write_new` is the commit of a manifest: one single-request upload (the
  JSON API's ``uploadType=multipart``: metadata and bytes in one request) with ``ifGenerationMatch=0``. GCS accepts
  it only if no live object of that name exists; a second writer gets ``412 Precondition Failed``, raised as
  :class:`~accelerate_txn.errors.CheckpointExistsError`, and the first writer's content stays. The commit is never a
  resumable upload: the client sends one request only up to :data:`SINGLE_REQUEST_LIMIT` (8 MiB), and a larger
  commit is refused before anything is sent (a manifest that large would list tens of thousands of files).
* **Uploads hashed as they are sent.** :meth:`GcsStore.upload_file` reads a local file once and hashes each chunk
  (XXH3-128, the manifest's hash) as it is handed to the client. A file up to ``single_request_size`` goes in one
  request; a larger one as a resumable upload, chunk after chunk (GCS appends a resumable upload's chunks in order:
  the parallelism is the files uploaded at once, ``core.remote.FILES_IN_FLIGHT``), and the object appears only when
  the last chunk is acknowledged. ``create_only=True`` sends ``ifGenerationMatch=0`` on either kind; the protocol
  relies on it for the manifest only (payloads have keys of their own transaction), and the emulator the tests use
  (fake-gcs-server) honours it on single-request uploads only, not on resumable ones.
* **Downloads verified before they exist.** :meth:`GcsStore.download_file` writes one streamed read (the client
  pins its retries to the object's generation) to a hidden temporary name beside the destination and renames it
  into place only after size and digest matched; otherwise :class:`~accelerate_txn.errors.CheckpointIntegrityError`
  naming the URL, and nothing is left under either name. :meth:`GcsStore.read_bytes` reads the generation whose
  size it checked (``ifGenerationMatch``): a manifest replaced meanwhile is refused, never mixed.
* **Deletion commit key first.** :meth:`GcsStore.delete_prefix` deletes the keys of ``first`` (the manifest) one by
  one, each acknowledged, before it lists and deletes the rest.
* **Leftovers of a killed writer.** A resumable upload cut short is no object: reads and listings do not see it,
  GCS has no request that lists open upload sessions, and it discards them a week after they started.
  :meth:`GcsStore.incomplete_uploads` and :meth:`GcsStore.abort_incomplete_uploads` therefore find and remove
  nothing; what a killed writer left that is visible (the objects it completed under its ``.txn-`` prefix) is
  removed by ``core.remote`` as on the other stores. A failed upload in a live process is abandoned without ever
  finalizing it: google-cloud-storage's ``BlobWriter`` commits the bytes written so far as the whole object when it
  is closed, and ``io`` closes it when it is garbage-collected (measured with google-cloud-storage 3.17.1: an
  abandoned 1 MiB + 500 byte writer became an object of 1 MiB + 500 bytes), so the store's writer refuses to
  finalize once abandoned.

URLs are ``gs://BUCKET/PREFIX`` (the form gcloud, gcsfs and obstore read). The credentials come from the standard
Google chain and from no variable of ours: Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, a
key file; ``gcloud auth application-default login``; the service account attached to a GCE VM, GKE pod or Cloud
Run service). ``STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:4443``) points the client at an emulator, with
anonymous credentials, as google-cloud-storage itself reads it. No project is needed: objects are addressed by
bucket.

The client is google-cloud-storage (Google's SDK, synchronous), an optional dependency (``pip install
'accelerate-txn[gcs]'``) imported when the first :class:`GcsStore` is created. Its errors are raised as the
library's own where they have a fix to name: a missing bucket and refused credentials as
:class:`~accelerate_txn.errors.CheckpointConfigurationError`, an endpoint that cannot be reached (after the client's
own retries, ``retry_timeout`` seconds) as :class:`~accelerate_txn.errors.CheckpointError`, each naming the URL.

:class:`GcsStore` implements :class:`.base.ObjectStore`; the checkpoint protocol on it is ``core.remote``'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ..errors import CheckpointConfigurationError, CheckpointError, CheckpointExistsError, CheckpointIntegrityError
from ._object import (
    ObjectUrl,
    Progress,
    check_read,
    check_readable,
    check_size,
    chunks,
    digest_of,
    download_verified,
    exists_error,
    key_problem,
    local_failure,
    missing_message,
    read_head,
)
from .base import HASH, new_hasher, require_clients

logger = logging.getLogger(__name__)

SCHEME = "gs://"
#: A resumable upload's chunks are a multiple of this size (GCS's rule), except the last.
CHUNK_MULTIPLE = 256 * 2**10
DEFAULT_CHUNK_SIZE = 16 * 2**20
#: The most google-cloud-storage sends in one request: a larger upload is a resumable one (several requests).
SINGLE_REQUEST_LIMIT = 8 * 2**20
DEFAULT_CONCURRENCY = 8
#: Seconds the client retries a request that failed transiently (its own default deadline).
DEFAULT_RETRY_TIMEOUT = 120.0
#: The standard variables the client is configured from (Google's, read by google-auth and google-cloud-storage).
ENVIRONMENT = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT")
_CONTENT_TYPE = "application/octet-stream"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]\Z")
#: Characters refused in object names: ``?`` and ``#`` end a URL's path; gcloud reads ``*``, ``[`` and ``]`` as
#: wildcards, so such a name cannot be given to it plainly.
_FORBIDDEN = "?#*[]"


def _bucket_problem(bucket: str) -> str | None:
    """What is wrong with a bucket name (``None``: nothing), by GCS's naming rules."""
    if not _BUCKET.match(bucket):
        return ("a bucket name has 3 to 63 lowercase letters, digits, hyphens, underscores and dots (up to 222 with "
                "dots), starting and ending with a letter or digit")
    parts = bucket.split(".")
    if (len(parts) == 1 and len(bucket) > 63) or any(not part or len(part) > 63 for part in parts):
        return "a bucket name has at most 63 characters, or dot-separated parts of 1 to 63 characters each"
    if bucket.startswith("goog") or "google" in bucket or "g00gle" in bucket:
        return "a bucket name cannot start with 'goog' or contain 'google'"
    return None


@dataclass(frozen=True)
class GcsUrl(ObjectUrl):
    """A location in Google Cloud Storage: a bucket and an object name (no leading or trailing slash; ``""`` is the
    bucket's root). As a prefix, ``gs://b/run/checkpoint_1`` holds the names starting with ``run/checkpoint_1/``."""

    SCHEME = SCHEME
    ROOT = "bucket"
    bucket: str
    key: str = ""

    @classmethod
    def parse(cls, url: str | GcsUrl) -> GcsUrl:
        """Parse ``gs://BUCKET[/NAME]``; a trailing ``/`` is dropped. Refuses (``CheckpointConfigurationError``)
        anything else, bucket names GCS refuses, and object names with empty, ``.`` or ``..`` segments, ``?``, ``#``,
        ``*``, ``[``, ``]`` or control characters: each would name another object than the one the user sees."""
        if isinstance(url, GcsUrl):
            return url
        if not isinstance(url, str) or not url.startswith(SCHEME):
            raise CheckpointConfigurationError(
                f"Not a Google Cloud Storage URL: {url!r}. Expected gs://BUCKET/PREFIX, e.g. "
                f"gs://my-bucket/run/checkpoint_1.")
        bucket, _, key = url[len(SCHEME):].partition("/")
        key = key.rstrip("/")
        problem = _bucket_problem(bucket)
        if problem is not None:
            raise CheckpointConfigurationError(
                f"{url!r} does not name a valid bucket ({bucket!r}): {problem}. Expected gs://BUCKET/PREFIX.")
        problem = key_problem(key, _FORBIDDEN, len(key.encode()), "GCS's 1024 bytes")
        if problem is not None:
            raise CheckpointConfigurationError(f"The object name of {url!r} {problem}; name the object plainly, e.g. "
                                               f"gs://{bucket}/run/checkpoint_1.")
        return cls(bucket, key)


@dataclass(frozen=True)
class _Sdk:
    """The parts of the client libraries the store uses, imported when the first store is created."""

    storage: Any
    api: Any  # google.api_core.exceptions
    auth: Any  # google.auth.exceptions
    invalid_response: type[BaseException]
    writer: type[Any]
    default_retry: Any


@functools.lru_cache(maxsize=1)
def _import_sdk() -> _Sdk:
    try:
        from google.api_core import exceptions as api
        from google.auth import exceptions as auth
        from google.cloud import storage
        from google.cloud.storage.exceptions import InvalidResponse
        from google.cloud.storage.fileio import BlobWriter
        from google.cloud.storage.retry import DEFAULT_RETRY
    except ImportError as exc:
        raise CheckpointConfigurationError(
            "Checkpoints in Google Cloud Storage (gs:// URLs) need the google-cloud-storage client, which is not "
            "installed here: pip install 'accelerate-txn[gcs]'") from exc

    class Writer(BlobWriter):
        """A resumable upload that, once abandoned, is never finalized: ``BlobWriter.close`` (which ``io`` also calls
        when the object is collected) would commit the bytes written so far as the whole object."""

        abandoned = False

        def close(self) -> None:
            if not self.abandoned:
                super().close()

    return _Sdk(storage, api, auth, InvalidResponse, Writer, DEFAULT_RETRY)


def client_from_environment() -> Any:
    """A ``google.cloud.storage.Client`` with the standard Google credentials (module docstring); no project."""
    sdk = _import_sdk()
    try:
        # project=None: bound to no project (objects are addressed by bucket), so a user's credentials without a
        # default project work too. The credentials are Application Default Credentials, or anonymous ones where
        # STORAGE_EMULATOR_HOST is set.
        return sdk.storage.Client(project=None)
    except sdk.auth.DefaultCredentialsError as exc:
        raise CheckpointConfigurationError(
            f"No Google Cloud credentials were found for gs:// URLs ({exc}). Set up Application Default "
            f"Credentials: 'gcloud auth application-default login', or GOOGLE_APPLICATION_CREDENTIALS=/path/to/key.json, "
            f"or run where a service account is attached (GCE, GKE, Cloud Run); for an emulator set "
            f"STORAGE_EMULATOR_HOST=http://HOST:PORT.") from exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it (a ``RetryError``'s last error, ``__cause__``, ``__context__``), once each."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop(0)
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        pending.extend(cause for cause in (getattr(error, "cause", None), error.__cause__, error.__context__)
                       if isinstance(cause, BaseException))


class _LocalFile:
    """The local file a download writes into; remembers a failure of the local side (the client's own network
    errors are ``OSError`` too)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return int(self.stream.write(data))
        except OSError as exc:
            self.failed = exc
            raise


class GcsStore:
    """Operations on Google Cloud Storage through google-cloud-storage; see the module docstring for each guarantee.

    ``chunk_size``: the size of each request of a resumable upload (a multiple of 256 KiB; an upload holds about two
    chunks in memory). ``single_request_size``: a file up to this size goes in one request, held in memory whole (by
    default and at most :data:`SINGLE_REQUEST_LIMIT`, and at most ``chunk_size``). ``concurrency``: deletions in
    flight at once. ``retry_timeout``: seconds the client retries a request that failed transiently (a 429, a 5xx, a
    connection error) before the store gives up. ``client``: a ``google.cloud.storage.Client`` configured by the
    caller; by default one with the standard Google credentials.
    """

    name = "gcs"

    def __init__(self, *, chunk_size: int = DEFAULT_CHUNK_SIZE, concurrency: int = DEFAULT_CONCURRENCY,
                 client: Any = None, single_request_size: int | None = None,
                 retry_timeout: float = DEFAULT_RETRY_TIMEOUT) -> None:
        if chunk_size < CHUNK_MULTIPLE or chunk_size % CHUNK_MULTIPLE:
            raise CheckpointConfigurationError(
                f"chunk_size={chunk_size}: a resumable upload's chunk is a multiple of {CHUNK_MULTIPLE} bytes (256 KiB).")
        if concurrency < 1:
            raise CheckpointConfigurationError(f"concurrency={concurrency}: at least 1 request must be in flight.")
        if not retry_timeout > 0:
            raise CheckpointConfigurationError(f"retry_timeout={retry_timeout}: give the client some seconds to retry.")
        require_clients("gcs", "the Google Cloud Storage store (gs:// URLs)")
        self._sdk = _import_sdk()
        self.client = client if client is not None else client_from_environment()
        self.chunk_size = chunk_size
        wanted = SINGLE_REQUEST_LIMIT if single_request_size is None else single_request_size
        self.single_request_size = max(0, min(wanted, SINGLE_REQUEST_LIMIT, chunk_size))
        self.concurrency = concurrency
        self.retry_timeout = retry_timeout
        self.retry = self._sdk.default_retry.with_timeout(retry_timeout)
        self._buckets: set[str] = set()  # buckets seen to exist: a 404 in them is the object's

    def _blob(self, url: GcsUrl) -> Any:
        return self.client.bucket(url.bucket).blob(url.key)

    def _status(self, exc: BaseException) -> int | None:
        """The HTTP status of a failed request of the client, else ``None``: its API errors carry it as ``code``, the
        errors of its upload sessions (``InvalidResponse``: a resumable upload's) on their response."""
        if isinstance(exc, self._sdk.api.GoogleAPICallError):
            return exc.code if isinstance(exc.code, int) else None
        if isinstance(exc, self._sdk.invalid_response):
            status = getattr(getattr(exc, "response", None), "status_code", None)
            return status if isinstance(status, int) else None
        return None

    # -- errors ------------------------------------------------------------------------------------------------

    def _endpoint(self) -> str:
        endpoint = getattr(self.client, "api_endpoint", None)
        return str(endpoint) if endpoint else "https://storage.googleapis.com"

    def _no_bucket(self, url: GcsUrl) -> CheckpointConfigurationError:
        return CheckpointConfigurationError(
            f"{url}: the bucket {url.bucket!r} does not exist at {self._endpoint()}. Create it (gcloud storage buckets "
            f"create gs://{url.bucket}) or correct the URL.")

    def _client_failure(self, exc: BaseException, url: GcsUrl) -> CheckpointError | None:
        """The library's error for a failure of the client that has a fix to name (credentials, permissions, an
        endpoint out of reach), else ``None``."""
        api, auth = self._sdk.api, self._sdk.auth
        for error in _chain(exc):
            if isinstance(error, auth.DefaultCredentialsError):
                return CheckpointConfigurationError(
                    f"No Google Cloud credentials for {url} ({error}). Set up Application Default Credentials: "
                    f"'gcloud auth application-default login', GOOGLE_APPLICATION_CREDENTIALS=/path/to/key.json, or a "
                    f"service account attached to the machine; for an emulator set STORAGE_EMULATOR_HOST.")
            if isinstance(error, auth.RefreshError) or self._status(error) in (401, 403):
                return CheckpointConfigurationError(
                    f"Google Cloud Storage refused access to {url}: {_short(error)}. The Application Default "
                    f"Credentials (GOOGLE_APPLICATION_CREDENTIALS, 'gcloud auth application-default login', or the "
                    f"machine's service account) are invalid, expired, or lack permission on the bucket "
                    f"{url.bucket!r}: reading needs storage.objects.get and storage.objects.list, saving also "
                    f"storage.objects.create and storage.objects.delete (roles/storage.objectAdmin has them).")
        for error in _chain(exc):
            network = isinstance(error, (auth.TransportError, ConnectionError, TimeoutError)) or (
                isinstance(error, OSError) and type(error).__module__.split(".")[0] in ("requests", "urllib3"))
            if network or isinstance(error, api.RetryError):
                return CheckpointError(
                    f"Google Cloud Storage at {self._endpoint()} could not be reached or kept failing for {url} "
                    f"(retried for {self.retry_timeout:g} s): {_short(error)}. Check the network and the endpoint "
                    f"(STORAGE_EMULATOR_HOST points the client at an emulator), then try again.")
        return None

    def _reraise(self, exc: BaseException, url: GcsUrl) -> NoReturn:
        error = self._client_failure(exc, url)
        if error is None:
            raise exc
        raise error from exc

    @contextlib.contextmanager
    def _failures(self, url: GcsUrl, *, writing: bool = False) -> Iterator[None]:
        """Raise the client's errors as the library's (``_client_failure``); ``writing``: a 404 may mean no bucket
        (checked: a resumable upload's session that expired is a 404 too) and a 412 that the object exists (the
        precondition ``ifGenerationMatch=0`` failed)."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            status = self._status(exc)
            if writing and status == 404:
                self._require_bucket(url)
            if writing and status == 412:
                raise CheckpointExistsError(
                    f"{url} already exists (another writer committed it first); the upload was refused and the "
                    f"existing object left as it is. Give each save its own output location.") from exc
            self._reraise(exc, url)

    def _require_bucket(self, url: GcsUrl) -> None:
        """Raise the missing bucket's error if ``url``'s bucket does not exist (once per bucket: a 404 of an object
        read is ambiguous, GCS answers it for a missing bucket too)."""
        if url.bucket in self._buckets:
            return
        with self._failures(url):
            try:
                next(iter(self.client.list_blobs(url.bucket, max_results=1, retry=self.retry)), None)
            except self._sdk.api.NotFound as exc:
                raise self._no_bucket(url) from exc
        self._buckets.add(url.bucket)

    # -- writes ------------------------------------------------------------------------------------------------

    def write_new(self, url: str | GcsUrl, data: bytes) -> None:
        """Create the object ``url`` holding exactly ``data`` (the commit of a manifest) in one request, or raise
        leaving the store as it was. If ``url`` exists, raises :class:`CheckpointExistsError` and its content stays,
        unless it already holds exactly ``data`` (this writer's own earlier request landed): then the call succeeds.
        ``data`` over :data:`SINGLE_REQUEST_LIMIT` is refused before anything is sent: the client would send it as a
        resumable upload, whose precondition the emulator the tests run on does not honour."""
        url = GcsUrl.parse(url)
        if len(data) > SINGLE_REQUEST_LIMIT:
            raise CheckpointConfigurationError(
                f"{url}: a create-only commit of {len(data)} bytes is more than the {SINGLE_REQUEST_LIMIT} bytes "
                f"(8 MiB) the Google Cloud Storage store sends in one request; nothing was written. A manifest this "
                f"large lists tens of thousands of files: save fewer, larger files.")
        try:
            with self._failures(url, writing=True):
                self._put(url, data, create_only=True)
        except CheckpointExistsError as exc:
            if self._holds(url, data):
                return
            raise exists_error(url) from exc

    def _put(self, url: GcsUrl, data: bytes, *, create_only: bool) -> None:
        # At most SINGLE_REQUEST_LIMIT bytes: the client sends them in one request (uploadType=multipart).
        condition = {"if_generation_match": 0} if create_only else {}
        self._blob(url).upload_from_string(data, content_type=_CONTENT_TYPE, retry=self.retry, **condition)

    def _holds(self, url: GcsUrl, data: bytes) -> bool:
        try:
            return self.size(url) == len(data) and self.read_bytes(url, limit=len(data)) == data
        except CheckpointIntegrityError:
            return False

    def upload_file(self, local: str | os.PathLike[str], url: str | GcsUrl, *, create_only: bool = False,
                    progress: Progress | None = None) -> tuple[int, str]:
        """Upload the local file ``local`` to ``url``; return ``(size, XXH3-128 hex digest)`` of the bytes sent.

        The file is read once, sequentially; each chunk is hashed as it is handed to the client. A file larger than
        ``single_request_size`` goes as a resumable upload, one chunk after the other, and appears only when its last
        chunk is acknowledged. If anything fails the upload is abandoned unfinished (no object; GCS discards the
        session after a week) and the error raised; so is one whose process is killed. ``create_only``: send
        ``ifGenerationMatch=0`` (refused with :class:`CheckpointExistsError`, the existing object kept, where the
        server honours it: see the module docstring). ``progress``: called with the bytes acknowledged so far after
        each chunk."""
        url = GcsUrl.parse(url)
        with open(local, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            first, second = read_head(stream, size, self.chunk_size, self.single_request_size)
            if not second and len(first) <= self.single_request_size:  # one request
                digest = digest_of(first)
                with self._failures(url, writing=True):
                    self._put(url, first, create_only=create_only)
                if progress is not None:
                    progress(len(first))
                return len(first), digest
            return self._upload_resumable(stream, [first, second] if second else [first], url, create_only, progress)

    def _upload_resumable(self, stream: Any, head: list[bytes], url: GcsUrl, create_only: bool,
                          progress: Progress | None) -> tuple[int, str]:
        condition = {"if_generation_match": 0} if create_only else {}
        writer = self._sdk.writer(self._blob(url), chunk_size=self.chunk_size, ignore_flush=True, retry=self.retry,
                                  content_type=_CONTENT_TYPE, **condition)
        hasher = new_hasher(HASH)
        written = acknowledged = 0
        with self._failures(url, writing=True):
            try:
                for chunk in chunks(stream, head, self.chunk_size):
                    hasher.update(chunk)
                    writer.write(chunk)  # sends every whole chunk buffered before it returns
                    written += len(chunk)
                    del chunk
                    sent = written - written % self.chunk_size
                    if sent > acknowledged:
                        acknowledged = sent
                        if progress is not None:
                            progress(acknowledged)
                writer.close()  # the last request: only now does the object exist
            except BaseException:
                writer.abandoned = True
                raise
        if written > acknowledged and progress is not None:
            progress(written)
        return written, str(hasher.hexdigest())

    # -- reads -------------------------------------------------------------------------------------------------

    def _metadata(self, url: GcsUrl) -> Any:
        """The object's metadata (size, generation); ``None`` if there is none (its bucket checked to exist)."""
        with self._failures(url):
            blob = self.client.bucket(url.bucket).get_blob(url.key, retry=self.retry)
        if blob is None:
            self._require_bucket(url)
        else:
            self._buckets.add(url.bucket)
        return blob

    def size(self, url: str | GcsUrl) -> int | None:
        """The size of the object ``url`` in bytes; ``None`` if there is none (an unfinished upload is none)."""
        blob = self._metadata(GcsUrl.parse(url))
        return None if blob is None else int(blob.size or 0)

    def read_bytes(self, url: str | GcsUrl, *, limit: int) -> bytes:
        """The content of the object ``url``, refused (:class:`CheckpointIntegrityError`) if it is missing, larger
        than ``limit`` bytes (a manifest is read bounded) or replaced between its size check and its read."""
        url = GcsUrl.parse(url)
        blob = self._metadata(url)
        size = check_readable(url, None if blob is None else int(blob.size or 0), limit)
        if not size:
            return b""
        try:
            data = blob.download_as_bytes(raw_download=True, checksum=None, if_generation_match=blob.generation,
                                          retry=self.retry)
        except Exception as exc:
            status = self._status(exc)
            if status == 404:
                raise CheckpointIntegrityError(f"{url} does not exist.") from None
            if status == 412:
                raise CheckpointIntegrityError(f"{url} was replaced while it was read; read it again.") from None
            self._reraise(exc, url)
        return check_read(url, data, size)

    def list(self, url: str | GcsUrl) -> dict[str, int]:
        """Every object under ``url`` (names starting with ``url``'s name and ``/``): its name relative to ``url``
        mapped to its size. Unfinished uploads are no object and are not listed."""
        url = GcsUrl.parse(url)
        found: dict[str, int] = {}
        with self._failures(url):
            try:
                for entry in self.client.list_blobs(url.bucket, prefix=url.prefix, retry=self.retry):
                    name = entry.name
                    if name.startswith(url.prefix) and name != url.prefix:  # the prefix filter is the server's
                        found[name[len(url.prefix):]] = int(entry.size or 0)
            except self._sdk.api.NotFound as exc:
                raise self._no_bucket(url) from exc
        self._buckets.add(url.bucket)
        return found

    def download_file(self, url: str | GcsUrl, local: str | os.PathLike[str], *, size: int,
                      digest: str | None, sync: bool = True, listed: bool = False) -> None:
        """Download ``url`` to the local file ``local`` if it holds exactly ``size`` bytes with the XXH3-128
        ``digest`` (``None``: the size only); otherwise raise :class:`CheckpointIntegrityError` naming the URL.

        The object's size is checked first, unless the caller has just checked it in a listing (``listed``). The
        bytes go to a hidden temporary file beside ``local`` (``.NAME.download-<id>``; one streamed read, which the
        client resumes after a transient failure from the same generation), are hashed from that file, fsynced
        (unless ``sync=False``), and renamed onto ``local`` only after both checks passed. On any failure nothing is
        left under either name, and an existing ``local`` is untouched."""
        url = GcsUrl.parse(url)
        local = Path(local)
        missing = missing_message(url, size, "object")
        if not listed:
            check_size(url, self.size(url), size, missing)

        def fetch(temporary: Path) -> None:
            try:
                output = open(temporary, "xb")
            except OSError as exc:
                raise local_failure(url, local, exc) from exc
            with output:
                sink = _LocalFile(output)
                try:
                    self._blob(url).download_to_file(sink, raw_download=True, checksum=None, retry=self.retry)
                except Exception as exc:
                    if sink.failed is not None:  # writing the local file failed: the object store is not at fault
                        raise local_failure(url, local, sink.failed) from exc
                    if self._status(exc) == 404:
                        self._require_bucket(url)
                        raise CheckpointIntegrityError(missing) from None
                    self._reraise(exc, url)

        download_verified(url, local, fetch, size=size, digest=digest, sync=sync)

    # -- deletion and leftovers --------------------------------------------------------------------------------

    def delete(self, url: str | GcsUrl) -> None:
        """Delete the object ``url``; returns after GCS acknowledged it. A missing object is not an error."""
        url = GcsUrl.parse(url)
        self._delete(url, url.key)

    def _delete(self, url: GcsUrl, name: str) -> None:
        """Delete the object ``name`` of ``url``'s bucket (a name from a listing is deleted as listed, never parsed
        again: one with a ``..`` segment that someone put under a prefix is still removed with it)."""
        with self._failures(url):
            try:
                self.client.bucket(url.bucket).delete_blob(name, retry=self.retry)
            except self._sdk.api.NotFound:
                pass

    def delete_prefix(self, url: str | GcsUrl, *, first: Sequence[str] = ()) -> int:
        """Delete every object under ``url``; return how many were listed for deletion (``first`` not counted).

        The names in ``first`` (relative to ``url``: pass the manifest) are deleted before anything else, one request
        each, in order, each acknowledged before the next. Only then are the other objects listed and deleted
        (``concurrency`` requests at once). A deletion cut short leaves either the whole checkpoint or one without its
        manifest. Missing objects are not an error."""
        url = GcsUrl.parse(url)
        for relative in first:
            self.delete(url.child(relative))
        names = list(self.list(url))
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="accelerate-txn-gcs") as pool:
            list(pool.map(lambda relative: self._delete(url, url.prefix + relative), names))  # raises the first failure
        return len(names)

    def incomplete_uploads(self, url: str | GcsUrl) -> list[str]:
        """Always empty: GCS has no request that lists open resumable upload sessions (they hold no object, and GCS
        discards them a week after they started)."""
        GcsUrl.parse(url)
        return []

    def abort_incomplete_uploads(self, url: str | GcsUrl) -> list[str]:
        """Nothing to abort that can be found (:meth:`incomplete_uploads`); returns ``[]``."""
        GcsUrl.parse(url)
        return []


def _short(error: BaseException) -> str:
    """One line of an error's message, bounded."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
