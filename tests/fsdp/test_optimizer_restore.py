"""The sharded FSDP1 optimizer restore across optimizer configurations, in fresh processes (2 ranks, gloo)."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch
from tests.scenarios.optimizer_matrix import CONFIGS

pytestmark = pytest.mark.distributed
TIMEOUT = 300


@pytest.fixture(scope="module")
def restored(tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("matrix"))
    launch("tests.scenarios.optimizer_matrix:save_matrix", 2, args=(root,), timeout=TIMEOUT)
    return launch("tests.scenarios.optimizer_matrix:load_matrix", 2, args=(root,), timeout=TIMEOUT)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fresh_optimizer_is_restored_bitwise(restored: list[dict[str, Any]], name: str) -> None:
    for obs in restored:
        assert obs[name]["differences"] == []
    config = CONFIGS[name]
    if (config["steps"] or config["optimizer"] == "adagrad") and config["optimizer"] != "sgd":
        assert sum(obs[name]["entries"] for obs in restored) > 0  # state really came back


@pytest.mark.parametrize("case, kind, message", [
    ("missing_moment", "CheckpointIntegrityError",
     r"Optimizer state of 'body\.0\.weight' lacks \['exp_avg_sq'\] in the checkpoint, which other parameters of its "
     r"group 0 have"),
    ("wrong_type", "CheckpointConfigurationError", r"lacks options \[.*'momentum'.*\].*saved by another optimizer type"),
    ("membership", "CheckpointConfigurationError", r"matches no parameter group in the checkpoint: group membership changed"),
])
def test_bad_optimizer_checkpoint_is_rejected_on_every_rank_before_any_change(
        restored: list[dict[str, Any]], case: str, kind: str, message: str) -> None:
    import re

    for obs in restored:
        error = obs[case]
        assert error["type"] == kind, error
        assert re.search(message, error["message"]), error["message"]
        assert error["failures"] == [0, 1]
        assert error["unchanged"]


@pytest.mark.parametrize("name", ["orig_adamw_groups", "flat_adam_amsgrad"])
def test_conversion_fallback_restores_the_same_state(restored: list[dict[str, Any]], name: str) -> None:
    for obs in restored:
        assert obs[f"fallback_{name}"] == []


def test_parameter_offload_without_original_params_is_refused_with_the_fix(restored: list[dict[str, Any]]) -> None:
    for obs in restored:
        assert obs["offload_flat"]["type"] == "CheckpointConfigurationError"
        assert "CPU offload requires use_orig_params=True" in obs["offload_flat"]["message"]
        assert "FullyShardedDataParallelPlugin(use_orig_params=True)" in obs["offload_flat"]["message"]


@pytest.fixture(scope="module")
def conversion(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.optimizer_matrix:conversion_preflight", 2, args=(str(tmp_path_factory.mktemp("conv")),),
                  timeout=TIMEOUT)


@pytest.mark.parametrize("tag", ["orig", "flat"])
def test_no_shard_on_two_ranks_restores_exactly_through_the_conversion_fallback(
        conversion: list[dict[str, Any]], tag: str) -> None:
    assert [obs[f"{tag}_strategies"] for obs in conversion] == [["NO_SHARD"], ["NO_SHARD"]]
    assert conversion[0][f"{tag}_geometry"] == "mapped"
    assert conversion[1][f"{tag}_geometry"].startswith("mismatch: ")  # rank 1 takes FSDP's conversion
    for obs in conversion:
        assert obs[f"{tag}_differences"] == []


@pytest.mark.parametrize("tag", ["orig", "flat"])
def test_conversion_fallback_checks_run_in_each_ranks_preflight_before_the_model_changes(
        conversion: list[dict[str, Any]], tag: str) -> None:
    message = r"Optimizer state of 'body\.0\.weight' lacks \['exp_avg_sq'\] in the checkpoint"
    import re

    for obs in conversion:  # rank 1 (conversion) used to skip these checks until after the weights were loaded
        assert obs[f"{tag}_preflight"]["type"] == "CheckpointIntegrityError"
        assert re.search(message, obs[f"{tag}_preflight"]["message"])
        error = obs[f"{tag}_missing_moment"]
        assert error["type"] == "CheckpointIntegrityError" and error["failures"] == [0, 1]
        assert re.search(message, error["message"])
        assert obs[f"{tag}_unchanged"] == []
