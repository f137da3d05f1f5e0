"""Checkpoints in object storage end to end: real 2-rank FSDP jobs (gloo) saving to and restoring from ``s3://`` on
the loopback S3 server (``tests.support.s3_server``): exact round trips, per-transaction keys and replacement, damaged
objects refused before anything is restored, the mirror tier, and kill -9 during an upload."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import MANIFEST
from accelerate_txn.testing import launch
from tests.support.s3_server import BUCKET, Server

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
TIMEOUT = 400


def _parent(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def roundtrip(request: Any, s3_server: Server, tmp_path_factory: Any) -> list[dict[str, Any]]:
    cache = tmp_path_factory.mktemp(f"remote_roundtrip_{request.param}") / "cache"
    return launch("tests.scenarios.remote_scenarios:roundtrip", 2, args=(_parent("roundtrip"), str(cache), request.param),
                  timeout=TIMEOUT)


def test_save_to_a_url_commits_one_transaction_and_resumes_exactly(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["returned"].startswith("s3://") and obs["returned"].endswith("/checkpoint_1")
        manifests = [key for key in obs["objects"] if key == "checkpoint_manifest.json"]
        assert manifests == ["checkpoint_manifest.json"]
        prefixes = {key.split("/")[0] for key in obs["objects"] if key != "checkpoint_manifest.json"}
        assert len(prefixes) == 1 and next(iter(prefixes)).startswith(".txn-")
        for label in ("fresh", "again", "damaged"):
            assert obs[f"{label}_error"] is None, obs[f"{label}_error"]
            assert obs[f"{label}_differences"] == []
            assert obs[f"{label}_rng"] and obs[f"{label}_lr"]
            assert obs[f"{label}_copies"] == ["checkpoint_1"]
        # Only the damaged cached copy was downloaded again (rank 0 logs it); the others were used as they were.
        assert [obs[f"{label}_downloaded_again"] for label in ("fresh", "again", "damaged")] == (
            [False, False, obs["rank"] == 0])


def test_the_explicit_api_returns_the_verified_local_copy_and_the_log_names_the_url(
        roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        returned = Path(obs["explicit_returned"])
        assert returned.name == "checkpoint_1" and returned.is_absolute() and "://" not in str(returned)
    (line,) = roundtrip[0]["explicit_lines"]  # rank 0 logs it
    assert line.startswith(f"Resumed from checkpoint s3://{BUCKET}/roundtrip-"), line
    assert f"/checkpoint_1, restored from its verified local copy {roundtrip[0]['explicit_returned']} (" in line
    assert roundtrip[1]["explicit_lines"] == []


def test_resaving_a_name_replaces_it_as_a_whole(roundtrip: list[dict[str, Any]]) -> None:
    first = {key.split("/")[0] for key in roundtrip[0]["objects"]}
    second = {key.split("/")[0] for key in roundtrip[0]["replaced_objects"]}
    assert len(second) == 2 and "checkpoint_manifest.json" in second and second != first


def test_an_asynchronous_save_to_a_url_is_committed_in_the_background(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert "checkpoint_manifest.json" in obs["async_objects"]
        assert len({key.split("/")[0] for key in obs["async_objects"]}) == 2  # the manifest and one transaction


def test_loading_a_url_without_a_checkpoint_is_refused_on_every_rank(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["missing_error"]["type"] == "NoCheckpointError"
        assert "checkpoint_9" in obs["missing_error"]["message"]
        assert obs["unchanged_after_missing"]


# -- damaged checkpoints in the bucket ---------------------------------------------------------------------------

DAMAGES = ("flipped_byte", "missing_object", "truncated_object", "extra_object", "foreign_manifest", "no_manifest")


def _damage(store: Any, url: str, how: str, other: str) -> None:
    from accelerate_txn.core.remote import data_dir, join, read_manifest

    manifest = read_manifest(store, url)
    prefix = join(url, data_dir(manifest))
    payload = join(prefix, "pytorch_model_fsdp_0/__0_0.distcp")
    if how == "flipped_byte":
        data = bytearray(store.fs.cat_file(payload))
        data[len(data) // 2] ^= 0x01
        store.fs.pipe_file(payload, bytes(data))
    elif how == "missing_object":
        store.delete(join(prefix, "scheduler.bin"))
    elif how == "truncated_object":
        store.fs.pipe_file(payload, store.fs.cat_file(payload)[:-7])
    elif how == "extra_object":
        store.fs.pipe_file(join(prefix, "optimizer_0/__7_0.distcp"), b"not written by the save")
    elif how == "foreign_manifest":  # another checkpoint's manifest copied over this one's
        store.delete(join(url, "checkpoint_manifest.json"))
        store.fs.pipe_file(join(url, "checkpoint_manifest.json"), store.fs.cat_file(join(other, "checkpoint_manifest.json")))
    elif how == "no_manifest":  # what an upload killed before its commit leaves
        store.delete(join(url, "checkpoint_manifest.json"))


@pytest.fixture(scope="module")
def damaged(s3_server: Server, tmp_path_factory: Any) -> dict[str, Any]:
    from accelerate_txn.store.s3 import S3Store

    parent = _parent("damaged")
    cache = tmp_path_factory.mktemp("remote_damaged")
    names = [*DAMAGES, "intact"]
    launch("tests.scenarios.remote_scenarios:save_many", 2, args=(parent, str(cache / "save"), names), timeout=TIMEOUT)
    store = S3Store()
    for how in DAMAGES:
        _damage(store, f"{parent}/{how}", how, f"{parent}/intact")
    return launch("tests.scenarios.remote_scenarios:load_each", 2, args=(parent, str(cache / "load"), list(DAMAGES)),
                  timeout=TIMEOUT)


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_remote_checkpoint_is_refused_on_every_rank_before_anything_is_restored(
        damaged: list[dict[str, Any]], how: str) -> None:
    errors = [obs[how] for obs in damaged]
    assert all(error is not None for error in errors), errors
    assert len({error["type"] for error in errors}) == 1, errors  # the same error on every rank
    expected = "NoCheckpointError" if how == "no_manifest" else "CheckpointIntegrityError"
    assert errors[0]["type"] == expected, errors[0]
    assert f"/{how}" in errors[0]["message"], errors[0]  # names the damaged checkpoint's URL
    assert all(obs["unchanged"] for obs in damaged)


# -- the mirror tier ---------------------------------------------------------------------------------------------

def _mirrored(root: Any, mirror: str, cache: Any, steps: int, *, resume: bool = False,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return launch("tests.scenarios.remote_scenarios:mirrored", 2, args=(str(root), mirror, str(cache), steps, 1),
                  env={**({"RESUME": "1"} if resume else {}), **(env or {})}, timeout=TIMEOUT)


def _committed(mirror: str) -> dict[str, Any]:
    """What the mirror holds: committed checkpoint names, transaction prefixes, open uploads; each committed
    checkpoint checked against its listing (raises if one is not complete)."""
    from accelerate_txn.core.remote import check_listing, checkpoints, read_manifest
    from accelerate_txn.store.s3 import S3Store

    store = S3Store()
    names = []
    for _number, url in checkpoints(store, mirror):
        check_listing(store, url, read_manifest(store, url))
        names.append(url.rsplit("/", 1)[1])
    prefixes = sorted({"/".join(key.split("/")[:2]) for key in store.list(mirror) if "/.txn-" in key})
    return {"names": names, "prefixes": prefixes, "open_uploads": store.incomplete_uploads(mirror)}


@pytest.fixture(scope="module")
def reference(s3_server: Server, tmp_path_factory: Any) -> list[dict[str, Any]]:
    """An uninterrupted mirrored run of 5 steps (one save per step)."""
    base = tmp_path_factory.mktemp("remote_reference")
    return _mirrored(base / "run", _parent("reference"), base / "cache", 5)


def test_a_mirrored_run_resumes_from_the_remote_tier_exactly(reference: list[dict[str, Any]], tmp_path: Any) -> None:
    import shutil

    mirror = _parent("mirror")
    first = _mirrored(tmp_path / "run", mirror, tmp_path / "cache", 3)
    assert [obs["resumed"] for obs in first] == [None, None] and [obs["iteration"] for obs in first] == [3, 3]
    # total_limit=2 holds on both tiers, and every committed checkpoint is complete; nothing else is left.
    held = _committed(mirror)
    assert held["names"] == ["checkpoint_1", "checkpoint_2"], held
    assert len(held["prefixes"]) == 2 and held["open_uploads"] == []
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("checkpoint_*")) == held["names"]
    # The local newest is damaged: the same checkpoint is taken from the mirror, then training goes on to step 5.
    local = tmp_path / "run" / "checkpoints" / "checkpoint_2" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data = bytearray(local.read_bytes())
    data[len(data) // 2] ^= 0x01
    local.write_bytes(bytes(data))
    second = _mirrored(tmp_path / "run", mirror, tmp_path / "cache", 5)
    assert [obs["resumed"] for obs in second] == [3, 3]
    assert [obs["state"] for obs in second] == [obs["state"] for obs in reference]
    # The local tier is gone (a replaced node): the newest checkpoint comes from the mirror alone.
    shutil.rmtree(tmp_path / "run")
    third = _mirrored(tmp_path / "run", mirror, tmp_path / "cache-new-node", 5, resume=True)
    assert [obs["resumed"] for obs in third] == [5, 5]
    assert [obs["state"] for obs in third] == [obs["state"] for obs in reference]


# -- kill -9 during an upload and during remote retention ------------------------------------------------------

@pytest.mark.parametrize("point", ["upload:during#6", "upload:before-commit#2",
                                   "upload:during-retention#1"])
def test_kill_9_during_an_upload_never_leaves_a_selectable_incomplete_checkpoint(
        reference: list[dict[str, Any]], tmp_path: Any, point: str) -> None:
    from accelerate_txn.testing import LaunchError

    mirror = _parent("killed")
    with pytest.raises(LaunchError, match=r"died with exit codes \[-9"):  # SIGKILL at the point, not an error
        _mirrored(tmp_path / "run", mirror, tmp_path / "cache", 5, env={"ACCELERATE_TXN_KILL_AT": point})
    held = _committed(mirror)  # every committed checkpoint is complete (checked against its listing)
    # The local tier is lost with the node: resume from the mirror's newest complete checkpoint, run to the end.
    import shutil

    shutil.rmtree(tmp_path / "run")
    newest = max((int(name.split("_")[1]) for name in held["names"]), default=None)
    resumed = _mirrored(tmp_path / "run", mirror, tmp_path / "cache-new-node", 5, resume=newest is not None)
    assert [obs["resumed"] for obs in resumed] == [None if newest is None else newest + 1] * 2, (held, resumed)
    assert [obs["state"] for obs in resumed] == [obs["state"] for obs in reference]
    after = _committed(mirror)
    assert after["names"] == ["checkpoint_3", "checkpoint_4"]
    if newest is not None:
        # The resumed run's saves removed what the killed upload of that run left: only committed transactions.
        assert len(after["prefixes"]) == len(after["names"]) and after["open_uploads"] == [], after
    else:
        # Killed before its first commit, the run is not resumed: a new run never deletes another run's uploads
        # (an object store has no lock: they could be a live writer's); they stay until removed by hand.
        assert len(after["prefixes"]) == len(after["names"]) + 1, after


def test_kill_9_during_a_download_leaves_no_usable_copy_and_the_next_load_downloads_again(
        reference: list[dict[str, Any]], tmp_path: Any) -> None:
    import shutil

    from accelerate_txn.testing import LaunchError

    mirror = _parent("fetch-killed")
    _mirrored(tmp_path / "run", mirror, tmp_path / "cache", 3)
    shutil.rmtree(tmp_path / "run")  # a replaced node: the restore downloads from the mirror into its cache
    cache = tmp_path / "cache-new-node"
    with pytest.raises(LaunchError, match=r"died with exit codes \[-9"):  # SIGKILL after a rank's second file
        _mirrored(tmp_path / "run", mirror, cache, 5, resume=True, env={"ACCELERATE_TXN_KILL_AT": "fetch:during#2"})
    cut_short = [path for path in cache.rglob("*") if path.is_dir() and ".download-" in path.name]
    assert cut_short and all(path.name.startswith(".") for path in cut_short), cut_short  # hidden, never a copy
    assert not [path for path in cache.rglob(MANIFEST)], "a download cut short left a complete-looking copy"
    resumed = _mirrored(tmp_path / "run", mirror, cache, 5, resume=True)
    assert [obs["resumed"] for obs in resumed] == [3, 3]
    assert [obs["state"] for obs in resumed] == [obs["state"] for obs in reference]
    assert not [path for path in cache.rglob("*") if ".download-" in path.name]  # the next download removed it
    from accelerate_txn.core.manifest import read_manifest

    for manifest in cache.rglob(MANIFEST):  # the copy holds its manifest's files, nothing the killed download left
        copy = manifest.parent
        held = {path.relative_to(copy).as_posix() for path in copy.rglob("*") if path.is_file()} - {MANIFEST}
        assert held == set(read_manifest(copy)["files"]), (copy, held)


# -- one process: the native path is told, protect="all" stores in the bucket ----------------------------------

def test_one_process_native_save_to_a_url_warns_and_protect_all_commits_it(
        s3_server: Server, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import accelerate_txn
    from accelerate_txn.core.remote import checkpoints
    from accelerate_txn.store.s3 import S3Store
    from tests.support.single import stepped_accelerator

    monkeypatch.delenv("ACCELERATE_TXN_PROTECT", raising=False)
    monkeypatch.chdir(tmp_path)
    parent = _parent("single")
    accelerator, model, _optimizer = stepped_accelerator(0)
    with pytest.warns(RuntimeWarning, match="does not know object stores"):
        accelerator.save_state(f"{parent}/checkpoint_0")  # native: a local directory named 's3:'
    assert (tmp_path / "s3:").is_dir() and checkpoints(S3Store(), parent) == []

    accelerate_txn.configure_checkpointing(accelerator, protect="all", cache_dir=tmp_path / "cache")
    saved = accelerator.save_state(f"{parent}/checkpoint_1")
    assert saved == f"{parent}/checkpoint_1"
    assert [url for _n, url in checkpoints(S3Store(), parent)] == [f"{parent}/checkpoint_1"]
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    fresh, fresh_model, _ = stepped_accelerator(5)
    accelerate_txn.configure_checkpointing(fresh, protect="all", cache_dir=tmp_path / "elsewhere")
    fresh.load_state(f"{parent}/checkpoint_1")
    assert all(torch.equal(expected[name], value) for name, value in fresh_model.state_dict().items())


@pytest.mark.parametrize("seed", [20261203, 7])
def test_kill_9_of_the_whole_job_at_a_random_instant_of_a_mirrored_run(
        reference: list[dict[str, Any]], tmp_path: Any, seed: int) -> None:
    """The kill instant is uniform over the reference run's training loop (saves and background uploads)."""
    import json
    import random
    import shutil
    import signal
    import time

    from accelerate_txn.core.remote import checkpoints, download, read_manifest
    from accelerate_txn.store.s3 import S3Store
    from accelerate_txn.testing import start_ranks

    mirror = _parent("random-kill")
    root = tmp_path / "run"
    root.mkdir()
    spec = {"root": str(root), "mirror": mirror, "cache": str(tmp_path / "cache"), "steps": 5}
    delay = random.Random(seed).uniform(0.0, max(obs["loop_seconds"] for obs in reference))
    processes = start_ranks("from tests.scenarios.remote_scenarios import mirrored_job; mirrored_job()", 2,
                            env={"ACCELERATE_TXN_TEST_JOB": json.dumps(spec)})
    try:
        deadline = time.monotonic() + TIMEOUT  # a hang guard: the job starts its loop within seconds
        while not (root / "loop-started").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), "the job did not start"
            time.sleep(0.02)
        kill_at = time.monotonic() + delay  # the random instant (the only sleep that is not a poll interval)
        while time.monotonic() < kill_at and all(p.poll() is None for p in processes):
            time.sleep(min(0.02, max(0.0, kill_at - time.monotonic())))
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in processes:
            process.wait(timeout=60)
    # Every committed checkpoint is complete, down to the content of every file.
    store = S3Store()
    held = _committed(mirror)
    for _number, url in checkpoints(store, mirror):
        manifest = read_manifest(store, url)
        download(store, url, manifest, list(manifest["files"]), tmp_path / "verify" / url.rsplit("/", 1)[1])
    print(f"killed {delay:.2f}s into the loop: the mirror holds {held}")  # shown with -s, for the record
    shutil.rmtree(root)
    newest = max((int(name.split("_")[1]) for name in held["names"]), default=None)
    resumed = _mirrored(root, mirror, tmp_path / "cache-new-node", 5, resume=newest is not None)
    assert [obs["resumed"] for obs in resumed] == [None if newest is None else newest + 1] * 2, (held, resumed)
    assert [obs["state"] for obs in resumed] == [obs["state"] for obs in reference]


# -- the commit protocol itself (no training) --------------------------------------------------------------------

def _fake_transaction(tmp_path: Any, store: Any, url: str, run: str, txid: str, content: bytes) -> dict[str, Any]:
    import xxhash

    from accelerate_txn.core.remote import upload

    directory = tmp_path / txid
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(content)
    manifest = {"protocol": 2, "status": "complete", "run_id": run, "transaction_id": txid, "hash": "xxh3_128",
                "files": {"model.safetensors": {"size": len(content), "xxh3_128": xxhash.xxh3_128_hexdigest(content)}}}
    upload(store, directory, url, manifest, ["model.safetensors"])
    return manifest


def test_two_writers_of_one_name_one_commit_wins_and_the_loser_removes_its_upload(
        s3_server: Server, tmp_path: Any) -> None:
    from accelerate_txn.core.remote import check_listing, commit, read_manifest
    from accelerate_txn.errors import CheckpointExistsError, CheckpointIntegrityError
    from accelerate_txn.store.s3 import S3Store

    store = S3Store()
    url = _parent("writers") + "/checkpoint_1"
    first = _fake_transaction(tmp_path, store, url, "runA", "aa01", b"first writer")
    second = _fake_transaction(tmp_path, store, url, "runB", "bb02", b"second writer!")
    assert commit(store, url, first, replace=False) is False
    with pytest.raises(CheckpointExistsError, match="already holds a checkpoint"):
        commit(store, url, second, replace=False)
    assert read_manifest(store, url)["transaction_id"] == "aa01"
    assert check_listing(store, url, first)["extra"] == []  # the loser's objects are gone
    # A transaction whose objects vanished during the save is never committed.
    third = _fake_transaction(tmp_path, store, url, "runA", "cc03", b"third")
    store.delete(url + "/.txn-runA-cc03/model.safetensors")
    with pytest.raises(CheckpointIntegrityError, match="was not committed"):
        commit(store, url, third, replace=True)
    assert read_manifest(store, url)["transaction_id"] == "aa01"
    # Replacing: the new manifest, then the old transaction's objects deleted.
    fourth = _fake_transaction(tmp_path, store, url, "runA", "dd04", b"fourth")
    assert commit(store, url, fourth, replace=True) is True
    assert read_manifest(store, url)["transaction_id"] == "dd04"
    assert check_listing(store, url, fourth)["extra"] == []


def test_a_failing_mirror_upload_is_raised_on_every_rank_at_the_next_save(s3_server: Server, tmp_path: Any) -> None:
    mirror = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    result = launch("tests.scenarios.remote_scenarios:mirror_failure", 2,
                    args=(str(tmp_path / "run"), mirror, str(tmp_path / "cache")), timeout=TIMEOUT,
                    env={"AWS_MAX_ATTEMPTS": "1"})  # botocore would retry a missing bucket with backoff
    for obs in result:
        assert obs["first"] is None  # the local save returned: training went on while the mirror uploaded
        assert obs["second"] is not None and "no-such-bucket" in obs["second"]["message"], obs["second"]
        assert "to the mirror" in obs["second"]["message"] and "local checkpoint is published" in obs["second"]["message"]
        assert obs["wait"] is None
        assert obs["local"] == ["checkpoint_0"]  # published locally; the failed save published nothing
    assert len({obs["second"]["type"] for obs in result}) == 1
