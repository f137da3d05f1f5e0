"""The Google Cloud Storage store end to end against a real GCS server on loopback (fake-gcs-server, started by
``tests.support.fakegcs``): create-only commits, uploads hashed as they are sent (one request, or a resumable upload chunk
by chunk), verified downloads, listing bounded by the prefix, deletion manifest first, hostile object names, the
library's errors for a missing bucket, missing or refused credentials and an endpoint out of reach, and a real
``kill -9`` in the middle of a resumable upload. The same operations as the S3 and Azure stores'
(tests/support/object_store_checks.py), with GCS's condition (``ifGenerationMatch=0``, 412).

The client reaches the server only through the standard variable ``STORAGE_EMULATOR_HOST``, as a user's would. The
order of requests is read from the server's own log, not from the client.
"""

from __future__ import annotations

import gc
import json
import re
import socket
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import xxhash

from accelerate_txn.errors import (
    CheckpointConfigurationError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIntegrityError,
)
from accelerate_txn.store.base import ObjectStore
from accelerate_txn.store.gcs import SINGLE_REQUEST_LIMIT, GcsStore, GcsUrl
from tests.support.fakegcs import BUCKET, FakeGcs
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

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
CHUNK = 256 * 2**10  # the smallest chunk GCS takes: a 3-chunk file is 768 KiB


@pytest.fixture
def store(fake_gcs: FakeGcs) -> GcsStore:
    return GcsStore(chunk_size=CHUNK, single_request_size=CHUNK, concurrency=4)


@pytest.fixture
def prefix(fake_gcs: FakeGcs, request: pytest.FixtureRequest) -> GcsUrl:
    """A fresh location of this test's own: ``gs://BUCKET/<test>-<id>/checkpoint_1``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:60]
    return GcsUrl.parse(f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}/checkpoint_1")


def _object(url: GcsUrl) -> str:
    """The request path of the object ``url`` in the JSON API (metadata, deletion)."""
    return f"/storage/v1/b/{url.bucket}/o/{quote(url.key, safe='')}"


def _raw(url: GcsUrl) -> Any:
    """The object ``url`` through the bare client, as another writer (or bit rot) would reach it."""
    from google.cloud import storage

    return storage.Client(project=None).bucket(url.bucket).blob(url.key)


# -- URLs and set-up -------------------------------------------------------------------------------------------

def test_url_parsing_accepts_plain_urls_and_names_the_bad_ones() -> None:
    assert GcsUrl.parse("gs://my-bucket/run/checkpoint_1/") == GcsUrl("my-bucket", "run/checkpoint_1")
    assert GcsUrl.parse("gs://my_bucket.example.com") == GcsUrl("my_bucket.example.com", "")
    url = GcsUrl.parse("gs://my-bucket/run")
    assert (url.prefix, str(url.child("checkpoint_1/model.safetensors"))) == (
        "run/", "gs://my-bucket/run/checkpoint_1/model.safetensors")
    refusals = {
        "/local/path": "Not a Google Cloud Storage URL",
        "s3://my-bucket/run": "Not a Google Cloud Storage URL",
        "gs://My-Bucket/run": "does not name a valid bucket",
        "gs://ab/run": "does not name a valid bucket",
        "gs:///run": "does not name a valid bucket",
        f"gs://{'a' * 64}/run": "at most 63 characters",
        "gs://goog-checkpoints/run": "cannot start with 'goog'",
        "gs://my-bucket/run//checkpoint_1": "empty, '.' or '..' path segment",
        "gs://my-bucket/run/../other": "empty, '.' or '..' path segment",
        "gs://my-bucket/run/./checkpoint_1": "empty, '.' or '..' path segment",
        "gs://my-bucket/run?generation=3": "contains '?', '#', '*', '[' or ']'",
        "gs://my-bucket/run/checkpoint_[1]": "contains '?', '#', '*', '[' or ']'",
        "gs://my-bucket/run/\nx": "control character",
        f"gs://my-bucket/{'é' * 513}": "longer than GCS's 1024 bytes",
    }
    for text, message in refusals.items():
        with pytest.raises(CheckpointConfigurationError, match=re.escape(message)) as caught:
            GcsUrl.parse(text)
        assert repr(text) in str(caught.value)
    with pytest.raises(CheckpointConfigurationError, match=re.escape("'..' path segment")):
        url.child("../escape")


def test_without_the_client_the_module_imports_and_the_error_names_the_extra_to_install() -> None:
    # A fresh interpreter where `from google.cloud import storage` fails, as where the gcs extra is not installed.
    message = error_without_the_client("google.cloud.storage", "store.gcs", "GcsStore", "GcsUrl",
                                       "gs://my-bucket/run", REPO)
    assert message == ("Checkpoints in Google Cloud Storage (gs:// URLs) need the google-cloud-storage "
                       "client, which is not installed here: pip install 'accelerate-txn[gcs]'")


def test_without_credentials_the_error_names_application_default_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A machine with no credentials anywhere: no emulator, no key file, no gcloud configuration, not on GCE.
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # google-auth's own switch: do not probe a metadata server
    with pytest.raises(CheckpointConfigurationError, match="No Google Cloud credentials were found") as caught:
        GcsStore()
    for fix in ("gcloud auth application-default login", "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST"):
        assert fix in str(caught.value)


def test_refused_credentials_are_a_configuration_error_naming_the_url(
        fake_gcs: FakeGcs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Application Default Credentials from a service account key file whose token endpoint (the loopback server)
    # refuses them: the client's first request fails exchanging the key for a token, before anything reaches a store.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    key = tmp_path / "credentials.json"
    key.write_text(json.dumps({"type": "service_account", "project_id": "accelerate-txn-tests",
                               "private_key_id": "0", "private_key": private,
                               "client_email": "tests@accelerate-txn-tests.iam.gserviceaccount.com",
                               "client_id": "0", "token_uri": f"{fake_gcs.endpoint}/token"}))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    store = GcsStore(retry_timeout=5)
    url = f"gs://{BUCKET}/run/checkpoint_1"
    for operation in (lambda: store.list(url), lambda: store.size(url), lambda: store.write_new(url, b"{}")):
        with pytest.raises(CheckpointConfigurationError, match=re.escape(f"Google Cloud Storage refused access to {url}")
                           ) as caught:
            operation()
        assert "GOOGLE_APPLICATION_CREDENTIALS" in str(caught.value)
        assert "roles/storage.objectAdmin" in str(caught.value)


def test_an_unreachable_endpoint_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    store = GcsStore(retry_timeout=1)
    url = f"gs://{BUCKET}/run/checkpoint_1"
    source, _ = payload(tmp_path, 100)
    for operation in (lambda: store.list(url), lambda: store.write_new(f"{url}/{MANIFEST}", b"{}"),
                      lambda: store.upload_file(source, f"{url}/x.bin")):
        with pytest.raises(CheckpointError) as caught:
            operation()
        message = str(caught.value)
        assert type(caught.value) is CheckpointError, message
        assert f"Google Cloud Storage at {endpoint} could not be reached or kept failing for gs://" in message
        assert "retried for 1 s" in message and "STORAGE_EMULATOR_HOST" in message


def test_a_missing_bucket_is_named_with_the_fix(store: GcsStore, tmp_path: Path) -> None:
    url = GcsUrl.parse("gs://no-such-bucket-accelerate-txn/run/checkpoint_1")
    small, _ = payload(tmp_path, 100, "small.bin")
    large, _ = payload(tmp_path, 3 * CHUNK, "large.bin")
    operations = {
        "list": lambda: store.list(url),
        "size": lambda: store.size(url.child(MANIFEST)),
        "read": lambda: store.read_bytes(url.child(MANIFEST), limit=100),
        "commit": lambda: store.write_new(url.child(MANIFEST), b"{}"),
        "upload": lambda: store.upload_file(small, url.child("small.bin")),
        "resumable upload": lambda: store.upload_file(large, url.child("large.bin")),
        "download": lambda: store.download_file(url.child("x.bin"), tmp_path / "x.bin", size=1, digest=None,
                                                listed=True),
    }
    for what, operation in operations.items():
        with pytest.raises(CheckpointConfigurationError) as caught:
            operation()
        assert "the bucket 'no-such-bucket-accelerate-txn' does not exist" in str(caught.value), what
        assert "gcloud storage buckets create gs://no-such-bucket-accelerate-txn" in str(caught.value), what
    assert not (tmp_path / "x.bin").exists()


def test_the_store_is_an_object_store(store: GcsStore) -> None:
    assert isinstance(store, ObjectStore) and store.name == "gcs"


# -- the commit --------------------------------------------------------------------------------------------------

def test_create_only_commit_wins_once_and_the_second_writer_is_refused(store: GcsStore, prefix: GcsUrl,
                                                                       fake_gcs: FakeGcs) -> None:
    manifest = prefix.child(MANIFEST)
    start: list[int] = []

    def refused() -> None:
        # The server itself refused the write: 412 on the single-request upload with ifGenerationMatch=0, once.
        uploads = [request for request in fake_gcs.settled()[start[0]:] if request[0] == "POST"]
        assert uploads == [("POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=multipart&ifGenerationMatch=0",
                            412)]

    check_second_commit_refused(store, manifest, lambda: start.append(len(fake_gcs.settled())), refused)


def test_create_only_commit_repeated_with_the_same_bytes_succeeds(store: GcsStore, prefix: GcsUrl) -> None:
    check_commit_repeated_with_the_same_bytes(store, prefix)


def test_a_commit_too_large_for_one_request_is_refused_before_anything_is_sent(store: GcsStore, prefix: GcsUrl,
                                                                               fake_gcs: FakeGcs) -> None:
    manifest = prefix.child(MANIFEST)
    start = len(fake_gcs.settled())
    with pytest.raises(CheckpointConfigurationError, match=re.escape(f"{manifest}: a create-only commit of")):
        store.write_new(manifest, b"x" * (SINGLE_REQUEST_LIMIT + 1))
    assert fake_gcs.settled()[start:] == []
    store.write_new(manifest, b"x" * SINGLE_REQUEST_LIMIT)  # the limit itself is one request
    assert store.size(manifest) == SINGLE_REQUEST_LIMIT
    assert [request for request in fake_gcs.settled()[start:] if request[0] == "POST"] == [
        ("POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=multipart&ifGenerationMatch=0", 200)]


def test_create_only_upload_in_one_request_is_refused_when_the_object_exists(store: GcsStore, prefix: GcsUrl,
                                                                            tmp_path: Path) -> None:
    check_create_only_upload_refused(store, prefix.child("scheduler.bin"), tmp_path, CHUNK, size=1000)


def test_a_resumable_create_only_upload_sends_the_precondition_which_the_emulator_ignores(
        store: GcsStore, prefix: GcsUrl, tmp_path: Path, fake_gcs: FakeGcs) -> None:
    # What docs/storage.md says the emulator cannot show: GCS checks ifGenerationMatch=0 of a resumable upload,
    # fake-gcs-server does not. The store sends it; the protocol never relies on it (a manifest is one request).
    url = prefix.child("model.safetensors")
    first, _ = payload(tmp_path, 2 * CHUNK + 100, "first.bin")
    second, second_data = payload(tmp_path, 2 * CHUNK + 100, "second.bin")
    start = len(fake_gcs.settled())
    store.upload_file(first, url, create_only=True)
    initiations = [request for request in fake_gcs.settled()[start:] if request[0] == "POST"]
    assert initiations == [("POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=resumable&ifGenerationMatch=0", 200)]
    try:
        store.upload_file(second, url, create_only=True)
    except CheckpointExistsError:
        pytest.fail("fake-gcs-server now refuses a resumable upload with ifGenerationMatch=0 onto an existing object: "
                    "update 'what the emulator cannot show' in docs/storage.md and test the refusal here")
    assert _raw(url).download_as_bytes() == second_data


# -- uploads and downloads ---------------------------------------------------------------------------------------

def test_resumable_upload_round_trips_with_the_right_hash(store: GcsStore, prefix: GcsUrl, tmp_path: Path,
                                                          fake_gcs: FakeGcs) -> None:
    url = prefix.child("pytorch_model_fsdp_0/__0_0.distcp")
    start = len(fake_gcs.settled())

    def uploaded() -> None:  # one resumable session, 3 chunks: two acknowledged with 308, the last completes it
        requests = [(method, status) for method, path, status in fake_gcs.settled()[start:]
                    if path.startswith(f"/upload/storage/v1/b/{BUCKET}/o?uploadType=resumable")]
        assert requests == [("POST", 200), ("PUT", 308), ("PUT", 308), ("PUT", 200)], requests

    check_chunked_round_trip(store, url, tmp_path, CHUNK, uploaded)


def test_small_file_goes_in_one_request_with_the_right_hash(store: GcsStore, prefix: GcsUrl, tmp_path: Path,
                                                            fake_gcs: FakeGcs) -> None:
    path, data = payload(tmp_path, 1000)
    url = prefix.child("random_states_0.pkl")
    start = len(fake_gcs.settled())
    assert store.upload_file(path, url) == (1000, xxhash.xxh3_128_hexdigest(data))
    assert [request for request in fake_gcs.settled()[start:] if request[0] in ("POST", "PUT")] == [
        ("POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=multipart", 200)]
    check_empty_file_round_trip(store, prefix, tmp_path)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_object_is_refused_naming_the_url_and_leaves_no_file(store: GcsStore, prefix: GcsUrl,
                                                                     tmp_path: Path, damage: str) -> None:
    url = prefix.child("optimizer_0/__1_0.distcp")

    def replace(altered: bytes) -> None:  # another writer (or bit rot) replaced the object
        _raw(url).upload_from_string(altered)

    check_damaged_object_refused(store, url, tmp_path, CHUNK, damage, replace, listed_too=True)


def test_missing_object_is_refused_naming_the_url(store: GcsStore, prefix: GcsUrl, tmp_path: Path) -> None:
    url = prefix.child("scheduler.bin")
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{url} does not exist")):
        store.download_file(url, tmp_path / "scheduler.bin", size=10, digest="0" * 32)
    with pytest.raises(CheckpointIntegrityError, match="the object store has no such object"):
        store.download_file(url, tmp_path / "scheduler.bin", size=10, digest=None, listed=True)
    assert leftovers(tmp_path) == []
    with pytest.raises(CheckpointIntegrityError, match=re.escape(f"{url} does not exist")):
        store.read_bytes(url, limit=1024)
    assert store.size(url) is None


def test_a_local_failure_during_a_download_names_the_local_side_not_the_object_store(
        store: GcsStore, prefix: GcsUrl, tmp_path: Path) -> None:
    check_local_failure_named(store, prefix, tmp_path, "object")


def test_a_failed_upload_is_never_finalized_and_leaves_no_object(store: GcsStore, prefix: GcsUrl,
                                                                  tmp_path: Path) -> None:
    url = prefix.child("big.bin")
    check_failed_upload_leaves_nothing(store, url, tmp_path, CHUNK)
    gc.collect()  # the abandoned writer is collected: it must not commit what it had
    assert store.size(url) is None and store.list(prefix) == {}

    # The check can fail: the client's own writer, abandoned the same way, commits its bytes so far when collected.
    def abandon() -> None:
        writer = _raw(url).open("wb", chunk_size=CHUNK, ignore_flush=True)
        writer.write(b"x" * (CHUNK + 500))
        raise RuntimeError("the caller gave up")

    with pytest.raises(RuntimeError, match="gave up"):
        abandon()
    gc.collect()
    assert store.size(url) == CHUNK + 500


# -- listing and deletion ----------------------------------------------------------------------------------------

def test_list_holds_exactly_the_objects_under_the_prefix(store: GcsStore, prefix: GcsUrl) -> None:
    sibling = GcsUrl(prefix.bucket, prefix.key + "0")  # checkpoint_10 beside checkpoint_1
    store.write_new(prefix.child(MANIFEST), b"{}")
    store.write_new(prefix.child("pytorch_model_fsdp_0/.metadata"), b"12345")
    store.write_new(sibling.child(MANIFEST), b"{}")
    assert store.list(prefix) == {MANIFEST: 2, "pytorch_model_fsdp_0/.metadata": 5}
    assert store.list(sibling) == {MANIFEST: 2}
    assert store.incomplete_uploads(prefix) == [] and store.abort_incomplete_uploads(prefix) == []


def test_hostile_object_names_are_listed_as_they_are_never_followed_and_deleted_with_their_prefix(
        store: GcsStore, prefix: GcsUrl) -> None:
    # GCS (and the emulator) store names with '..', '.' and empty segments: someone else may put them under a prefix.
    outside = GcsUrl(prefix.bucket, prefix.key.rpartition("/")[0] + "/escape")
    store.write_new(outside, b"outside")
    hostile = ["../escape", "./x", "a//b", "../../../etc/passwd"]
    for name in hostile:
        _raw(GcsUrl(prefix.bucket, f"{prefix.key}/{name}")).upload_from_string(b"hostile")
    store.write_new(prefix.child(MANIFEST), b"{}")
    assert store.list(prefix) == {**dict.fromkeys(hostile, 7), MANIFEST: 2}
    for name in hostile:  # no URL, hence no request, is ever built from such a name
        with pytest.raises(CheckpointConfigurationError, match=re.escape("empty, '.' or '..' path segment")):
            prefix.child(name)
    assert store.delete_prefix(prefix, first=[MANIFEST]) == len(hostile)
    assert store.list(prefix) == {}
    assert store.read_bytes(outside, limit=100) == b"outside"  # '..' named another object, never this one


def test_delete_prefix_removes_the_manifest_before_anything_else(store: GcsStore, prefix: GcsUrl,
                                                                fake_gcs: FakeGcs) -> None:
    sibling = GcsUrl(prefix.bucket, prefix.key + "0")
    for url in (prefix, sibling):
        store.write_new(url.child("pytorch_model_fsdp_0/__0_0.distcp"), b"shard")
        store.write_new(url.child("random_states_0.pkl"), b"rng")
        store.write_new(url.child(MANIFEST), b"{}")

    start = len(fake_gcs.settled())
    assert store.delete_prefix(prefix, first=[MANIFEST]) == 2
    seen = [(method, path.partition("?")[0]) for method, path, _ in fake_gcs.settled()[start:]]
    deletions = [path for method, path in seen if method == "DELETE"]
    assert deletions[0] == _object(prefix.child(MANIFEST)), seen
    assert sorted(deletions[1:]) == sorted(_object(prefix.child(name)) for name in
                                           ("pytorch_model_fsdp_0/__0_0.distcp", "random_states_0.pkl")), seen
    listing = seen.index(("GET", f"/storage/v1/b/{BUCKET}/o"))
    # The manifest's deletion was acknowledged before the rest was even listed; the rest after the listing.
    assert seen.index(("DELETE", deletions[0])) < listing < min(seen.index(("DELETE", path)) for path in deletions[1:])
    assert store.list(prefix) == {}
    assert store.list(sibling) == {MANIFEST: 2, "pytorch_model_fsdp_0/__0_0.distcp": 5, "random_states_0.pkl": 3}

    # The check can fail: without ``first`` the manifest is deleted after the listing, with everything else.
    start = len(fake_gcs.settled())
    assert store.delete_prefix(sibling) == 3
    seen = [(method, path.partition("?")[0]) for method, path, _ in fake_gcs.settled()[start:]]
    assert seen.index(("DELETE", _object(sibling.child(MANIFEST)))) > seen.index(("GET", f"/storage/v1/b/{BUCKET}/o"))
    assert store.list(sibling) == {}


# -- kill -9 -----------------------------------------------------------------------------------------------------

# Uploads argv[1] to argv[2] in 256 KiB chunks; after the first chunk is acknowledged it prints the bytes acknowledged
# and waits for a line that never comes: the test kills it there with SIGKILL.
_UPLOADER = """
import sys
from accelerate_txn.store.gcs import GcsStore

def progress(acknowledged):
    print(acknowledged, flush=True)
    sys.stdin.readline()

GcsStore(chunk_size=2**18, single_request_size=2**18).upload_file(sys.argv[1], sys.argv[2], progress=progress)
print("completed", flush=True)
"""


def test_kill_9_mid_resumable_upload_leaves_no_object_and_the_name_stays_free(
        store: GcsStore, prefix: GcsUrl, tmp_path: Path) -> None:
    path, data = payload(tmp_path, 3 * CHUNK + 1)
    url = prefix.child("pytorch_model_fsdp_0/__0_0.distcp")
    kill_uploader_after_its_first_part(_UPLOADER, path, url, CHUNK, REPO)

    # One chunk of the session was acknowledged; the object does not exist, to reads and to listings.
    assert store.size(url) is None
    assert store.list(prefix) == {}
    assert store.incomplete_uploads(prefix) == []  # GCS cannot list open sessions: nothing to find or abort
    # The name is free: a create-only upload of it succeeds and holds exactly its own bytes.
    size, digest = store.upload_file(path, url, create_only=True)
    store.download_file(url, tmp_path / "back.bin", size=size, digest=digest)
    assert (tmp_path / "back.bin").read_bytes() == data


# -- where gs:// URLs are accepted -------------------------------------------------------------------------------

def test_gs_urls_are_object_store_urls_everywhere_a_url_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate_txn.cli import main
    from accelerate_txn.core.remote import cache_path, is_url

    assert is_url("gs://my-bucket/run/checkpoint_1") and not is_url("gcs://my-bucket/run")
    assert cache_path(Path("/cache"), "gs://my-bucket/run/checkpoint_1") == Path("/cache/gs/my-bucket/run/checkpoint_1")
    # The command line checks the URL with the GCS store's rules before any client exists: a usage error (exit 2).
    assert main(["verify", "gs://My_Bucket/run/checkpoint_1"]) == 2
    assert "does not name a valid bucket ('My_Bucket')" in capsys.readouterr().err
    assert main(["verify", "gs://my-bucket/run/../checkpoint_1"]) == 2
    assert "empty, '.' or '..' path segment" in capsys.readouterr().err
