"""The guarantee where ranks come and go: no silent partial publish, no hang from a setting that differs per rank,
dispatch switched off is exactly native, lineage survives a failed asynchronous save, and claims a manifest makes
are checked against its files. Real 2-process gloo runs (hard timeouts), real checkpoints damaged on disk."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import MANIFEST
from accelerate_txn.core.manifest import hash_file, read_manifest, verify_manifest
from accelerate_txn.errors import CheckpointIntegrityError
from accelerate_txn.testing import launch

pytestmark = pytest.mark.distributed
TIMEOUT = 300
REPO = Path(__file__).resolve().parents[2]


def _cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "accelerate_txn", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


# --------------------------------------------------------------------------------- item: async save, teardown

@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_destroy_process_group_during_an_async_save_waits_and_publishes_every_ranks_shards(
        tmp_path: Path, fsdp_version: int) -> None:
    observed = launch("tests.scenarios.guarantee_scenarios:async_save_then_destroy", 2,
                      args=(str(tmp_path), fsdp_version, False), timeout=TIMEOUT)
    for obs in observed:
        assert obs["in_flight_before_destroy"]  # the background write was held until destroy_process_group
        assert obs["initialized_after_destroy"] is False
        assert obs["wait"] is None and obs["published"] and obs["verify_error"] is None
        assert obs["staging_left"] == [] and obs["library_threads"] == [] and obs["background_group_dropped"]
    manifest = read_manifest(tmp_path / "checkpoint")
    payloads = {Path(name).name.split("_")[2] for name in manifest["files"] if name.endswith(".distcp")}
    assert payloads == {"0", "1"}  # both ranks' shards, not rank 0's alone
    for obs in launch("tests.scenarios.guarantee_scenarios:load_and_compare", 2, args=(str(tmp_path), fsdp_version),
                      timeout=TIMEOUT):
        assert obs["error"] is None and obs["differences"] == []


def test_a_background_write_whose_group_was_destroyed_publishes_nothing_and_fails_on_every_rank(
        tmp_path: Path) -> None:
    observed = launch("tests.scenarios.guarantee_scenarios:async_save_then_destroy", 2, args=(str(tmp_path), 2, True),
                      timeout=TIMEOUT)
    for obs in observed:
        assert obs["in_flight_before_destroy"] and obs["initialized_after_destroy"] is False
        assert obs["wait"]["type"] == "CheckpointRankError"
        assert "process group this checkpoint phase runs over was destroyed" in obs["wait"]["message"]
        assert obs["published"] is False and obs["library_threads"] == []
    assert not (tmp_path / "checkpoint").exists()
    # Rank 0 removes its staging; a rank whose DCP write was already running when the group went may still write
    # into it afterwards (it can no longer coordinate with anyone): at most an unpublished staging leftover remains,
    # which is never loadable and which the run's next save removes.
    assert all(name.startswith(".checkpoint.staging-") for name in observed[0]["staging_left"])


# --------------------------------------------------------------------------------- item: per-rank settings

@pytest.mark.parametrize("variable, value, message", [
    ("ACCELERATE_TXN_LOCK_TIMEOUT", "soon", "ACCELERATE_TXN_LOCK_TIMEOUT is 'soon'"),
    ("ACCELERATE_TXN_LOCK_TIMEOUT", "-3", "ACCELERATE_TXN_LOCK_TIMEOUT is '-3'"),
    # Read (leniently) before any agreement, by the arrival check: the ranks still meet, then all raise.
    ("ACCELERATE_TXN_ARRIVAL_TIMEOUT", "soon", "ACCELERATE_TXN_ARRIVAL_TIMEOUT is 'soon'"),
])
def test_a_setting_invalid_on_one_rank_raises_the_same_error_on_every_rank(
        tmp_path: Path, variable: str, value: str, message: str) -> None:
    observed = launch("tests.scenarios.guarantee_scenarios:setting_invalid_on_one_rank", 2, args=(str(tmp_path), variable,
                      value), timeout=TIMEOUT)
    for call in ("save", "load", "direct"):
        errors = [obs[call] for obs in observed]
        assert errors[0] is not None, call
        assert errors[0] == errors[1], call  # the same error, raised on both ranks (neither waited)
        assert errors[0]["type"] == "CheckpointConfigurationError", errors[0]
        assert message in errors[0]["message"] and errors[0]["failures"] == [1]
    assert all(obs["nothing_published"] for obs in observed)


# --------------------------------------------------------------------------------- item: off is off

def test_dispatch_switched_off_runs_exactly_the_collectives_and_files_of_native_accelerate(tmp_path: Path) -> None:
    observed = launch("tests.scenarios.guarantee_scenarios:dispatch_off_is_native", 2, args=(str(tmp_path),),
                      timeout=TIMEOUT, env={"ACCELERATE_TXN_PATCHES": "0"})
    for obs in observed:
        assert obs["off"]["save"] == obs["native"]["save"]
        assert obs["off"]["load"] == obs["native"]["load"]
        assert obs["off"]["files"] == obs["native"]["files"]
        assert obs["off"]["parent"] == ["ckpt"]  # no lock file, no staging, no manifest


# --------------------------------------------------------------------------------- item: lineage

@pytest.fixture(scope="module")
def two_rank_fsdp1(tmp_path_factory: Any) -> Path:
    root = tmp_path_factory.mktemp("two_rank_fsdp1") / "ckpt"
    launch("tests.scenarios.elastic_scenarios:save", 2, args=(1, str(root)), timeout=TIMEOUT)
    return root


@pytest.mark.parametrize("asynchronous_last", [True, False], ids=["then_async", "then_sync"])
def test_lineage_survives_a_failed_async_save(two_rank_fsdp1: Path, tmp_path: Path, asynchronous_last: bool) -> None:
    (obs,) = launch("tests.scenarios.guarantee_scenarios:lineage_after_failed_async", 1,
                    args=(str(two_rank_fsdp1), str(tmp_path), asynchronous_last), timeout=TIMEOUT,
                    env={"ACCELERATE_TXN_ASYNC_FAIL_AT": "0#1"})
    assert obs["failure"] is not None and "injected background write failure" in obs["failure"]["message"]
    lineage = obs["resharded_from"]
    assert lineage is not None, "the published checkpoint lost its elastic-resume lineage"
    assert lineage[""]["checkpoint"] == str(two_rank_fsdp1)
    assert lineage[""]["saved_world_size"] == 2 and lineage[""]["world_size"] == 1


# --------------------------------------------------------------------------------- partial and lying checkpoints

def _rewrite(path: Path, change: Any) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=1))


def _drop_rank_payloads(path: Path) -> None:
    """Rank 1's DCP payloads removed, and from the inventory too (a manifest consistent with what rank 0 alone
    would have published)."""
    gone = [name for name in json.loads((path / MANIFEST).read_text())["files"]
            if re.search(r"(^|/)__1_\d+\.distcp$", name)]
    assert gone
    for name in gone:
        (path / name).unlink()
    _rewrite(path, lambda m: [m["files"].pop(name) for name in gone])


def _drop_rank_chunks(path: Path) -> None:
    """Every DCP ``.metadata`` rewritten without rank 1's chunks (its payload files stay listed): only the
    metadata's own coverage shows that rank 1's part is missing."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name in [n for n in manifest["files"] if n.rsplit("/", 1)[-1] == ".metadata"]:
        with (path / name).open("rb") as stream:
            metadata = pickle.load(stream)  # our own test checkpoint: trusted
        dropped = {index for index, info in metadata.storage_data.items() if str(info.relative_path).startswith("__1_")}
        for key, value in metadata.state_dict_metadata.items():
            if hasattr(value, "chunks"):
                kept = [c for c in value.chunks if not any(i.fqn == key and tuple(i.offset) == tuple(c.offsets)
                                                           for i in dropped)]
                value.chunks[:] = kept
        for index in dropped:
            del metadata.storage_data[index]
        with (path / name).open("wb") as stream:
            pickle.dump(metadata, stream)
        size, digest = hash_file(path / name, "xxh3_128")
        manifest["files"][name].update(size=size, xxh3_128=digest)
    (path / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=1))


def _claim_one_rank(path: Path) -> None:
    _rewrite(path, lambda m: m["components"][""].update(world_size=1))


def _unknown_policy(path: Path) -> None:
    _rewrite(path, lambda m: m["rank_state"].update(policy="keep-everything/9"))


DAMAGES = {
    "rank_payloads_removed": (_drop_rank_payloads, r"DCP payloads of no rank \[1\]", True),
    "rank_chunks_removed": (_drop_rank_chunks, r"cover \d+ of its \d+ elements", False),
    "world_size_claim": (_claim_one_rank, r"records a world of 1 rank\(s\).*present for rank\(s\) \[1\] outside it",
                         True),
    "unknown_policy": (_unknown_policy, r"per-rank state policy 'keep-everything/9'.*\['keep-or-derive/1'\]", True),
}


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def published_pair(request: Any, tmp_path_factory: Any) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp(f"pair_fsdp{request.param}")
    (obs, _) = launch("tests.scenarios.guarantee_scenarios:publish_two", 2, args=(str(root), request.param), timeout=TIMEOUT)
    assert obs["checkpoints"][-2:] == ["checkpoint_0", "checkpoint_1"]
    return root, request.param


def _damaged_copy(published_pair: tuple[Path, int], tmp_path: Path, damage: str) -> Path:
    root, _version = published_pair
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    DAMAGES[damage][0](copy / "checkpoints" / "checkpoint_1")
    return copy


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_partial_or_lying_checkpoint_is_refused_by_verify_latest_and_list(
        published_pair: tuple[Path, int], tmp_path: Path, damage: str) -> None:
    run = _damaged_copy(published_pair, tmp_path, damage)
    target = run / "checkpoints" / "checkpoint_1"
    _change, message, without_dcp = DAMAGES[damage]
    assert verify_manifest(run / "checkpoints" / "checkpoint_0", read_manifest(run / "checkpoints" / "checkpoint_0"),
                           full=True, dcp=True)  # the intact sibling stays valid
    with pytest.raises(CheckpointIntegrityError, match=message):
        verify_manifest(target, read_manifest(target), full=True, dcp=True)
    full = _cli("verify", target, "--full", "--dcp")
    assert full.returncode == 1 and re.search(message, full.stdout + full.stderr), full.stdout + full.stderr
    assert "Traceback" not in full.stderr
    quick = _cli("verify", target)
    assert quick.returncode == (1 if without_dcp else 0), quick.stdout + quick.stderr
    if without_dcp:  # proven from file names alone: the offline CLI picks the intact checkpoint
        latest = _cli("latest", run / "checkpoints")
        assert latest.returncode == 0 and latest.stdout.strip().endswith("checkpoint_0"), latest.stdout + latest.stderr


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_partial_or_lying_checkpoint_is_never_restored(
        published_pair: tuple[Path, int], tmp_path: Path, damage: str) -> None:
    run = _damaged_copy(published_pair, tmp_path, damage)
    _change, message, _without_dcp = DAMAGES[damage]
    # allow_reshard: a world-size claim must be refused even where a world-size change is allowed.
    observed = launch("tests.scenarios.guarantee_scenarios:resume_around_damage", 2,
                      args=(str(run), published_pair[1], "checkpoint_1", damage == "world_size_claim"),
                      timeout=TIMEOUT)
    for obs in observed:
        assert obs["explicit"]["type"] == "CheckpointIntegrityError", obs["explicit"]
        assert re.search(message, obs["explicit"]["message"]), obs["explicit"]["message"]
        assert obs["untouched"]
        assert obs["automatic"] is None and obs["differences_to_checkpoint_0"] == []
    assert observed[0]["explicit"]["message"] == observed[1]["explicit"]["message"]


# --------------------------------------------------------------------------------- item: teardown

def test_teardown_with_a_save_in_flight_leaves_no_library_thread_and_exits_cleanly(tmp_path: Path) -> None:
    """Four real interpreters; each must exit 0 with nothing of the library alive after destroy_process_group and
    no C++ ``terminate`` at exit (threads or process groups of the library outliving the job)."""
    import os

    from accelerate_txn.testing import free_port

    world = 4
    code = f"from tests.scenarios.guarantee_scenarios import teardown_job; teardown_job({str(tmp_path)!r})"
    port = free_port()
    processes, logs = [], []
    for rank in range(world):
        log = (tmp_path / f"rank{rank}.err").open("w")
        logs.append(log)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        processes.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=log, text=True))
    try:
        outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]  # a hang guard only
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        stderr = (tmp_path / f"rank{rank}.err").read_text()
        assert process.returncode == 0, stderr[-3000:]
        assert "terminate called" not in stderr and "Traceback" not in stderr, stderr[-3000:]
        result = json.loads(output.strip().splitlines()[-1])
        assert result == {"rank": rank, "library_threads": [], "published": True}


# --------------------------------------------------------------------------------- item: a destination under a file

@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_a_destination_under_a_regular_file_raises_the_same_error_on_every_rank(tmp_path: Path,
                                                                                fsdp_version: int) -> None:
    # Regression (issue 34 item 6): rank 0's failed reservation was followed by its staging cleanup outside any rank
    # phase, which raised a raw NotADirectoryError on rank 0 alone (rank 1: CheckpointRankError ... FileExistsError).
    observed = launch("tests.scenarios.guarantee_scenarios:save_under_a_file", 2, args=(str(tmp_path), fsdp_version),
                      timeout=TIMEOUT)
    blocker = tmp_path / "file.txt"
    for case, leaf in (("save_state", "ckpt"), ("async", "async"), ("automatic", "project")):
        errors = [obs[case] for obs in observed]
        assert errors[0] == errors[1], (case, errors)  # the same exception, the same message, on both ranks
        error = errors[0]
        assert error is not None and error["type"] == "CheckpointConfigurationError", (case, error)
        assert str(blocker / leaf) in error["message"], (case, error)  # names the destination
        assert f"{blocker} is not a directory (it is a file)" in error["message"], (case, error)
    assert observed[0]["listing"] == ["file.txt"] and blocker.read_text() == "a regular file, not a directory"
