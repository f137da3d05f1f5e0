"""``configure_checkpointing``: a call changes only what it names, validates before it changes anything, and the
directory-lock wait (``lock_timeout``, ``ACCELERATE_TXN_LOCK_TIMEOUT``)."""

from __future__ import annotations

from typing import Any

import pytest
from accelerate import Accelerator

from accelerate_txn import configure_checkpointing
from accelerate_txn.accelerate.config import LOCK_TIMEOUT_ENV, checkpoint_config
from accelerate_txn.errors import CheckpointConfigurationError


@pytest.fixture
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def _snapshot(accelerator: Accelerator) -> dict[str, Any]:
    config = checkpoint_config(accelerator)
    return {name: getattr(config, name) for name in (
        "allow_legacy", "check_finite", "checksum", "metadata", "legacy_metadata_keys", "legacy_metadata_groups",
        "lock_timeout")}


def test_later_call_keeps_legacy_metadata_keys_and_groups_it_does_not_name(accelerator: Accelerator) -> None:
    # Regression (issue 7 item 8): configure_checkpointing(acc, check_finite=True) cleared both legacy lists.
    configure_checkpointing(accelerator, metadata={"seed": 1, "schedule": "cosine", "lr": 0.1},
                            legacy_metadata_keys=["seed"], legacy_metadata_groups=[("schedule", "lr")])
    configure_checkpointing(accelerator, check_finite=True)
    config = checkpoint_config(accelerator)
    assert config.check_finite is True
    assert config.legacy_metadata_keys == ("seed",)
    assert config.legacy_metadata_groups == (("schedule", "lr"),)
    assert config.metadata == {"lr": 0.1, "schedule": "cosine", "seed": 1}

    configure_checkpointing(accelerator, legacy_metadata_keys=())  # naming one clears only that one
    assert config.legacy_metadata_keys == () and config.legacy_metadata_groups == (("schedule", "lr"),)
    configure_checkpointing(accelerator, legacy_metadata_groups=[])
    assert config.legacy_metadata_groups == ()


def test_legacy_keys_are_validated_against_the_resulting_configuration(accelerator: Accelerator) -> None:
    configure_checkpointing(accelerator, metadata={"seed": 1, "lr": 0.1}, legacy_metadata_keys=["seed"])
    before = _snapshot(accelerator)
    # New metadata without a kept legacy key: refused, and nothing (not even check_finite) changed.
    with pytest.raises(CheckpointConfigurationError, match=r"legacy metadata keys \['seed'\] are not in metadata"):
        configure_checkpointing(accelerator, metadata={"lr": 0.2}, check_finite=True)
    assert _snapshot(accelerator) == before
    # New legacy keys are checked against the metadata already configured.
    configure_checkpointing(accelerator, legacy_metadata_groups=[("lr",)])
    assert checkpoint_config(accelerator).legacy_metadata_groups == (("lr",),)
    with pytest.raises(CheckpointConfigurationError, match=r"legacy metadata keys \['epochs'\] are not in metadata"):
        configure_checkpointing(accelerator, legacy_metadata_keys=["epochs"])
    # Changing both together is judged on the result.
    configure_checkpointing(accelerator, metadata={"epochs": 3}, legacy_metadata_keys=["epochs"], legacy_metadata_groups=())
    assert checkpoint_config(accelerator).legacy_metadata_keys == ("epochs",)


def test_a_bare_string_is_not_a_list_of_legacy_keys(accelerator: Accelerator) -> None:
    configure_checkpointing(accelerator, metadata={"seed": 1})
    with pytest.raises(CheckpointConfigurationError, match=r"legacy_metadata_keys=\.\.\.\) must be a list of metadata key"):
        configure_checkpointing(accelerator, legacy_metadata_keys="seed")  # type: ignore[arg-type]
    assert checkpoint_config(accelerator).legacy_metadata_keys == ()


def test_failed_call_changes_nothing(accelerator: Accelerator) -> None:
    configure_checkpointing(accelerator, allow_legacy=False, metadata={"seed": 1})
    before = _snapshot(accelerator)
    with pytest.raises(CheckpointConfigurationError, match=r"checksum='sha1'"):
        configure_checkpointing(accelerator, allow_legacy=True, metadata={"seed": 2}, lock_timeout=5, checksum="sha1")
    assert _snapshot(accelerator) == before


def test_lock_timeout_defaults_to_60_and_is_validated(accelerator: Accelerator, monkeypatch: Any) -> None:
    monkeypatch.delenv(LOCK_TIMEOUT_ENV, raising=False)
    assert checkpoint_config(accelerator).lock_timeout == 60.0
    configure_checkpointing(accelerator, lock_timeout=0)
    assert checkpoint_config(accelerator).lock_timeout == 0.0
    configure_checkpointing(accelerator, lock_timeout=2.5)
    assert checkpoint_config(accelerator).lock_timeout == 2.5
    for bad in (-1, float("nan"), float("inf"), "ten", True):
        with pytest.raises(CheckpointConfigurationError,
                           match=r"configure_checkpointing\(lock_timeout=\.\.\.\) is .*: the directory-lock wait must be"):
            configure_checkpointing(accelerator, lock_timeout=bad)
    assert checkpoint_config(accelerator).lock_timeout == 2.5
    configure_checkpointing(accelerator, check_finite=True)
    assert checkpoint_config(accelerator).lock_timeout == 2.5  # unnamed: unchanged


def test_lock_timeout_default_comes_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, " 120 ")
    assert checkpoint_config(Accelerator(cpu=True)).lock_timeout == 120.0
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "-3")
    with pytest.raises(CheckpointConfigurationError,
                       match=rf"The environment variable {LOCK_TIMEOUT_ENV} is '-3': the directory-lock wait must be"):
        checkpoint_config(Accelerator(cpu=True))
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "")
    assert checkpoint_config(Accelerator(cpu=True)).lock_timeout == 60.0
