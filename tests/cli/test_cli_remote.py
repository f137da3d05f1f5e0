"""The command line on checkpoints in object storage: every command given ``s3://`` URLs (a prefix of checkpoints,
or one checkpoint) on the loopback S3 server (``tests.support.s3_server``), reached only through the standard AWS
environment.

The checkpoints are real: one 2-rank FSDP1 job (gloo) saves ``checkpoint_1`` to ``checkpoint_3`` of one run to
``s3://`` (``tests.scenarios.remote_scenarios:series``). Each test that damages anything works on a server-side copy of
that prefix: a flipped byte, a missing object, an extra object a loader would read, a manifest copied from another
checkpoint (foreign), a transaction prefix with no manifest (an unfinished upload).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import MANIFEST
from accelerate_txn.store.s3 import S3Store
from accelerate_txn.testing import launch
from tests.cli import test_cli
from tests.support.s3_server import BUCKET, Server

REPO = test_cli.REPO

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
TIMEOUT = 240


def _fs() -> Any:
    return S3Store().fs


@pytest.fixture(scope="module")
def saved(s3_server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``s3://.../checkpoint_1..3`` of one run (pristine: tests copy before changing anything), and the local copy
    of ``checkpoint_3`` the save left in its cache."""
    parent = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}"
    cache = tmp_path_factory.mktemp("cli_remote") / "cache"
    launch("tests.scenarios.remote_scenarios:series", 2, args=(parent, str(cache), 1, 3), timeout=TIMEOUT)
    local = next(cache.rglob("checkpoint_3"))
    return {"parent": parent, "local": local, "manifests": {
        n: json.loads(_fs().cat_file(f"{parent}/checkpoint_{n}/{MANIFEST}")) for n in (1, 2, 3)}}


@pytest.fixture
def copy(saved: dict[str, Any]) -> str:
    """A fresh server-side copy of the saved prefix."""
    target = f"s3://{BUCKET}/copy-{uuid.uuid4().hex[:8]}"
    _fs().copy(saved["parent"], target, recursive=True)
    return target


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the commands download into (to see that they leave nothing there)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _data(manifest: dict[str, Any]) -> str:
    return f".txn-{manifest['run_id']}-{manifest['transaction_id']}"


def _key(parent: str, number: int, manifest: dict[str, Any], name: str) -> str:
    return f"{parent}/checkpoint_{number}/{_data(manifest)}/{name}"


def _payload(manifest: dict[str, Any]) -> str:
    return next(name for name in sorted(manifest["files"]) if name.endswith(".distcp"))


def _flip(url: str) -> None:
    data = bytearray(_fs().cat_file(url))
    data[len(data) // 2] ^= 0xFF
    _fs().pipe_file(url, bytes(data))


# --------------------------------------------------------------------------------------------- list, latest


def test_list_shows_complete_damaged_and_unfinished_checkpoints_of_a_prefix(cli: Any, saved: dict[str, Any],
                                                                             copy: str, scratch: Path) -> None:
    manifests = saved["manifests"]
    _flip(_key(copy, 2, manifests[2], _payload(manifests[2])))
    unfinished = f"{copy}/checkpoint_4/.txn-{manifests[3]['run_id']}-{'e' * 32}/random_states_0.pkl"
    _fs().pipe_file(unfinished, b"partial")
    listed = cli("list", copy, "--json")
    assert listed.code == 0, listed.err
    data = listed.json()
    rows = {row["name"]: row for row in data["checkpoints"]}
    assert [row["name"] for row in data["checkpoints"]] == ["checkpoint_4", "checkpoint_3", "checkpoint_2", "checkpoint_1"]
    assert {name: row["status"] for name, row in rows.items()} == {
        "checkpoint_4": "unfinished upload", "checkpoint_3": "complete", "checkpoint_2": "corrupt",
        "checkpoint_1": "complete"}
    assert data["would_load"] == f"{copy}/checkpoint_3" and rows["checkpoint_3"]["would_load"]
    assert _payload(manifests[2]) in rows["checkpoint_2"]["reason"] and copy in rows["checkpoint_2"]["reason"]
    assert rows["checkpoint_4"]["run_id"] == manifests[3]["run_id"] and rows["checkpoint_4"]["size_bytes"] == 7
    assert rows["checkpoint_3"]["size_bytes"] == sum(row["size"] for row in manifests[3]["files"].values()) + len(
        _fs().cat_file(f"{copy}/checkpoint_3/{MANIFEST}"))
    assert rows["checkpoint_3"]["checkpoint_number"] == 3 and rows["checkpoint_1"]["checkpoint_number"] == 1
    assert rows["checkpoint_3"]["modified"] is None  # a listing has no times: not made up
    text = cli("list", copy)
    assert text.code == 0 and "unfinished upload" in text.out and "newest complete checkpoint: checkpoint_3" in text.out
    assert list(scratch.iterdir()) == []
    # A checkpoint is not a prefix: a usage error that says what to run instead.
    wrong = cli("list", f"{copy}/checkpoint_3")
    assert wrong.code == 2 and f"accelerate-txn verify {copy}/checkpoint_3" in wrong.err and wrong.out == ""
    # Nothing under the prefix: exit 1 ("none found"), as a local empty directory and as latest.
    nothing = f"s3://{BUCKET}/nothing-{uuid.uuid4().hex[:8]}"
    empty = cli("list", nothing, "--json")
    assert empty.code == 1 and empty.json()["checkpoints"] == [] and empty.json()["would_load"] is None
    assert "no checkpoints" in empty.err
    text_empty = cli("list", nothing)
    assert text_empty.code == 1 and f"{nothing}: no checkpoints" in text_empty.err and text_empty.out == ""


def test_latest_downloads_and_hashes_and_skips_a_damaged_newest(cli: Any, saved: dict[str, Any], copy: str,
                                                                 scratch: Path) -> None:
    pristine = cli("latest", saved["parent"])
    assert pristine.code == 0 and pristine.out.strip() == f"{saved['parent']}/checkpoint_3", pristine.err
    _flip(_key(copy, 3, saved["manifests"][3], _payload(saved["manifests"][3])))
    skipped = cli("latest", copy, "--json")
    assert skipped.code == 0 and skipped.json()["latest"] == f"{copy}/checkpoint_2"
    assert "Skipping checkpoint" in skipped.err and f"{copy}/checkpoint_3" in skipped.err
    assert list(scratch.iterdir()) == []
    none = cli("latest", f"s3://{BUCKET}/nothing-{uuid.uuid4().hex[:8]}")
    assert none.code == 1 and "no checkpoints" in none.err and none.out == ""


# --------------------------------------------------------------------------------------------- verify


def test_verify_a_remote_checkpoint_quick_full_and_dcp(cli: Any, saved: dict[str, Any], scratch: Path) -> None:
    url = f"{saved['parent']}/checkpoint_3"
    files = saved["manifests"][3]["files"]
    text = cli("verify", url)
    assert text.code == 0, text.err
    assert text.out.startswith(f"{url}: valid (run {saved['manifests'][3]['run_id']}")
    assert f"{len(files)} files present with their recorded sizes (objects of one listing)" in text.out
    assert "downloaded and hashed" in text.out
    full = cli("verify", url, "--full", "--dcp", "--json")
    assert full.code == 0, full.err
    checked = full.json()["checked"]
    assert full.json()["path"] == url and checked["full"] and checked["dcp"]
    assert checked["files"] == len(files) and checked["hashed"] == len(files) and checked["downloaded"] == len(files)
    assert checked["dcp_metadata"] == 2  # the model's and the optimizer's DCP directories
    assert list(scratch.iterdir()) == []  # the temporary copies are removed


@pytest.mark.parametrize("damage", ["flipped byte", "missing object", "extra object", "foreign manifest", "unfinished"])
def test_verify_refuses_damage_naming_the_url(cli: Any, saved: dict[str, Any], copy: str, scratch: Path,
                                              damage: str) -> None:
    manifest = saved["manifests"][2]
    url = f"{copy}/checkpoint_2"
    payload = _key(copy, 2, manifest, _payload(manifest))
    if damage == "flipped byte":
        _flip(payload)
        words = [payload]
    elif damage == "missing object":
        _fs().rm(payload)
        words = [payload, "is missing"]
    elif damage == "extra object":
        _fs().pipe_file(_key(copy, 2, manifest, "random_states_7.pkl"), b"x" * 10)
        words = ["random_states_7.pkl", "not in the checkpoint's inventory"]
    elif damage == "foreign manifest":
        _fs().copy(f"{copy}/checkpoint_1/{MANIFEST}", f"{url}/{MANIFEST}")
        words = [f"{url}/{_data(saved['manifests'][1])}", "is missing"]
    else:
        _fs().rm(f"{url}/{MANIFEST}")
        words = [url, "unfinished upload"]
    result = cli("verify", url, "--json")
    assert result.code == 1
    assert result.json()["valid"] is False
    for word in words:
        assert word in result.json()["error"] and word in result.err, (damage, word, result.err)
    assert list(scratch.iterdir()) == []
    if damage == "flipped byte":  # same size: only the hash of the download finds it
        assert "XXH3-128" in result.err


def test_verify_usage_errors_name_the_url_and_the_fix(cli: Any, saved: dict[str, Any]) -> None:
    prefix = cli("verify", saved["parent"])
    assert prefix.code == 2 and f"accelerate-txn list {saved['parent']}" in prefix.err
    nothing = cli("verify", f"{saved['parent']}/checkpoint_9")
    assert nothing.code == 2 and "nothing is stored there" in nothing.err and f"list {saved['parent']}" in nothing.err
    other = cli("verify", "hdfs://bucket/run/checkpoint_1")
    assert other.code == 2 and "hdfs:// is not supported" in other.err and "gs://BUCKET/PREFIX" in other.err
    bad = cli("verify", "s3://bucket/run/../checkpoint_1")
    assert bad.code == 2 and "'..'" in bad.err
    for command in ("verify", "list"):  # the bucket: its prefixes of checkpoints are named
        bucket = cli(command, f"s3://{BUCKET}")
        assert bucket.code == 2 and saved["parent"] in bucket.err and f"accelerate-txn list s3://{BUCKET}/" in bucket.err


# --------------------------------------------------------------------------------------------- inspect, diff


def test_inspect_and_diff_read_remote_manifests(cli: Any, saved: dict[str, Any]) -> None:
    url = f"{saved['parent']}/checkpoint_3"
    shown = cli("inspect", url, "--json")
    assert shown.code == 0, shown.err
    assert shown.json()["run_id"] == saved["manifests"][3]["run_id"]
    assert shown.json()["components"][""]["world_size"] == 2
    assert "world size 2" in cli("inspect", url).out
    same = cli("diff", f"{saved['parent']}/checkpoint_1", url)
    assert same.code == 0 and "would resume A" in same.out, same.err
    mixed = cli("diff", url, saved["local"], "--json")  # a URL and a local path: the same manifest
    assert mixed.code == 0 and mixed.json()["would_resume"] and mixed.json()["same_run"], mixed.err


# --------------------------------------------------------------------------------------------- prune


def test_prune_a_prefix_manifest_first_with_dry_run_and_refusal(cli: Any, saved: dict[str, Any], copy: str) -> None:
    dry = cli("prune", copy, "--keep", "2", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    assert dry.json()["would_delete"] == [f"{copy}/checkpoint_1"] and dry.json()["deleted"] == []
    assert _fs().exists(f"{copy}/checkpoint_1/{MANIFEST}")
    done = cli("prune", copy, "--keep", "2")
    assert done.code == 0 and "deleted: checkpoint_1" in done.out and "kept: checkpoint_2, checkpoint_3" in done.out
    assert S3Store().list(f"{copy}/checkpoint_1") == {}
    assert cli("latest", copy).out.strip() == f"{copy}/checkpoint_3"
    # A corrupt published checkpoint of the run would count toward --keep: refused, nothing deleted.
    _fs().rm(_key(copy, 3, saved["manifests"][3], _payload(saved["manifests"][3])))
    refused = cli("prune", copy, "--keep", "1")
    assert refused.code == 1 and "Refusing to prune" in refused.err and "checkpoint_3" in refused.err
    assert _fs().exists(f"{copy}/checkpoint_2/{MANIFEST}")


def _commit_copy_of(saved: dict[str, Any], url: str) -> None:
    """Commit the saved run's ``checkpoint_3`` (its local copy) at ``url`` through the library's own upload and
    create-only commit (``core.remote``): a save of the same run committing a newer checkpoint."""
    from accelerate_txn.core import remote as objects
    from accelerate_txn.core.manifest import read_manifest

    store = S3Store()
    manifest = read_manifest(saved["local"])
    objects.upload(store, saved["local"], url, manifest, sorted(manifest["files"]))
    assert objects.commit(store, url, manifest, replace=False) is False


def test_prune_of_a_prefix_never_deletes_a_checkpoint_committed_after_its_scan(
        cli: Any, saved: dict[str, Any], copy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: the CLI scanned checkpoint_1..3, a save committed checkpoint_4 before retention listed; retention
    protected only the scan's newest (checkpoint_3), counted checkpoint_4 as old and deleted it with --keep 1."""
    from accelerate_txn.cli import _remote

    real = _remote.prune
    committed = []

    def commit_then_prune(url: str, run_id: str, keep: int, newest: str) -> list[str]:
        _commit_copy_of(saved, f"{copy}/checkpoint_4")  # after the CLI's scan and decision, before retention lists
        committed.append(True)
        return real(url, run_id, keep, newest)

    monkeypatch.setattr(_remote, "prune", commit_then_prune)
    done = cli("prune", copy, "--keep", "1", "--json")
    assert done.code == 0, done.err
    assert committed == [True]
    assert done.json()["deleted"] == [f"{copy}/checkpoint_1", f"{copy}/checkpoint_2"]
    assert _fs().exists(f"{copy}/checkpoint_4/{MANIFEST}")
    monkeypatch.setattr(_remote, "prune", real)
    assert cli("latest", copy).out.strip() == f"{copy}/checkpoint_4"  # the newest complete checkpoint survived
    # The next prune, with nothing committed meanwhile, keeps exactly the newest.
    again = cli("prune", copy, "--keep", "1", "--json")
    assert again.code == 0 and again.json()["deleted"] == [f"{copy}/checkpoint_3"], again.out
    assert cli("latest", copy).out.strip() == f"{copy}/checkpoint_4"


def test_remote_retention_never_deletes_what_became_the_newest_complete_checkpoint_while_it_ran(
        saved: dict[str, Any], copy: str) -> None:
    """No lock on an object store: after its decision (delete checkpoint_1 and checkpoint_2, keep 1), checkpoint_3
    is deleted by someone else. Retention lists again before each deletion, so checkpoint_2, now the run's newest
    complete checkpoint, is kept; and a checkpoint committed after its listing is never a victim."""
    from accelerate_txn.core import remote as objects

    store = S3Store()
    run = saved["manifests"][3]["run_id"]
    events = []

    def meanwhile() -> None:  # called after each victim's manifest was deleted
        if not events:
            store.delete_prefix(f"{copy}/checkpoint_3", first=[MANIFEST])  # another prune, or a user
            _commit_copy_of(saved, f"{copy}/checkpoint_0")  # an older number, committed after the listing
        events.append(True)

    deleted = objects.prune(store, copy, run, 1, f"{copy}/checkpoint_3", between=meanwhile)
    assert deleted == [f"{copy}/checkpoint_1"] and len(events) == 1
    assert [url for _n, url in objects.checkpoints(store, copy)] == [f"{copy}/checkpoint_0", f"{copy}/checkpoint_2"]
    assert objects.complete_run_id(store, f"{copy}/checkpoint_2") == run


# --------------------------------------------------------------------------------------------- export


def test_export_from_a_url_equals_the_export_of_the_local_copy(cli: Any, saved: dict[str, Any], tmp_path: Path,
                                                               scratch: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"_class_name": "Tiny", "width": 16}))
    url = f"{saved['parent']}/checkpoint_3"
    remote = cli("export", url, config, tmp_path / "remote", "--json")
    assert remote.code == 0, remote.err
    local = cli("export", saved["local"], config, tmp_path / "local", "--json")
    assert local.code == 0, local.err
    assert remote.json()["files"] == local.json()["files"] and any(f.endswith(".safetensors") for f in remote.json()["files"])
    for name in local.json()["files"]:
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    assert list(scratch.iterdir()) == []
    refused = cli("export", url, config, f"s3://{BUCKET}/out")
    assert refused.code == 2 and "local path" in refused.err
    # Without a config: the checkpoint carries none, and the usage error names --config (issue 46, item 1), which
    # works as CONFIG does.
    missing = cli("export", url, tmp_path / "none")
    assert missing.code == 2 and f"{url} carries no config.json" in missing.err
    assert f"'accelerate-txn export {url} {tmp_path / 'none'} --config MODEL'" in missing.err
    assert not (tmp_path / "none").exists() and list(scratch.iterdir()) == []
    option = cli("export", url, tmp_path / "option", "--config", config, "--json")
    assert option.code == 0 and option.json()["files"] == local.json()["files"], option.err
    # The export uploaded to the store is no checkpoint: a usage error saying what it is (issue 46, item 2).
    uploaded = f"s3://{BUCKET}/export-{uuid.uuid4().hex[:8]}"
    _fs().put(str(tmp_path / "local") + "/", uploaded, recursive=True)
    verify = cli("verify", uploaded, "--json")
    assert verify.code == 2 and verify.out == "", verify.err
    assert f"{uploaded} is not a checkpoint: it is a model directory (config.json, diffusion_pytorch_model" in verify.err


# --------------------------------------------------------------------------------------------- process


def test_list_and_verify_of_a_url_import_no_torch_and_client_errors_print_no_traceback(saved: dict[str, Any]) -> None:
    code = ("import sys\nfrom accelerate_txn.cli import main\n"
            f"codes = [main(['list', {saved['parent']!r}, '--json']), main(['verify', {saved['parent'] + '/checkpoint_3'!r}])]\n"
            "print('torch' in sys.modules, codes)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.stdout.strip().splitlines()[-1] == "False [0, 0]", result.stdout + result.stderr
    unreachable = subprocess.run([sys.executable, "-m", "accelerate_txn", "list", f"s3://{BUCKET}/run"],
                                 capture_output=True, text=True, timeout=120, cwd=REPO,
                                 env={**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                                      "AWS_MAX_ATTEMPTS": "1"})
    assert unreachable.returncode == 1 and "Traceback" not in unreachable.stderr, unreachable.stderr
    assert "AWS_ENDPOINT_URL" in unreachable.stderr


def test_the_remote_export_reads_the_model_directory_the_weights_exporter_reads() -> None:
    # The CLI keeps its own copy of the name (importing accelerate_txn.weights would import torch for `list`).
    from accelerate_txn.cli._remote import MODEL_DIR
    from accelerate_txn.weights._common import ACCELERATE_FSDP_MODEL_DIR

    assert MODEL_DIR == ACCELERATE_FSDP_MODEL_DIR
