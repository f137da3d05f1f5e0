"""The Azure Blob store end to end against a real Azure Storage server on loopback (Azurite, started by
``tests.support.azurite``): create-only commits, block uploads hashed as they are sent, verified downloads, listing bounded
by the prefix, deletion manifest first, and a real ``kill -9`` in the middle of a block upload. The same operations
as the S3 store's (tests/store/test_store_object.py), with Azure's conditions (409 BlobAlreadyExists).

The client reaches the server only through the standard Azure environment (``AZURE_STORAGE_CONNECTION_STRING``), as
a user's would. Order of requests is read from the server's own access log, not from the client.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import xxhash

from accelerate_txn.errors import (
    CheckpointConfigurationError,
    CheckpointIntegrityError,
)
from accelerate_txn.store.azure import AzureStore, AzureUrl
from accelerate_txn.store.base import ObjectStore
from tests.support.azurite import CONTAINER, Azurite
from tests.support.object_store_checks import (
    MANIFEST,
    check_chunked_round_trip,
    check_commit_repeated_with_the_same_bytes,
    check_create_only_upload_refused,
    check_damaged_object_refused,
    check_empty_file_round_trip,
    check_failed_upload_leaves_nothing,
    check_local_failure_named,
    check_second_commit_refused,
    error_without_the_client,
    kill_uploader_after_its_first_part,
    leftovers,
    payload,
)

pytestmark = pytest.mark.timeout(300)  # the first test also installs Azurite with npm where it is not cached

REPO = Path(__file__).resolve().parents[2]
BLOCK = 2**20  # small blocks: a 3-block file is 3 MiB


@pytest.fixture
def store(azurite: Azurite) -> AzureStore:
    return AzureStore(block_size=BLOCK, single_request_size=BLOCK, concurrency=4)


@pytest.fixture
def prefix(azurite: Azurite, request: pytest.FixtureRequest) -> AzureUrl:
    """A fresh location of this test's own: ``az://CONTAINER/<test>-<id>/checkpoint_1``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:60]
    return AzureUrl.parse(f"az://{CONTAINER}/{name}-{uuid.uuid4().hex[:8]}/checkpoint_1")








def _path(url: AzureUrl) -> str:
    """The request path of ``url`` in Azurite's access log (path-style: account, container, name)."""
    return f"/devstoreaccount1/{url.container}/{url.key}"


# -- URLs and set-up -------------------------------------------------------------------------------------------

def test_url_parsing_accepts_plain_urls_and_names_the_bad_ones() -> None:
    assert AzureUrl.parse("az://my-container/run/checkpoint_1/") == AzureUrl("my-container", "run/checkpoint_1")
    assert AzureUrl.parse("az://my-container") == AzureUrl("my-container", "")
    url = AzureUrl.parse("az://my-container/run")
    assert (url.prefix, str(url.child("checkpoint_1/model.safetensors"))) == (
        "run/", "az://my-container/run/checkpoint_1/model.safetensors")
    refusals = {
        "/local/path": "Not an Azure Blob URL",
        "s3://my-container/run": "Not an Azure Blob URL",
        "az://My-Container/run": "does not name a valid container",
        "az://a--b/run": "does not name a valid container",
        "az:///run": "does not name a valid container",
        "az://my-container/run//checkpoint_1": "empty, '.' or '..' path segment",
        "az://my-container/run/../other": "empty, '.' or '..' path segment",
        "az://my-container/run?snapshot=3": "contains '?', '#' or '\\'",
    }
    for text, message in refusals.items():
        with pytest.raises(CheckpointConfigurationError, match=re.escape(message)) as caught:
            AzureUrl.parse(text)
        assert repr(text) in str(caught.value)


def test_without_the_client_the_module_imports_and_the_error_names_the_extra_to_install() -> None:
    # A fresh interpreter where `from azure.storage import blob` fails, as where the azure extra is not installed.
    message = error_without_the_client("azure.storage.blob", "store.azure", "AzureStore", "AzureUrl",
                                       "az://my-container/run", REPO)
    assert message == ("Checkpoints in Azure Blob Storage (az:// URLs) need the azure-storage-blob "
                       "client, which is not installed here: pip install 'accelerate-txn[azure]'")


def test_without_an_account_in_the_environment_the_error_names_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
                 "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CheckpointConfigurationError, match="No Azure storage account is configured") as caught:
        AzureStore()
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(caught.value) and "AZURE_STORAGE_KEY" in str(caught.value)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "not a connection string")
    with pytest.raises(CheckpointConfigurationError, match="AZURE_STORAGE_CONNECTION_STRING is not a valid"):
        AzureStore()


def test_the_store_is_an_object_store(store: AzureStore) -> None:
    assert isinstance(store, ObjectStore) and store.name == "azure"


# -- the commit --------------------------------------------------------------------------------------------------

def test_create_only_commit_wins_once_and_the_second_writer_is_refused(store: AzureStore, prefix: AzureUrl,
                                                                       azurite: Azurite) -> None:
    manifest = prefix.child(MANIFEST)
    start: list[int] = []

    def refused() -> None:
        # The server itself refused the write: 409 on the Put Blob (If-None-Match: *), no unconditional retry.
        puts = [request for request in azurite.settled()[start[0]:] if request[0] == "PUT"]
        assert puts == [("PUT", _path(manifest), 409)]

    check_second_commit_refused(store, manifest, lambda: start.append(len(azurite.settled())), refused)


def test_create_only_commit_repeated_with_the_same_bytes_succeeds(store: AzureStore, prefix: AzureUrl) -> None:
    check_commit_repeated_with_the_same_bytes(store, prefix)


def test_create_only_block_upload_is_refused_when_the_blob_exists(store: AzureStore, prefix: AzureUrl,
                                                                  tmp_path: Path, azurite: Azurite) -> None:
    url = prefix.child("model.safetensors")
    start: list[int] = []

    def refused() -> None:
        commits = [request for request in azurite.settled()[start[0]:] if "comp=blocklist" in request[1]]
        assert commits == [("PUT", _path(url) + "?comp=blocklist", 409)]

    check_create_only_upload_refused(store, url, tmp_path, BLOCK, lambda: start.append(len(azurite.settled())),
                                     refused)
    assert store.incomplete_uploads(prefix) == []


# -- uploads and downloads ---------------------------------------------------------------------------------------

def test_block_upload_round_trips_with_the_right_hash(store: AzureStore, prefix: AzureUrl, tmp_path: Path) -> None:
    url = prefix.child("pytorch_model_fsdp_0/__0_0.distcp")

    def uploaded() -> None:
        committed, uncommitted = store.client.get_blob_client(url.container, url.key).get_block_list("all")
        assert (len(committed), uncommitted) == (3, [])  # the server committed a 3-block blob

    check_chunked_round_trip(store, url, tmp_path, BLOCK, uploaded)


def test_small_file_goes_in_one_request_with_the_right_hash(store: AzureStore, prefix: AzureUrl, tmp_path: Path,
                                                            azurite: Azurite) -> None:
    path, data = payload(tmp_path, 1000)
    url = prefix.child("random_states_0.pkl")
    start = len(azurite.settled())
    assert store.upload_file(path, url) == (1000, xxhash.xxh3_128_hexdigest(data))
    assert [request for request in azurite.settled()[start:] if request[0] == "PUT"] == [("PUT", _path(url), 201)]
    check_empty_file_round_trip(store, prefix, tmp_path)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_blob_is_refused_naming_the_url_and_leaves_no_file(store: AzureStore, prefix: AzureUrl,
                                                                   tmp_path: Path, damage: str) -> None:
    url = prefix.child("optimizer_0/__1_0.distcp")

    def replace(altered: bytes) -> None:  # another writer (or bit rot) replaced the blob
        store.client.get_blob_client(url.container, url.key).upload_blob(altered, overwrite=True)

    check_damaged_object_refused(store, url, tmp_path, BLOCK, damage, replace, listed_too=True)


def test_missing_blob_is_refused_naming_the_url(store: AzureStore, prefix: AzureUrl, tmp_path: Path) -> None:
    url = prefix.child("scheduler.bin")
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{url} does not exist")):
        store.download_file(url, tmp_path / "scheduler.bin", size=10, digest="0" * 32)
    with pytest.raises(CheckpointIntegrityError, match="the object store has no such blob"):
        store.download_file(url, tmp_path / "scheduler.bin", size=10, digest=None, listed=True)
    assert leftovers(tmp_path) == []
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{url} does not exist")):
        store.read_bytes(url, limit=1024)
    assert store.size(url) is None


def test_a_local_failure_during_a_download_names_the_local_side_not_the_object_store(
        store: AzureStore, prefix: AzureUrl, tmp_path: Path) -> None:
    check_local_failure_named(store, prefix, tmp_path)


def test_a_failed_upload_leaves_no_blob_and_no_staged_blocks(store: AzureStore, prefix: AzureUrl,
                                                             tmp_path: Path) -> None:
    check_failed_upload_leaves_nothing(store, prefix.child("big.bin"), tmp_path, BLOCK)
    assert store.incomplete_uploads(prefix) == []
    assert store.list(prefix) == {}


# -- listing and deletion ----------------------------------------------------------------------------------------

def test_list_holds_exactly_the_blobs_under_the_prefix(store: AzureStore, prefix: AzureUrl) -> None:
    sibling = AzureUrl(prefix.container, prefix.key + "0")  # checkpoint_10 beside checkpoint_1
    store.write_new(prefix.child(MANIFEST), b"{}")
    store.write_new(prefix.child("pytorch_model_fsdp_0/.metadata"), b"12345")
    store.write_new(sibling.child(MANIFEST), b"{}")
    open_blob = prefix.child("open.bin")
    store.client.get_blob_client(open_blob.container, open_blob.key).stage_block("YmxvY2s=", b"staged")
    assert store.list(prefix) == {MANIFEST: 2, "pytorch_model_fsdp_0/.metadata": 5}
    assert store.list(sibling) == {MANIFEST: 2}
    assert store.incomplete_uploads(prefix) == ["open.bin"]
    assert store.incomplete_uploads(sibling) == []


def test_delete_prefix_removes_the_manifest_before_anything_else(store: AzureStore, prefix: AzureUrl,
                                                                azurite: Azurite) -> None:
    sibling = AzureUrl(prefix.container, prefix.key + "0")
    for url in (prefix, sibling):
        store.write_new(url.child("pytorch_model_fsdp_0/__0_0.distcp"), b"shard")
        store.write_new(url.child("random_states_0.pkl"), b"rng")
        store.write_new(url.child(MANIFEST), b"{}")

    start = len(azurite.settled())
    assert store.delete_prefix(prefix, first=[MANIFEST]) == 2
    seen = [(method, path) for method, path, _ in azurite.settled()[start:]]
    deletions = [path for method, path in seen if method == "DELETE"]
    assert deletions[0] == _path(prefix.child(MANIFEST)), seen
    assert sorted(deletions[1:]) == sorted(_path(prefix.child(name)) for name in
                                           ("pytorch_model_fsdp_0/__0_0.distcp", "random_states_0.pkl")), seen
    listing = next(index for index, (method, path) in enumerate(seen) if method == "GET" and "comp=list" in path)
    # The manifest's deletion was acknowledged before the rest was even listed; the rest after the listing.
    assert seen.index(("DELETE", deletions[0])) < listing < min(seen.index(("DELETE", path)) for path in deletions[1:])
    assert store.list(prefix) == {}
    assert store.list(sibling) == {MANIFEST: 2, "pytorch_model_fsdp_0/__0_0.distcp": 5, "random_states_0.pkl": 3}

    # The check can fail: without ``first`` the manifest is deleted after the listing, with everything else.
    start = len(azurite.settled())
    assert store.delete_prefix(sibling) == 3
    seen = [(method, path) for method, path, _ in azurite.settled()[start:]]
    listing = next(index for index, (method, path) in enumerate(seen) if method == "GET" and "comp=list" in path)
    assert seen.index(("DELETE", _path(sibling.child(MANIFEST)))) > listing
    assert store.list(sibling) == {}


# -- kill -9 -----------------------------------------------------------------------------------------------------

# Uploads argv[1] to argv[2] in 1 MiB blocks, one at a time; after the first block is acknowledged it prints the
# bytes acknowledged and waits for a line that never comes: the test kills it there with SIGKILL.
_UPLOADER = """
import sys
from accelerate_txn.store.azure import AzureStore

def progress(acknowledged):
    print(acknowledged, flush=True)
    sys.stdin.readline()

AzureStore(block_size=2**20, single_request_size=2**20, concurrency=1).upload_file(sys.argv[1], sys.argv[2],
                                                                                   progress=progress)
print("completed", flush=True)
"""


def test_kill_9_mid_block_upload_leaves_no_blob_and_the_staged_blocks_are_discarded(
        store: AzureStore, prefix: AzureUrl, tmp_path: Path) -> None:
    path, data = payload(tmp_path, 3 * BLOCK + 1)
    url = prefix.child("pytorch_model_fsdp_0/__0_0.distcp")
    elsewhere = AzureUrl(prefix.container, prefix.key + "0")  # another checkpoint's staged blocks: never touched
    other = elsewhere.child("x")
    store.client.get_blob_client(other.container, other.key).stage_block("YmxvY2s=", b"staged")
    kill_uploader_after_its_first_part(_UPLOADER, path, url, BLOCK, REPO)

    assert store.size(url) is None
    assert store.list(prefix) == {}
    assert store.incomplete_uploads(prefix) == ["pytorch_model_fsdp_0/__0_0.distcp"]
    assert store.abort_incomplete_uploads(prefix) == ["pytorch_model_fsdp_0/__0_0.distcp"]
    assert store.incomplete_uploads(prefix) == []
    assert store.list(prefix) == {}
    assert store.incomplete_uploads(elsewhere) == ["x"]
    # The name is free again: a create-only upload of it succeeds and holds exactly its own bytes.
    size, digest = store.upload_file(path, url, create_only=True)
    store.download_file(url, tmp_path / "back.bin", size=size, digest=digest)
    assert (tmp_path / "back.bin").read_bytes() == data


# -- where az:// URLs are accepted -------------------------------------------------------------------------------

def test_az_urls_are_object_store_urls_everywhere_a_url_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate_txn.cli import main
    from accelerate_txn.core.remote import cache_path, is_url

    assert is_url("az://my-container/run/checkpoint_1") and not is_url("abfs://container/run")
    assert cache_path(Path("/cache"), "az://my-container/run/checkpoint_1") == Path("/cache/az/my-container/run/checkpoint_1")
    # The command line checks the URL with the Azure store's rules before any client exists: a usage error (exit 2).
    assert main(["verify", "az://My_Container/run/checkpoint_1"]) == 2
    assert "does not name a valid container ('My_Container')" in capsys.readouterr().err
    assert main(["verify", "az://my-container/run/../checkpoint_1"]) == 2
    assert "empty, '.' or '..' path segment" in capsys.readouterr().err
