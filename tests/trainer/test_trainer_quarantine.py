"""The Trainer's ``resume_from_checkpoint=True`` takes the newest complete checkpoint that is not quarantined
(``accelerate_txn.quarantine_checkpoint``): the same selection as ``load_state()``. Real one-process Trainer, tiny
Llama built from a config (as tests/trainer/test_trainer_single.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import accelerate_txn
from accelerate_txn.core import quarantine
from tests.trainer.test_trainer_single import _trainer, _weights

pytestmark = pytest.mark.timeout(300)
REASON = "loss NaN 3 steps after resume"


def test_resume_from_checkpoint_true_skips_a_quarantined_checkpoint_and_ends_exactly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reference = _trainer(tmp_path / "reference", 6)
    reference.train()
    expected = _weights(reference)
    run = tmp_path / "run"
    _trainer(run, 4).train()  # checkpoint-2 and checkpoint-4 (save_total_limit=2)
    accelerate_txn.quarantine_checkpoint(run / "checkpoint-4", reason=REASON)

    caplog.set_level(logging.WARNING)
    resumed = _trainer(run, 6)
    resumed.train(resume_from_checkpoint=True)
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith(f"Skipping checkpoint {run / 'checkpoint-4'}") and REASON in m for m in messages)
    # Resumed from checkpoint-2: the run saved checkpoint-4 again, replacing the quarantined one (the warning says so),
    # and ended exactly as the uninterrupted run.
    assert any(m.startswith(f"Replacing {run / 'checkpoint-4'}") and REASON in m for m in messages), messages
    assert all(torch.equal(expected[name], value) for name, value in _weights(resumed).items())
    assert quarantine.local_mark(run / "checkpoint-4") is None  # the new checkpoint-4 is not the one set aside
