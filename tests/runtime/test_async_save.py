"""Asynchronous protected save (issue 10): real 2-process gloo FSDP1 and FSDP2, real DCP files, real kill -9."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import CheckpointConfigurationError, configure_checkpointing
from accelerate_txn.testing import LaunchError, launch

# A hang guard per launch (and per wait for a saver's marker), not a time budget: the slowest launch here took 64 s
# with 2 cores loaded 5 times over. A test runs at most two guarded phases; pytest's timeout is a backstop above them.
TIMEOUT = 720.0
KILLED = -signal.SIGKILL
pytestmark = pytest.mark.timeout(int(2 * TIMEOUT) + 60)


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("async")
    return launch("tests.scenarios.async_scenarios:async_lifecycle", 2, args=(str(root),), timeout=TIMEOUT,
                  env={"ACCELERATE_TXN_ASYNC_FAIL_AT": "1#3,5"})


def test_async_save_returns_a_path_like_handle_and_back_to_back_saves_publish_in_order(lifecycle: Any) -> None:
    for obs in lifecycle:
        assert obs["handle_type"] == "AsyncCheckpoint"
        assert Path(obs["first_path"]).name == "checkpoint_0"
        assert obs["first_done_when_second_returned"] is True  # at most one save in flight
        assert obs["own_group"]  # background collectives run on their own gloo group, not the training one
        assert Path(obs["second_path"]).name == "checkpoint_1"
        assert obs["after_two"] == ["checkpoint_0", "checkpoint_1"]
        # Each manifest records the step at its own save, not the step reached when the background finished.
        assert obs["manifest_steps"] == [{"": 5}, {"": 7}], obs["manifest_steps"]


def test_background_failure_on_one_rank_is_raised_on_every_rank_at_wait_and_at_next_save(lifecycle: Any) -> None:
    for obs in lifecycle:
        for key in ("wait_error", "next_save_error"):
            error = obs[key]
            assert error is not None, key
            assert error["type"] == "CheckpointRankError", error
            assert error["failures"] == [1], error
            assert "injected background write failure on rank 1" in error["message"], error
        assert obs["wait_again"] is None  # raised once, then settled
        assert obs["iteration_after_failed"] == 2  # the unpublished number is given back


def test_retention_never_deletes_before_a_publish(lifecycle: Any) -> None:
    assert lifecycle[0]["after_failed_listing"] is not None
    for obs in lifecycle:
        # Save 3 failed in the background: nothing was pruned for it, and its staging was removed.
        assert obs["after_failed"] == ["checkpoint_0", "checkpoint_1"]
        assert obs["after_failed_listing"] in (None, ["checkpoint_0", "checkpoint_1"])
        assert obs["after_fourth"] == ["checkpoint_1", "checkpoint_2"]  # pruned only after checkpoint_2 published
        assert obs["after_fifth"] == ["checkpoint_1", "checkpoint_2"]
        assert obs["seventh"] == "checkpoint_3"
        assert obs["after_seventh"] == ["checkpoint_2", "checkpoint_3"]
        assert obs["no_staging_left"]


def test_async_checkpoint_restores_exactly_with_the_protected_loader(lifecycle: Any) -> None:
    for obs in lifecycle:
        assert obs["roundtrip_differences"] == []
        assert obs["rng_restored"] and obs["private_generator_restored"] and obs["progress_restored"]
        assert obs["scheduler_restored"] and obs["step_restored"]
        assert obs["sync_type"] == "PosixPath"
        assert obs["same_layout_as_sync"]  # the same files as a synchronous save
        # The background thread's CPU time is reported once it ended (it wrote and hashed the files: not zero).
        assert isinstance(obs["background_cpu_seconds"], float) and obs["background_cpu_seconds"] > 0


def _assert_reused_staging(obs: dict[str, Any]) -> None:
    assert obs["reuse_pool_after_first"], "reuse_staging_memory kept no buffers after the save"
    assert obs["reuse_first_done_when_second_returned"]  # the second save copied only after the first was written
    assert obs["reuse_pool_after_second"] == obs["reuse_pool_after_first"]  # copied into the same memory
    assert obs["reuse_differences"] == [[], []]  # each checkpoint holds what was saved, not the next save's copy
    assert obs["reuse_pool_released"]


def test_reused_staging_memory_is_copied_into_again_and_both_saves_restore_exactly(lifecycle: Any) -> None:
    for obs in lifecycle:
        _assert_reused_staging(obs)


@pytest.mark.parametrize(("point", "killed", "version"), [
    ("save:during-flush", 0, 1), ("save:during-flush", 1, 1), ("save:after-manifest", 0, 1),
    ("save:after-rename", 0, 1), ("save:during-flush", 1, 2), ("save:after-manifest", 0, 2)])
def test_kill_9_in_the_background_leaves_newest_complete_checkpoint_selected_and_next_save_clean(
        tmp_path: Any, point: str, killed: int, version: int) -> None:
    with pytest.raises(LaunchError, match=rf"rank\(s\) \[{killed}\] died with exit codes \[-9\]"):
        launch("tests.scenarios.async_scenarios:async_killable", 2, args=(str(tmp_path), version), timeout=TIMEOUT,
               env={"ACCELERATE_TXN_KILL_AT": f"{point}@{killed}#3"})
    results = launch("tests.scenarios.async_scenarios:async_resume", 2, args=(str(tmp_path), version), timeout=TIMEOUT)
    published = point == "save:after-rename"  # killed after the atomic rename: the third save is complete
    complete = ["checkpoint_0", "checkpoint_1"] + (["checkpoint_2"] if published else [])
    for obs in results:
        assert obs["complete_before"] == complete  # nothing published before the rename, nothing lost after
        if killed == 0 and not published:  # the publisher died: its staging stays until the next save
            assert any(".checkpoint_2.staging-" in name for name in obs["before"]), obs["before"]
        assert obs["next_iteration"] == len(complete)  # resumed from the newest complete checkpoint
        # The next save publishes, cleans the leftover, and retention (total_limit=3) keeps the newest three.
        assert obs["after"] == [f"checkpoint_{n}" for n in range(len(complete) + 1)][-3:]


def test_configure_async_save_is_validated_first() -> None:
    class Owner:  # configure_checkpointing keys its configuration weakly by object
        pass

    owner = Owner()
    with pytest.raises(CheckpointConfigurationError, match=r"async_save='yes'.*True.*False"):
        configure_checkpointing(owner, async_save="yes", check_finite=True)
    from accelerate_txn.accelerate.config import checkpoint_config

    assert checkpoint_config(owner).async_save is False and checkpoint_config(owner).check_finite is False
    configure_checkpointing(owner, async_save=True)
    assert checkpoint_config(owner).async_save is True
    configure_checkpointing(owner, check_finite=True)  # None leaves it unchanged
    assert checkpoint_config(owner).async_save is True


_EXITING_SAVER = """
import sys
import torch
from accelerate import Accelerator
from accelerate_txn import save_training_checkpoint

accelerator = Accelerator(cpu=True)
model, optimizer = accelerator.prepare(torch.nn.Linear(4, 3), torch.optim.Adam(torch.nn.Linear(4, 3).parameters()))
handle = save_training_checkpoint(accelerator, sys.argv[1], async_save=True)
print("returned", type(handle).__name__, flush=True)
"""  # exits with the save in flight: no wait, no end_training


@pytest.mark.parametrize("fail", [False, True])
def test_interpreter_exit_waits_for_the_save_in_flight_or_reports_its_failure(tmp_path: Path, fail: bool) -> None:
    import os
    import subprocess
    import sys

    from accelerate_txn import MANIFEST

    target = tmp_path / "ckpt"
    env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_TXN_ASYNC_FAIL_AT"}
    if fail:
        env["ACCELERATE_TXN_ASYNC_FAIL_AT"] = "0"
    done = subprocess.run([sys.executable, "-c", _EXITING_SAVER, str(target)], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "returned AsyncCheckpoint" in done.stdout
    if fail:
        assert not target.exists()
        assert "failed and was never waited for" in done.stderr, done.stderr
        assert "injected background write failure on rank 0" in done.stderr, done.stderr
        assert not [p for p in tmp_path.iterdir() if ".staging-" in p.name]
    else:
        assert (target / MANIFEST).is_file()  # the interpreter waited for the background publish


def test_staged_copy_is_independent_of_the_live_tensors() -> None:
    import torch

    from accelerate_txn.fsdp.host_memory import staged_copy

    live = {"weight": torch.arange(6.0).view(2, 3)[:, 1:], "state": [torch.tensor(3), {"lr": 0.1, "name": "g"}]}
    staged = staged_copy(live)
    live["weight"].add_(100)
    live["state"][0].add_(1)
    assert torch.equal(staged["weight"], torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    assert staged["state"][0].item() == 3 and staged["state"][1] == {"lr": 0.1, "name": "g"}
    assert staged["weight"].is_contiguous() and staged["weight"].untyped_storage().nbytes() == 4 * 4


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_whole_job_killed_at_a_random_instant_of_the_background_write(tmp_path: Path, seed: int) -> None:
    import random
    import time

    from accelerate_txn.testing import start_ranks

    code = f"from tests.scenarios.async_scenarios import async_train_until_killed; async_train_until_killed({str(tmp_path)!r})"
    processes = start_ranks(code)
    marker = tmp_path / "third-save-returned"
    deadline = time.monotonic() + TIMEOUT
    try:
        while not marker.exists():  # poll the filesystem for the saver's signal, with a deadline
            assert time.monotonic() < deadline, "the saver never returned from its third save"
            assert all(p.poll() is None for p in processes), "a saver exited before its third save returned"
            time.sleep(0.02)
        # The instant to kill at (not a synchronisation): the background publishes ~0.13 s after the marker here.
        time.sleep(random.Random(seed).uniform(0.0, 0.2))
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=120)  # a hang guard only: a SIGKILLed process exits at once
    results = launch("tests.scenarios.async_scenarios:async_resume", 2, args=(str(tmp_path),), timeout=TIMEOUT)
    for obs in results:
        complete = obs["complete_before"]
        assert complete in (["checkpoint_0", "checkpoint_1"], ["checkpoint_0", "checkpoint_1", "checkpoint_2"])
        assert obs["next_iteration"] == len(complete)  # the newest complete checkpoint was selected and verified
        assert obs["after"] == [f"checkpoint_{n}" for n in range(len(complete) + 1)][-3:]


def test_load_state_waits_for_the_save_in_flight_and_resumes_from_it(tmp_path: Path) -> None:
    for obs in launch("tests.scenarios.async_scenarios:load_right_after_async_save", 2, args=(str(tmp_path),), timeout=TIMEOUT):
        assert obs["published"] is True
        assert obs["restored_from"] == 0  # checkpoint_0, the save that was in flight
        assert obs["differences"] == []


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_async_staging_runs_no_fsdp_collective_and_writes_files_both_loaders_restore_exactly(
        tmp_path: Path, use_orig_params: bool) -> None:
    for obs in launch("tests.scenarios.async_scenarios:fsdp1_collective_free", 2, args=(str(tmp_path), use_orig_params),
                      timeout=TIMEOUT):
        # The caller staged local shards only; native Accelerate's save of the same state ran FSDP's gathers (the
        # counter sees them), so the empty list is a measurement, not a blind spot.
        assert obs["async_collectives"] == [], obs["async_collectives"]
        assert obs["sync_collectives"] > 0
        # The same DCP entries (keys, global shapes, dtypes) and parameter groups as native Accelerate's save (the
        # asynchronous and the synchronous protected save), the same files as the synchronous one.
        assert obs["dcp_differences"] == [] and obs["dcp_entries"] > 0
        assert obs["same_files_as_sync"] and obs["same_param_groups"]
        assert obs["protected_differences"] == [] and obs["persistent_buffer_restored"]
        # native Accelerate load_state reads the boxes too; Accelerate 1.7-1.12's native FSDP1 optimizer load
        # fails on synchronous checkpoints as well, and then it must fail identically on both
        assert obs["native_differences"] == [] or (
            obs["native_differences"] is None and obs["native_sync_error"] == obs["native_async_error"])
        # Declined on one rank: every rank built natively (FSDP's gathers ran on both) and the save is exact.
        assert obs["declined_collectives"] > 0 and obs["declined_differences"] == []


def test_fsdp2_async_save_round_trips_with_both_loaders_and_matches_a_synchronous_save(tmp_path: Path) -> None:
    for obs in launch("tests.scenarios.async_scenarios:fsdp2_async", 2, args=(str(tmp_path),), timeout=TIMEOUT):
        assert obs["handle_type"] == "AsyncCheckpoint" and obs["manifest"]
        assert obs["caller_collectives"] == [], obs["caller_collectives"]  # local DTensor views: a host copy only
        assert obs["protected_differences"] == []
        assert obs["native_differences"] == []
        assert obs["same_files_as_sync"] and obs["dcp_differences"] == []
        _assert_reused_staging(obs)


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_async_save_holds_the_state_at_save_state_whatever_the_script_mutates_next(tmp_path: Path,
                                                                                    fsdp_version: int) -> None:
    for obs in launch("tests.scenarios.async_scenarios:async_exact_under_mutation", 2, args=(str(tmp_path), fsdp_version),
                      timeout=TIMEOUT):
        mutations = set(obs["differences"])
        assert len(mutations) == 9 and ("p.to_local().mul_" in mutations) == (fsdp_version == 2), mutations
        assert obs["errors"] == dict.fromkeys(mutations), obs["errors"]  # each save published, no error
        # the live state did change (on the mutating rank), so the comparison below can fail
        unchanged = [name for name, changed in obs["live_changed"].items() if not changed]
        assert unchanged in ([], ["one rank only"]), unchanged
        assert obs["differences"] == {name: [] for name in mutations}, obs["differences"]
