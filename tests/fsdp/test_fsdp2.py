"""FSDP2 (Accelerate ``fsdp_version=2``, DTensor parameters) through the protected transaction, with real 2-process
gloo runs: exact round trips (parameters, optimizer, groups, scheduler, RNG, and the next step), load right after
save in one process (accelerate #3896), resume into a fresh optimizer and from a checkpoint saved before the first
step, each rank reading only its own optimizer shards, the descriptor's FSDP2 layout, a flipped byte refused on
every rank before mutation, another model or optimizer refused before mutation, a rank fault, native fallback
with a warning on versions the FSDP2 path was not validated on, and (FSDP1 and FSDP2) a checkpoint saved on 2
ranks refused on 1 and 3 ranks before anything changes, naming the elastic-resume opt-in."""

from __future__ import annotations

from typing import Any

import accelerate
import pytest
from packaging.version import Version

from accelerate_txn.testing import launch

pytestmark = pytest.mark.distributed
TIMEOUT = 300


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.fsdp2_scenarios:roundtrip", 2, args=(str(tmp_path_factory.mktemp("fsdp2_roundtrip")),),
                  timeout=TIMEOUT)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.fsdp2_scenarios:refusals", 2, args=(str(tmp_path_factory.mktemp("fsdp2_refusals")),),
                  timeout=TIMEOUT)


def test_fsdp2_save_is_protected_and_published_with_a_manifest(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["installed"] and obs["dtensor"] == "DTensor"
        assert obs["protected"] is True and obs["save_error"] is None
        assert obs["manifest_name"] == "checkpoint_manifest.json"
        assert {"optimizer_0/.metadata", "pytorch_model_fsdp_0/.metadata", "optimizer_0/__1_0.distcp",
                "pytorch_model_fsdp_0/__1_0.distcp", "random_states_1.pkl", "scheduler.bin"} <= set(obs["files"])


def test_descriptor_records_the_fsdp2_layout(roundtrip: list[dict[str, Any]]) -> None:
    model = roundtrip[0]["descriptor_model"]
    # The user's class, not fully_shard's swapped-in FSDPTinyModel (whose torch-private module moves between releases).
    assert model["class"] == "accelerate_txn.testing.TinyModel"
    assert model["fsdp"] == [{"fsdp_version": 2, "mesh": [2]}]
    assert model["parameters"]["head.weight"] == {"shape": [5, 16], "dtype": "torch.float32",
                                                  "requires_grad": True, "placements": ["S(0)"]}
    assert set(model["parameters"]) == {f"body.{i}.{k}" for i in (0, 3, 6) for k in ("weight", "bias")} | {
        "head.weight", "head.bias"}


def test_load_right_after_save_in_the_same_process_is_exact(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["same_process_error"] is None
        assert obs["same_process_differences"] == []


def test_a_load_into_a_stepped_optimizer_reads_into_its_own_state_tensors_exactly(
        roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["stepped_error"] is None
        assert obs["stepped_in_place"], "the restore allocated new optimizer state instead of reading in place"
        assert obs["stepped_differences"] == []


def test_resume_into_a_fresh_model_and_optimizer_is_exact_and_continues_identically(
        roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["fresh_state_before"] == 0  # a fresh optimizer: no state to build a template from
        assert obs["fresh_error"] is None
        assert obs["fresh_differences"] == []  # params, optimizer state, groups, scheduler, RNG
        assert obs["next_step_differences"] == []


def test_tied_weights_round_trip_exactly_and_stay_tied(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["tied_save_error"] is None and obs["tied_manifest"] is True
        assert obs["tied_load_error"] is None and obs["tied_differences"] == []
        assert obs["tied_still_tied"]


def test_each_rank_reads_only_its_own_optimizer_shards(roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        # Every element DCP read for the optimizer is one this rank keeps (its DTensor local shards plus the
        # 0-dim steps): no rank reads another's state, so peak memory is about one optimizer shard.
        assert obs["optimizer_elements_read"] == obs["optimizer_elements_local"]
        assert obs["optimizer_elements_read"] < 0.6 * obs["optimizer_elements_global"]


def test_checkpoint_saved_before_the_first_step_restores_no_state_over_live_momentum(
        roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["early_save_error"] is None and obs["early_error"] is None
        assert obs["early_differences"] == []  # the live momentum buffers are gone: the checkpoint has none


def test_a_save_before_the_first_step_does_not_step_the_optimizer_and_restores_no_state(
        roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        # Native FSDP2 saves call get_optimizer_state_dict, which steps a stateless optimizer once at lr 0 (AdamW
        # then holds step=1 and zero moments: its next update differs from an unsaved run's).
        assert obs["early_adam_saver_state"] == 0
        assert not [e for e in obs["early_adam_saved_entries"] if e.startswith("optimizer.state.")]
        assert "optimizer.param_groups.0.lr" in obs["early_adam_saved_entries"]
        assert obs["early_adam_error"] is None and obs["early_adam_state"] == 0


def test_the_protected_fsdp2_optimizer_writer_produces_native_accelerates_format(
        roundtrip: list[dict[str, Any]]) -> None:
    for obs in roundtrip:
        assert obs["format_native_manifest"] is False  # the second save really was native
        assert obs["format_entries"] > 30 and obs["format_differences"] == []


def test_flipped_byte_in_a_dcp_payload_is_refused_on_every_rank_before_anything_changes(
        refusals: list[dict[str, Any]]) -> None:
    for obs in refusals:
        error = obs["corrupt_error"]
        assert error["type"] == "CheckpointIntegrityError" and error["failures"] == [1]
        assert "damaged/optimizer_0/__1_0.distcp does not match its xxh3_128" in error["message"]
        assert obs["corrupt_unchanged"] == []
        assert obs["intact_error"] is None and obs["intact_differences"] == []


def test_check_finite_reads_dtensor_local_shards_and_refuses_on_every_rank(refusals: list[dict[str, Any]]) -> None:
    for obs in refusals:
        assert obs["finite_clean_error"] is None
        error = obs["finite_error"]
        assert error["type"] == "NonFiniteStateError" and error["failures"] == [1]  # the NaN is in rank 1's shard
        assert "The model parameters contains NaN or Inf" in error["message"]
        assert obs["finite_nothing_published"]


def test_checkpoint_of_another_model_is_refused_before_anything_changes(refusals: list[dict[str, Any]]) -> None:
    for obs in refusals:
        error = obs["configuration_error"]
        assert error["type"] == "CheckpointConfigurationError" and error["failures"] == [0, 1]
        assert "models[0].parameters.body.0.weight.shape[0]: 16 (saved) vs 24 (live)" in error["message"]
        assert obs["configuration_unchanged"] == []


def test_a_load_hook_failing_on_one_rank_raises_the_same_error_everywhere_and_blocks_training(
        refusals: list[dict[str, Any]]) -> None:
    messages = {obs["rank_fault_error"]["message"] for obs in refusals}
    assert len(messages) == 1
    for obs in refusals:
        assert obs["rank_fault_error"]["type"] == "CheckpointRankError"
        assert obs["rank_fault_error"]["failures"] == [1]
        assert "load hook failed on rank 1" in obs["rank_fault_error"]["message"]
        assert obs["step_after_failed_restore"]["type"] == "RestoreFailedError"
        assert obs["recovery_error"] is None and obs["recovered_differences"] == []


def test_native_fsdp2_checkpoint_is_checked_against_the_live_optimizer_before_anything_changes(
        refusals: list[dict[str, Any]]) -> None:
    for obs in refusals:
        error = obs["legacy_other_optimizer_error"]
        assert error["type"] == "CheckpointConfigurationError" and error["failures"] == [0, 1]
        assert "Optimizer checkpoint group 0 lacks options ['amsgrad', 'betas', 'capturable'" in error["message"]
        assert "of AdamW: it was saved by another optimizer type" in error["message"]
        assert obs["legacy_other_optimizer_unchanged"] == []
        # The matching optimizer restores the native checkpoint exactly through the protected loader.
        assert obs["legacy_error"] is None and obs["legacy_differences"] == []


def test_a_changed_fsdp2_piece_runs_fsdp2_native_with_one_warning_and_nothing_else(tmp_path: Any) -> None:
    rank0, rank1 = launch("tests.scenarios.fsdp2_scenarios:unvalidated_and_native", 2, args=(str(tmp_path),),
                          timeout=TIMEOUT)
    for obs in (rank0, rank1):
        assert obs["protected"] == [False, False]
        assert obs["save_error"] is None and obs["manifest"] is False and obs["model_saved"] is True
        (warning,) = obs["seen"]["warnings"]
        assert warning.startswith("accelerate-txn: Accelerate FSDP2 checkpoints run native, NOT protected: the "
                                  "installed releases differ from every release that passed")
        # FSDP2 reads save_fsdp_optimizer by its code (its FULL_STATE_DICT save runs the body): the changed body is
        # named, with the calls it no longer makes.
        assert (f"accelerate {accelerate.__version__}: accelerate.utils.fsdp_utils.save_fsdp_optimizer (its code) "
                "differs from every release that passed") in warning
        assert "calls removed: os.makedirs" in warning
        # Native Accelerate builds its read template from the live optimizer, so a checkpoint without optimizer
        # state (saved before the first step) fails into an optimizer that has state (accelerate #3971; the
        # protected loader restores it: see the before-first-step test) ...
        assert "Missing key in checkpoint state_dict: optimizer.state." in obs["native_early_error"]["message"]
        assert "momentum_buffer" in obs["native_early_error"]["message"]
        # ... and into a fresh AdamW too on Accelerate 1.13 and later (its template comes from one dummy step:
        # step, exp_avg, exp_avg_sq). Accelerate 1.7 to 1.12 build the template from ``optimizer.state_dict()``: a
        # fresh optimizer's is empty, so native reads no state at all and raises nothing (the silently empty
        # restore the protected loader replaces).
        if Version(accelerate.__version__) >= Version("1.13"):
            assert "Missing key in checkpoint state_dict: optimizer.state." in obs["native_early_adam_error"]["message"]
        else:
            assert obs["native_early_adam_error"] is None
    # The warning says why: no INFO line repeats it (one "NOT protected" per process and reason).
    assert [m for obs in (rank0, rank1) for m in obs["seen"]["info"] if "NOT protected" in m] == []


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory: Any) -> str:
    root = str(tmp_path_factory.mktemp("world_size_change"))
    launch("tests.scenarios.fsdp2_scenarios:save_fsdp1_and_fsdp2", 2, args=(root,), timeout=TIMEOUT)
    return root


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_world_size_change_is_refused_before_anything_changes_naming_the_opt_in(
        saved_on_two_ranks: str, ranks: int) -> None:
    observed = launch("tests.scenarios.fsdp2_scenarios:world_size_change", ranks, args=(saved_on_two_ranks,), timeout=TIMEOUT)
    for obs in observed:
        for version in ("fsdp1", "fsdp2"):
            error = obs[f"{version}_error"]
            assert error["type"] == "CheckpointConfigurationError" and error["failures"] == list(range(ranks))
            assert f"world_size: 2 (saved) vs {ranks} (live)" in error["message"]
            assert (f"This checkpoint was saved on 2 ranks and this run has {ranks}: a world-size change is refused "
                    "before anything is restored.") in error["message"]
            assert "configure_checkpointing(accelerator, allow_reshard=True)" in error["message"]
            assert obs[f"{version}_unchanged"] == []
        assert f"models[0].fsdp[0].mesh[0]: 2 (saved) vs {ranks} (live)" in obs["fsdp2_error"]["message"]
