"""The protected FSDP1 model restore reads each rank's elements straight into its flat-parameter shard (no
all-gather over the training group) and restores exactly what native Accelerate does, in fresh processes (2 ranks,
gloo)."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch

pytestmark = pytest.mark.distributed
TIMEOUT = 300


@pytest.fixture(scope="module")
def observed(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.fsdp1_model_scenarios:restores", 2, args=(str(tmp_path_factory.mktemp("model")),),
                  timeout=TIMEOUT)


@pytest.mark.parametrize("label", ["orig", "flat"])
def test_protected_restore_reads_straight_into_the_flat_shards_exactly(observed: list[dict[str, Any]],
                                                                       label: str) -> None:
    for obs in observed:
        assert obs[f"{label}_protected"] == {"direct": 1, "gathers": 0}, obs[f"{label}_protected"]
        assert obs[f"{label}_protected_differences"] == []
        # Native's loader all-gathers (so the counter above can fail) and restores the same parameters and buffers.
        assert obs[f"{label}_native"]["direct"] == 0 and obs[f"{label}_native"]["gathers"] > 0
        assert obs[f"{label}_native_differences"] == []
        assert obs[f"{label}_next_step_differences"] == []


def test_original_parameters_stay_views_of_the_flat_shard(observed: list[dict[str, Any]]) -> None:
    assert all(obs["orig_views_kept"] for obs in observed)


@pytest.mark.parametrize("label", ["native", "captured"])
def test_native_and_captured_checkpoints_restore_exactly_through_the_direct_read(
        observed: list[dict[str, Any]], label: str) -> None:
    for obs in observed:
        assert obs[f"from_{label}"] == {"direct": 1, "gathers": 0}, obs[f"from_{label}"]
        assert obs[f"from_{label}_differences"] == []


def test_a_declined_layout_restores_exactly_through_native(observed: list[dict[str, Any]]) -> None:
    for obs in observed:
        assert obs["declined"]["direct"] == 0 and obs["declined"]["gathers"] > 0, obs["declined"]
        assert obs["declined_differences"] == []
