"""Unit tests of the training-configuration descriptor: comparison and its migrations, JSON differences,
checkpoint participants, scheduler callables, and ``describe`` on a real single-process Accelerator."""

from __future__ import annotations

import copy
import enum
import functools
import json
import warnings
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from accelerate_txn import configure_checkpointing
from accelerate_txn.accelerate.descriptor import _callable_signature, compare_descriptor, describe, participants
from accelerate_txn.core.jsondiff import differences
from accelerate_txn.errors import CheckpointConfigurationError

_EXEC_A = {"capturable": False, "differentiable": False, "fused": None}
_EXEC_B = {"capturable": True, "differentiable": False, "fused": None}


def _descriptor(**overrides: Any) -> dict[str, Any]:
    """A descriptor shaped like ``describe()``'s output."""
    value: dict[str, Any] = {
        "world_size": 2,
        "backend": "FSDP",
        "mixed_precision": "no",
        "accumulation_steps": 1,
        "models": [{
            "id": "model",
            "class": "net.Net",
            "parameters": {"a": {"shape": [2, 3], "dtype": "torch.float32", "requires_grad": True},
                           "b": {"shape": [3], "dtype": "torch.float32", "requires_grad": True},
                           "c": {"shape": [1], "dtype": "torch.float32", "requires_grad": True}},
            "config": {},
            "fsdp": [],
        }],
        "optimizers": [{"class": "torch.optim.adam.Adam", "groups": [["a", "b"], ["c"]],
                        "execution": [dict(_EXEC_A), dict(_EXEC_B)]}],
        "schedulers": [],
        "custom_objects": [],
        "scaler": None,
        "private_states": {},
        "training": {"lr": 0.1, "batch": 8},
        "dataloaders": [],
    }
    value.update(overrides)
    return value


def _scheduler(cls: str = "torch.optim.lr_scheduler.LambdaLR", function: str = "warmup") -> dict[str, Any]:
    return {"class": cls, "optimizer": 0,
            "functions": [{"function": function, "defaults": [0.5], "keywords": None, "closure": []}]}


# --- compare_descriptor -------------------------------------------------------------------------------------

def test_compare_descriptor_identical_descriptors_pass_with_nothing_migrated() -> None:
    assert compare_descriptor(_descriptor(), _descriptor()) == []


def test_compare_descriptor_lists_each_difference_with_its_path() -> None:
    saved = _descriptor()
    live = _descriptor(world_size=4, mixed_precision="bf16")
    live["models"][0]["parameters"]["a"]["shape"] = [3, 2]
    with pytest.raises(CheckpointConfigurationError) as info:
        compare_descriptor(saved, live, where="run/checkpoint_3")
    message = str(info.value)
    assert message.startswith("run/checkpoint_3 was saved for a different training configuration:\n  ")
    assert "models[0].parameters.a.shape[0]: 2 (saved) vs 3 (live)" in message
    assert "mixed_precision: \"no\" (saved) vs \"bf16\" (live)" in message
    assert "world_size: 2 (saved) vs 4 (live)" in message
    assert "start a new run directory" in message


def test_compare_descriptor_does_not_modify_its_arguments() -> None:
    saved = _descriptor(training={"lr": 0.1}, schedulers=[_scheduler("old.module.LambdaLR")])
    live = _descriptor(training={"lr": 0.1, "seed": 3}, schedulers=[_scheduler()])
    before = copy.deepcopy((saved, live))
    compare_descriptor(saved, live, legacy_metadata_groups=(("seed",),), warn=False)
    assert (saved, live) == before


def test_compare_descriptor_migrates_wholly_absent_legacy_group_with_warning() -> None:
    saved = _descriptor(training={"lr": 0.1})
    live = _descriptor(training={"lr": 0.1, "seed": 3, "schedule": "cosine"})
    with pytest.warns(RuntimeWarning, match=r"ckpt lacks training metadata \['schedule', 'seed'\]; using the current"):
        migrated = compare_descriptor(saved, live, legacy_metadata_groups=(("seed", "schedule"),), where="ckpt")
    assert migrated == ["schedule", "seed"]


def test_compare_descriptor_legacy_metadata_keys_form_one_group() -> None:
    saved = _descriptor(training={"lr": 0.1})
    live = _descriptor(training={"lr": 0.1, "seed": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warn=False: no warning at all
        assert compare_descriptor(saved, live, legacy_metadata_keys=("seed",), warn=False) == ["seed"]


def test_compare_descriptor_refuses_partially_absent_legacy_group() -> None:
    saved = _descriptor(training={"lr": 0.1, "schedule": "cosine"})
    live = _descriptor(training={"lr": 0.1, "seed": 3, "schedule": "cosine"})
    with pytest.raises(CheckpointConfigurationError,
                       match=r"records only part of the field group \['schedule', 'seed'\] \(missing \['seed'\]\)"):
        compare_descriptor(saved, live, legacy_metadata_groups=(("seed", "schedule"),))


def test_compare_descriptor_legacy_groups_migrate_independently() -> None:
    saved = _descriptor(training={"lr": 0.1, "seed": 3})  # the first generation is recorded, the second is not
    live = _descriptor(training={"lr": 0.1, "seed": 3, "schedule": "cosine"})
    migrated = compare_descriptor(saved, live, legacy_metadata_groups=(("seed",), ("schedule",)), warn=False)
    assert migrated == ["schedule"]


def test_compare_descriptor_present_legacy_value_must_still_match() -> None:
    saved = _descriptor(training={"lr": 0.1, "seed": 4})
    live = _descriptor(training={"lr": 0.1, "seed": 3})
    with pytest.raises(CheckpointConfigurationError, match=r"training\.seed: 4 \(saved\) vs 3 \(live\)"):
        compare_descriptor(saved, live, legacy_metadata_keys=("seed",))


def test_compare_descriptor_undeclared_new_metadata_is_a_difference() -> None:
    saved = _descriptor(training={"lr": 0.1})
    live = _descriptor(training={"lr": 0.1, "seed": 3})
    with pytest.raises(CheckpointConfigurationError, match=r"training\.seed: only in live \(3\)"):
        compare_descriptor(saved, live)


def test_compare_descriptor_allows_fsdp_group_reorder_without_schedulers() -> None:
    live = _descriptor()
    live["optimizers"][0]["groups"] = [["c"], ["b", "a"]]
    live["optimizers"][0]["execution"] = [dict(_EXEC_B), dict(_EXEC_A)]
    assert compare_descriptor(_descriptor(), live) == []


def test_compare_descriptor_reordered_groups_keep_their_execution_settings() -> None:
    live = _descriptor()
    live["optimizers"][0]["groups"] = [["c"], ["b", "a"]]  # execution not moved with its group
    with pytest.raises(CheckpointConfigurationError, match=r"optimizers\[0\]\.execution\[0\]\.capturable"):
        compare_descriptor(_descriptor(), live)


def test_compare_descriptor_refuses_fsdp_group_reorder_with_schedulers() -> None:
    saved = _descriptor(schedulers=[_scheduler()])
    live = _descriptor(schedulers=[_scheduler()])
    live["optimizers"][0]["groups"] = [["c"], ["a", "b"]]
    live["optimizers"][0]["execution"] = [dict(_EXEC_B), dict(_EXEC_A)]
    with pytest.raises(CheckpointConfigurationError,
                       match=r'optimizers\[0\]\.groups\[0\]: \["a", "b"\] \(saved\) vs \["c"\] \(live\)'):
        compare_descriptor(saved, live)


def test_compare_descriptor_refuses_group_reorder_outside_fsdp() -> None:
    live = _descriptor(backend="MULTI_GPU")
    live["optimizers"][0]["groups"] = [["c"], ["a", "b"]]
    live["optimizers"][0]["execution"] = [dict(_EXEC_B), dict(_EXEC_A)]
    with pytest.raises(CheckpointConfigurationError, match=r"optimizers\[0\]\.groups"):
        compare_descriptor(_descriptor(backend="MULTI_GPU"), live)


def test_compare_descriptor_refuses_changed_group_membership_even_under_fsdp() -> None:
    live = _descriptor()
    live["optimizers"][0]["groups"] = [["a"], ["b", "c"]]
    with pytest.raises(CheckpointConfigurationError, match=r"optimizers\[0\]\.groups"):
        compare_descriptor(_descriptor(), live)


def test_compare_descriptor_normalises_scheduler_class_and_function_modules() -> None:
    saved = _descriptor(schedulers=[_scheduler("transformers.old_module.LambdaLR", "train.warmup")])
    saved["schedulers"][0]["functions"][0]["code"] = "deadbeef"  # early manifests recorded bytecode
    saved["schedulers"][0]["functions"].append({"partial": {"function": "utils.decay", "defaults": None,
                                                            "keywords": None, "closure": []},
                                                "args": [], "kwargs": {"rate": 2}})
    live = _descriptor(schedulers=[_scheduler()])
    live["schedulers"][0]["functions"].append({"partial": {"function": "decay", "defaults": None,
                                                           "keywords": None, "closure": []},
                                               "args": [], "kwargs": {"rate": 2}})
    assert compare_descriptor(saved, live) == []


def test_compare_descriptor_refuses_other_scheduler_class_or_function() -> None:
    with pytest.raises(CheckpointConfigurationError, match=r"schedulers\[0\]\.class: \"LambdaLR\" \(saved\) vs \"StepLR\""):
        compare_descriptor(_descriptor(schedulers=[_scheduler()]),
                           _descriptor(schedulers=[_scheduler("torch.optim.lr_scheduler.StepLR")]))
    with pytest.raises(CheckpointConfigurationError, match=r"schedulers\[0\]\.functions\[0\]\.function"):
        compare_descriptor(_descriptor(schedulers=[_scheduler()]),
                           _descriptor(schedulers=[_scheduler(function="cooldown")]))


def test_compare_descriptor_defaults_private_state_schema_version_and_ignores_hooks() -> None:
    saved = _descriptor(private_states={"state_{rank}.pt": {"generators": {"g": "cpu"}, "progress_keys": ["i"]}},
                        hooks=["<function save_hook at 0x1>"])
    live = _descriptor(private_states={"state_{rank}.pt": {"generators": {"g": "cpu"}, "progress_keys": ["i"],
                                                           "schema_version": 1}})
    assert compare_descriptor(saved, live) == []


# --- _jsondiff.differences ----------------------------------------------------------------------------------

def test_differences_of_equal_values_is_empty() -> None:
    assert differences({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]}) == []


def test_differences_reports_nested_paths_and_one_sided_keys() -> None:
    found = differences({"a": [{"b": 1}], "old": True}, {"a": [{"b": 2}], "new": "x"})
    assert found == ["a[0].b: 1 (saved) vs 2 (live)", "new: only in live (\"x\")", "old: only in saved (true)"]


def test_differences_reports_list_length_change_once_at_the_list() -> None:
    assert differences({"g": [1, 2]}, {"g": [1, 2, 3]}) == ["g: [1, 2] (saved) vs [1, 2, 3] (live)"]


def test_differences_stops_at_default_limit_of_eight() -> None:
    left = {f"k{i:02d}": i for i in range(20)}
    right = {f"k{i:02d}": -i - 1 for i in range(20)}
    found = differences(left, right)
    assert len(found) == 8
    assert found[0] == "k00: 0 (saved) vs -1 (live)"


def test_differences_respects_custom_limit_in_lists_and_names() -> None:
    found = differences(list(range(10)), list(range(1, 11)), names=("rank 0", "rank 1"), limit=3)
    assert found == ["[0]: 0 (rank 0) vs 1 (rank 1)", "[1]: 1 (rank 0) vs 2 (rank 1)", "[2]: 2 (rank 0) vs 3 (rank 1)"]


def test_differences_truncates_long_values() -> None:
    (line,) = differences({"k": "x" * 500}, {"k": "y"})
    shown = line.split(": ", 1)[1].split(" (saved)")[0]
    assert len(shown) == 160 and shown.endswith("...")


def test_differences_top_level_scalar_path_is_value() -> None:
    assert differences(1, 2) == ["value: 1 (saved) vs 2 (live)"]


# --- participants -------------------------------------------------------------------------------------------

def test_participants_single_owner_is_the_root_component() -> None:
    owner = object()
    assert participants(owner) == {"": owner}


def test_participants_dict_names_normalised_components() -> None:
    a, b = object(), object()
    result = participants({"vae/": a, "./unet": b})
    assert result == {"unet": b, "vae": a}
    assert participants({".": a}) == {"": a}


@pytest.mark.parametrize("names", [("", "x"), ("a", "a/b"), ("a/b/c", "a/b")])
def test_participants_rejects_overlapping_components(names: tuple[str, str]) -> None:
    with pytest.raises(CheckpointConfigurationError, match=r"overlaps another component"):
        participants({names[0]: object(), names[1]: object()})


def test_participants_accepts_sibling_components_with_common_prefix() -> None:
    a, b = object(), object()
    assert participants({"a": a, "ab": b}) == {"a": a, "ab": b}


@pytest.mark.parametrize("name", ["/abs", "../up", "a/../b"])
def test_participants_rejects_paths_leaving_the_checkpoint(name: str) -> None:
    with pytest.raises(CheckpointConfigurationError, match=rf"Checkpoint component {name!r} must be a relative path"):
        participants({name: object()})


def test_participants_rejects_the_same_accelerator_twice() -> None:
    owner = object()
    with pytest.raises(CheckpointConfigurationError, match=r"Accelerators must be unique \(component 'b'\)"):
        participants({"a": owner, "b": owner})


def test_participants_rejects_duplicate_component_after_normalisation() -> None:
    with pytest.raises(CheckpointConfigurationError, match=r"must be unique \(component 'a'\)"):
        participants({"a": object(), "./a": object()})


def test_participants_rejects_empty_group() -> None:
    with pytest.raises(CheckpointConfigurationError, match=r"needs at least one Accelerator"):
        participants({})


# --- _callable_signature ------------------------------------------------------------------------------------

def warmup(step: int, scale: float = 0.5, *, floor: float = 0.1) -> float:
    return max(floor, scale * step)


def test_callable_signature_of_plain_function_records_name_defaults_and_closure_with_their_names() -> None:
    factor = 0.25

    def decay(step: int) -> float:
        return factor**step

    assert _callable_signature(warmup) == {"function": "warmup", "defaults": [0.5], "default_names": ["scale"],
                                           "keywords": {"floor": 0.1}, "closure": [], "closure_names": []}
    assert _callable_signature(decay) == {"function": "decay", "defaults": None, "default_names": [],
                                          "keywords": None, "closure": [0.25], "closure_names": ["factor"]}


def test_callable_signature_of_partial_records_arguments_and_wrapped_function() -> None:
    function = functools.partial(warmup, scale=2.0)
    assert _callable_signature(function) == {
        "partial": {"function": "warmup", "defaults": [0.5], "default_names": ["scale"], "keywords": {"floor": 0.1},
                    "closure": [], "closure_names": []},
        "args": [],
        "kwargs": {"scale": 2.0},
    }


class _Schedule:
    def __call__(self, step: int) -> float:
        return 1.0


def test_callable_signature_rejects_callable_object() -> None:
    with pytest.raises(CheckpointConfigurationError,
                       match=r"LR scheduler callable tests\.accelerate\.test_descriptor\._Schedule cannot be described"):
        _callable_signature(_Schedule())
    with pytest.raises(CheckpointConfigurationError, match=r"_Schedule cannot be described"):
        _callable_signature(functools.partial(_Schedule()))


def test_callable_signature_rejects_closure_over_unrecordable_value() -> None:
    table = object()

    def lookup(step: int) -> float:
        return float(id(table))

    with pytest.raises(CheckpointConfigurationError, match=r"lookup closure has type builtins\.object"):
        _callable_signature(lookup)


# --- describe on a real single-process Accelerator (NO backend) ---------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _prepared() -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True)
    model = _Net()
    optimizer = torch.optim.Adam([{"params": model.body.parameters()},
                                  {"params": model.head.parameters(), "lr": 0.1}], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [warmup, functools.partial(warmup, scale=2.0)])
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def test_describe_single_model_roles_backend_and_parameter_shapes() -> None:
    accelerator, _model, _optimizer, _scheduler = _prepared()
    descriptor = describe(accelerator)
    assert (descriptor["backend"], descriptor["world_size"], descriptor["accumulation_steps"]) == ("NO", 1, 1)
    (model,) = descriptor["models"]
    assert model["id"] == "model"
    assert model["class"] == "tests.accelerate.test_descriptor._Net"
    assert {name: row["shape"] for name, row in model["parameters"].items()} == {
        "body.bias": [3], "body.weight": [3, 4], "head.bias": [2], "head.weight": [2, 3]}
    assert all(row["dtype"] == "torch.float32" and row["requires_grad"] for row in model["parameters"].values())


def test_describe_records_optimizer_groups_by_parameter_name_and_schedulers() -> None:
    accelerator, _model, _optimizer, _scheduler = _prepared()
    descriptor = describe(accelerator)
    (optimizer,) = descriptor["optimizers"]
    assert optimizer["class"] == "torch.optim.adam.Adam"
    assert optimizer["groups"] == [["body.weight", "body.bias"], ["head.weight", "head.bias"]]
    (scheduler,) = descriptor["schedulers"]
    assert scheduler["class"] == "torch.optim.lr_scheduler.LambdaLR" and scheduler["optimizer"] == 0
    assert scheduler["functions"] == [_callable_signature(warmup),
                                      _callable_signature(functools.partial(warmup, scale=2.0))]


def test_describe_is_json_and_compares_equal_to_itself() -> None:
    accelerator, _model, _optimizer, _scheduler = _prepared()
    descriptor = describe(accelerator)
    assert compare_descriptor(json.loads(json.dumps(descriptor)), describe(accelerator)) == []


def test_describe_two_models_of_same_class_without_model_ids_is_refused() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointConfigurationError,
                       match=r"Several prepared models are torch\.nn\.modules\.linear\.Linear: .*model_ids="):
        describe(accelerator)
    assert [m["id"] for m in describe(accelerator, require_model_ids=False)["models"]] == [
        "legacy_model_0", "legacy_model_1"]


def test_describe_uses_configured_model_ids_as_roles() -> None:
    accelerator = Accelerator(cpu=True)
    first, second = accelerator.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    configure_checkpointing(accelerator, model_ids={"teacher": second, "student": first})
    assert [m["id"] for m in describe(accelerator)["models"]] == ["student", "teacher"]


def test_describe_refuses_model_ids_naming_an_unprepared_model() -> None:
    accelerator = Accelerator(cpu=True)
    first, _second = accelerator.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    stranger = torch.nn.Linear(2, 2)
    configure_checkpointing(accelerator, model_ids={"student": first, "other": stranger})
    with pytest.raises(CheckpointConfigurationError,
                       match=r"must name every prepared model, and only prepared models \(unknown roles: \['other'\]\)"):
        describe(accelerator)


def test_nan_training_metadata_is_refused_up_front_or_compares_equal() -> None:
    accelerator = Accelerator(cpu=True)
    try:
        configure_checkpointing(accelerator, metadata={"max_grad_norm": float("nan")})
    except CheckpointConfigurationError:
        return  # refusing an unrecordable value when it is configured is an acceptable fix
    saved = json.loads(json.dumps(describe(accelerator)))  # as recorded in, and read back from, the manifest
    assert compare_descriptor(saved, describe(accelerator)) == []


def test_describe_models_of_different_classes_use_class_names_as_roles() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2), _Net())
    assert [m["id"] for m in describe(accelerator)["models"]] == ["torch.nn.modules.linear.Linear",
                                                                   "tests.accelerate.test_descriptor._Net"]


# --- model-config values a manifest cannot record (issue 7 item 7) ------------------------------------------

class _Activation(enum.Enum):
    GELU = "gelu"


class _Opaque:
    """An object with the default repr (it holds a memory address)."""


class _ConfiguredNet(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.config = {"hidden": 3, "init": lambda module: None, "act_fn": torch.nn.functional.silu,
                       "activation": _Activation.GELU, "helper": _Opaque(), "norm": torch.nn.LayerNorm,
                       "tags": {"b", "a"}, "scale": functools.partial(warmup, scale=2.0)}


_CONFIG_IN_A_FRESH_PROCESS = """
    import json
    from accelerate import Accelerator
    from accelerate_txn.accelerate.descriptor import describe
    from tests.accelerate.test_descriptor import _ConfiguredNet

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(_ConfiguredNet())
    print(json.dumps(describe(accelerator)["models"][0]["config"]))
"""


def _config_in_a_fresh_process() -> dict[str, Any]:
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(_CONFIG_IN_A_FRESH_PROCESS)],
                               cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300,
                               check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_model_config_callables_and_objects_are_described_the_same_in_every_process() -> None:
    # Regression: repr() of a lambda or a default-repr object holds its address, which differs per process,
    # so every multi-rank save failed with "ranks disagree" and no resume could ever match.
    first, second = _config_in_a_fresh_process(), _config_in_a_fresh_process()
    assert first == second
    assert "0x" not in json.dumps(first)
    assert first["init"] == "<callable tests.accelerate.test_descriptor._ConfiguredNet.__init__.<locals>.<lambda>>"
    assert first["act_fn"] == "<callable torch.nn.functional.silu>"
    assert first["norm"] == "<callable torch.nn.modules.normalization.LayerNorm>"
    assert first["activation"] == "<enum tests.accelerate.test_descriptor._Activation.GELU>"
    assert first["helper"] == "<instance of tests.accelerate.test_descriptor._Opaque>"  # its value is deliberately left out
    assert first["tags"] == ["a", "b"]
    assert first["scale"] == {"partial": "<callable tests.accelerate.test_descriptor.warmup>", "args": [],
                              "kwargs": {"scale": 2.0}}
    assert first["hidden"] == 3


def test_model_config_descriptions_compare_equal_after_a_manifest_round_trip() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(_ConfiguredNet())
    saved = json.loads(json.dumps(describe(accelerator)))
    assert compare_descriptor(saved, describe(accelerator)) == []


# --- full and sharded checkpoints ------------------------------------------------------------------------------

def test_a_full_checkpoint_and_a_sharded_run_refuse_each_other_naming_the_state_dict_type() -> None:
    from accelerate_txn.accelerate.descriptor import check_resume, full_on_both

    full, sharded = _descriptor(state_dict_type="FULL_STATE_DICT"), _descriptor()
    for saved, live in ((full, sharded), (sharded, full)):
        assert not full_on_both(saved, live)
        with pytest.raises(CheckpointConfigurationError, match="state_dict_type"):
            check_resume(copy.deepcopy(saved), copy.deepcopy(live), where="run/checkpoint_0")
    # Full on both sides: another world size is no difference (whole tensors), without the opt-in.
    assert full_on_both(full, _descriptor(state_dict_type="FULL_STATE_DICT", world_size=4))
    check_resume(copy.deepcopy(full), _descriptor(state_dict_type="FULL_STATE_DICT", world_size=4),
                 where="run/checkpoint_0", allow_reshard=True)
