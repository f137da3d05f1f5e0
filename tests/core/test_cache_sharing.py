"""Two jobs of one user sharing one local cache of object-store checkpoints (the default ``~/.cache/accelerate-txn``):
neither job's clean-up removes a copy the other restores from, nor the other's live download (issue 34).

Real processes: each job is its own launch (one rank, gloo), both restore from the loopback S3 server
(``tests.support.s3_server``) into one cache directory. The race is made deterministic by a hook in job B
(``tests.scenarios.remote_scenarios:load_pausing``): B stops at a chosen step and creates a file; the test then runs job A to
completion (A restores another checkpoint of the same prefix, and publishing its copy cleans the cache); then it
lets B go on. Before the fix, A's clean-up removed B's verified copy (B's restore failed, its model part-way
restored) or B's live download directory (B's download failed, blamed on the object store).
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.testing import launch
from tests.support.s3_server import BUCKET, Server

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
TIMEOUT = 200


@pytest.fixture(scope="module")
def saved(s3_server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    parent = f"s3://{BUCKET}/shared-cache-{uuid.uuid4().hex[:8]}"
    cache = tmp_path_factory.mktemp("shared_cache_save") / "cache"
    [states] = launch("tests.scenarios.remote_scenarios:saved_states", 1, args=(parent, str(cache)), timeout=TIMEOUT)
    return {"parent": parent, "states": states}


def _differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    from tests.scenarios.scenarios import _same

    return _same(expected, actual)


@pytest.mark.parametrize("pause", ["download", "restore"])
def test_another_jobs_cache_clean_up_never_removes_a_copy_or_a_download_in_use(
        saved: dict[str, Any], tmp_path: Path, pause: str) -> None:
    parent, states = saved["parent"], saved["states"]
    cache = tmp_path / "shared-cache"
    ready, go = tmp_path / "b-ready", tmp_path / "b-go"
    results: dict[str, Any] = {}
    b = _paused_load(results, "b", f"{parent}/checkpoint_2", cache, pause, ready, go)
    try:
        name = "checkpoint_2"
        held = [path.name for path in cache.rglob("*") if path.is_dir() and name in path.name]
        assert held, "job B holds nothing in the cache at its pause"
        [a] = launch("tests.scenarios.remote_scenarios:load_into", 1, args=(f"{parent}/checkpoint_1", str(cache)),
                     timeout=TIMEOUT)
        # What B holds is still there after A's restore published its copy and cleaned the cache.
        still = [path.name for path in cache.rglob("*") if path.is_dir() and name in path.name]
        assert set(held) <= set(still), (held, still)
    finally:
        go.write_text("")
        b.join(TIMEOUT)
    assert not b.is_alive()
    assert a["error"] is None and _differences(states[1], a["state"]) == []
    assert not isinstance(results["b"], BaseException), results["b"]
    assert results["b"]["error"] is None, results["b"]["error"]
    assert _differences(states[2], results["b"]["state"]) == []  # B restored its checkpoint exactly
    # Nothing left behind: no download directory, no lock file (each is removed by its last holder or by the clean-up).
    leftovers = [path.name for path in cache.rglob(".*") if path.name != ".metadata"]  # DCP metadata is a file of a copy
    assert leftovers == [], leftovers
    copies = sorted(path.name for path in cache.rglob("checkpoint_*") if path.is_dir())
    # B published last after a download: the cache keeps its copy only; A published last while B restored: both.
    assert copies == (["checkpoint_2"] if pause == "download" else ["checkpoint_1", "checkpoint_2"]), copies


def _paused_load(results: dict[str, Any], key: str, url: str, cache: Path, pause: str, ready: Path,
                 go: Path) -> threading.Thread:
    """A one-rank job restoring ``url`` (tests.scenarios.remote_scenarios.load_pausing) in a thread, returned once it stopped
    at ``pause`` (it created ``ready``; it goes on when ``go`` exists); its result, or what it raised, lands in
    ``results[key]``."""

    def job() -> None:
        try:
            [results[key]] = launch("tests.scenarios.remote_scenarios:load_pausing", 1,
                                    args=(url, str(cache), pause, str(ready), str(go)), timeout=TIMEOUT)
        except BaseException as exc:  # reported by the caller's assertions
            results[key] = exc

    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not ready.exists() and key not in results:  # it reached its pause (or failed before it)
        if time.monotonic() > deadline:
            go.write_text("")
            raise AssertionError(f"the restore of {url} never reached its pause ({pause})")
        time.sleep(0.05)
    if key in results:
        go.write_text("")
        thread.join(TIMEOUT)
        raise AssertionError(f"the restore of {url} ended before its pause: {results[key]}")
    return thread


def test_prune_of_a_local_checkpoint_being_restored_keeps_it_until_the_restore_ends(
        tmp_path: Path, cli: Any) -> None:
    """The posix side of the same class: ``accelerate-txn prune`` (retention, under the writers' lock) ran while a
    restore of the oldest checkpoint had verified it and not yet read it; it deleted it under the restore."""
    root = tmp_path / "run"
    [states] = launch("tests.scenarios.remote_scenarios:saved_states", 1, args=(str(root), str(tmp_path / "unused")),
                      timeout=TIMEOUT)
    ready, go = tmp_path / "ready", tmp_path / "go"
    results: dict[str, Any] = {}
    loader = _paused_load(results, "load", str(root / "checkpoint_1"), tmp_path / "unused", "verified", ready, go)
    try:
        pruned = cli("prune", root, "--keep", "1", "--json")
        assert pruned.code == 0, pruned.err
        assert pruned.json()["deleted"] == [] and (root / "checkpoint_1").is_dir()  # in use: kept this time
    finally:
        go.write_text("")
        loader.join(TIMEOUT)
    assert not loader.is_alive()
    assert not isinstance(results["load"], BaseException), results["load"]
    assert results["load"]["error"] is None and _differences(states[1], results["load"]["state"]) == []
    again = cli("prune", root, "--keep", "1", "--json")  # the restore is over: the next prune deletes it
    assert again.code == 0 and again.json()["deleted"] == [str(root / "checkpoint_1")], again.out
    assert sorted(path.name for path in root.iterdir()) == [".accelerate-txn.lock", "checkpoint_2"]


def test_a_replacement_never_swaps_a_directory_a_restore_in_another_process_holds(tmp_path: Path) -> None:
    """The replace side of the class: a save replacing ``NAME`` (Accelerate, Trainer, a cached copy, an export: all
    through ``store.posix.replace_directory``) while a restore in another process holds ``NAME`` in use would swap
    the tree under it (the restore verified the old files and would read the new ones). It waits for the restore,
    bounded, then refuses with nothing changed; once the restore is over it replaces, leaving no lock file."""
    import subprocess
    import sys

    from accelerate_txn.errors import CheckpointLockedError
    from accelerate_txn.store.posix import in_use_file, replace_directory

    final, staging = tmp_path / "checkpoint_1", tmp_path / ".checkpoint_1.staging-x"
    for directory, text in ((final, "old"), (staging, "new")):
        directory.mkdir()
        (directory / "payload.bin").write_text(text)
    holder = subprocess.Popen(  # a restore in another process: holds checkpoint_1 in use until its stdin closes
        [sys.executable, "-c", "import sys; from accelerate_txn.store.posix import InUse; "
         f"hold = InUse({str(final)!r}); assert hold.acquire(); print('held', flush=True); sys.stdin.read(); "
         "hold.release()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointLockedError, match=r"holds it in use .* Nothing was replaced"):
            replace_directory(staging, final, "x", wait=0)
        assert (final / "payload.bin").read_text() == "old" and (staging / "payload.bin").read_text() == "new"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=TIMEOUT) == 0
    replace_directory(staging, final, "x", wait=0)  # the restore is over: replaced at once
    assert (final / "payload.bin").read_text() == "new" and not staging.exists()
    assert not in_use_file(final).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1"]
