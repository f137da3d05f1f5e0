"""``accelerate_txn.protection()`` and strict mode (``require_protection``), in one process with the real Accelerator
and the real Trainer (the FSDP cases, on two gloo ranks, are in tests/accelerate/test_dispatch.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_txn
from accelerate_txn import MANIFEST, CheckpointConfigurationError, CheckpointUnprotectedError, configure_checkpointing

pytestmark = pytest.mark.timeout(300)


def _accelerator() -> Any:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator.prepare(model, optimizer)
    return accelerator


def test_protection_says_why_a_one_process_accelerator_is_native_and_the_fix(monkeypatch: Any) -> None:
    monkeypatch.delenv("ACCELERATE_TXN_PROTECT", raising=False)
    accelerator = _accelerator()
    found = accelerate_txn.protection(accelerator)
    assert not found and found.protected is False and found.front_end == "accelerate" and found.path == "common"
    assert found.reason == "NO checkpoints are protected only with protect='all'"
    assert found.fix is not None and "protect='all'" in found.fix
    assert str(found).startswith("NOT protected (accelerate): NO checkpoints")
    configure_checkpointing(accelerator, protect="all")
    found = accelerate_txn.protection(accelerator)
    assert found and found.reason is None and str(found) == "protected (accelerate, common path)"


def test_protection_names_the_switch_that_turned_dispatch_off(monkeypatch: Any) -> None:
    accelerator = configure_checkpointing(_accelerator(), protect="all")
    monkeypatch.setenv("VIDEOX_ACCELERATE_PATCHES", "0")  # the older spelling is named as set
    found = accelerate_txn.protection(accelerator)
    assert not found
    assert found.reason == "automatic dispatch is off (VIDEOX_ACCELERATE_PATCHES='0')"
    assert found.fix is not None and found.fix.startswith("unset VIDEOX_ACCELERATE_PATCHES")


def test_strict_mode_refuses_a_native_save_before_anything_is_written(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("ACCELERATE_TXN_PROTECT", raising=False)
    accelerator = configure_checkpointing(_accelerator(), require_protection=True)
    target = tmp_path / "checkpoint_0"
    with pytest.raises(CheckpointUnprotectedError) as caught:
        accelerator.save_state(str(target))
    message = str(caught.value)
    assert "would run native, NOT protected, and protection is required" in message
    assert "configure_checkpointing(require_protection=True)" in message  # where strict mode was asked for
    assert "protect='all'" in message and message.endswith("Nothing was written or read.")
    assert isinstance(caught.value, CheckpointConfigurationError)  # a configuration error, for existing handlers
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointUnprotectedError):
        accelerator.load_state(str(target))
    # The fix it names works: the same Accelerator, protected, saves a published checkpoint.
    configure_checkpointing(accelerator, protect="all")
    accelerator.save_state(str(target))
    assert (target / MANIFEST).is_file()


def test_strict_mode_from_the_environment_refuses_dispatch_off(tmp_path: Path, monkeypatch: Any) -> None:
    accelerator = configure_checkpointing(_accelerator(), protect="all")
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "0")
    monkeypatch.setenv("ACCELERATE_TXN_REQUIRE_PROTECTION", "1")
    with pytest.raises(CheckpointUnprotectedError, match=r"ACCELERATE_TXN_REQUIRE_PROTECTION=1\): automatic dispatch is off"):
        accelerator.save_state(str(tmp_path / "checkpoint_0"))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("ACCELERATE_TXN_REQUIRE_PROTECTION", "maybe")
    with pytest.raises(CheckpointConfigurationError, match="ACCELERATE_TXN_REQUIRE_PROTECTION"):
        accelerator.save_state(str(tmp_path / "checkpoint_0"))
    monkeypatch.setenv("ACCELERATE_TXN_REQUIRE_PROTECTION", "0")
    accelerator.save_state(str(tmp_path / "checkpoint_0"))  # strict mode off: native, as asked
    assert not (tmp_path / "checkpoint_0" / MANIFEST).exists()


def test_configure_checkpointing_refuses_a_require_protection_that_is_not_a_bool() -> None:
    with pytest.raises(CheckpointConfigurationError, match=r"require_protection='yes'.*use True"):
        configure_checkpointing(_accelerator(), require_protection="yes")  # type: ignore[arg-type]


def _trainer(output_dir: Path) -> Any:
    from transformers import Trainer, TrainingArguments

    from tests.scenarios.trainer_scenarios import tiny_llama

    model, data = tiny_llama(16)
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=4, max_steps=2,
                             save_strategy="steps", save_steps=2, report_to=[], seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data)


def test_a_trainer_is_told_and_refused_in_strict_mode(tmp_path: Path, monkeypatch: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(tmp_path / "protected")
    found = accelerate_txn.protection(trainer)
    assert found and found.front_end == "trainer" and found.path == "common"
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "0")
    found = accelerate_txn.protection(trainer)
    assert not found and found.reason == "automatic dispatch is off (ACCELERATE_TXN_PATCHES='0')"
    monkeypatch.setenv("ACCELERATE_TXN_REQUIRE_PROTECTION", "1")
    strict = _trainer(tmp_path / "strict")
    with pytest.raises(CheckpointUnprotectedError, match="this Trainer's checkpoints would run native"):
        strict.train()
    assert not list((tmp_path / "strict").glob("checkpoint-*"))
    monkeypatch.delenv("ACCELERATE_TXN_REQUIRE_PROTECTION")
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        _trainer(tmp_path / "native").train()
    said = [r for r in caplog.records if "this Trainer's checkpoints run native, NOT protected" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "To protect them: unset ACCELERATE_TXN_PATCHES" in said[0].getMessage()
    assert (tmp_path / "native" / "checkpoint-2").is_dir()
    assert not (tmp_path / "native" / "checkpoint-2" / MANIFEST).exists()
