"""FSDP ``FULL_STATE_DICT`` (Accelerate's FSDP1 default and the Trainer's default) takes the protected path: the same
transaction as a sharded save (staging, every file hashed, manifest last, atomic publish), rank 0 writing native's
full model and optimizer files, every rank verifying before anything is restored; native Accelerate still loads the
checkpoint. Real Accelerate, two gloo ranks on CPU.

FSDP1's native ``FULL_STATE_DICT`` save kills rank 0 with a segmentation fault on CPU (torch's gather of the full
state dict, not the library's code): its protected path is checked where that crash does not happen (see
docs/troubleshooting.md); FSDP2's runs here."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
TIMEOUT = 300


@pytest.fixture(scope="module")
def fsdp2_round_trip(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return launch("tests.scenarios.full_state_dict_scenarios:round_trip", 2,
                  args=(str(tmp_path_factory.mktemp("full2")), 2), timeout=TIMEOUT)


def test_an_fsdp2_full_state_dict_save_is_published_with_native_files(fsdp2_round_trip: list[dict[str, Any]]) -> None:
    for obs in fsdp2_round_trip:
        assert obs["protection"] == "protected (accelerate, fsdp2 path)"
        assert obs["save_error"] is None and obs["manifest"] is True
        assert obs["files"] == ["checkpoint_manifest.json", "optimizer.bin", "pytorch_model_fsdp.bin",
                                "random_states_0.pkl", "random_states_1.pkl"]


def test_an_fsdp2_full_state_dict_checkpoint_restores_exactly(fsdp2_round_trip: list[dict[str, Any]]) -> None:
    for obs in fsdp2_round_trip:
        assert obs["moved_on"] is True  # training changed the state after the save
        assert obs["load_error"] is None and obs["restored"] == []
        assert obs["fresh_load_error"] is None and obs["fresh_restored"] == []


def test_a_damaged_full_file_is_refused_on_every_rank_before_anything_changes(
        fsdp2_round_trip: list[dict[str, Any]]) -> None:
    errors = [obs["damaged_error"] for obs in fsdp2_round_trip]
    assert errors[0] == errors[1]  # the same error on every rank
    assert errors[0]["type"] == "CheckpointIntegrityError"
    assert "damaged/optimizer.bin does not match its xxh3_128" in errors[0]["message"]
    assert all(obs["damaged_untouched"] == [] for obs in fsdp2_round_trip)


def test_native_accelerate_loads_a_protected_full_state_dict_checkpoint(fsdp2_round_trip: list[dict[str, Any]]) -> None:
    for obs in fsdp2_round_trip:
        assert obs["native_load_error"] is None and obs["native_restored"] == []


def test_an_asynchronous_full_state_dict_save_is_the_state_when_save_state_returned(tmp_path: Any) -> None:
    for obs in launch("tests.scenarios.full_state_dict_scenarios:asynchronous", 2, args=(str(tmp_path), 2),
                      timeout=TIMEOUT):
        assert obs["wait_error"] is None and obs["published"] is True
        assert obs["load_error"] is None and obs["restored"] == []


@pytest.mark.parametrize("world", [1, 4])
def test_a_full_state_dict_checkpoint_resumes_on_another_world_size_without_the_opt_in(tmp_path: Any,
                                                                                      world: int) -> None:
    # Whole tensors in the files: as natively, another world size resumes; the per-rank RNG files follow the elastic
    # policy (a new rank derives its state), instead of native's missing random_states_N.pkl on a larger world.
    (saved, _), = [launch("tests.scenarios.full_state_dict_scenarios:elastic_save", 2, args=(str(tmp_path), 2),
                          timeout=TIMEOUT)]
    loaded = launch("tests.scenarios.full_state_dict_scenarios:elastic_load", world, args=(str(tmp_path), 2),
                    timeout=TIMEOUT)
    for obs in loaded:
        assert obs["error"] is None and obs["world"] == world
        assert obs["restored"] == saved["saved"]
