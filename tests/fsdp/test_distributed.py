"""Real 2-process gloo tests of the protected FSDP1 path (hard timeouts: a hang fails, never stalls CI).

Each launch runs several checks in one process group (see tests/scenarios/scenarios.py); the tests below assert on
the observations each rank returned."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch

pytestmark = pytest.mark.distributed
TIMEOUT = 240


@pytest.fixture(scope="module", params=[True, False], ids=["orig_params", "flat_params"])
def roundtrip(request: Any, tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("roundtrip")
    return launch("tests.scenarios.scenarios:roundtrip", 2, args=(str(root), request.param), timeout=TIMEOUT)


def test_roundtrip_restores_params_optimizer_scheduler_rng_and_private_state_exactly(roundtrip: list) -> None:
    for obs in roundtrip:
        assert obs["roundtrip_differences"] == []
        assert obs["optimizer_entries"] > 0  # a fresh optimizer got its moments back, not silently nothing
        assert obs["rng_restored"] and obs["private_generator_restored"] and obs["progress_restored"]
        assert obs["scheduler_restored"] and obs["step_restored"]


def test_save_publishes_a_manifest_and_leaves_no_staging(roundtrip: list) -> None:
    for obs in roundtrip:
        assert "checkpoint_manifest.json" in obs["listing"]
        assert {"optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl",
                "scheduler.bin", "training_state_0.pt", "training_state_1.pt"} <= set(obs["listing"])
        assert obs["no_staging_left"]


def test_manifest_records_the_real_library_versions(roundtrip: list) -> None:
    # Regression: the reference design recorded hard-coded "1.7.0"/"2.7.0" and rejected anything else.
    for obs in roundtrip:
        assert obs["manifest_versions"] == obs["installed_versions"]


def test_path_containing_accelerate_directory_names_round_trips(roundtrip: list) -> None:
    # Accelerate 1.7-1.14 choose DCP directories by substring; the saved path contains both names.
    for obs in roundtrip:
        assert "optimizer" in obs["saved_at"] and "pytorch_model_fsdp" in obs["saved_at"]
        assert obs["roundtrip_differences"] == []


@pytest.mark.parametrize("case, message", [
    ("truncated", r"__0_0\.distcp has \d+ bytes; the manifest recorded \d+"),
    ("flipped", r"random_states_1\.pkl does not match its xxh3_128"),
    ("missing_rank_file", r"random_states_1\.pkl is missing"),
    ("configuration", r"saved for a different training configuration:\n  models\[0\]\.parameters\.body\.0\.bias\.shape"),
])
def test_damaged_or_mismatched_checkpoint_is_rejected_on_every_rank_before_any_change(
        roundtrip: list, case: str, message: str) -> None:
    import re

    errors = [obs["rejections"][case] for obs in roundtrip]
    expected_type = "CheckpointConfigurationError" if case == "configuration" else "CheckpointIntegrityError"
    for error in errors:
        assert error["type"] == expected_type
        assert re.search(message, error["message"]), error["message"]
        assert error["unchanged"], "the live model or optimizer changed before the rejection"
    assert errors[0]["message"] == errors[1]["message"]  # the same error on every rank


def test_hook_raising_on_one_rank_makes_every_rank_raise_and_publishes_nothing(roundtrip: list) -> None:
    for obs in roundtrip:
        failure = obs["hook_failure"]
        assert failure["type"] == "CheckpointRankError"
        assert failure["failures"] == [1]
        assert "hook exploded on rank 1" in failure["message"]
        assert obs["hook_nothing_published"]
        assert obs["hook_iteration_restored"]


def test_existing_checkpoint_is_replaced_atomically_or_refused_with_overwrite_refuse(roundtrip: list) -> None:
    for obs in roundtrip:
        assert obs["overwrite"]["type"] == "CheckpointExistsError"
        assert "Refusing to overwrite" in obs["overwrite"]["message"]
        assert obs["replace"] is None and obs["replaced"]
        assert obs["replaced_listing"] == [".accelerate-txn.lock", "ckpt"]  # nothing staged or set aside is left


@pytest.fixture(scope="module")
def retention(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.scenarios:retention", 2, args=(str(tmp_path_factory.mktemp("retention")),), timeout=TIMEOUT)


def test_total_limit_deletes_only_after_the_new_checkpoint_is_published(retention: list) -> None:
    for obs in retention:
        # While checkpoint_2 was being written, checkpoint_0 and checkpoint_1 both still existed.
        assert obs["seen_during_save"] == [[], ["checkpoint_0"], ["checkpoint_0", "checkpoint_1"]]
        assert obs["after"] == ["checkpoint_1", "checkpoint_2"]
        assert obs["iteration"] == 3


def test_automatic_resume_selects_newest_and_continues_numbering(retention: list) -> None:
    for obs in retention:
        assert obs["resumed_differences"] == []
        assert obs["resumed_iteration"] == 3


@pytest.fixture(scope="module")
def toggles(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.scenarios:dispatch_toggles", 2, args=(str(tmp_path_factory.mktemp("toggles")),),
                  timeout=TIMEOUT)


def test_per_instance_unpatch_and_patch(toggles: list) -> None:
    for obs in toggles:
        assert obs["auto_has_manifest"] is True
        assert obs["unpatched_has_manifest"] is False
        assert obs["repatched_has_manifest"] is True


def test_opted_in_instance_routes_native_load_state_through_the_sharded_loader(toggles: list) -> None:
    for obs in toggles:
        assert obs["opted_in_native_differences"] == []


def test_legacy_checkpoint_loads_with_warning_or_is_refused(toggles: list) -> None:
    assert toggles[0]["legacy_warned"]  # rank 0 warns
    for obs in toggles:
        assert obs["legacy_differences"] == []
        assert obs["legacy_refused"]["type"] == "CheckpointIntegrityError"
        assert "allow_legacy=False" in obs["legacy_refused"]["message"]


def test_env_toggle_off_runs_native_unless_opted_in(tmp_path: Any) -> None:
    results = launch("tests.scenarios.scenarios:env_off", 2, args=(str(tmp_path),), timeout=TIMEOUT,
                     env={"ACCELERATE_TXN_PATCHES": "0"})
    for obs in results:
        assert obs == {"native_has_manifest": False, "opted_in_has_manifest": True}


def test_kill_9_mid_save_leaves_previous_checkpoint_selected_and_next_save_unblocked(tmp_path: Any) -> None:
    import signal
    import time

    from accelerate_txn.testing import start_ranks

    code = f"from tests.scenarios.scenarios import killable_save; killable_save({str(tmp_path)!r}, 3)"
    processes = start_ranks(code)
    marker = tmp_path / "blocked-in-save"
    deadline = time.monotonic() + TIMEOUT
    try:
        while not marker.exists():  # poll the filesystem for the saver's signal, with a deadline
            assert time.monotonic() < deadline, "the saver never reached its third save"
            assert all(p.poll() is None for p in processes), "a saver exited before reaching its third save"
            time.sleep(0.05)
        staging_of_killed_save = marker.read_text()
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=120)  # a hang guard only: a SIGKILLed process exits at once
    assert ".checkpoint_2.staging-" in staging_of_killed_save
    results = launch("tests.scenarios.scenarios:resume_after_kill", 2, args=(str(tmp_path),), timeout=TIMEOUT)
    for obs in results:
        assert [name for name in obs["before"] if not name.startswith(".")] == ["checkpoint_0", "checkpoint_1"]
        assert any(".checkpoint_2.staging-" in name for name in obs["before"])  # the killed save's leftover
        assert "checkpoint_2" not in obs["before"]  # never published
        assert obs["next_iteration"] == 2  # resumed from checkpoint_1
        assert obs["after"] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]  # saved; leftover cleaned


@pytest.fixture(scope="module")
def disagreement(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.scenarios:disagreement_and_native_gap", 2,
                  args=(str(tmp_path_factory.mktemp("disagree")),), timeout=TIMEOUT)


def test_ranks_with_different_configuration_raise_the_same_explained_error(disagreement: list) -> None:
    messages = {obs["disagreement"]["message"] for obs in disagreement}
    assert len(messages) == 1
    message = messages.pop()
    assert "Ranks disagree on the training configuration" in message
    assert "training.dataset" in message and "laion" in message and "coyo" in message
    assert all(obs["disagreement"]["type"] == "CheckpointConfigurationError" for obs in disagreement)
    assert all(obs["disagreement_published_nothing"] for obs in disagreement)


def test_restore_verification_catches_the_silently_empty_native_optimizer(disagreement: list) -> None:
    import accelerate
    from packaging.version import Version

    for obs in disagreement:
        if Version(accelerate.__version__) >= Version("1.13.0"):
            assert obs["native_optimizer_entries"] == 0  # what native Accelerate silently leaves
            assert obs["verify_native"]["type"] == "CheckpointIntegrityError"
            assert "The optimizer was not restored" in obs["verify_native"]["message"]


def test_dcp_checkpoint_exception_on_one_rank_is_raised_on_every_rank(disagreement: list) -> None:
    for obs in disagreement:
        error = obs["dcp_exception"]
        assert error["type"] == "CheckpointRankError"
        assert error["failures"] == [1]
        assert "Reading shards failed on rank(s) [1]" in error["message"]
        assert "CheckpointException" in error["message"]


def test_restore_failing_part_way_blocks_step_and_save_until_a_successful_load(disagreement: list) -> None:
    for obs in disagreement:
        assert "load hook failed" in obs["partial_restore"]["message"]
        assert obs["step_after_failed_restore"]["type"] == "RestoreFailedError"
        assert "load a checkpoint successfully before calling optimizer.step()" in obs["step_after_failed_restore"]["message"]
        assert obs["save_after_failed_restore"]["type"] == "RestoreFailedError"
        assert obs["recovered_differences"] == []
        assert obs["step_after_recovery"] is True


def test_explicit_api_protects_multi_cpu(tmp_path: Any) -> None:
    for obs in launch("tests.scenarios.scenarios:multi_cpu_explicit", 2, args=(str(tmp_path),), timeout=TIMEOUT):
        assert obs["backend"] == "MULTI_CPU"
        assert obs["manifest"] is True
        assert "model.safetensors" in obs["main_only"] and "checkpoint_manifest.json" not in obs["main_only"]
        assert obs["differences"] == []
