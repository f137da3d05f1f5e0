"""The validated version table, checkpoint version compatibility, the import-time patch (tested in fresh
subprocesses), the explicit API on a single-process NO-backend Accelerator, and the failed-restore guard."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import wrapt
from accelerate import Accelerator

from accelerate_txn import (
    MANIFEST,
    load_training_checkpoint,
    save_training_checkpoint,
)
from accelerate_txn.accelerate.config import mark_failed
from accelerate_txn.core.manifest import read_manifest, verify_manifest
from accelerate_txn.errors import RestoreFailedError
from accelerate_txn.runtime.versions import (
    OVERRIDE_ENV,
    PATCH_ENV,
    checkpoint_compatibility,
    installed_versions,
    override_requested,
)
from tests.support.overlay import accelerate_with_a_renamed_parameter, overlay

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT = 300  # a hang guard only


def _python(code: str, **env: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (repository root, no patch/override variables); its last stdout line
    is a JSON object of observations."""
    environment = {key: value for key, value in os.environ.items() if key not in (PATCH_ENV, OVERRIDE_ENV)}
    environment.update(env)
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=environment,
                               capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


# --- the version table --------------------------------------------------------------------------------------

# The table and the minor-series policy: tests/runtime/test_versions_table.py.


def test_installed_versions_report_the_real_packages() -> None:
    import accelerate

    assert installed_versions() == {"accelerate": accelerate.__version__, "torch": torch.__version__}


def test_checkpoint_compatibility_accepts_same_and_older_torch() -> None:
    running = installed_versions()["torch"]
    assert checkpoint_compatibility({"torch": running}) is None
    assert checkpoint_compatibility({"torch": "2.0.1"}) is None
    assert checkpoint_compatibility({"torch": "1.13.0", "accelerate": "0.1.0"}) is None


@pytest.mark.parametrize("newer", ["2.99.0", "3.0.0", "2.99.0.dev20260101+cu128"])
def test_checkpoint_compatibility_refuses_newer_torch_with_reason(newer: str) -> None:
    running = installed_versions()["torch"]
    reason = checkpoint_compatibility({"torch": newer})
    assert reason == (f"it was written by torch {newer}, newer than the running torch {running} "
                      "(torch.distributed.checkpoint is not forward compatible): upgrade torch to load it")


@pytest.mark.parametrize("saved", [{}, {"accelerate": "1.15.0"}, {"torch": None}, {"torch": "not a version"}])
def test_checkpoint_compatibility_refuses_missing_torch_version(saved: dict[str, Any]) -> None:
    assert checkpoint_compatibility(saved) == "the manifest does not record the torch version that wrote it"


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), (" YES ", True), ("on", True),
    ("0", False), ("", False), ("no", False), ("off", False),
])
def test_override_env_var_values(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv(OVERRIDE_ENV, value)
    assert override_requested() is expected


def test_override_env_var_unset_is_not_an_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    assert override_requested() is False


# --- the import-time patch, in fresh interpreters -----------------------------------------------------------

_LIFECYCLE = """
    import importlib, json, types, warnings
    import torch, wrapt
    import accelerate.accelerator as module

    def current():
        return {"save_state": module.Accelerator.__dict__["save_state"],
                "load_state": module.Accelerator.__dict__["load_state"],
                "load_fsdp_model": module.load_fsdp_model, "load_fsdp_optimizer": module.load_fsdp_optimizer}

    def wrapped_once(function, original):
        return (isinstance(function, wrapt.FunctionWrapper) and type(function.__wrapped__) is types.FunctionType
                and function.__wrapped__ is original)

    before = current()
    obs = {"wrapped_before_import": [isinstance(f, wrapt.FunctionWrapper) for f in before.values()]}
    import accelerate_txn
    first = current()
    obs["wrapped_once_after_import"] = {k: wrapped_once(f, before[k]) for k, f in first.items()}
    importlib.reload(accelerate_txn)
    accelerate_txn.install()
    obs["wrapped_once_after_reload_and_install"] = {k: wrapped_once(f, before[k]) for k, f in current().items()}
    obs["same_wrapper_after_reload"] = {k: f is first[k] for k, f in current().items()}
    accelerate_txn.uninstall()
    obs["originals_after_uninstall"] = {k: f is before[k] for k, f in current().items()}
    accelerate_txn.uninstall()
    obs["originals_after_second_uninstall"] = {k: f is before[k] for k, f in current().items()}
    accelerate_txn.install()
    obs["wrapped_once_after_reinstall"] = {k: wrapped_once(f, before[k]) for k, f in current().items()}

    # The dispatch decision on a validated pair, for a single-process Accelerator forced to FSDP1 sharded.
    import os
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from accelerate_txn import patch_accelerate_fsdp, unpatch_accelerate_fsdp
    from accelerate_txn.accelerate import patch as _patch

    acc = Accelerator(cpu=True)
    obs["no_backend_protected"] = _patch._protected(acc)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    acc.state.device = torch.device("cpu")
    obs["fsdp_protected"] = _patch._protected(acc)
    os.environ["ACCELERATE_TXN_PATCHES"] = "0"
    obs["fsdp_protected_automatic_off"] = _patch._protected(acc)
    patch_accelerate_fsdp(acc)
    obs["fsdp_protected_opted_in"] = _patch._protected(acc)
    del os.environ["ACCELERATE_TXN_PATCHES"]
    unpatch_accelerate_fsdp(acc)
    obs["fsdp_protected_opted_out"] = _patch._protected(acc)
    print(json.dumps(obs))
"""

# A release of Accelerate that renamed one parameter of a function the protected path replaces, and one that changed
# nothing but its version number: the evidence decides, not the number.


def _new_version(text: str) -> str:
    return re.sub(r'^__version__ = "[^"]+"', '__version__ = "1.99.0"', text, flags=re.MULTILINE)


_UNVALIDATED = """
    import json, os, warnings
    import torch
    import accelerate
    import accelerate_txn
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from accelerate_txn.accelerate import native as _native
    from accelerate_txn.accelerate import patch as _patch
    from accelerate_txn.runtime import versions as _versions
    from accelerate_txn.errors import UnsupportedVersionError

    obs = {"version": accelerate.__version__, "file": accelerate.__file__}
    acc = Accelerator(cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    acc.state.device = torch.device("cpu")
    obs["protected_fsdp1"] = _versions.protected("fsdp1")
    obs["unprotected"] = _versions.unprotected()
    try:
        accelerate_txn.patch_accelerate_fsdp(acc)
        obs["patch_error"] = None
    except UnsupportedVersionError as exc:
        obs["patch_error"] = str(exc)
    obs["opted_in_after_refusal"] = acc in _native.OPTED_IN
    import logging
    notices = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: notices.append(record.getMessage())
    logging.getLogger("accelerate_txn").addHandler(handler)
    logging.getLogger("accelerate_txn").setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs["protected"] = _patch._protected(acc)
        obs["protected_again"] = _patch._protected(acc)
    obs["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    obs["notices"] = notices
    os.environ["ACCELERATE_TXN_ALLOW_UNVALIDATED"] = "1"
    obs["protected_fsdp1_with_override"] = _versions.protected("fsdp1")
    obs["protected_with_override"] = _patch._protected(acc)
    accelerate_txn.patch_accelerate_fsdp(acc)
    obs["opted_in_with_override"] = acc in _native.OPTED_IN
    print(json.dumps(obs))
"""


@pytest.fixture(scope="module")
def lifecycle() -> dict[str, Any]:
    return _python(_LIFECYCLE)


@pytest.fixture(scope="module")
def unvalidated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    shadow = accelerate_with_a_renamed_parameter(tmp_path_factory.mktemp("renamed"))
    return _python(_UNVALIDATED, PYTHONPATH=str(shadow))


@pytest.fixture(scope="module")
def new_release(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    shadow = overlay("accelerate", tmp_path_factory.mktemp("new"), {"__init__.py": _new_version})
    return _python(_UNVALIDATED, PYTHONPATH=str(shadow))


def test_importing_accelerate_txn_wraps_save_state_load_state_and_fsdp_loaders(lifecycle: dict[str, Any]) -> None:
    assert lifecycle["wrapped_before_import"] == [False, False, False, False]
    assert lifecycle["wrapped_once_after_import"] == dict.fromkeys(
        ("save_state", "load_state", "load_fsdp_model", "load_fsdp_optimizer"), True)


def test_reload_and_second_install_do_not_double_wrap(lifecycle: dict[str, Any]) -> None:
    assert all(lifecycle["wrapped_once_after_reload_and_install"].values())
    assert all(lifecycle["same_wrapper_after_reload"].values())


def test_uninstall_restores_the_exact_original_functions(lifecycle: dict[str, Any]) -> None:
    assert lifecycle["originals_after_uninstall"] == dict.fromkeys(
        ("save_state", "load_state", "load_fsdp_model", "load_fsdp_optimizer"), True)
    assert all(lifecycle["originals_after_second_uninstall"].values())


def test_install_after_uninstall_wraps_again(lifecycle: dict[str, Any]) -> None:
    assert all(lifecycle["wrapped_once_after_reinstall"].values())
    assert len(lifecycle["wrapped_once_after_reinstall"]) == 4


def test_dispatch_on_validated_versions_protects_only_fsdp1_sharded(lifecycle: dict[str, Any]) -> None:
    assert lifecycle["no_backend_protected"] is False
    assert lifecycle["fsdp_protected"] is True


def test_dispatch_patch_env_off_is_native_unless_opted_in_and_opt_out_wins(lifecycle: dict[str, Any]) -> None:
    assert lifecycle["fsdp_protected_automatic_off"] is False
    assert lifecycle["fsdp_protected_opted_in"] is True
    assert lifecycle["fsdp_protected_opted_out"] is False


def test_a_release_that_changed_a_piece_is_detected_from_its_installed_source(unvalidated: dict[str, Any]) -> None:
    assert unvalidated["file"].startswith(tempfile.gettempdir())  # the changed release was imported
    assert unvalidated["protected_fsdp1"] is False
    # Its signature (a piece of every path) and, on the FSDP paths whose FULL_STATE_DICT restore runs it, its code.
    reason, code = unvalidated["unprotected"]["fsdp1"]
    assert reason.startswith(f"accelerate {unvalidated['version']}: accelerate.utils.fsdp_utils.load_fsdp_optimizer "
                             "has the parameters (fsdp_plugin, accelerator, optimizer, model, input_dir, index=, ")
    assert "accelerate.utils.fsdp_utils.load_fsdp_optimizer" in code and code != reason
    assert "optimizer_index=" in reason  # what the releases that passed have
    assert set(unvalidated["unprotected"]) == {"fsdp1", "common", "fsdp2"}


def test_patch_accelerate_fsdp_refuses_a_changed_piece_naming_it_and_the_override(unvalidated: dict[str, Any]) -> None:
    message = unvalidated["patch_error"]
    assert message is not None
    assert message.startswith("accelerate-txn: Accelerate FSDP1 checkpoints run native, NOT protected: the installed "
                              "releases differ from every release that passed accelerate-txn's tests in a private "
                              "piece it relies on (accelerate ")
    assert "accelerate.utils.fsdp_utils.load_fsdp_optimizer has the parameters" in message
    assert f"set {OVERRIDE_ENV}=1" in message and "accelerate-txn doctor" in message
    assert unvalidated["opted_in_after_refusal"] is False


def test_automatic_dispatch_stays_native_for_fsdp_on_a_changed_piece_with_one_warning(
        unvalidated: dict[str, Any]) -> None:
    assert unvalidated["protected"] is False and unvalidated["protected_again"] is False
    (warning,) = unvalidated["warnings"]
    assert warning == unvalidated["patch_error"]


def test_a_changed_piece_is_said_by_its_one_warning_alone(unvalidated: dict[str, Any]) -> None:
    # Two decisions, one warning (above) and no INFO line repeating it (the override's own warning comes later).
    assert [line for line in unvalidated["notices"] if "NOT protected" in line] == []


def test_override_env_var_enables_the_protected_path_on_a_changed_piece(unvalidated: dict[str, Any]) -> None:
    assert unvalidated["protected_fsdp1_with_override"] is True
    assert unvalidated["protected_with_override"] is True
    assert unvalidated["opted_in_with_override"] is True


def test_a_release_that_changed_no_piece_is_protected_whatever_its_version(new_release: dict[str, Any]) -> None:
    # Release day: an Accelerate no table row names, its private pieces unchanged.
    assert new_release["version"] == "1.99.0" and new_release["file"].startswith(tempfile.gettempdir())
    assert new_release["protected_fsdp1"] is True and new_release["unprotected"] == {}
    assert new_release["patch_error"] is None
    assert new_release["protected"] is True and new_release["warnings"] == []


# --- a single-process NO-backend Accelerator ----------------------------------------------------------------

def _halve(step: int) -> float:
    return 0.5 ** (step + 1)


def _training(seed: int) -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _halve)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _step(model: Any, optimizer: Any, scheduler: Any) -> None:
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_patched_save_state_on_no_backend_runs_native_without_manifest(tmp_path: Path) -> None:
    import accelerate.accelerator as module

    assert isinstance(module.Accelerator.__dict__["save_state"], wrapt.FunctionWrapper)
    accelerator, model, optimizer, scheduler = _training(0)
    _step(model, optimizer, scheduler)
    accelerator.save_state(str(tmp_path / "native"))
    names = sorted(path.name for path in (tmp_path / "native").iterdir())
    assert names == ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]


def test_save_training_checkpoint_on_no_backend_publishes_a_verified_manifest(tmp_path: Path) -> None:
    accelerator, model, optimizer, scheduler = _training(0)
    _step(model, optimizer, scheduler)
    path = save_training_checkpoint(accelerator, tmp_path / "ckpt")
    assert path == (tmp_path / "ckpt").absolute()
    manifest = read_manifest(path)
    assert manifest is not None
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"}
    assert manifest["components"][""]["backend"] == "NO"
    verify_manifest(path, manifest, full=True)
    assert [p.name for p in tmp_path.iterdir() if ".staging-" in p.name] == []


def test_load_training_checkpoint_round_trips_model_and_optimizer_exactly_on_no_backend(tmp_path: Path) -> None:
    accelerator, model, optimizer, scheduler = _training(0)
    for _ in range(2):
        _step(model, optimizer, scheduler)
    path = save_training_checkpoint(accelerator, tmp_path / "ckpt")
    saved_model = {key: value.clone() for key, value in model.state_dict().items()}
    saved_optimizer = optimizer.state_dict()
    saved_scheduler = scheduler.state_dict()

    fresh, fresh_model, fresh_optimizer, fresh_scheduler = _training(1)
    assert not torch.equal(fresh_model.state_dict()["0.weight"], saved_model["0.weight"])
    assert load_training_checkpoint(fresh, path) == path
    restored = fresh_model.state_dict()
    assert restored.keys() == saved_model.keys()
    assert all(torch.equal(restored[key], saved_model[key]) for key in saved_model)
    state = fresh_optimizer.state_dict()
    assert state["param_groups"] == saved_optimizer["param_groups"]
    assert state["state"].keys() == saved_optimizer["state"].keys() and len(state["state"]) == 4
    for index, entry in saved_optimizer["state"].items():
        assert entry.keys() == state["state"][index].keys()
        assert all(torch.equal(entry[key], state["state"][index][key]) for key in entry)
    assert fresh_scheduler.state_dict() == saved_scheduler


# --- the failed-restore guard -------------------------------------------------------------------------------

def test_marked_failed_accelerator_refuses_optimizer_step_and_save_until_cleared(tmp_path: Path) -> None:
    accelerator, model, optimizer, scheduler = _training(0)
    mark_failed(accelerator, True)
    model(torch.randn(5, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RestoreFailedError, match=r"The last load_state\(\) failed part-way.*before calling optimizer"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(RestoreFailedError, match=r"Refusing to save: the last load_state\(\) failed part-way"):
        save_training_checkpoint(accelerator, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()

    mark_failed(accelerator, False)
    _step(model, optimizer, scheduler)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (save_training_checkpoint(accelerator, tmp_path / "ckpt") / MANIFEST).is_file()
