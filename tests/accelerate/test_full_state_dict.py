"""FSDP ``FULL_STATE_DICT`` (Accelerate's FSDP1 default and the Trainer's default) takes the protected path: the same
transaction as a sharded save (staging, every file hashed, manifest last, atomic publish), rank 0 writing native's
full model and optimizer files, every rank verifying before anything is restored; native Accelerate still loads the
checkpoint. Real Accelerate, two gloo ranks on CPU, FSDP1 and FSDP2 (FSDP1's full gather on CPU with the harness's
fix of two torch bugs that only CPU meets: ``accelerate_txn.testing`` ``full_state_dict_on_cpu``)."""

from __future__ import annotations

from typing import Any

import pytest

from accelerate_txn.testing import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
TIMEOUT = 300


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def round_trip(request: Any, tmp_path_factory: Any) -> tuple[int, list[dict[str, Any]]]:
    version = request.param
    return version, launch("tests.scenarios.full_state_dict_scenarios:round_trip", 2,
                           args=(str(tmp_path_factory.mktemp(f"full{version}")), version), timeout=TIMEOUT)


def test_a_full_state_dict_save_is_published_with_native_files(round_trip: tuple[int, list[dict[str, Any]]]) -> None:
    version, results = round_trip
    for obs in results:
        assert obs["protection"] == f"protected (accelerate, fsdp{version} path)"
        assert obs["save_error"] is None and obs["manifest"] is True
        assert obs["files"] == ["checkpoint_manifest.json", "optimizer.bin", "pytorch_model_fsdp.bin",
                                "random_states_0.pkl", "random_states_1.pkl"]


def test_a_full_state_dict_checkpoint_restores_exactly(round_trip: tuple[int, list[dict[str, Any]]]) -> None:
    for obs in round_trip[1]:
        assert obs["moved_on"] is True  # training changed the state after the save
        assert obs["load_error"] is None and obs["restored"] == []
        assert obs["fresh_load_error"] is None and obs["fresh_restored"] == []


def test_a_damaged_full_file_is_refused_on_every_rank_before_anything_changes(
        round_trip: tuple[int, list[dict[str, Any]]]) -> None:
    errors = [obs["damaged_error"] for obs in round_trip[1]]
    assert errors[0] == errors[1]  # the same error on every rank
    assert errors[0]["type"] == "CheckpointIntegrityError"
    assert "damaged/optimizer.bin does not match its xxh3_128" in errors[0]["message"]
    assert all(obs["damaged_untouched"] == [] for obs in round_trip[1])


def test_native_accelerate_loads_a_protected_full_state_dict_checkpoint(
        round_trip: tuple[int, list[dict[str, Any]]]) -> None:
    for obs in round_trip[1]:
        assert obs["native_load_error"] is None and obs["native_restored"] == []


def test_an_asynchronous_full_state_dict_save_is_the_state_when_save_state_returned(tmp_path: Any) -> None:
    for obs in launch("tests.scenarios.full_state_dict_scenarios:asynchronous", 2, args=(str(tmp_path), 2),
                      timeout=TIMEOUT):
        assert obs["wait_error"] is None and obs["published"] is True
        assert obs["load_error"] is None and obs["restored"] == []


@pytest.mark.parametrize(("version", "world"), [(2, 1), (2, 4), (1, 4)])
def test_a_full_state_dict_checkpoint_resumes_on_another_world_size_without_the_opt_in(tmp_path: Any, version: int,
                                                                                      world: int) -> None:
    # Whole tensors in the files: as natively, another world size resumes; the per-rank RNG files follow the elastic
    # policy (a new rank derives its state), instead of native's missing random_states_N.pkl on a larger world. The
    # resumed run saves again: its full files equal the first ones, tensor for tensor.
    from tests.scenarios.full_state_dict_scenarios import full_files_differences

    launch("tests.scenarios.full_state_dict_scenarios:elastic_save", 2, args=(str(tmp_path), version), timeout=TIMEOUT)
    loaded = launch("tests.scenarios.full_state_dict_scenarios:elastic_load", world, args=(str(tmp_path), version),
                    timeout=TIMEOUT)
    assert [(obs["error"], obs["world"]) for obs in loaded] == [(None, world)] * world
    assert full_files_differences(str(tmp_path / "checkpoint_0"), str(tmp_path / "checkpoint_1")) == []
