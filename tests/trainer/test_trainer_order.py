"""A Trainer resume whose data order or position changed (dataset length, per-device batch size, gradient
accumulation, drop_last, sampler, sampler seed) is refused before anything loads, or accepted with
``ignore_data_skip=True`` and one line (``accelerate_txn.trainer.order``). Real one-process Trainer, tiny Llama."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_txn  # noqa: F401  (the import protects Trainer checkpoints)
from accelerate_txn import MANIFEST
from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.trainer.order import SETTINGS, order_changes, order_record
from tests.scenarios.trainer_scenarios import tiny_llama

pytestmark = pytest.mark.timeout(300)
LINE = "the data order is not reproduced"


# --- the comparison (pure) --------------------------------------------------------------------------------------

def _record(**changed: Any) -> dict[str, Any]:
    record = {"train_dataset_length": 32, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
              "dataloader_drop_last": False, "group_by_length": None, "train_sampling_strategy": "random",
              "sampler_seed": 0}
    return {**record, **changed}


@pytest.mark.parametrize("key, value", [("train_dataset_length", 24), ("per_device_train_batch_size", 8),
                                        ("gradient_accumulation_steps", 2), ("dataloader_drop_last", True),
                                        ("train_sampling_strategy", "group_by_length"), ("sampler_seed", 1),
                                        ("group_by_length", True)])
def test_each_order_setting_change_is_named_with_saved_and_live(key: str, value: Any) -> None:
    saved = _record(group_by_length=False) if key == "group_by_length" else _record()
    assert order_changes(saved, {**saved, key: value}) == [(key, saved[key], value)]


def test_unknown_is_not_a_change() -> None:
    assert order_changes(None, _record()) == []  # a checkpoint saved before data_order was recorded
    assert order_changes({}, _record()) == []
    assert order_changes(_record(train_dataset_length=None), _record(train_dataset_length=8)) == []  # no length
    assert order_changes(_record(), _record(train_dataset_length=None)) == []  # an iterable dataset now
    saved = {key: value for key, value in _record().items() if key != "sampler_seed"}  # an older record
    assert order_changes(saved, _record(sampler_seed=5)) == []
    assert order_changes(_record(), _record()) == []
    assert set(_record()) == set(SETTINGS)


# --- one-process Trainer ----------------------------------------------------------------------------------------

def _trainer(output_dir: Path, max_steps: int, samples: int = 32, batch: int = 4, **arguments: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    model, data = tiny_llama(samples)
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=batch,
                             max_steps=max_steps, save_strategy="steps", save_steps=2, lr_scheduler_type="constant",
                             report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True, **arguments)
    return Trainer(model=model, args=args, train_dataset=data)


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 of 32 samples in batches of 4: mid-epoch (step 2 of 8)."""
    run = tmp_path_factory.mktemp("order") / "run"
    _trainer(run, 2).train()
    record = json.loads((run / "checkpoint-2" / MANIFEST).read_text())["trainer"]["data_order"]
    assert record["train_dataset_length"] == 32 and record["per_device_train_batch_size"] == 4
    return run / "checkpoint-2"


@pytest.mark.parametrize("changed, named", [({"samples": 24}, r"train dataset length .* from 32 \(saved\) to 24"),
                                            ({"batch": 8}, r"per_device_train_batch_size changed from 4 \(saved\) "
                                                           r"to 8 \(live\)")])
def test_a_changed_data_order_is_refused_before_anything_loads(saved: Path, changed: dict[str, Any],
                                                               named: str) -> None:
    trainer = _trainer(saved.parent, 4, **changed)
    before = _weights(trainer)
    with pytest.raises(CheckpointConfigurationError, match=named) as refused:
        trainer.train(resume_from_checkpoint=str(saved))
    assert "ignore_data_skip=True" in str(refused.value) and "Nothing was loaded" in str(refused.value)
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[name], value) for name, value in _weights(trainer).items())


def test_ignore_data_skip_accepts_the_change_with_one_line(saved: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(saved.parent, 3, samples=24, ignore_data_skip=True)
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        trainer.train(resume_from_checkpoint=str(saved))
    assert trainer.state.global_step == 3
    lines = [record.getMessage() for record in caplog.records if LINE in record.getMessage()]
    assert len(lines) == 1 and "from 32 (saved) to 24 (live)" in lines[0], lines


def test_unchanged_settings_resume_without_the_line(saved: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(saved.parent, 3)
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        trainer.train(resume_from_checkpoint=str(saved))
    assert trainer.state.global_step == 3
    assert not [record for record in caplog.records if LINE in record.getMessage()]


def test_a_manifest_without_the_record_resumes_as_before(saved: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    older = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(saved, older)
    manifest = json.loads((older / MANIFEST).read_text())
    del manifest["trainer"]["data_order"]  # saved before the record existed: unknown, not a change
    (older / MANIFEST).write_text(json.dumps(manifest))
    trainer = _trainer(older.parent, 3, samples=24)
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        trainer.train(resume_from_checkpoint=str(older))
    assert trainer.state.global_step == 3
    assert not [record for record in caplog.records if LINE in record.getMessage()]


def test_the_record_follows_the_trainer_arguments(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 2, samples=8, data_seed=7, dataloader_drop_last=True, gradient_accumulation_steps=2)
    record = order_record(trainer)
    assert record["train_dataset_length"] == 8 and record["sampler_seed"] == 7
    assert record["dataloader_drop_last"] is True and record["gradient_accumulation_steps"] == 2
    assert order_record(_trainer(tmp_path, 2, auto_find_batch_size=True))["per_device_train_batch_size"] is None
    strategy = getattr(trainer.args, "train_sampling_strategy", None)
    assert record["train_sampling_strategy"] == strategy
