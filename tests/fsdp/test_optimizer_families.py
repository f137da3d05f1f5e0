"""Which optimizer state the protected path takes, read from the state itself (single process, real torch.optim
optimizers and real DCP metadata); and the completeness rule read from a checkpoint's entries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.errors import CheckpointIntegrityError
from accelerate_txn.fsdp.dcp_optimizer import check_saved_state as _check_saved_state
from accelerate_txn.fsdp.optimizer_state import unsupported_checkpoint, unsupported_state
from tests.scenarios.dispatch_scenarios import Blocky, Counting
from tests.scenarios.optimizer_matrix import OPTIMIZERS


def _stepped(factory: Any, steps: int = 2) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = factory(model.parameters())
    batch = torch.randn(5, 4)

    def closure() -> torch.Tensor:  # LBFGS re-evaluates; the others step once per call
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        optimizer.step(closure)
    return optimizer


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_torch_optim_families_are_supported_from_their_state(kind: str) -> None:
    optimizer = _stepped(OPTIMIZERS[kind])
    assert unsupported_state(optimizer) is None
    if kind != "sgd":  # SGD without momentum keeps no state
        assert any(optimizer.state.values())


def test_state_of_another_shape_is_named_with_both_shapes() -> None:
    reason = unsupported_state(_stepped(lambda params: Blocky(params)))
    assert reason == ("tests.scenarios.dispatch_scenarios.Blocky state 'absmax' (parameter group 0) has shape [3] for a "
                      "parameter (shard) of shape [3, 4]; the protected path restores only state made of "
                      "parameter-shaped tensors and scalars")


def test_container_state_is_named_with_its_type() -> None:
    reason = unsupported_state(_stepped(lambda params: Counting(params, lr=1e-2, momentum=0.9)))
    assert reason is not None and "Counting state 'stats' (parameter group 0) is a builtins.dict" in reason


def test_lbfgs_history_lists_are_not_supported() -> None:
    reason = unsupported_state(_stepped(lambda params: torch.optim.LBFGS(params, history_size=3), steps=1))
    assert reason is not None and "torch.optim.lbfgs.LBFGS state " in reason and "builtins.list" in reason


def test_an_optimizer_without_state_yet_is_supported() -> None:
    assert unsupported_state(Blocky(torch.nn.Linear(2, 2).parameters())) is None


def test_nested_entries_in_a_checkpoint_are_named(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from accelerate_txn.core.manifest import read_dcp_metadata

    state = {"optimizer": {"state": {"w": {"step": torch.tensor(2.0), "stats": {"updates": 3}}},
                           "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    plain = {"optimizer": {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
                           "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "nested"), no_dist=True)
        dcp.save(plain, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    assert unsupported_checkpoint(read_dcp_metadata(tmp_path / "nested"), "ckpt/optimizer_0") == (
        "ckpt/optimizer_0 holds nested optimizer state 'optimizer.state.w.stats.updates'; the protected path "
        "restores only state made of parameter-shaped tensors and scalars")
    assert unsupported_checkpoint(read_dcp_metadata(tmp_path / "plain"), "ckpt/optimizer_0") is None


# --- completeness, from the checkpoint's own entries ----------------------------------------------------------

def _groups(*members: list[str]) -> list[dict[str, Any]]:
    return [{"params": names} for names in members]


def test_groups_may_hold_different_keys_and_parameters_may_have_no_state_yet() -> None:
    entries = {"a": {"step": 1, "exp_avg": 1, "max_exp_avg_sq": 1}, "b": {"step": 1, "exp_avg": 1, "max_exp_avg_sq": 1},
               "c": {"step": 1, "exp_avg": 1}}
    _check_saved_state(entries, _groups(["a", "b", "frozen"], ["c"]))


def test_a_parameter_lacking_a_key_its_group_has_is_an_integrity_error() -> None:
    entries = {"a": {"step": 1, "exp_avg": 1, "exp_avg_sq": 1}, "b": {"step": 1, "exp_avg": 1}}
    with pytest.raises(CheckpointIntegrityError, match=r"Optimizer state of 'b' lacks \['exp_avg_sq'\] in the "
                                                       r"checkpoint, which other parameters of its group 0 have"):
        _check_saved_state(entries, _groups(["a", "b"]))


def test_state_outside_the_saved_groups_is_an_integrity_error() -> None:
    with pytest.raises(CheckpointIntegrityError, match=r"holds state for parameters outside its groups: \['z'\]"):
        _check_saved_state({"z": {"step": 1}}, _groups(["a"]))
