"""Checkpoints in Azure Blob Storage end to end: real 2-rank FSDP1 jobs (gloo) saving to ``az://`` URLs on the
loopback Azurite (``tests.support.azurite``) and restoring from them exactly; the command line on the same prefix; and a
mirrored run killed with ``kill -9`` in the middle of its uploads, which leaves only complete checkpoints.

The S3 suite (tests/core/test_remote.py, tests/cli/test_cli_remote.py) covers the protocol of ``core.remote`` in depth; these
tests show that it holds on Azure's store, with one launch each (CI's time budget)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import MANIFEST
from accelerate_txn.testing import LaunchError, launch
from tests.support.azurite import CONTAINER, Azurite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
TIMEOUT = 300


def _parent(name: str) -> str:
    return f"az://{CONTAINER}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def saved(azurite: Azurite, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    parent = _parent("roundtrip")
    cache = tmp_path_factory.mktemp("azure_roundtrip") / "cache"
    ranks = launch("tests.scenarios.object_store_scenarios:roundtrip", 2, args=(parent, str(cache)), timeout=TIMEOUT)
    return {"parent": parent, "ranks": ranks}


def test_an_fsdp1_save_to_azure_commits_one_transaction_and_restores_exactly(saved: dict[str, Any]) -> None:
    for obs in saved["ranks"]:
        assert obs["returned_2"] == f"{saved['parent']}/checkpoint_2"
        assert [key for key in obs["objects"] if "/" not in key] == [MANIFEST]
        prefixes = {key.split("/")[0] for key in obs["objects"] if key != MANIFEST}
        assert len(prefixes) == 1 and next(iter(prefixes)).startswith(".txn-"), obs["objects"]
        assert any(key.endswith(".distcp") for key in obs["objects"]), obs["objects"]
        assert obs["before_differences"] > 0  # the fresh model differed before the restore
        assert obs["error"] is None, obs["error"]
        assert obs["differences"] == [] and obs["rng"] and obs["lr"]


def test_the_command_line_lists_verifies_and_prunes_an_azure_prefix(cli: Any, saved: dict[str, Any],
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_txn.store.azure import AzureStore, AzureUrl

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    parent = saved["parent"]
    listed = cli("list", parent, "--json")
    assert listed.code == 0, listed.err
    assert {row["name"]: row["status"] for row in listed.json()["checkpoints"]} == {
        "checkpoint_2": "complete", "checkpoint_1": "complete"}
    assert listed.json()["would_load"] == f"{parent}/checkpoint_2"
    full = cli("verify", f"{parent}/checkpoint_2", "--full")
    assert full.code == 0, full.err
    assert cli("latest", parent).out.strip() == f"{parent}/checkpoint_2"
    pruned = cli("prune", parent, "--keep", "1")
    assert pruned.code == 0 and "deleted: checkpoint_1" in pruned.out, pruned.err
    store = AzureStore()
    assert store.list(f"{parent}/checkpoint_1") == {}

    # A flipped byte in a shard: verify --full names the damaged blob's URL; latest finds nothing complete.
    manifest = store.read_bytes(f"{parent}/checkpoint_2/{MANIFEST}", limit=2**20)
    shard = next(key for key in store.list(f"{parent}/checkpoint_2") if key.endswith(".distcp"))
    url = AzureUrl.parse(f"{parent}/checkpoint_2/{shard}")
    blob = store.client.get_blob_client(url.container, url.key)
    data = bytearray(blob.download_blob().readall())
    data[len(data) // 2] ^= 0x01
    blob.upload_blob(bytes(data), overwrite=True)
    damaged = cli("verify", f"{parent}/checkpoint_2", "--full")
    assert damaged.code != 0 and str(url) in damaged.out + damaged.err, (damaged.out, damaged.err)
    none = cli("latest", parent)
    assert none.code == 1 and none.out == "", none.err
    assert store.read_bytes(f"{parent}/checkpoint_2/{MANIFEST}", limit=2**20) == manifest  # the CLI only read


def test_kill_9_during_a_mirror_upload_to_azure_leaves_only_complete_checkpoints(
        azurite: Azurite, cli: Any, tmp_path: Path) -> None:
    from accelerate_txn.core.remote import check_listing, checkpoints, layout, read_manifest
    from accelerate_txn.store.azure import AzureStore

    mirror = _parent("killed")
    with pytest.raises(LaunchError, match=r"died with exit codes \[-9"):  # SIGKILL at the point, not an error
        launch("tests.scenarios.remote_scenarios:mirrored", 2,
               args=(str(tmp_path / "run"), mirror, str(tmp_path / "cache"), 3, 1),
               env={"ACCELERATE_TXN_KILL_AT": "upload:during#12"}, timeout=TIMEOUT)
    store = AzureStore()
    committed = checkpoints(store, mirror)
    for _number, url in committed:  # every committed checkpoint is complete, checked against its listing
        check_listing(store, url, read_manifest(store, url))
    unfinished = [name for name, entry in layout(store, mirror).items() if not entry["manifest"]]
    assert unfinished, layout(store, mirror)  # the killed upload left objects that no manifest commits
    listed = cli("list", mirror, "--json")
    statuses = {row["name"]: row["status"] for row in listed.json()["checkpoints"]}
    assert {name: statuses[name] for name in unfinished} == {name: "unfinished upload" for name in unfinished}
    assert all(statuses[url.rsplit("/", 1)[1]] == "complete" for _number, url in committed), statuses
    # The kill comes at the 12th file a rank uploads: here the second checkpoint's upload (the first one committed).
    latest = cli("latest", mirror)
    if committed:
        assert latest.code == 0 and latest.out.strip() == committed[-1][1], (latest.out, latest.err)
    else:
        assert latest.code == 1 and latest.out == "", (latest.out, latest.err)
