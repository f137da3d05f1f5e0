"""Checkpoints in Google Cloud Storage end to end: real 2-rank FSDP1 jobs (gloo) saving to ``gs://`` URLs on the
loopback fake-gcs-server (``tests.support.fakegcs``) and restoring from them exactly; the command line on the same prefix;
and a mirrored run killed with ``kill -9`` in the middle of its uploads, which leaves only complete checkpoints, then
resumed from the mirror by a new node.

The S3 suite (tests/core/test_remote.py, tests/cli/test_cli_remote.py) covers the protocol of ``core.remote`` in depth; these
tests show that it holds on Google's store, with one launch each (CI's time budget)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import MANIFEST
from accelerate_txn.testing import LaunchError, launch
from tests.support.fakegcs import BUCKET, FakeGcs

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
TIMEOUT = 240


def _parent(name: str) -> str:
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def saved(fake_gcs: FakeGcs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    parent = _parent("roundtrip")
    cache = tmp_path_factory.mktemp("gcs_roundtrip") / "cache"
    ranks = launch("tests.scenarios.object_store_scenarios:roundtrip", 2, args=(parent, str(cache)), timeout=TIMEOUT)
    return {"parent": parent, "ranks": ranks}


def test_an_fsdp1_save_to_gcs_commits_one_transaction_and_restores_exactly(saved: dict[str, Any]) -> None:
    for obs in saved["ranks"]:
        assert obs["returned_2"] == f"{saved['parent']}/checkpoint_2"
        assert [key for key in obs["objects"] if "/" not in key] == [MANIFEST]
        prefixes = {key.split("/")[0] for key in obs["objects"] if key != MANIFEST}
        assert len(prefixes) == 1 and next(iter(prefixes)).startswith(".txn-"), obs["objects"]
        assert any(key.endswith(".distcp") for key in obs["objects"]), obs["objects"]
        assert obs["before_differences"] > 0  # the fresh model differed before the restore
        assert obs["error"] is None, obs["error"]
        assert obs["differences"] == [] and obs["rng"] and obs["lr"]
        # The verified local copy lives in the cache under gs/BUCKET/PREFIX.
        assert obs["copies"] == [f"gs/{BUCKET}/{saved['parent'].rsplit('/', 1)[1]}/checkpoint_2"], obs["copies"]


def test_the_command_line_lists_verifies_inspects_and_prunes_a_gcs_prefix(cli: Any, saved: dict[str, Any],
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_txn.store.gcs import GcsStore, GcsUrl

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    parent = saved["parent"]
    listed = cli("list", parent, "--json")
    assert listed.code == 0, listed.err
    assert {row["name"]: row["status"] for row in listed.json()["checkpoints"]} == {
        "checkpoint_2": "complete", "checkpoint_1": "complete"}
    assert listed.json()["would_load"] == f"{parent}/checkpoint_2"
    full = cli("verify", f"{parent}/checkpoint_2", "--full")
    assert full.code == 0, full.err
    shown = cli("inspect", f"{parent}/checkpoint_2", "--json")
    assert shown.code == 0 and shown.json()["components"][""]["world_size"] == 2, shown.err
    assert cli("latest", parent).out.strip() == f"{parent}/checkpoint_2"
    pruned = cli("prune", parent, "--keep", "1")
    assert pruned.code == 0 and "deleted: checkpoint_1" in pruned.out, pruned.err
    store = GcsStore()
    assert store.list(f"{parent}/checkpoint_1") == {}

    # A flipped byte in a shard: verify --full names the damaged object's URL; latest finds nothing complete.
    manifest = store.read_bytes(f"{parent}/checkpoint_2/{MANIFEST}", limit=2**20)
    shard = next(key for key in store.list(f"{parent}/checkpoint_2") if key.endswith(".distcp"))
    url = GcsUrl.parse(f"{parent}/checkpoint_2/{shard}")
    blob = store.client.bucket(url.bucket).blob(url.key)
    data = bytearray(blob.download_as_bytes())
    data[len(data) // 2] ^= 0x01
    blob.upload_from_string(bytes(data))
    damaged = cli("verify", f"{parent}/checkpoint_2", "--full")
    assert damaged.code != 0 and str(url) in damaged.out + damaged.err, (damaged.out, damaged.err)
    none = cli("latest", parent)
    assert none.code == 1 and none.out == "", none.err
    assert store.read_bytes(f"{parent}/checkpoint_2/{MANIFEST}", limit=2**20) == manifest  # the CLI only read

    # A bucket that does not exist: the library's error names it and the fix, without a traceback.
    missing = cli("list", "gs://no-such-bucket-accelerate-txn/run")
    assert missing.code == 1 and "the bucket 'no-such-bucket-accelerate-txn' does not exist" in missing.err, missing.err


def _mirrored(root: Path, mirror: str, cache: Path, steps: int, *, resume: bool = False,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return launch("tests.scenarios.remote_scenarios:mirrored", 2, args=(str(root), mirror, str(cache), steps, 1),
                  env={**({"RESUME": "1"} if resume else {}), **(env or {})}, timeout=TIMEOUT)


def _held(mirror: str) -> dict[str, Any]:
    """What the mirror holds: committed checkpoint names (each checked complete against its listing), transaction
    prefixes, and checkpoint names with objects but no manifest."""
    from accelerate_txn.core.remote import check_listing, checkpoints, layout, read_manifest
    from accelerate_txn.store.gcs import GcsStore

    store = GcsStore()
    names = []
    for _number, url in checkpoints(store, mirror):
        check_listing(store, url, read_manifest(store, url))
        names.append(url.rsplit("/", 1)[1])
    found = layout(store, mirror)
    return {"names": names, "prefixes": sorted(f"{name}/{data}" for name, entry in found.items() for data in entry["data"]),
            "unfinished": sorted(name for name, entry in found.items() if not entry["manifest"])}


def test_kill_9_during_a_mirror_upload_to_gcs_leaves_only_complete_checkpoints_and_a_resume_cleans_up(
        fake_gcs: FakeGcs, cli: Any, tmp_path: Path) -> None:
    mirror = _parent("killed")
    with pytest.raises(LaunchError, match=r"died with exit codes \[-9"):  # SIGKILL at the point, not an error
        _mirrored(tmp_path / "run", mirror, tmp_path / "cache", 3, env={"ACCELERATE_TXN_KILL_AT": "upload:during#12"})
    held = _held(mirror)  # every committed checkpoint is complete (checked against its listing)
    assert held["unfinished"], held  # the killed upload left objects that no manifest commits
    listed = cli("list", mirror, "--json")
    statuses = {row["name"]: row["status"] for row in listed.json()["checkpoints"]}
    assert {name: statuses[name] for name in held["unfinished"]} == dict.fromkeys(held["unfinished"], "unfinished upload")
    assert all(statuses[name] == "complete" for name in held["names"]), statuses
    latest = cli("latest", mirror)
    if held["names"]:
        assert latest.code == 0 and latest.out.strip() == f"{mirror}/{held['names'][-1]}", (latest.out, latest.err)
    else:
        assert latest.code == 1 and latest.out == "", (latest.out, latest.err)

    # The node is lost with its local tier: a new one resumes from the mirror's newest complete checkpoint.
    shutil.rmtree(tmp_path / "run")
    newest = max((int(name.split("_")[1]) for name in held["names"]), default=None)
    resumed = _mirrored(tmp_path / "run", mirror, tmp_path / "cache-new-node", 3, resume=newest is not None)
    assert [obs["resumed"] for obs in resumed] == [None if newest is None else newest + 1] * 2, (held, resumed)
    assert [obs["iteration"] for obs in resumed] == [3, 3]
    after = _held(mirror)
    assert after["names"] == ["checkpoint_1", "checkpoint_2"], after  # total_limit=2 on the mirror too
    if newest is not None:
        # The resumed run (the same run id) removed what the killed upload of its run left: only committed ones.
        assert after["unfinished"] == [] and len(after["prefixes"]) == len(after["names"]), after
    else:
        # Killed before its first commit, the run was not resumed: a new run never deletes another run's uploads.
        assert len(after["prefixes"]) == len(after["names"]) + 1, after
    assert cli("latest", mirror).out.strip() == f"{mirror}/checkpoint_2"
