"""FSDP2 rank faults, and a protected restore into an Accelerator whose gradient scaler is already initialised.

One launched 2-rank gloo group (tests/scenarios/fsdp2_faults.py). Rank faults: ranks that disagree on the training
configuration, and a save pre-hook raising on rank 1 only, each raise the same explained error on every rank and
publish nothing; the next save publishes. Scaler: a CPU ``GradScaler`` attached, training through
``accelerator.backward`` (which scales the loss, initialising the scaler as every fp16 step does), a protected
save, then ``load_state`` (1) right after the save in the training process, (2) into a fresh Accelerator, and
(3) again into that Accelerator (a rollback). Every load must restore parameters, optimizer state, scheduler,
scaler, RNG, custom object, private state and ``accelerator.step`` exactly; whatever fails must either change
nothing or leave the Accelerator marked failed (training blocked).

Known failure (strict xfail below, to be removed with the fix): native Accelerate's FSDP2 ``load_state`` calls
``scaler._lazy_init_scale_growth_tracker`` after loading ``scaler.pt``, which raises ``AssertionError:
_growth_tracker initialized before _scale`` when the scaler is already initialised; the protected path lets it
through after the model was restored, so cases (1) and (3) fail part way (parameters overwritten, Accelerator
marked failed). Case (2), the usual resume in a new process, is exact. About 10-15 s on 2 shared CPU cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch

pytestmark = pytest.mark.distributed
TIMEOUT = 240
# Accelerate 1.9+'s FSDP2 load_state re-initialises the scaler from scaler.pt and asserts it was not initialised:
# the protected load resets it first (_internals.uninitialise_grad_scaler). These cases would fail part way without.


@pytest.fixture(scope="module")
def observations(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.fsdp2_faults:fsdp2_faults", 2, args=(str(tmp_path_factory.mktemp("fsdp2_faults")),),
                  timeout=TIMEOUT)


def _exact(observations: list[dict[str, Any]], case: str) -> None:
    for rank, obs in enumerate(observations):
        result = obs[case]
        assert result["same_as_saved"] == [], f"rank {rank}: precondition {result['same_as_saved']}"
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        assert result["restored_differences"] == [], f"rank {rank}: {result['restored_differences']}"


def test_the_scaler_was_initialised_by_training_and_not_by_construction(observations: list[dict[str, Any]]) -> None:
    for obs in observations:
        assert obs["scaler_initialised_by_backward"] is True
        assert obs["fresh_scaler_uninitialised"] is True


def test_first_load_into_a_fresh_fsdp2_accelerator_restores_everything_exactly(
        observations: list[dict[str, Any]]) -> None:
    _exact(observations, "fresh_first")


def test_load_right_after_save_with_a_scaler_initialised_by_training_is_exact(
        observations: list[dict[str, Any]]) -> None:
    _exact(observations, "same_process")


def test_a_second_load_in_one_process_is_exact(observations: list[dict[str, Any]]) -> None:
    _exact(observations, "fresh_second")


@pytest.mark.parametrize("case", ["same_process", "fresh_first", "fresh_second"])
def test_a_restore_that_fails_changes_nothing_or_blocks_training(observations: list[dict[str, Any]], case: str) -> None:
    for rank, obs in enumerate(observations):
        result = obs[case]
        if result["error"] is not None:
            assert result["changed"] == [] or result["marked_failed"], f"rank {rank}: {result}"
    assert observations[0][case]["error"] == observations[1][case]["error"]  # the same outcome on every rank


def test_ranks_with_different_configuration_raise_the_same_explained_error_and_publish_nothing(
        observations: list[dict[str, Any]]) -> None:
    errors = [obs["rank_faults"]["disagreement"] for obs in observations]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert errors[0]["type"] == "CheckpointConfigurationError", errors[0]
    message = errors[0]["message"]
    assert "Ranks disagree on the training configuration" in message and "laion" in message and "coyo" in message
    assert not any(obs["rank_faults"]["disagreement_published"] for obs in observations)


def test_a_save_hook_failing_on_one_rank_raises_the_same_error_everywhere_and_the_next_save_publishes(
        observations: list[dict[str, Any]]) -> None:
    errors = [obs["rank_faults"]["hook_failure"] for obs in observations]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert errors[0]["type"] == "CheckpointRankError", errors[0]
    assert "save hook failed on rank 1" in errors[0]["message"] and "rank(s) [1]" in errors[0]["message"], errors[0]
    for obs in observations:
        assert obs["rank_faults"]["hook_failure_published"] is False
        assert obs["rank_faults"]["next_save"] is None, obs["rank_faults"]["next_save"]
        assert obs["rank_faults"]["next_save_published"] is True
