"""Checkpoints in object storage end to end: real 2-rank FSDP jobs (gloo) saving to and restoring from ``s3://`` on
the loopback S3 server (``tests._s3_server``): exact round trips, per-transaction keys and replacement, damaged
objects refused before anything is restored, the mirror tier, and kill -9 during an upload."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from accelerate_txn.testing import launch
from tests._s3_server import BUCKET, Server

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
TIMEOUT = 400


def _parent(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def roundtrip(request: Any, s3_server: Server, tmp_path_factory: Any) -> list[dict[str, Any]]:
    cache = tmp_path_factory.mktemp(f"remote_roundtrip_{request.param}") / "cache"
    return launch("tests._remote_scenarios:roundtrip", 2, args=(_parent("roundtrip"), str(cache), request.param),
                  timeout=TIMEOUT)


def test_save_to_a_url_commits_one_transaction_and_resumes_exactly(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["returned"].startswith("s3://") and obs["returned"].endswith("/checkpoint_1")
        manifests = [key for key in obs["objects"] if key == "checkpoint_manifest.json"]
        assert manifests == ["checkpoint_manifest.json"]
        prefixes = {key.split("/")[0] for key in obs["objects"] if key != "checkpoint_manifest.json"}
        assert len(prefixes) == 1 and next(iter(prefixes)).startswith(".txn-")
        for label in ("fresh", "again"):
            assert obs[f"{label}_error"] is None, obs[f"{label}_error"]
            assert obs[f"{label}_differences"] == []
            assert obs[f"{label}_rng"] and obs[f"{label}_lr"]
            assert obs[f"{label}_copies"] == ["checkpoint_1"]


def test_resaving_a_name_replaces_it_as_a_whole(roundtrip: list[dict[str, Any]]) -> None:
    first = {key.split("/")[0] for key in roundtrip[0]["objects"]}
    second = {key.split("/")[0] for key in roundtrip[0]["replaced_objects"]}
    assert len(second) == 2 and "checkpoint_manifest.json" in second and second != first


def test_loading_a_url_without_a_checkpoint_is_refused_on_every_rank(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["missing_error"]["type"] == "NoCheckpointError"
        assert "checkpoint_9" in obs["missing_error"]["message"]
        assert obs["unchanged_after_missing"]
