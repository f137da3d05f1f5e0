"""Environment variables accept only their documented values (issue 43 item 4): ``core.environment`` reads each one,
and a value outside its set raises ``CheckpointConfigurationError`` naming the variable, the value and the accepted
values, through the real entry point that reads it, before anything is written. ``ACCELERATE_TXN_DIRECT_IO=off`` once
silently meant "on".
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest

import accelerate_txn
from accelerate_txn import MANIFEST
from accelerate_txn.accelerate.config import PROTECT_ENV
from accelerate_txn.core.environment import OFF, OLDER_NAMES, ON, Variable, choice, flag
from accelerate_txn.errors import CheckpointConfigurationError
from tests.support.single import stepped_accelerator

REPO = Path(__file__).resolve().parents[2]
NAME = "ACCELERATE_TXN_TEST_SETTING"  # no variable of the library
#: Every variable of the library and of its test harness, at its documented default (unset).
LIBRARY = ("ACCELERATE_TXN_PATCHES", "ACCELERATE_TXN_PROTECT", "ACCELERATE_TXN_ALLOW_UNVALIDATED",
           "ACCELERATE_TXN_CHECK_FINITE", "ACCELERATE_TXN_LOCK_TIMEOUT", "ACCELERATE_TXN_ARRIVAL_TIMEOUT",
           "ACCELERATE_TXN_SIGNING_KEY_FILE", "ACCELERATE_TXN_VERIFY_KEYS", "ACCELERATE_TXN_DIRECT_IO",
           "ACCELERATE_TXN_KILL_AT", "ACCELERATE_TXN_KILL_SIGNAL", "ACCELERATE_TXN_ASYNC_FAIL_AT",
           "ACCELERATE_TXN_CPU_RANKS_PER_NODE", "ACCELERATE_TXN_MOUNTINFO", "ACCELERATE_TXN_REQUIRE_PROTECTION")


OLDER = tuple(old for olds in OLDER_NAMES.values() for old in olds)  # VIDEOX_*: still honoured


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*LIBRARY, *OLDER, NAME):
        monkeypatch.delenv(name, raising=False)


# --- The helper -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    *((spelling, True) for spelling in ON), *((spelling, False) for spelling in OFF),
    ("TRUE", True), (" Yes ", True), ("On", True), ("FALSE", False), (" no ", False), ("Off", False),
])
def test_a_switch_takes_each_documented_spelling_in_any_case(monkeypatch: pytest.MonkeyPatch, value: str,
                                                              expected: bool) -> None:
    monkeypatch.setenv(NAME, value)
    assert flag(NAME, not expected).read() is expected


@pytest.mark.parametrize("default", [True, False])
def test_a_switch_unset_or_empty_is_its_default(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    assert flag(NAME, default).read() is default
    for blank in ("", "   "):
        monkeypatch.setenv(NAME, blank)
        assert flag(NAME, default).read() is default


@pytest.mark.parametrize("garbage", ["maybe", "2", "enabled", "o n", "+1", "tru"])
def test_a_switch_refuses_any_other_value_naming_the_variable_the_value_and_the_accepted_values(
        monkeypatch: pytest.MonkeyPatch, garbage: str) -> None:
    monkeypatch.setenv(NAME, garbage)
    with pytest.raises(CheckpointConfigurationError) as caught:
        flag(NAME, True).read()
    assert str(caught.value) == (
        f"The environment variable {NAME} is {garbage!r}: use 1, true, yes or on (on), or 0, false, no or off (off), "
        "in any case; unset or empty: on. Set an accepted value, or unset it for the default.")


def test_a_choice_takes_its_names_in_any_case_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    variable = choice(NAME, ("fsdp", "all"), "fsdp", "what each does")
    assert variable.read() == "fsdp"
    monkeypatch.setenv(NAME, " ALL ")
    assert variable.read() == "all"
    monkeypatch.setenv(NAME, "everything")
    with pytest.raises(CheckpointConfigurationError, match=re.escape(
            f"The environment variable {NAME} is 'everything': use 'fsdp' or 'all' (what each does), in any case; "
            "unset or empty: 'fsdp'.")):
        variable.read()


def test_a_variable_parses_with_its_own_rule_and_names_its_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    variable = Variable(NAME, lambda raw: int(raw) * 2, 7, "use a whole number")
    assert variable.read() == 7
    monkeypatch.setenv(NAME, " 21 ")
    assert variable.raw() == "21" and variable.read() == 42
    monkeypatch.setenv(NAME, "twenty")  # int() raises ValueError: the library's error, not int's
    with pytest.raises(CheckpointConfigurationError, match=f"{NAME} is 'twenty': use a whole number"):
        variable.read()


# --- Every variable is documented -------------------------------------------------------------------------------------


def _declared() -> dict[str, Variable[Any]]:
    """Every :class:`Variable` a module of the library holds (the scripts ``__main__`` and the worker excepted)."""
    found = {}
    for module in pkgutil.walk_packages(accelerate_txn.__path__, "accelerate_txn."):
        if module.name.endswith(("__main__", "._worker")):
            continue
        for value in vars(importlib.import_module(module.name)).values():
            if isinstance(value, Variable):
                found[value.name] = value
    return found


def _documented() -> dict[str, str]:
    """The rows of docs/configuration.md's table of environment variables: name -> accepted values."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = text.split("## Environment variables", 1)[1].split("| variable | values |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return {row[0].strip("| `"): row[1] for row in rows}


def test_every_variable_the_library_reads_is_documented_with_its_values() -> None:
    declared = _declared()
    documented = _documented()
    # Two variables are read by modules below core.environment's layer, each with its own check: the CPU harness
    # (it imports none of the library: testing/_cpu_fsdp.py) and the stores' mount table (store.mounts; a path that
    # cannot be read is a configuration error: tests/store/test_mounts.py).
    own_readers = {"ACCELERATE_TXN_CPU_RANKS_PER_NODE", "ACCELERATE_TXN_MOUNTINFO"}
    assert sorted(documented) == sorted({*declared, *own_readers}) == sorted(LIBRARY)
    for name, variable in declared.items():
        if variable.default is True:  # a switch that is on unless set: the table names every spelling of off
            assert all(f"`{spelling}`" in documented[name] for spelling in OFF), (name, documented[name])
        elif variable.default is False:
            assert all(f"`{spelling}`" in documented[name] for spelling in ON), (name, documented[name])


# --- Each variable through the entry point that reads it --------------------------------------------------------------


#: (variable, a value outside its documented set). The save is a one-process protected one (protect="all" from the
#: environment), which reads every one of them before anything is written.
GARBAGE = [
    ("ACCELERATE_TXN_PATCHES", "maybe"),
    ("ACCELERATE_TXN_PROTECT", "yes"),
    ("ACCELERATE_TXN_ALLOW_UNVALIDATED", "sure"),
    ("ACCELERATE_TXN_CHECK_FINITE", "always"),
    ("ACCELERATE_TXN_LOCK_TIMEOUT", "soon"),
    ("ACCELERATE_TXN_ARRIVAL_TIMEOUT", "-1"),
    ("ACCELERATE_TXN_DIRECT_IO", "fast"),
    ("ACCELERATE_TXN_KILL_AT", "save:after-manifest@one"),
    ("ACCELERATE_TXN_KILL_AT", "save:after-manifest#0"),
    ("ACCELERATE_TXN_KILL_SIGNAL", "SIGNOPE"),
    ("ACCELERATE_TXN_KILL_SIGNAL", "99999"),
    ("ACCELERATE_TXN_ASYNC_FAIL_AT", "rank1"),
    ("ACCELERATE_TXN_ASYNC_FAIL_AT", "1#3,x"),
]


@pytest.mark.parametrize("name, garbage", GARBAGE)
def test_a_value_outside_the_documented_set_refuses_the_save_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, garbage: str) -> None:
    accelerator, _, _ = stepped_accelerator()
    monkeypatch.setenv(PROTECT_ENV, "all")
    monkeypatch.setenv(name, garbage)
    with pytest.raises(CheckpointConfigurationError, match=re.escape(f"The environment variable {name} is {garbage!r}: ")):
        accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no staging, no lock file


@pytest.mark.parametrize("name, value", [
    ("ACCELERATE_TXN_DIRECT_IO", "OFF"), ("ACCELERATE_TXN_DIRECT_IO", " yes "), ("ACCELERATE_TXN_CHECK_FINITE", "True"),
    ("ACCELERATE_TXN_ALLOW_UNVALIDATED", "no"), ("ACCELERATE_TXN_KILL_AT", "save:after-manifest@3#2"),
    ("ACCELERATE_TXN_KILL_SIGNAL", "term"), ("ACCELERATE_TXN_ASYNC_FAIL_AT", "3#1,2"),
])
def test_a_documented_value_lets_the_save_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                  value: str) -> None:
    accelerator, _, _ = stepped_accelerator()
    monkeypatch.setenv(PROTECT_ENV, "all")
    monkeypatch.setenv(name, value)  # the crash point and the failure name rank 3: not this process
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1" / MANIFEST).is_file()


@pytest.mark.parametrize("off", ["0", "off", "False", " NO "])
def test_every_spelling_of_dispatch_off_stays_exactly_native(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             off: str) -> None:
    monkeypatch.setenv(PROTECT_ENV, "all")
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", off)
    accelerator, _, _ = stepped_accelerator()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert not (tmp_path / "checkpoint-1" / MANIFEST).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no lock file, no staging


# --- The older VIDEOX_* names ------------------------------------------------------------------------------------------


def test_every_older_name_is_one_of_a_library_variable_and_documented_beside_it() -> None:
    declared = _declared()
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert set(OLDER_NAMES) <= set(declared) and len(OLDER) == len(set(OLDER)) == 6
    for name, olds in OLDER_NAMES.items():
        assert all(old.startswith("VIDEOX_") and f"| `{name}` | `{old}` |" in text for old in olds), name


@pytest.mark.parametrize("off", ["0", "off"])
def test_the_older_dispatch_switch_still_keeps_a_save_exactly_native(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     off: str) -> None:
    monkeypatch.setenv(PROTECT_ENV, "all")
    monkeypatch.setenv("VIDEOX_ACCELERATE_PATCHES", off)  # the design this came from: it must keep working
    accelerator, _, _ = stepped_accelerator()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # native: no manifest, lock or staging
    assert not (tmp_path / "checkpoint-1" / MANIFEST).exists()


def test_an_older_name_alone_sets_its_variable_and_names_itself_in_an_error(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDEOX_ACCELERATE_PROTECT", "all")  # the older spelling of ACCELERATE_TXN_PROTECT
    accelerator, _, _ = stepped_accelerator()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1" / MANIFEST).is_file()  # protected: the older name was read
    monkeypatch.setenv("VIDEOX_CHECKPOINT_LOCK_TIMEOUT", "soon")  # read when an Accelerator is first configured
    fresh, _, _ = stepped_accelerator()
    with pytest.raises(CheckpointConfigurationError, match=re.escape(
            "The environment variable VIDEOX_CHECKPOINT_LOCK_TIMEOUT is 'soon': ")):
        fresh.save_state(str(tmp_path / "checkpoint-2"))
    assert not (tmp_path / "checkpoint-2").exists()


def test_both_spellings_agreeing_are_one_setting_and_disagreeing_are_refused_naming_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTECT_ENV, "all")
    monkeypatch.setenv("VIDEOX_ACCELERATE_PROTECT", " all ")
    accelerator, _, _ = stepped_accelerator()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1" / MANIFEST).is_file()
    monkeypatch.setenv("VIDEOX_ACCELERATE_PATCHES", "0")
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "1")
    with pytest.raises(CheckpointConfigurationError, match=re.escape(
            "The environment variables ACCELERATE_TXN_PATCHES='1', VIDEOX_ACCELERATE_PATCHES='0' are spellings of one "
            "setting with different values: unset all but ACCELERATE_TXN_PATCHES.")):
        accelerator.save_state(str(tmp_path / "checkpoint-2"))
    assert not (tmp_path / "checkpoint-2").exists()


def test_the_finite_check_of_the_environment_is_read_by_configure_checkpointing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_txn.accelerate.config import checkpoint_config

    monkeypatch.setenv("ACCELERATE_TXN_CHECK_FINITE", "on")
    accelerator, _, _ = stepped_accelerator()
    assert checkpoint_config(accelerate_txn.configure_checkpointing(accelerator)).check_finite is True
    monkeypatch.setenv("ACCELERATE_TXN_CHECK_FINITE", "2")
    fresh, _, _ = stepped_accelerator()
    with pytest.raises(CheckpointConfigurationError, match=r"ACCELERATE_TXN_CHECK_FINITE is '2': use 1, true, yes or on"):
        accelerate_txn.configure_checkpointing(fresh)


def test_an_invalid_dispatch_switch_refuses_a_trainer_checkpoint(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Trainer, TrainingArguments

    from tests.scenarios.trainer_scenarios import tiny_llama

    model, data = tiny_llama(8)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, per_device_train_batch_size=4,
                             max_steps=1, save_strategy="steps", save_steps=1, report_to=[], seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "maybe")
    with pytest.raises(CheckpointConfigurationError, match=r"ACCELERATE_TXN_PATCHES is 'maybe': use 1, true"):
        trainer.train()
    assert not any((tmp_path / "run").glob("checkpoint-*"))


def test_the_cpu_harness_names_its_ranks_per_node_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from torch.distributed.fsdp import ShardingStrategy

    from accelerate_txn.testing._cpu_fsdp import RANKS_PER_NODE_ENV, hybrid_ranks_per_node

    hybrid = SimpleNamespace(fsdp_version=1, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, " 2 ")
    assert hybrid_ranks_per_node(hybrid, 4) == 2
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "two")
    with pytest.raises(CheckpointConfigurationError, match=rf"The environment variable {RANKS_PER_NODE_ENV} is 'two': "
                       r"use a positive whole number of ranks per emulated node that divides the 4 ranks"):
        hybrid_ranks_per_node(hybrid, 4)


def test_doctor_names_an_invalid_switch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate_txn.cli import main

    monkeypatch.setenv("ACCELERATE_TXN_ALLOW_UNVALIDATED", "perhaps")
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "The environment variable ACCELERATE_TXN_ALLOW_UNVALIDATED is 'perhaps': use 1, true" in captured.err
