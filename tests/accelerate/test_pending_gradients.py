"""The pending-gradient rule (``accelerate.gradients``): a save is refused only where resumed training would differ.

Zeroed gradients (``zero_grad(set_to_none=False)``) and gradients a completed ``optimizer.step()`` applied (a save
between ``step()`` and ``zero_grad()``) are saved, as native Accelerate saves them, and the checkpoint resumes bitwise
equal with the same next step; gradients written by ``backward()`` since the last step, and a save in the middle of
an accumulation cycle, are refused on every rank with nothing published. Real 2-rank FSDP1 (original and flat
parameters) and FSDP2 runs (one launch each, every case in sequence: tests/scenarios/gradient_scenarios.py), and one process
through the explicit API and ``protect="all"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_txn
from accelerate_txn import MANIFEST, CheckpointConfigurationError, load_training_checkpoint, save_training_checkpoint
from accelerate_txn.testing import launch
from tests.scenarios.gradient_scenarios import ASYNC_CASES, CASES
from tests.support.single import stepped_accelerator

TIMEOUT = 300
SAVED = [case for case in {**CASES, **ASYNC_CASES} if not any(word in case for word in (
    "backward, save", "writes", "mid-accumulation"))]
REFUSED = {
    "backward, save": [0, 1],
    "step, backward, save": [0, 1],
    "step, zero_grad(zeros), backward, save": [0, 1],
    "step, rank 1 writes a gradient, save": [1],
    "async: backward, save": [0, 1],
}
PENDING = ("save_state() found pending gradients (e.g. {name}): backward() wrote them after the last completed "
           "optimizer.step(), and a checkpoint holds no gradients, so resumed training would differ. Save after "
           "optimizer.step() (before or after optimizer.zero_grad()), or call optimizer.zero_grad() first.")


def _first_parameter(setup: str) -> str:
    """The parameter the message names: the first one, without FSDP1's wrapper prefixes."""
    return "body.0._flat_param" if "use_orig_params=False" in setup else "body.0.weight"


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def orders(request: Any, tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp(f"gradients_fsdp{request.param}")
    return launch("tests.scenarios.gradient_scenarios:orders", 2, args=(str(root), request.param), timeout=TIMEOUT)


def _cases(orders: list[dict[str, Any]]) -> list[tuple[int, str, str, dict[str, Any]]]:
    return [(rank, setup, case, seen) for rank, obs in enumerate(orders) for setup, cases in obs.items()
            for case, seen in cases.items()]


@pytest.mark.distributed
def test_zeroed_or_applied_gradients_are_saved_and_resume_bitwise_with_the_same_next_step(
        orders: list[dict[str, Any]]) -> None:
    checked = set()
    for rank, setup, case, seen in _cases(orders):
        if case not in SAVED:
            continue
        where = f"rank {rank}, {setup}, {case}"
        assert seen["error"] is None, f"{where}: {seen['error']}"
        assert seen["published"], where
        assert seen["load_differences"] == [], where
        assert seen["next_step_differences"] == [], where
        checked.add(case)
    assert checked == ({c for c in SAVED if c in CASES} if "fsdp2" not in orders[0] else set(SAVED))


@pytest.mark.distributed
def test_gradients_written_since_the_last_step_are_refused_on_every_rank_and_nothing_is_published(
        orders: list[dict[str, Any]]) -> None:
    for rank, setup, case, seen in _cases(orders):
        if case not in REFUSED:
            continue
        where = f"rank {rank}, {setup}, {case}"
        error = seen["error"]
        assert error is not None and error["type"] == "CheckpointConfigurationError", f"{where}: {error}"
        assert error["failures"] == REFUSED[case], where
        for failed in REFUSED[case]:  # each failing rank's own message, named in every rank's error
            message = PENDING.format(name=_first_parameter(setup))
            assert f"rank {failed}: CheckpointConfigurationError: {message}" in error["message"], where
        assert not seen["published"], where
    for setup in orders[0]:  # one error, the same on every rank
        for case in REFUSED:
            if case in orders[0][setup]:
                assert orders[0][setup][case]["error"] == orders[1][setup][case]["error"], f"{setup}, {case}"


@pytest.mark.distributed
def test_a_save_in_the_middle_of_an_accumulation_cycle_is_still_refused(orders: list[dict[str, Any]]) -> None:
    for rank, setup, case, seen in _cases(orders):
        if case != "mid-accumulation save":
            continue
        error = seen["error"]
        assert error is not None and error["failures"] == [0, 1], f"rank {rank}, {setup}: {error}"
        assert ("save_state() was called in the middle of gradient accumulation (accelerator.sync_gradients is "
                "False)") in error["message"]
        assert not seen["published"]


# --- one process: the explicit API and protect="all" -------------------------------------------------------------

def _backward(model: Any) -> None:
    model(torch.randn(2, 4)).pow(2).sum().backward()


def _saves(accelerator: Any, path: Path) -> bool:
    save_training_checkpoint(accelerator, path)
    return (path / MANIFEST).is_file()


def test_one_process_saves_between_step_and_zero_grad_and_after_zeroing(tmp_path: Path) -> None:
    accelerator, model, optimizer = stepped_accelerator(0)
    _backward(model)
    optimizer.step()
    assert _saves(accelerator, tmp_path / "step-save")  # before zero_grad
    optimizer.zero_grad(set_to_none=False)
    assert _saves(accelerator, tmp_path / "zeroed")  # zeroed buffers
    _backward(model)
    with pytest.raises(CheckpointConfigurationError, match=r"found pending gradients \(e\.g\. weight\)"):
        save_training_checkpoint(accelerator, tmp_path / "pending")  # backward into the zeroed buffers, no step
    assert not (tmp_path / "pending").exists()
    optimizer.step()
    _backward(model)  # accumulates onto the applied gradients: pending again
    with pytest.raises(CheckpointConfigurationError, match=r"found pending gradients"):
        save_training_checkpoint(accelerator, tmp_path / "pending")
    assert not (tmp_path / "pending").exists()


def test_protect_all_save_state_between_step_and_zero_grad_is_protected(tmp_path: Path) -> None:
    accelerator, model, optimizer = stepped_accelerator(0)
    accelerate_txn.configure_checkpointing(accelerator, protect="all")
    _backward(model)
    optimizer.step()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1" / MANIFEST).is_file()  # the protected path ran and published


def test_a_step_the_gradient_scaler_skipped_leaves_its_gradients_pending(tmp_path: Path) -> None:
    accelerator, model, optimizer = stepped_accelerator(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(2, 4)).pow(2).sum() * float("inf")).backward()
    scaler.step(optimizer)  # an inf gradient: the optimizer's step is skipped
    scaler.update()
    with pytest.raises(CheckpointConfigurationError, match=r"found pending gradients"):
        save_training_checkpoint(accelerator, tmp_path / "skipped")
    assert not (tmp_path / "skipped").exists()
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(model(torch.randn(2, 4)).pow(2).sum()).backward()
    scaler.step(optimizer)  # finite: the step runs (after unscale_ wrote the gradients in place)
    scaler.update()
    assert _saves(accelerator, tmp_path / "stepped")


def test_load_accepts_zeroed_or_applied_gradients_and_refuses_pending_ones(tmp_path: Path) -> None:
    saved, _, _ = stepped_accelerator(0)
    path = save_training_checkpoint(saved, tmp_path / "ckpt")
    accelerator, model, optimizer = stepped_accelerator(3)
    _backward(model)
    with pytest.raises(CheckpointConfigurationError, match=r"load_state\(\) found accumulated gradients \(e\.g\. weight\)"):
        load_training_checkpoint(accelerator, path)
    optimizer.step()
    load_training_checkpoint(accelerator, path)  # applied by the step
    optimizer.zero_grad(set_to_none=False)
    load_training_checkpoint(accelerator, path)  # zeroed


def test_without_the_step_hook_only_zeroed_gradients_pass(tmp_path: Path) -> None:
    accelerator, model, optimizer = stepped_accelerator(0)
    accelerate_txn.uninstall()
    try:
        _backward(model)
        optimizer.step()
        with pytest.raises(CheckpointConfigurationError, match=r"found pending gradients"):
            save_training_checkpoint(accelerator, tmp_path / "untracked")
        optimizer.zero_grad(set_to_none=False)
        assert _saves(accelerator, tmp_path / "zeroed")
    finally:
        accelerate_txn.install()


def test_with_dispatch_off_and_nothing_opted_in_a_step_notes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # ACCELERATE_TXN_PATCHES=0 is exactly native: the step hook records nothing (no protected save can run) ...
    from accelerate_txn.accelerate.gradients import pending_gradient

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "0")
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert pending_gradient([model]) == "weight"  # not noted as applied
    # ... and with dispatch on, the same step is noted: its gradients are not pending
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "1")
    optimizer.step()
    assert pending_gradient([model]) is None
