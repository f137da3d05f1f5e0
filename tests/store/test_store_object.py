"""The S3 store end to end against a real S3-protocol server on loopback (moto's ``ThreadedMotoServer``, started
here on 127.0.0.1 on a free port): create-only commits, multipart uploads hashed as they are sent, verified
downloads, listing bounded by the prefix, deletion manifest first, and a real ``kill -9`` in the middle of a
multipart upload.

The client reaches the server only through the standard AWS environment (``AWS_ENDPOINT_URL`` and credentials),
as a user's would. Order of requests is read from the server's own request log, not from the client.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import xxhash

from accelerate_txn.errors import CheckpointConfigurationError, CheckpointIntegrityError
from accelerate_txn.store.s3 import MIN_PART_SIZE, S3Store, S3Url
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
from tests.support.s3_server import BUCKET, Server

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(s3_server: Server) -> S3Store:
    return S3Store(part_size=MIN_PART_SIZE, concurrency=4)


@pytest.fixture
def prefix(s3_server: Server, request: pytest.FixtureRequest) -> S3Url:
    """A fresh location of this test's own: ``s3://BUCKET/<test>-<id>/checkpoint_1``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:60]
    return S3Url.parse(f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}/checkpoint_1")






# -- URLs and set-up -------------------------------------------------------------------------------------------

def test_url_parsing_accepts_plain_urls_and_names_the_bad_ones() -> None:
    assert S3Url.parse("s3://my-bucket/run/checkpoint_1/") == S3Url("my-bucket", "run/checkpoint_1")
    assert S3Url.parse("s3://my-bucket") == S3Url("my-bucket", "")
    url = S3Url.parse("s3://my-bucket/run")
    assert (url.prefix, str(url.child("checkpoint_1/model.safetensors"))) == (
        "run/", "s3://my-bucket/run/checkpoint_1/model.safetensors")
    refusals = {
        "/local/path": "Not an S3 URL",
        "gs://my-bucket/run": "Not an S3 URL",
        "s3://x/run": "does not name a valid bucket",
        "s3:///run": "does not name a valid bucket",
        "s3://my-bucket/run//checkpoint_1": "empty, '.' or '..' path segment",
        "s3://my-bucket/run/../other": "empty, '.' or '..' path segment",
        "s3://my-bucket/run?versionId=3": "contains '?' or '#'",
    }
    for text, message in refusals.items():
        with pytest.raises(CheckpointConfigurationError, match=re.escape(message)) as caught:
            S3Url.parse(text)
        assert repr(text) in str(caught.value)


def test_without_the_client_the_module_imports_and_the_error_names_the_extra_to_install() -> None:
    # A fresh interpreter where `import s3fs` fails, as where the s3 extra is not installed.
    message = error_without_the_client("s3fs", "store.s3", "S3Store", "S3Url",
                                       "s3://my-bucket/run", REPO)
    assert message == ("Checkpoints in S3 (s3:// URLs) need the s3fs client, which is not installed "
                       "here: pip install 'accelerate-txn[s3]'")


def test_a_client_that_would_drop_the_condition_is_refused_before_any_request() -> None:
    # s3fs passes botocore only the parameters botocore's service model knows: on a botocore without S3's
    # conditional writes, IfNoneMatch would vanish and the "create-only" commit would overwrite.
    calls: list[Any] = []
    old_model = SimpleNamespace(operation_model=lambda name: SimpleNamespace(
        input_shape=SimpleNamespace(members={"Bucket": None, "Key": None, "Body": None})))
    client = SimpleNamespace(s3=SimpleNamespace(meta=SimpleNamespace(service_model=old_model)),
                             call_s3=lambda *args, **kwargs: calls.append((args, kwargs)))
    old = S3Store(filesystem=client)
    with pytest.raises(CheckpointConfigurationError, match="does not know S3's conditional writes") as caught:
        old.write_new("s3://some-bucket/run/checkpoint_1/checkpoint_manifest.json", b"{}")
    assert "PutObject, CompleteMultipartUpload" in str(caught.value)
    with pytest.raises(CheckpointConfigurationError, match="does not know S3's conditional writes"):
        old.upload_file(__file__, "s3://some-bucket/run/checkpoint_1/x", create_only=True)
    assert calls == []


# -- the commit --------------------------------------------------------------------------------------------------

def test_create_only_commit_wins_once_and_the_second_writer_is_refused(store: S3Store, prefix: S3Url) -> None:
    check_second_commit_refused(store, prefix.child(MANIFEST))


def test_create_only_commit_repeated_with_the_same_bytes_succeeds(store: S3Store, prefix: S3Url) -> None:
    check_commit_repeated_with_the_same_bytes(store, prefix)


def test_create_only_multipart_upload_is_refused_when_the_key_exists(store: S3Store, prefix: S3Url,
                                                                     tmp_path: Path) -> None:
    check_create_only_upload_refused(store, prefix.child("model.safetensors"), tmp_path, MIN_PART_SIZE)
    assert store.list_incomplete_uploads(prefix) == []  # the refused upload was aborted, not left behind


# -- uploads and downloads ---------------------------------------------------------------------------------------

def test_multipart_upload_round_trips_with_the_right_hash(store: S3Store, prefix: S3Url, tmp_path: Path) -> None:
    url = prefix.child("pytorch_model_fsdp_0/__0_0.distcp")

    def uploaded() -> None:
        assert store.fs.info(str(url))["ETag"].strip('"').endswith("-3")  # the server completed a 3-part upload

    check_chunked_round_trip(store, url, tmp_path, MIN_PART_SIZE, uploaded)


def test_small_file_goes_in_one_request_with_the_right_hash(store: S3Store, prefix: S3Url, tmp_path: Path) -> None:
    path, data = payload(tmp_path, 1000)
    url = prefix.child("random_states_0.pkl")
    assert store.upload_file(path, url) == (1000, xxhash.xxh3_128_hexdigest(data))
    assert "-" not in store.fs.info(str(url))["ETag"]
    check_empty_file_round_trip(store, prefix, tmp_path)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_object_is_refused_naming_the_url_and_leaves_no_file(store: S3Store, prefix: S3Url, tmp_path: Path,
                                                                     damage: str) -> None:
    url = prefix.child("optimizer_0/__1_0.distcp")

    def replace(altered: bytes) -> None:
        store.fs.pipe_file(str(url), altered)  # another writer (or bit rot) replaced the object

    check_damaged_object_refused(store, url, tmp_path, MIN_PART_SIZE, damage, replace)


def test_missing_object_is_refused_naming_the_url(store: S3Store, prefix: S3Url, tmp_path: Path) -> None:
    url = prefix.child("scheduler.bin")
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{url} does not exist")):
        store.download_file(url, tmp_path / "scheduler.bin", size=10, digest="0" * 32)
    assert leftovers(tmp_path) == []
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{url} does not exist")):
        store.read_bytes(url, limit=1024)


def test_a_local_file_not_found_during_a_download_names_the_local_side_not_the_object_store(
        store: S3Store, prefix: S3Url, tmp_path: Path) -> None:
    """Issue 34: a download whose local directory was removed meanwhile (another job sharing the cache) raised
    "the object store has no such object. The checkpoint is incomplete" although the object was there."""
    check_local_failure_named(store, prefix, tmp_path, "object")
    # The object store's side is still named as such: a key that is not there.
    with pytest.raises(CheckpointIntegrityError, match="the object store has no such object"):
        store.download_file(prefix.child("missing.bin"), tmp_path / "missing.bin", size=10, digest=None, listed=True)


def test_a_failed_upload_is_aborted_and_leaves_no_object(store: S3Store, prefix: S3Url, tmp_path: Path) -> None:
    check_failed_upload_leaves_nothing(store, prefix.child("big.bin"), tmp_path, MIN_PART_SIZE)
    assert store.list_incomplete_uploads(prefix) == []


# -- listing and deletion ----------------------------------------------------------------------------------------

def test_list_holds_exactly_the_objects_under_the_prefix(store: S3Store, prefix: S3Url) -> None:
    sibling = S3Url(prefix.bucket, prefix.key + "0")  # checkpoint_10 beside checkpoint_1
    store.write_new(prefix.child(MANIFEST), b"{}")
    store.write_new(prefix.child("pytorch_model_fsdp_0/.metadata"), b"12345")
    store.write_new(sibling.child(MANIFEST), b"{}")
    store.fs.call_s3("create_multipart_upload", Bucket=prefix.bucket, Key=prefix.child("open.bin").key)
    assert store.list(prefix) == {MANIFEST: 2, "pytorch_model_fsdp_0/.metadata": 5}
    assert store.list(sibling) == {MANIFEST: 2}
    store.abort_incomplete_uploads(prefix)


def test_delete_prefix_removes_the_manifest_before_anything_else(store: S3Store, prefix: S3Url,
                                                                s3_server: Server) -> None:
    sibling = S3Url(prefix.bucket, prefix.key + "0")
    for url in (prefix, sibling):
        store.write_new(url.child("pytorch_model_fsdp_0/__0_0.distcp"), b"shard")
        store.write_new(url.child("random_states_0.pkl"), b"rng")
        store.write_new(url.child(MANIFEST), b"{}")
    manifest_path = f"/{prefix.bucket}/{prefix.child(MANIFEST).key}"

    start = len(s3_server.requests)
    assert store.delete_prefix(prefix, first=[MANIFEST]) == 2
    seen = s3_server.requests[start:]
    deletions = [(method, path) for method, path in seen
                 if method == "DELETE" or (method == "POST" and path.endswith("?delete"))]
    assert deletions[0] == ("DELETE", manifest_path), seen  # acknowledged before the rest is even listed
    assert deletions[1:] == [("POST", f"/{prefix.bucket}?delete")], seen
    listing = next(index for index, (method, path) in enumerate(seen) if method == "GET" and "list-type=2" in path)
    assert seen.index(("DELETE", manifest_path)) < listing < seen.index(("POST", f"/{prefix.bucket}?delete"))
    assert store.list(prefix) == {}
    assert store.list(sibling) == {MANIFEST: 2, "pytorch_model_fsdp_0/__0_0.distcp": 5, "random_states_0.pkl": 3}

    # The check can fail: without ``first`` the manifest goes in the same batch as everything else.
    start = len(s3_server.requests)
    assert store.delete_prefix(sibling) == 3
    assert [request for request in s3_server.requests[start:] if request[0] == "DELETE"] == []
    assert store.list(sibling) == {}


# -- kill -9 -----------------------------------------------------------------------------------------------------

# Uploads argv[1] to argv[2] in 5 MiB parts, one at a time; after the first part is acknowledged it prints the
# bytes acknowledged and waits for a line that never comes: the test kills it there with SIGKILL.
_UPLOADER = """
import sys
from accelerate_txn.store.s3 import MIN_PART_SIZE, S3Store

def progress(acknowledged):
    print(acknowledged, flush=True)
    sys.stdin.readline()

S3Store(part_size=MIN_PART_SIZE, concurrency=1).upload_file(sys.argv[1], sys.argv[2], progress=progress)
print("completed", flush=True)
"""


def test_kill_9_mid_multipart_upload_leaves_no_object_and_the_leftover_upload_is_aborted(
        store: S3Store, prefix: S3Url, tmp_path: Path) -> None:
    path, _ = payload(tmp_path, 3 * MIN_PART_SIZE + 1)
    url = prefix.child("pytorch_model_fsdp_0/__0_0.distcp")
    elsewhere = S3Url(prefix.bucket, prefix.key + "0")  # another checkpoint's open upload: never touched
    other = store.fs.call_s3("create_multipart_upload", Bucket=prefix.bucket, Key=elsewhere.child("x").key)
    kill_uploader_after_its_first_part(_UPLOADER, path, url, MIN_PART_SIZE, REPO)

    assert store.size(url) is None
    assert store.list(prefix) == {}
    leftovers = store.list_incomplete_uploads(prefix)
    assert [upload.url for upload in leftovers] == [url]
    assert store.abort_incomplete_uploads(prefix) == leftovers
    assert store.list_incomplete_uploads(prefix) == []
    assert store.list(prefix) == {}
    assert [upload.upload_id for upload in store.list_incomplete_uploads(elsewhere)] == [other["UploadId"]]
    store.abort_incomplete_uploads(elsewhere)
