"""Azure Blob Storage: the same primitives as ``store.s3``, from what Azure's block blobs offer.

An object store has no rename, no directory and no lock; "complete or it does not exist" is rebuilt as on S3
(docs/storage.md):

* **Create-only writes.** :meth:`AzureStore.write_new` is the commit of a manifest: one ``Put Blob`` with
  ``If-None-Match: *``. Azure accepts it only if no blob of that name exists; a second writer gets ``409
  BlobAlreadyExists``, raised as :class:`~accelerate_txn.errors.CheckpointExistsError`, and the first writer's
  content stays. The same condition is sent on ``Put Block List`` by :meth:`AzureStore.upload_file` with
  ``create_only=True``.
* **Uploads hashed as they are sent.** :meth:`AzureStore.upload_file` reads a local file once and hashes each block
  (XXH3-128, the manifest's hash) as it is handed to the client. A large file is staged as blocks in parallel
  (``Put Block``) and appears only when its block list is committed (``Put Block List``). Block ids carry a token of
  their upload, so two uploads of one name never commit each other's blocks.
* **Downloads verified before they exist.** :meth:`AzureStore.download_file` writes to a hidden temporary name beside
  the destination (the SDK's parallel ranged reads, each pinned to the ETag of the first) and renames it into place
  only after size and digest matched; otherwise :class:`~accelerate_txn.errors.CheckpointIntegrityError` naming the
  URL, and nothing is left under either name.
* **Deletion commit key first.** :meth:`AzureStore.delete_prefix` deletes the keys of ``first`` (the manifest) one by
  one, each acknowledged, before it lists and deletes the rest.
* **Leftovers of a killed writer.** Staged blocks never committed are no blob: reads and listings do not see them.
  Azure discards them after a week, or when a blob of that name is committed; :meth:`AzureStore.incomplete_uploads`
  finds them (``List Blobs`` with ``include=uncommittedblobs``) and :meth:`AzureStore.abort_incomplete_uploads`
  discards them by committing an empty block list under ``If-None-Match: *`` (never over a committed blob) and
  deleting that empty blob under ``If-Match`` its ETag. Azure has no other way to drop uncommitted blocks.

URLs are ``az://CONTAINER/PREFIX`` (the form adlfs and obstore read); the storage account and credentials come from
the standard Azure environment, as the Azure CLI reads it, and from no variable of ours:
``AZURE_STORAGE_CONNECTION_STRING`` (the account, its endpoint and its key or SAS: Azurite's development account is
one), or ``AZURE_STORAGE_ACCOUNT`` with ``AZURE_STORAGE_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``, or
``AZURE_STORAGE_ACCOUNT`` alone with azure-identity's ``DefaultAzureCredential`` (``AZURE_CLIENT_ID``,
``AZURE_TENANT_ID``, ``AZURE_CLIENT_SECRET``, a managed identity, ``az login``) where azure-identity is installed.

The client is azure-storage-blob (Microsoft's SDK, synchronous), an optional dependency (``pip install
'accelerate-txn[azure]'``) imported when the first :class:`AzureStore` is created. It was chosen over obstore and
adlfs on measurement (docs/storage.md): it is what adlfs itself calls, it sends ``If-None-Match`` on ``Put Block
List`` (obstore's conditional put is a single ``Put Blob``), and it lists uncommitted blobs.

:class:`AzureStore` implements :class:`.base.ObjectStore`; the checkpoint protocol on it is ``core.remote``'s.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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

SCHEME = "az://"
#: At most this many blocks in one blob (Azure's limit): larger files get larger blocks.
MAX_BLOCKS = 50_000
DEFAULT_BLOCK_SIZE = 16 * 2**20
#: A file up to this size goes in one ``Put Blob`` (the SDK's own default single-put size).
DEFAULT_SINGLE_REQUEST_SIZE = 64 * 2**20
DEFAULT_CONCURRENCY = 8
#: The standard variables the client is configured from (the Azure CLI's).
ENVIRONMENT = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
               "AZURE_STORAGE_SAS_TOKEN")
_CONTAINER = re.compile(r"(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]\Z")


@dataclass(frozen=True)
class AzureUrl(ObjectUrl):
    """A location in Azure Blob Storage: a container and a blob name (no leading or trailing slash; ``""`` is the
    container's root). As a prefix, ``az://c/run/checkpoint_1`` holds the names starting with ``run/checkpoint_1/``."""

    SCHEME = SCHEME
    ROOT = "container"
    container: str
    key: str = ""

    @classmethod
    def parse(cls, url: str | AzureUrl) -> AzureUrl:
        """Parse ``az://CONTAINER[/NAME]``; a trailing ``/`` is dropped. Refuses (``CheckpointConfigurationError``)
        anything else, container names Azure refuses, and names with empty, ``.`` or ``..`` segments, ``?``, ``#``,
        ``\\`` or control characters: each would name another blob than the one the user sees."""
        if isinstance(url, AzureUrl):
            return url
        if not isinstance(url, str) or not url.startswith(SCHEME):
            raise CheckpointConfigurationError(
                f"Not an Azure Blob URL: {url!r}. Expected az://CONTAINER/PREFIX, e.g. az://my-container/run/"
                f"checkpoint_1 (the storage account comes from AZURE_STORAGE_CONNECTION_STRING or "
                f"AZURE_STORAGE_ACCOUNT).")
        container, _, key = url[len(SCHEME):].partition("/")
        key = key.rstrip("/")
        if not _CONTAINER.match(container):
            raise CheckpointConfigurationError(
                f"{url!r} does not name a valid container ({container!r}): a container name has 3 to 63 lowercase "
                f"letters, digits and single hyphens, starting and ending with a letter or digit. Expected "
                f"az://CONTAINER/PREFIX.")
        problem = key_problem(key, "?#\\", len(key), "Azure's 1024 characters")
        if problem is not None:
            raise CheckpointConfigurationError(f"The blob name of {url!r} {problem}; name the blob plainly, e.g. "
                                               f"az://{container}/run/checkpoint_1.")
        return cls(container, key)


def _import_sdk() -> Any:
    try:
        from azure.storage import blob
    except ImportError as exc:
        raise CheckpointConfigurationError(
            "Checkpoints in Azure Blob Storage (az:// URLs) need the azure-storage-blob client, which is not "
            "installed here: pip install 'accelerate-txn[azure]'") from exc
    return blob


def client_from_environment() -> Any:
    """A ``BlobServiceClient`` for the account the standard Azure environment names (module docstring)."""
    blob = _import_sdk()
    connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        try:
            return blob.BlobServiceClient.from_connection_string(connection)
        except ValueError as exc:
            raise CheckpointConfigurationError(
                f"AZURE_STORAGE_CONNECTION_STRING is not a valid connection string ({exc}); copy it again from the "
                f"storage account's 'Access keys' page.") from exc
    account = os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise CheckpointConfigurationError(
            "No Azure storage account is configured for az:// URLs: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN (or with azure-identity "
            "installed, for a managed identity, a service principal or 'az login').")
    credential: Any = os.environ.get("AZURE_STORAGE_KEY") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if not credential:
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError as exc:
            raise CheckpointConfigurationError(
                f"AZURE_STORAGE_ACCOUNT={account} is set without AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN; for a "
                f"managed identity, a service principal or 'az login', install azure-identity "
                f"(pip install azure-identity).") from exc
        credential = DefaultAzureCredential()
    return blob.BlobServiceClient(f"https://{account}.blob.core.windows.net", credential=credential)


def block_size_for(size: int, block_size: int) -> int:
    """The block size to upload ``size`` bytes with: ``block_size``, grown in whole MiB where the file would
    otherwise need more than :data:`MAX_BLOCKS` blocks."""
    return chunk_size_for(size, block_size, MAX_BLOCKS)


class AzureStore:
    """Operations on Azure Blob Storage through azure-storage-blob; see the module docstring for each guarantee.

    ``block_size``: the size of each staged block of a large file. ``single_request_size``: a file up to this size
    goes in one ``Put Blob``, held in memory whole (:data:`DEFAULT_SINGLE_REQUEST_SIZE` by default, at least
    ``block_size``). ``concurrency``: blocks of one upload in flight at once (an upload holds about ``concurrency +
    2`` blocks in memory), and parallel ranged reads of one download. ``client``: a ``BlobServiceClient``
    configured by the caller; by default one configured from the standard Azure environment.
    """

    name = "azure"

    def __init__(self, *, block_size: int = DEFAULT_BLOCK_SIZE, concurrency: int = DEFAULT_CONCURRENCY,
                 client: Any = None, single_request_size: int | None = None) -> None:
        if block_size < 1:
            raise CheckpointConfigurationError(f"block_size={block_size}: a block holds at least 1 byte.")
        if concurrency < 1:
            raise CheckpointConfigurationError(f"concurrency={concurrency}: at least 1 request must be in flight.")
        require_clients("azure", "the Azure Blob Storage store (az:// URLs)")
        sdk = _import_sdk()
        self._exceptions = _exceptions()
        self._block = sdk.BlobBlock
        self.client = client if client is not None else client_from_environment()
        self.block_size = block_size
        self.single_request_size = max(block_size, DEFAULT_SINGLE_REQUEST_SIZE if single_request_size is None
                                       else single_request_size)
        self.concurrency = concurrency

    def _blob(self, url: AzureUrl) -> Any:
        return self.client.get_blob_client(url.container, url.key)

    def _container(self, url: AzureUrl) -> Any:
        return self.client.get_container_client(url.container)

    # -- writes ------------------------------------------------------------------------------------------------

    def write_new(self, url: str | AzureUrl, data: bytes) -> None:
        """Create the blob ``url`` holding exactly ``data`` (the commit of a manifest), or raise leaving the store
        as it was. If ``url`` exists, raises :class:`CheckpointExistsError` and its content stays, unless it already
        holds exactly ``data`` (this writer's own earlier request landed): then the call succeeds."""
        url = AzureUrl.parse(url)
        try:
            self._put(url, data, create_only=True)
        except self._exceptions.ResourceExistsError as exc:  # 409 BlobAlreadyExists (the SDK maps a 412 to it too)
            if self._holds(url, data):
                return
            raise exists_error(url) from exc

    def _put(self, url: AzureUrl, data: bytes, *, create_only: bool) -> None:
        # overwrite=False is the SDK's If-None-Match: *; one request (data is at most single_request_size).
        self._blob(url).upload_blob(data, overwrite=not create_only, length=len(data), max_concurrency=1)

    def _holds(self, url: AzureUrl, data: bytes) -> bool:
        try:
            return self.size(url) == len(data) and self.read_bytes(url, limit=len(data)) == data
        except CheckpointIntegrityError:
            return False

    def upload_file(self, local: str | os.PathLike[str], url: str | AzureUrl, *, create_only: bool = False,
                    progress: Progress | None = None) -> tuple[int, str]:
        """Upload the local file ``local`` to ``url``; return ``(size, XXH3-128 hex digest)`` of the bytes sent.

        The file is read once, sequentially; each block is hashed as it is handed to the client. A file larger
        than ``single_request_size`` is staged in blocks, up to ``concurrency`` in flight, and appears only when its
        block list is committed. If anything fails, the blocks staged are discarded where no blob of that name
        exists (:meth:`abort_incomplete_uploads`) and the error raised. A process killed mid-upload leaves staged
        blocks and no blob. ``create_only``: refuse (:class:`CheckpointExistsError`, the existing blob kept) if
        ``url`` exists when the upload completes. ``progress``: called with the bytes acknowledged so far after
        each block."""
        url = AzureUrl.parse(url)
        with open(local, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            block_size = block_size_for(size, self.block_size)
            first, second = read_head(stream, size, block_size, self.single_request_size)
            if not second:  # one request: Put Blob
                digest = digest_of(first)
                try:
                    self._put(url, first, create_only=create_only)
                except self._exceptions.ResourceExistsError as exc:
                    raise self._exists(url) from exc
                if progress is not None:
                    progress(len(first))
                return len(first), digest
            return self._upload_blocks(stream, [first, second], url, block_size, create_only, progress)

    def _upload_blocks(self, stream: Any, head: list[bytes], url: AzureUrl, block_size: int, create_only: bool,
                       progress: Progress | None) -> tuple[int, str]:
        blob = self._blob(url)
        token = uuid.uuid4().hex  # this upload's blocks: another upload of the name never commits them
        ids: dict[int, str] = {}
        try:
            def send(number: int, block: bytes) -> int:
                ids[number] = base64.b64encode(f"{token}-{number:06d}".encode()).decode()
                blob.stage_block(ids[number], block, length=len(block))
                return len(block)

            acknowledged, digest = upload_in_parallel(chunks(stream, head, block_size), send,
                                                      concurrency=self.concurrency,
                                                      thread_name_prefix="accelerate-txn-azure", progress=progress)
            blocks = [self._block(block_id=ids[number]) for number in sorted(ids)]
            condition = {"match_condition": _if_missing()} if create_only else {}
            try:
                blob.commit_block_list(blocks, **condition)
            except (self._exceptions.ResourceExistsError, self._exceptions.ResourceModifiedError) as exc:
                # The blob exists: its own blocks stay, ours are discarded by Azure within a week (no call can).
                raise self._exists(url) from exc
        except CheckpointExistsError:
            raise
        except BaseException:
            self._discard_quietly(url)
            raise
        return acknowledged, digest

    def _exists(self, url: AzureUrl) -> CheckpointExistsError:
        return CheckpointExistsError(
            f"{url} already exists (another writer committed it first); the upload was refused and the existing "
            f"blob left as it is. Give each save its own output location.")

    def _discard_quietly(self, url: AzureUrl) -> None:
        try:
            self._discard(url)
        except Exception as exc:  # the upload's own error is the one to raise; this one is only left behind
            logger.warning("Discarding the staged blocks of %s failed (%s); abort_incomplete_uploads removes them, "
                           "and Azure does after a week", url, exc)

    def _discard(self, url: AzureUrl) -> bool:
        """Drop the uncommitted blocks of ``url`` if no blob of that name is committed: commit an empty block list
        create-only, then delete that empty blob if it is still the one committed. False if a blob exists."""
        blob = self._blob(url)
        try:
            empty = blob.commit_block_list([], match_condition=_if_missing())
        except self._exceptions.ResourceExistsError:
            return False
        try:
            blob.delete_blob(etag=empty["etag"], match_condition=_if_unchanged())
        except (self._exceptions.ResourceNotFoundError, self._exceptions.ResourceModifiedError):
            pass  # deleted meanwhile, or replaced by a real commit: not ours to delete
        return True

    # -- reads -------------------------------------------------------------------------------------------------

    def size(self, url: str | AzureUrl) -> int | None:
        """The size of the blob ``url`` in bytes; ``None`` if there is none (uncommitted blocks are none)."""
        url = AzureUrl.parse(url)
        try:
            return int(self._blob(url).get_blob_properties().size)
        except self._exceptions.ResourceNotFoundError:
            return None

    def read_bytes(self, url: str | AzureUrl, *, limit: int) -> bytes:
        """The content of the blob ``url``, refused (:class:`CheckpointIntegrityError`) if it is missing or larger
        than ``limit`` bytes (a manifest is read bounded)."""
        url = AzureUrl.parse(url)
        size = check_readable(url, self.size(url), limit)
        try:
            data = self._blob(url).download_blob(offset=0, length=size, max_concurrency=1).readall() if size else b""
        except self._exceptions.ResourceNotFoundError:
            raise CheckpointIntegrityError(f"{url} does not exist.") from None
        return check_read(url, data, size)

    def list(self, url: str | AzureUrl) -> dict[str, int]:
        """Every blob under ``url`` (names starting with ``url``'s name and ``/``): its name relative to ``url``
        mapped to its size. Uncommitted blocks are no blob and are not listed."""
        url = AzureUrl.parse(url)
        return {name[len(url.prefix):]: size for name, size in self._listing(url, uncommitted=False).items()}

    def _listing(self, url: AzureUrl, *, uncommitted: bool) -> dict[str, int]:
        include = ["uncommittedblobs"] if uncommitted else None
        found = {}
        for entry in self._container(url).list_blobs(name_starts_with=url.prefix, include=include):
            name = entry.name
            if name.startswith(url.prefix) and name != url.prefix:  # the prefix filter is the server's: check it
                found[name] = int(entry.size or 0)
        return found

    def download_file(self, url: str | AzureUrl, local: str | os.PathLike[str], *, size: int,
                      digest: str | None, sync: bool = True, listed: bool = False) -> None:
        """Download ``url`` to the local file ``local`` if it holds exactly ``size`` bytes with the XXH3-128
        ``digest`` (``None``: the size only); otherwise raise :class:`CheckpointIntegrityError` naming the URL.

        The blob's size is checked first, unless the caller has just checked it in a listing (``listed``). The bytes
        go to a hidden temporary file beside ``local`` (``.NAME.download-<id>``; ranged reads in parallel for a
        large blob, each conditional on the ETag of the first, so a blob replaced meanwhile fails the download
        instead of mixing two contents), are hashed from that file, fsynced (unless ``sync=False``), and renamed onto
        ``local`` only after both checks passed. On any failure nothing is left under either name, and an existing
        ``local`` is untouched."""
        url = AzureUrl.parse(url)
        local = Path(local)
        missing = missing_message(url, size, "blob")
        if not listed:
            check_size(url, self.size(url), size, missing)

        def fetch(temporary: Path) -> None:
            try:
                output = open(temporary, "xb")
            except OSError as exc:
                raise local_failure(url, local, exc) from exc
            with output:
                try:
                    self._blob(url).download_blob(max_concurrency=self.concurrency).readinto(output)
                except self._exceptions.ResourceNotFoundError:
                    raise CheckpointIntegrityError(missing) from None
                except self._exceptions.ResourceModifiedError as exc:
                    raise CheckpointIntegrityError(
                        f"{url} was replaced while it was downloaded; the download was stopped. The checkpoint was "
                        f"altered; restore from another one.") from exc
                except OSError as exc:  # writing the local file failed (the SDK's own errors are no OSError)
                    raise local_failure(url, local, exc) from exc

        download_verified(url, local, fetch, size=size, digest=digest, sync=sync)

    # -- deletion and leftovers --------------------------------------------------------------------------------

    def delete(self, url: str | AzureUrl) -> None:
        """Delete the blob ``url`` (and its snapshots); returns after Azure acknowledged it. A missing blob is not an
        error."""
        url = AzureUrl.parse(url)
        try:
            self._blob(url).delete_blob(delete_snapshots="include")
        except self._exceptions.ResourceNotFoundError:
            pass

    def delete_prefix(self, url: str | AzureUrl, *, first: Sequence[str] = ()) -> int:
        """Delete every blob under ``url``; return how many were listed for deletion (``first`` not counted).

        The names in ``first`` (relative to ``url``: pass the manifest) are deleted before anything else, one
        request each, in order, each acknowledged before the next. Only then are the other blobs listed and deleted
        (``concurrency`` requests at once; one ``Delete Blob`` each, which every account type accepts, where a
        ``Blob Batch`` is refused on hierarchical-namespace accounts). A deletion cut short leaves either the whole
        checkpoint or one without its manifest. Missing blobs are not an error; uncommitted blocks are not
        touched (:meth:`abort_incomplete_uploads`)."""
        url = AzureUrl.parse(url)
        for relative in first:
            self.delete(url.child(relative))
        names = list(self.list(url))
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="accelerate-txn-azure") as pool:
            list(pool.map(lambda relative: self.delete(url.child(relative)), names))  # raises the first failure
        return len(names)

    def incomplete_uploads(self, url: str | AzureUrl) -> list[str]:
        """Names under ``url`` (relative to it) with blocks staged and no blob committed."""
        url = AzureUrl.parse(url)
        committed = self._listing(url, uncommitted=False)
        every = self._listing(url, uncommitted=True)
        return sorted(name[len(url.prefix):] for name in every if name not in committed)

    def abort_incomplete_uploads(self, url: str | AzureUrl) -> list[str]:
        """Discard the staged blocks of every name under ``url`` with no blob committed; return those names
        (relative to ``url``). Only for leftovers: a live writer's upload then fails when it commits."""
        url = AzureUrl.parse(url)
        return [name for name in self.incomplete_uploads(url) if self._discard(url.child(name))]


def _exceptions() -> Any:
    from azure.core import exceptions

    return exceptions


def _if_missing() -> Any:
    from azure.core import MatchConditions

    return MatchConditions.IfMissing


def _if_unchanged() -> Any:
    from azure.core import MatchConditions

    return MatchConditions.IfNotModified
