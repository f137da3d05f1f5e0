"""The public surface: ``__all__`` and its re-exports, the RNG file reader (weights_only, never arbitrary
objects, no side effect on the process generators) and ``register_checkpoint_state`` argument validation."""

from __future__ import annotations

import importlib
import importlib.metadata
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator

import accelerate_txn
from accelerate_txn import errors, register_checkpoint_state
from accelerate_txn.accelerate.config import checkpoint_config
from accelerate_txn.accelerate.descriptor import describe
from accelerate_txn.accelerate.rng import RNG_FILE, apply_rng, read_rng_file
from accelerate_txn.errors import CheckpointConfigurationError, CheckpointIntegrityError

# Where each public name is defined (names defined in __init__ itself map to None).
_ORIGINS: dict[str, str | None] = {
    "MANIFEST": "core.manifest",
    "PROTOCOL": "core.manifest",
    "__version__": None,
    "check_finite_state": "accelerate.finite",
    "check_finite_training_value": "accelerate.finite",
    "checkpoint_source_identity": None,
    "configure_checkpointing": "accelerate.config",
    "install": "accelerate.patch",
    "latest_training_checkpoint": "accelerate.selection",
    "load_training_checkpoint": "accelerate.load",
    "patch_accelerate_fsdp": "accelerate.patch",
    "protection": None,
    "quarantine_checkpoint": "runtime.quarantine",
    "register_checkpoint_state": "accelerate.rng",
    "release_checkpoint": "runtime.quarantine",
    "save_training_checkpoint": "accelerate.save",
    "unpatch_accelerate_fsdp": "accelerate.patch",
    "uninstall": "accelerate.patch",
    "wait_for_checkpoint": "runtime.async_save",
    **dict.fromkeys(errors.__all__, "errors"),
}


# --- __all__ and re-exports ---------------------------------------------------------------------------------

def test_every_name_in_all_exists() -> None:
    missing = [name for name in accelerate_txn.__all__ if not hasattr(accelerate_txn, name)]
    assert missing == []
    assert len(set(accelerate_txn.__all__)) == len(accelerate_txn.__all__)


def test_all_is_exactly_the_documented_public_api() -> None:
    assert set(accelerate_txn.__all__) == set(_ORIGINS)


@pytest.mark.parametrize("name", sorted(name for name, origin in _ORIGINS.items() if origin is not None))
def test_reexport_is_the_same_object_as_in_its_private_module(name: str) -> None:
    module = importlib.import_module(f"accelerate_txn.{_ORIGINS[name]}")
    assert getattr(accelerate_txn, name) is getattr(module, name)


def test_agree_and_on_main_are_the_rank_helpers() -> None:
    from accelerate_txn.core import ranks as _ranks

    assert accelerate_txn.agree is _ranks.agree and accelerate_txn.on_main is _ranks.on_main


def test_version_matches_the_installed_distribution() -> None:
    assert accelerate_txn.__version__ == importlib.metadata.version("accelerate-txn")


# --- the RNG reader -----------------------------------------------------------------------------------------

def _seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def _process_rng() -> tuple[Any, ...]:
    numpy_state = np.random.get_state()
    return (random.getstate(), numpy_state[0], numpy_state[1].tolist(), numpy_state[2:],
            torch.get_rng_state().tolist())


def _write_rng_file(directory: Path, seed: int, rank: int = 0, **changes: Any) -> dict[str, Any]:
    _seed(seed)
    state: dict[str, Any] = {
        "step": 7,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    state.update(changes)
    torch.save({key: value for key, value in state.items() if value is not None},
               directory / RNG_FILE.format(rank=rank))
    return state


def test_read_rng_file_loads_accelerate_style_state_with_numpy_under_weights_only(tmp_path: Path) -> None:
    written = _write_rng_file(tmp_path, seed=1, rank=2)
    _seed(99)
    state = read_rng_file(tmp_path, 2)
    assert state["step"] == 7
    assert state["random_state"] == written["random_state"]
    assert state["numpy_random_seed"][0] == "MT19937"
    assert np.array_equal(state["numpy_random_seed"][1], written["numpy_random_seed"][1])
    assert torch.equal(state["torch_manual_seed"], written["torch_manual_seed"])
    _seed(1)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    apply_rng(state)  # the state read back reproduces the writer's streams
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_read_rng_file_does_not_change_the_process_generators(tmp_path: Path) -> None:
    _write_rng_file(tmp_path, seed=1)
    _seed(42)
    before = _process_rng()
    read_rng_file(tmp_path, 0)
    assert _process_rng() == before


def test_read_rng_file_reads_a_real_accelerate_save(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(str(tmp_path / "native"))
    state = read_rng_file(tmp_path / "native", 0)
    assert {"step", "random_state", "numpy_random_seed", "torch_manual_seed"} <= set(state)


class _Payload:
    """An arbitrary object; unpickling it would run ``os.mkdir(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return os.mkdir, (self.marker,)


class _Custom:
    def __init__(self) -> None:
        self.value = 3


@pytest.mark.parametrize("make", [lambda marker: _Payload(marker), lambda marker: _Custom()],
                         ids=["reduce_payload", "custom_instance"])
def test_read_rng_file_refuses_arbitrary_objects(tmp_path: Path, make: Any) -> None:
    marker = tmp_path / "executed"
    _write_rng_file(tmp_path, seed=1, step=make(str(marker)))
    with pytest.raises(CheckpointIntegrityError,
                       match=r"Unreadable checkpoint file .*random_states_0\.pkl: (?i:.*global).*never unpickles"):
        read_rng_file(tmp_path, 0)
    assert not marker.exists()


def test_read_rng_file_names_missing_keys(tmp_path: Path) -> None:
    _write_rng_file(tmp_path, seed=1, numpy_random_seed=None, torch_manual_seed=None)
    with pytest.raises(CheckpointIntegrityError,
                       match=r"random_states_0\.pkl lacks RNG state \['numpy_random_seed', 'torch_manual_seed'\]"):
        read_rng_file(tmp_path, 0)


def test_read_rng_file_refuses_non_dict(tmp_path: Path) -> None:
    torch.save([1, 2, 3], tmp_path / "random_states_0.pkl")
    with pytest.raises(CheckpointIntegrityError, match=r"random_states_0\.pkl is not an Accelerate RNG state"):
        read_rng_file(tmp_path, 0)


def test_read_rng_file_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointIntegrityError, match=rf"Missing checkpoint file {tmp_path / 'random_states_5.pkl'}"):
        read_rng_file(tmp_path, 5)


def test_read_rng_file_refuses_unappliable_state_and_restores_the_process_generators(tmp_path: Path) -> None:
    _write_rng_file(tmp_path, seed=1, torch_manual_seed=torch.zeros(3, dtype=torch.uint8))
    _seed(42)
    before = _process_rng()
    with pytest.raises(CheckpointIntegrityError, match=r"random_states_0\.pkl holds an RNG state that cannot be applied"):
        read_rng_file(tmp_path, 0)
    assert _process_rng() == before  # python and numpy were applied before torch failed: put back


# --- register_checkpoint_state ------------------------------------------------------------------------------

def test_register_checkpoint_state_requires_rank_in_filename() -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(CheckpointConfigurationError,
                       match=r"filename='state\.pt'\): the name must contain '\{rank\}'"):
        register_checkpoint_state(accelerator, {"g": torch.Generator()}, {"step": 0}, filename="state.pt")
    assert len(accelerator._save_model_state_pre_hook) == 0
    assert checkpoint_config(accelerator).private_states == {}


def test_register_checkpoint_state_requires_declared_progress_keys() -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(CheckpointConfigurationError, match=r"progress lacks keys \['batch'\]"):
        register_checkpoint_state(accelerator, {}, {"epoch": 0}, progress_keys=["epoch", "batch"])
    assert len(accelerator._load_model_state_pre_hook) == 0


def test_register_checkpoint_state_refuses_second_registration_of_a_file() -> None:
    accelerator = Accelerator(cpu=True)
    register_checkpoint_state(accelerator, {}, {"epoch": 0})
    with pytest.raises(CheckpointConfigurationError, match=r"'training_state_\{rank\}\.pt' is already registered"):
        register_checkpoint_state(accelerator, {}, {"epoch": 1})


def test_register_checkpoint_state_records_schema_in_descriptor_and_returns_removable_hooks() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    save, load = register_checkpoint_state(accelerator, {"noise": torch.Generator()}, {"epoch": 0, "batch": 3},
                                           filename="private_{rank}.pt")
    assert describe(accelerator)["private_states"] == {
        "private_{rank}.pt": {"schema_version": 1, "generators": {"noise": "cpu"}, "progress_keys": ["batch", "epoch"]}}
    assert len(accelerator._save_model_state_pre_hook) == 1 and len(accelerator._load_model_state_pre_hook) == 1
    save.remove()
    load.remove()
    assert len(accelerator._save_model_state_pre_hook) == 0 and len(accelerator._load_model_state_pre_hook) == 0
