"""Issue 19 item 3, "train longer": what may change on resume (``accelerate.resume_changes``).

Unit tests compare descriptors that ``describe()`` builds from real torch and diffusers schedulers on a real
single-process Accelerator, and check the torch behaviour the policy rests on (``LambdaLR.load_state_dict`` keeps
the live functions; a built-in scheduler's ``load_state_dict`` restores its settings). One real 2-rank FSDP run
trains a 40-step schedule, saves, resumes with an 80-step one and compares with an uninterrupted run
(tests/scenarios/longer_scenarios.py).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from diffusers.optimization import get_scheduler

from accelerate_txn import configure_checkpointing
from accelerate_txn.accelerate.config import checkpoint_config
from accelerate_txn.accelerate.descriptor import check_resume, compare_descriptor, describe
from accelerate_txn.accelerate.resume_changes import continue_live_schedules
from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.testing import launch

LENGTH_LINE = ("the learning-rate schedule's total length changed from 40 to 80 steps: the restored scheduler "
               "continues with the new length")
Factory = Callable[[torch.optim.Optimizer], Any]


def _optimizer() -> torch.optim.Optimizer:
    model = torch.nn.Linear(3, 2)  # two parameter groups: diffusers replicates its function for each
    return torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)


def _descriptor(make: Factory, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """``describe()`` of a real Accelerator with one model, one optimizer and the scheduler ``make`` builds, as a
    manifest records it (a JSON round trip)."""
    accelerator = Accelerator(cpu=True)
    optimizer = _optimizer()
    scheduler = make(optimizer)
    accelerator.prepare(torch.nn.Linear(3, 2), optimizer, scheduler)
    if metadata is not None:
        configure_checkpointing(accelerator, metadata=metadata)
    return json.loads(json.dumps(describe(accelerator)))


def _diffusers(name: str, warmup: int = 10, total: int = 40) -> Factory:
    return lambda optimizer: get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def _refusal(saved: dict[str, Any], live: dict[str, Any], **options: Any) -> str:
    with pytest.raises(CheckpointConfigurationError) as info:
        check_resume(saved, live, where="run/checkpoint_3", **options)
    return str(info.value)


def _accept_names(message: str) -> list[str]:
    """The names a refusal tells the user to pass, read from the message exactly as printed."""
    (names,) = re.findall(r"configure_checkpointing\(accelerator, accept_changes=(\[.*?\])\)", message)
    return json.loads(names)


# --- accepted: a schedule's total length ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["linear", "cosine", "cosine_with_restarts", "polynomial"])
def test_diffusers_schedule_length_change_is_accepted_with_one_exact_line(name: str) -> None:
    result = check_resume(_descriptor(_diffusers(name, total=40)), _descriptor(_diffusers(name, total=80)))
    assert [change.accepted_line() for change in result.accepted] == [LENGTH_LINE]  # one line for both groups
    assert result.migrated == []
    assert [change.schedule for change in result.accepted] == [0]


def test_length_change_in_a_user_closure_or_partial_is_accepted_by_its_name() -> None:
    def linear(total_steps: int) -> Callable[[int], float]:
        def decay(step: int) -> float:
            return max(0.0, 1 - step / total_steps)
        return decay

    def lambda_lr(total: int) -> Factory:
        return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, linear(total))

    result = check_resume(_descriptor(lambda_lr(40)), _descriptor(lambda_lr(80)))
    assert [change.accepted_line() for change in result.accepted] == [LENGTH_LINE]

    import functools

    def fraction(step: int, *, num_training_steps: int) -> float:
        return 1 - step / num_training_steps

    def partial_lr(total: int) -> Factory:  # transformers builds its schedules this way
        return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(fraction, num_training_steps=total))

    result = check_resume(_descriptor(partial_lr(40)), _descriptor(partial_lr(80)))
    assert [change.accepted_line() for change in result.accepted] == [LENGTH_LINE]


def test_a_closure_value_with_an_unlisted_name_is_refused_in_its_own_name() -> None:
    def schedule(horizon: int) -> Factory:
        def decay(step: int) -> float:
            return max(0.0, 1 - step / horizon)
        return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, decay)

    message = _refusal(_descriptor(schedule(40)), _descriptor(schedule(80)))
    assert ("the learning-rate schedule's value horizon changed from 40 to 80: if accepted, the restored scheduler "
            "continues with the new value") in message
    assert _accept_names(message) == ["schedulers[0].horizon"]
    assert "closure[" not in message


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_restored_lambda_lr_continues_with_the_live_length(name: str) -> None:
    """What the acceptance rests on, with the installed torch and diffusers: ``LambdaLR.load_state_dict`` restores
    the step and base rates but keeps the live functions; ``continue_live_schedules`` then sets the rate of the
    restored step to the live schedule's value, as an 80-step schedule stepped as far gives."""
    restored_steps = 25
    saved_optimizer = _optimizer()
    saved = get_scheduler(name, saved_optimizer, num_warmup_steps=10, num_training_steps=40)
    for _ in range(restored_steps):
        saved_optimizer.step()
        saved.step()
    reference_optimizer = _optimizer()
    reference = get_scheduler(name, reference_optimizer, num_warmup_steps=10, num_training_steps=80)
    for _ in range(restored_steps):
        reference_optimizer.step()
        reference.step()

    optimizer = _optimizer()
    live = get_scheduler(name, optimizer, num_warmup_steps=10, num_training_steps=80)
    optimizer.load_state_dict(saved_optimizer.state_dict())  # what the optimizer restore brings back
    live.load_state_dict(saved.state_dict())
    assert live.last_epoch == restored_steps
    assert live.get_last_lr() == saved.get_last_lr() != reference.get_last_lr()  # the 40-step rate, restored
    continue_live_schedules([live], [0])
    assert [group["lr"] for group in optimizer.param_groups] == reference.get_last_lr()
    assert live.get_last_lr() == reference.get_last_lr()
    for _ in range(3):
        optimizer.step()
        live.step()
        reference_optimizer.step()
        reference.step()
        assert live.get_last_lr() == reference.get_last_lr()


# --- refused unless accepted: a schedule's shape ------------------------------------------------------------------

def test_warmup_change_is_refused_in_the_users_terms_and_accepted_by_the_printed_name() -> None:
    saved, live = _descriptor(_diffusers("cosine", warmup=10)), _descriptor(_diffusers("cosine", warmup=20))
    message = _refusal(saved, live)
    assert message.startswith("run/checkpoint_3 was saved for a different training configuration:\n  the learning-rate "
                              "schedule's warmup changed from 10 to 20 steps: if accepted, the restored scheduler "
                              "continues with the new warmup\n")
    assert ('To resume with this change on purpose, accept it by name: configure_checkpointing(accelerator, '
            'accept_changes=["schedulers[0].num_warmup_steps"])') in message
    names = _accept_names(message)
    result = check_resume(saved, live, accept_changes=names)
    assert [change.accepted_line() for change in result.accepted] == [
        "the learning-rate schedule's warmup changed from 10 to 20 steps: the restored scheduler continues with the "
        "new warmup"]
    assert result.accepted[0].schedule == 0


def test_number_of_cycles_change_is_refused_and_another_name_does_not_accept_it() -> None:
    def cycles(count: int) -> Factory:
        return lambda optimizer: get_scheduler("cosine_with_restarts", optimizer, num_warmup_steps=10,
                                               num_training_steps=40, num_cycles=count)

    saved, live = _descriptor(cycles(1)), _descriptor(cycles(3))
    message = _refusal(saved, live, accept_changes=["schedulers[0].num_warmup_steps"])
    assert "the learning-rate schedule's number of cycles changed from 1 to 3" in message
    assert _accept_names(message) == ["schedulers[0].num_cycles"]


def test_length_and_warmup_changed_together_refuse_only_the_warmup() -> None:
    message = _refusal(_descriptor(_diffusers("linear", warmup=10, total=40)),
                       _descriptor(_diffusers("linear", warmup=20, total=80)))
    assert "warmup changed from 10 to 20 steps" in message
    assert "total length" not in message
    assert _accept_names(message) == ["schedulers[0].num_warmup_steps"]


# --- refused: a built-in scheduler's setting (load_state_dict restores it) ----------------------------------------

BUILTINS = [
    ("CosineAnnealingLR", "T_max", lambda value: lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=value)),
    ("OneCycleLR", "total_steps",
     lambda value: lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=value)),
    ("StepLR", "step_size", lambda value: lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=value)),
]


@pytest.mark.parametrize("kind, setting, make", BUILTINS, ids=[row[0] for row in BUILTINS])
def test_builtin_scheduler_setting_change_is_refused_because_the_restore_would_ignore_it(
        kind: str, setting: str, make: Callable[[int], Factory]) -> None:
    # The torch behaviour behind the refusal: load_state_dict puts the saved value back.
    saved_scheduler, live_scheduler = make(40)(_optimizer()), make(80)(_optimizer())
    live_scheduler.load_state_dict(saved_scheduler.state_dict())
    assert getattr(live_scheduler, setting) == 40

    saved, live = _descriptor(make(40)), _descriptor(make(80))
    message = _refusal(saved, live)
    assert (f"the learning-rate scheduler {kind}'s {setting} changed from 40 to 80: if accepted, load_state_dict "
            "restores the saved 40 and the new value is ignored") in message
    assert _accept_names(message) == [f"schedulers[0].{setting}"]
    result = check_resume(saved, live, accept_changes=[f"schedulers[0].{setting}"])
    assert [change.schedule for change in result.accepted] == [None]  # nothing to re-evaluate: the saved value stays


def test_other_built_in_settings_are_recorded_and_equal_ones_pass() -> None:
    descriptor = _descriptor(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[30, 10, 30], gamma=0.5))
    assert descriptor["schedulers"][0]["settings"] == {"gamma": 0.5, "milestones": [10, 30, 30]}
    assert compare_descriptor(descriptor, copy.deepcopy(descriptor)) == []


# --- training metadata ---------------------------------------------------------------------------------------

def test_run_length_and_cadence_metadata_changes_are_accepted_with_one_line_each() -> None:
    saved = _descriptor(_diffusers("cosine"), {"num_epochs": 1, "seed": 3, "log": {"logging_steps": 10}})
    live = _descriptor(_diffusers("cosine", total=80), {"num_epochs": 2, "seed": 3, "log": {"logging_steps": 50}})
    result = check_resume(saved, live)
    assert [change.accepted_line() for change in result.accepted] == [
        LENGTH_LINE,
        "training metadata log.logging_steps changed from 10 to 50: the next checkpoint records the new value",
        "training metadata num_epochs changed from 1 to 2: the next checkpoint records the new value",
    ]


def test_other_metadata_change_is_refused_and_accepted_by_name() -> None:
    saved = _descriptor(_diffusers("cosine"), {"num_epochs": 1, "seed": 3})
    live = _descriptor(_diffusers("cosine"), {"num_epochs": 2, "seed": 4})
    message = _refusal(saved, live)
    assert "\n  training.seed: 3 (saved) vs 4 (live)\n" in message  # as any other difference reads
    assert "num_epochs" not in message
    assert _accept_names(message) == ["training.seed"]
    result = check_resume(saved, live, accept_changes=["training.seed"])
    assert [change.accepted_line() for change in result.accepted] == [
        "training metadata num_epochs changed from 1 to 2: the next checkpoint records the new value",
        "training.seed: 3 (saved) vs 4 (live): the next checkpoint records the new value"]


def test_a_run_length_metadata_key_added_or_removed_is_still_refused() -> None:
    saved = _descriptor(_diffusers("cosine"), {"seed": 3})
    live = _descriptor(_diffusers("cosine"), {"seed": 3, "num_epochs": 2})
    assert "training.num_epochs: only in live (2)" in _refusal(saved, live)


# --- everything else is refused as before ---------------------------------------------------------------------

def test_a_length_change_does_not_hide_other_differences() -> None:
    saved = _descriptor(_diffusers("cosine", total=40))
    live = _descriptor(_diffusers("cosine", total=80))
    live["models"][0]["parameters"]["weight"]["shape"] = [4, 3]
    live["world_size"] = 2
    message = _refusal(saved, live)
    assert "models[0].parameters.weight.shape[0]: 2 (saved) vs 4 (live)" in message
    assert "world_size: 1 (saved) vs 2 (live)" in message
    assert "total length" not in message and "accept_changes" not in message


def test_another_scheduler_class_or_function_is_refused_as_before() -> None:
    message = _refusal(_descriptor(_diffusers("cosine")),
                       _descriptor(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40)))
    assert 'schedulers[0].class: "LambdaLR" (saved) vs "CosineAnnealingLR" (live)' in message
    message = _refusal(_descriptor(_diffusers("linear")), _descriptor(_diffusers("constant_with_warmup")))
    assert "schedulers[0].functions[0]" in message and "accept_changes" not in message


# --- descriptors written before names and settings were recorded -------------------------------------------

def _closure(name: str, total_steps: int) -> Factory:
    def decay(step: int) -> float:
        return max(0.0, 1 - step / total_steps)

    decay.__name__ = name
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, decay)


def _without_names(descriptor: dict[str, Any]) -> dict[str, Any]:
    """A descriptor as manifests recorded it before this change: no value names, no built-in settings."""
    old = copy.deepcopy(descriptor)
    for scheduler in old["schedulers"]:
        scheduler.pop("settings", None)
        for function in scheduler.get("functions", []):
            function.pop("closure_names")
            function.pop("default_names")
    return old


def test_old_descriptor_without_names_still_loads_and_compares() -> None:
    saved = _without_names(_descriptor(_diffusers("cosine")))
    assert check_resume(saved, _descriptor(_diffusers("cosine"))).accepted == []
    # Read with the live function's names (same function, same number of values: what the positional
    # comparison always assumed), a length change is accepted and a warmup change is named.
    result = check_resume(saved, _descriptor(_diffusers("cosine", total=80)))
    assert [change.accepted_line() for change in result.accepted] == [LENGTH_LINE]
    assert "warmup changed from 10 to 20 steps" in _refusal(saved, _descriptor(_diffusers("cosine", warmup=20)))
    # Another function is still another function; one with another number of values compares as before.
    assert 'schedulers[0].functions[0].function: "decay" (saved) vs "lr_lambda" (live)' in _refusal(
        _without_names(_descriptor(_closure("decay", 40))), _descriptor(_diffusers("constant_with_warmup")))
    message = _refusal(_without_names(_descriptor(_diffusers("linear"))), _descriptor(_diffusers("cosine")))
    assert "schedulers[0].functions[0].closure: [1.0, 0.0, 40, 10] (saved) vs [0.5, 40, 10] (live)" in message


def test_old_descriptor_without_built_in_settings_compares_as_before() -> None:
    saved = _without_names(_descriptor(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40)))
    # Nothing recorded, nothing to compare (as before this change); the next save records the settings.
    live = _descriptor(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=80))
    assert check_resume(saved, live).accepted == []


# --- configure_checkpointing(accept_changes=...) ----------------------------------------------------------

def test_accept_changes_is_validated_stored_and_cleared() -> None:
    accelerator = Accelerator(cpu=True)
    configure_checkpointing(accelerator, accept_changes=["schedulers[0].num_warmup_steps", "training.seed"])
    assert checkpoint_config(accelerator).accept_changes == ("schedulers[0].num_warmup_steps", "training.seed")
    with pytest.raises(CheckpointConfigurationError, match=r"accept_changes='training.seed'\) must be a list"):
        configure_checkpointing(accelerator, accept_changes="training.seed")  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigurationError,
                       match=r"\['closure\[1\]', 3\] are not change names\. A name is \"schedulers\[N\]\.<setting>\""):
        configure_checkpointing(accelerator, accept_changes=["training.seed", "closure[1]", 3])
    assert checkpoint_config(accelerator).accept_changes == ("schedulers[0].num_warmup_steps", "training.seed")
    configure_checkpointing(accelerator, accept_changes=())
    assert checkpoint_config(accelerator).accept_changes == ()


# --- a real 2-rank FSDP resume ------------------------------------------------------------------------------

@pytest.mark.distributed
def test_fsdp_resume_with_a_longer_schedule_matches_an_uninterrupted_run(tmp_path: Any) -> None:
    results = launch("tests.scenarios.longer_scenarios:train_longer", 2, args=(str(tmp_path),), timeout=240)
    for rank, obs in enumerate(results):
        # The schedule the run follows after the resume is the 80-step one, from the first step on...
        assert obs["resumed_epochs"] == obs["epochs"]  # the restored scheduler step, then as before
        assert obs["resumed_lrs"] == obs["lrs_80"]
        assert obs["lrs_80"][0] != obs["lr_40_at_resume"]  # ...which the restored optimizer alone would not give
        # ...and the model and optimizer equal those of a run that was never interrupted and switched schedules.
        assert obs["differences"] == []
        assert obs["reference_lrs"] == obs["lrs_80"]
        expected = [f"Resumed {obs['path']} with changes: {LENGTH_LINE}"] if rank == 0 else []
        assert obs["change_lines"] == expected  # once, on rank 0
        # A warmup change is refused on every rank, before anything changed, then accepted by the printed name.
        assert obs["warmup_refusal"]["type"] == "CheckpointConfigurationError"
        assert "the learning-rate schedule's warmup changed from 2 to 3 steps" in obs["warmup_refusal"]["message"]
        assert obs["refusal_changed_nothing"]
        assert obs["accepted_warmup_lr"] == obs["lr_warmup3_at_resume"]
    assert results[0]["warmup_refusal"]["message"] == results[1]["warmup_refusal"]["message"]
