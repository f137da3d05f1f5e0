"""The sharded FSDP1 optimizer restore across optimizer configurations, in fresh processes (2 ranks, gloo)."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch
from tests._optimizer_matrix import CONFIGS

pytestmark = pytest.mark.distributed
TIMEOUT = 300


@pytest.fixture(scope="module")
def restored(tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("matrix"))
    launch("tests._optimizer_matrix:save_matrix", 2, args=(root,), timeout=TIMEOUT)
    return launch("tests._optimizer_matrix:load_matrix", 2, args=(root,), timeout=TIMEOUT)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fresh_optimizer_is_restored_bitwise(restored: list[dict[str, Any]], name: str) -> None:
    for obs in restored:
        assert obs[name]["differences"] == []
    if CONFIGS[name]["steps"] and CONFIGS[name]["optimizer"] != "sgd":
        assert sum(obs[name]["entries"] for obs in restored) > 0  # state really came back


@pytest.mark.parametrize("case, kind, message", [
    ("missing_moment", "CheckpointIntegrityError", r"Adam state of 'body\.0\.weight' lacks \['exp_avg_sq'\]"),
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
