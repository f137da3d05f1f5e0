"""The dispatch decision with real 2-process (and 1-process) gloo FSDP1 runs: a setup the protected path cannot
handle runs native Accelerate with one warning (or is refused when opted in explicitly), every native FSDP
setup logs one INFO line naming why, world size 1 (NO_SHARD) is protected and exact, HYBRID_SHARD with one-rank
shard groups falls back."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch

pytestmark = pytest.mark.distributed
TIMEOUT = 300
UNPROTECTED = "accelerate-txn: this Accelerator's FSDP checkpoints run native Accelerate save_state/load_state, UNPROTECTED"
NOT_PROTECTED = ("accelerate-txn: FSDP checkpoints of this Accelerator run native, NOT protected (no staging, no "
                 "manifest, no verification before restore): ")


@pytest.fixture(scope="module")
def fallbacks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.dispatch_scenarios:fallbacks", 2, args=(str(tmp_path_factory.mktemp("fallbacks")),),
                  timeout=TIMEOUT)


def _notices(seen: dict[str, list[str]]) -> list[str]:
    """The native-fallback lines logged at WARNING (seen at Python's default logging level)."""
    return [line for line in seen["logged_warnings"] if line.startswith(NOT_PROTECTED)]


def test_optimizer_state_that_is_not_parameter_shaped_runs_native_with_one_warning(
        fallbacks: list[dict[str, Any]]) -> None:
    for obs in fallbacks:
        # Before the first step the state is empty: protected. After it, native (no manifest) on every rank.
        assert obs["counting_manifests"] == [True, False, False]
        (warning,) = obs["counting_seen"]["warnings"]  # three calls, one warning
        assert warning.startswith(UNPROTECTED)
        assert "Unsupported optimizer: tests.scenarios.dispatch_scenarios.Counting state 'stats' (parameter group 0) is a " \
               "builtins.dict" in warning
        assert obs["counting_reloaded"] == []  # native saved and loaded it exactly
        assert _notices(obs["counting_seen"]) == []  # the warning says it: no second line


def test_native_checkpoint_of_such_an_optimizer_loads_native_decided_from_the_checkpoint(
        fallbacks: list[dict[str, Any]]) -> None:
    for obs in fallbacks:
        assert obs["fresh_counting_error"] is None
        (warning,) = obs["fresh_counting_seen"]["warnings"]  # a fresh optimizer has no state: the checkpoint decides
        assert "counting_2/optimizer_0 holds nested optimizer state 'optimizer.state." in warning
        assert ".stats.updates'" in warning


def test_state_of_another_shape_warns_and_leaves_the_save_to_native_fsdp(fallbacks: list[dict[str, Any]]) -> None:
    for obs in fallbacks:
        (warning,) = obs["blocky_seen"]["warnings"]
        assert "Blocky state 'absmax' (parameter group 0) has shape [34] for a parameter (shard) of shape [136]" in warning
        # FSDP1 itself cannot save such state; the error is native FSDP's, not one the library added.
        assert obs["blocky_native_error"]["type"] == "AssertionError"
        assert "_sharded_numel_padded" in obs["blocky_native_error"]["message"]


@pytest.mark.parametrize("case, reason", [
    ("counting_explicit", "Counting state 'stats' (parameter group 0) is a builtins.dict"),
    ("blocky_explicit", "Blocky state 'absmax' (parameter group 0) has shape [34]"),
])
def test_explicit_opt_in_refuses_an_unsupported_optimizer_with_the_reason(
        fallbacks: list[dict[str, Any]], case: str, reason: str) -> None:
    for obs in fallbacks:
        error = obs[case]
        assert error["type"] == "CheckpointConfigurationError"
        assert error["message"].startswith("This Accelerator was opted in with patch_accelerate_fsdp(), but the "
                                           "protected path cannot handle it: rank 0: Unsupported optimizer: ")
        assert reason in error["message"]
        assert error["message"].endswith("Unpatch it (unpatch_accelerate_fsdp) to use native save_state/load_state, "
                                         "unprotected.")
    assert fallbacks[0]["counting_explicit_nothing_written"]


@pytest.mark.parametrize("case, condition, fix", [
    ("local_state_dict", "state_dict_type is LOCAL_STATE_DICT (protected: SHARDED_STATE_DICT and FULL_STATE_DICT)",
     "set the FSDP state dict type to SHARDED_STATE_DICT"),
    ("opted_out", "opted out with unpatch_accelerate_fsdp()", "opt it back in with patch_accelerate_fsdp(accelerator)"),
    ("env_off", "automatic dispatch is off (ACCELERATE_TXN_PATCHES='0')", "unset ACCELERATE_TXN_PATCHES (or set it to 1)"),
])
def test_each_native_fsdp_setup_logs_one_warning_naming_the_condition_and_the_fix(
        fallbacks: list[dict[str, Any]], case: str, condition: str, fix: str) -> None:
    rank0, rank1 = fallbacks
    (notice,) = _notices(rank0[f"{case}_seen"])  # two calls, one WARNING line, on rank 0
    assert notice.startswith(NOT_PROTECTED + condition + ". To protect them: " + fix), notice
    assert _notices(rank1[f"{case}_seen"]) == []
    for obs in fallbacks:
        assert obs[f"{case}_seen"]["warnings"] == []  # a configuration choice, not a surprise
        if case != "local_state_dict":
            assert obs[f"{case}_error"] is None and obs[f"{case}_manifest"] is False
    assert rank0["local_state_dict_protected"] == [False, False]


def test_strict_mode_refuses_a_native_fsdp_save_and_load_on_every_rank_before_anything_is_written(
        fallbacks: list[dict[str, Any]]) -> None:
    for obs in fallbacks:
        assert obs["local_protection"] == {
            "protected": False, "path": "fsdp1",
            "reason": "state_dict_type is LOCAL_STATE_DICT (protected: SHARDED_STATE_DICT and FULL_STATE_DICT)",
            "fix": obs["local_protection"]["fix"]}
        assert obs["local_protection"]["fix"].startswith("set the FSDP state dict type to SHARDED_STATE_DICT")
        for key in ("strict_error", "strict_load_error"):
            error = obs[key]
            assert error["type"] == "CheckpointUnprotectedError", error
            assert error["message"].startswith(
                "accelerate-txn: this Accelerator's checkpoints would run native, NOT protected, and protection is "
                "required (configure_checkpointing(require_protection=True)): state_dict_type is LOCAL_STATE_DICT")
        assert obs["strict_nothing_written"]
    assert fallbacks[0]["strict_error"] == fallbacks[1]["strict_error"]  # the same error on every rank


@pytest.mark.parametrize("case", ["protected", "fsdp2"])
def test_a_protected_setup_logs_no_notice(fallbacks: list[dict[str, Any]], case: str) -> None:
    # FSDP2 SHARDED_STATE_DICT is protected where the evidence protects the installed releases (tests/fsdp/test_fsdp2.py:
    # its native fallback where a piece changed logs "a private piece it relies on changed (...)").
    for obs in fallbacks:
        assert obs[f"{case}_manifest"] is True and obs[f"{case}_error"] is None
        assert _notices(obs[f"{case}_seen"]) == [] and obs[f"{case}_seen"]["warnings"] == []


def test_world_size_one_no_shard_is_protected_and_restores_exactly(tmp_path: Any) -> None:
    (obs,) = launch("tests.scenarios.dispatch_scenarios:sharding", 1, args=(str(tmp_path), ""), timeout=TIMEOUT)
    assert obs["strategies"] == ["NO_SHARD"]  # FSDP switches to NO_SHARD at world size 1
    assert obs["save_error"] is None and obs["load_error"] is None
    assert obs["manifest"] is True
    assert obs["differences"] == [] and obs["optimizer_entries"] == 8
    assert obs["seen"]["warnings"] == []


def test_hybrid_shard_with_one_rank_per_shard_group_falls_back_to_native_with_a_warning(tmp_path: Any) -> None:
    # The strategy is set after fsdp_accelerator, so no nodes are emulated: FSDP1 builds HYBRID_SHARD's shard groups
    # from the CPU's device count (one rank each) and runs NO_SHARD, whose replicas never synchronise. (Protected
    # hybrid sharding with real shard groups: tests/fsdp/test_hsdp_fsdp1.py.)
    observed = launch("tests.scenarios.dispatch_scenarios:sharding", 2, args=(str(tmp_path), "HYBRID_SHARD"), timeout=TIMEOUT)
    for obs in observed:
        assert obs["strategies"] == ["NO_SHARD"]
        assert obs["manifest"] is False and obs["save_error"] is None and obs["load_error"] is None
        assert len(obs["seen"]["warnings"]) == 2  # one per Accelerator (the saver and the fresh one)
        assert all("Unsupported sharding strategy: an FSDP1 unit asked for hybrid sharding has a shard group of 1 "
                   "rank, so FSDP1 runs it as NO_SHARD and never all-reduces across its 2 replicas" in w
                   for w in obs["seen"]["warnings"])
