"""``accelerate-txn doctor``: on the installed releases, and on changed releases of Accelerate.

A changed release is what a new release looks like to the library: a shadow of the installed Accelerate, first on
``PYTHONPATH`` of a subprocess, whose files are the installed ones except one changed function (``tests/support/overlay.py``):

* ``load_fsdp_optimizer`` with a renamed parameter: a piece every path of both front ends relies on;
* ``save_fsdp_optimizer`` with one more statement and the same parameters: FSDP1 relies on its code, Accelerate's
  FSDP2 only on its signature (the library replaces it), the Trainer's FSDP2 on its code (Trainer calls it), one
  process and DDP not at all.

The subprocesses run at once (each imports torch, Accelerate and transformers: the cost of the module).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.cli import main
from accelerate_txn.runtime.versions import OVERRIDE_ENV, PATCH_ENV
from tests.support.overlay import accelerate_with_a_changed_fsdp1_save, accelerate_with_a_renamed_parameter

REPO = Path(__file__).resolve().parents[2]
ALL = ["fsdp1", "fsdp2", "ddp", "trainer-fsdp1", "trainer-fsdp2", "trainer-ddp"]
TRAINER = ["trainer-fsdp1", "trainer-fsdp2", "trainer-ddp"]
RENAMED = "accelerate.utils.fsdp_utils.load_fsdp_optimizer has the parameters (fsdp_plugin, accelerator, optimizer, " \
          "model, input_dir, index="
CHANGED = "accelerate.utils.fsdp_utils.save_fsdp_optimizer (its code) differs from every release that passed"

# Runs the command line several times in one process (``[[args, {env: value or None}], ...]`` as argv[1]) and prints
# ``[{code, out}]``: the pieces are read once per process, as in a real one.
SEVERAL = """
import contextlib, io, json, os, sys
from accelerate_txn.cli import main
results = []
for args, environment in json.loads(sys.argv[1]):
    for name, value in environment.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = main(args)
    results.append({"code": code, "out": captured.getvalue()})
print(json.dumps(results))
"""


# The settings of a job the doctor reads (tests/cli/test_cli_doctor_job.py): left out here, with Accelerate's default
# config file in an empty directory, so that these tests judge the installed releases alone wherever they run.
JOB_VARIABLES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION", "FSDP_STATE_DICT_TYPE",
                 "ACCELERATE_TXN_PROTECT", "ACCELERATE_TXN_REQUIRE_PROTECTION")


def _environment(overlay: Path) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in (PATCH_ENV, OVERRIDE_ENV, *JOB_VARIABLES)}
    environment["PYTHONPATH"] = os.pathsep.join([str(overlay), str(REPO)])
    environment["HF_HOME"] = str(overlay / "no-hf-home")
    return environment


def _several(overlay: Path, runs: list[tuple[list[str], dict[str, str | None]]]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", SEVERAL, json.dumps(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_environment(overlay))


@pytest.fixture(scope="module")
def changed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The doctor's answers on the two changed releases, every subprocess started at once."""
    renamed = accelerate_with_a_renamed_parameter(tmp_path_factory.mktemp("renamed"))
    fsdp1 = accelerate_with_a_changed_fsdp1_save(tmp_path_factory.mktemp("fsdp1"))
    override = {OVERRIDE_ENV: "1"}
    processes = {
        "renamed": subprocess.Popen([sys.executable, "-m", "accelerate_txn", "doctor"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=REPO, env=_environment(renamed)),
        "renamed several": _several(renamed, [(["doctor", "--json", "--require", "trainer"], {}),
                                              (["doctor", "--json"], override),
                                              (["doctor", "--require", "accelerate"], override)]),
        "fsdp1 several": _several(fsdp1, [(["doctor", "--json"], {}),
                                          (["doctor", "--require", "ddp", "--require", "trainer-ddp"], {}),
                                          (["doctor", "--json", "--require", "trainer"], {}),
                                          (["doctor"], override)]),
    }
    results: dict[str, Any] = {}
    try:
        for name, process in processes.items():
            stdout, stderr = process.communicate(timeout=300)
            if name == "renamed":
                results[name] = {"code": process.returncode, "out": stdout, "err": stderr}
            else:
                assert process.returncode == 0, stderr
                results[name] = json.loads(stdout.strip().splitlines()[-1])
        yield results
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def _statuses(report: dict[str, Any]) -> dict[str, str]:
    return {name: path["status"] for name, path in report["paths"].items()}


@pytest.fixture
def plain_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (PATCH_ENV, OVERRIDE_ENV, "VIDEOX_ACCELERATE_PATCHES", "VIDEOX_ACCELERATE_ALLOW_UNVALIDATED",
                 *JOB_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no Accelerate config file at the default location


# --- The installed releases (in this process) ------------------------------------------------------------------------


def test_the_installed_releases_are_protected_on_every_path(capsys: pytest.CaptureFixture[str],
                                                            plain_environment: None) -> None:
    import accelerate
    import torch
    import transformers

    code, stdout = _doctor(capsys, "--json")
    report = json.loads(stdout)
    assert code == 0 and report["protected"] is True
    assert report["releases"] == {"torch": torch.__version__, "accelerate": accelerate.__version__,
                                  "transformers": transformers.__version__}
    assert report["python"] == {"version": platform.python_version(), "executable": sys.executable}
    assert sorted(report["paths"]) == sorted(ALL) and report["required"] == ALL
    for path in report["paths"].values():
        assert (path["status"], path["protected"], path["evidence"], path["differences"]) == \
            ("protected", True, "matches", []), path
    assert report["automatic_dispatch"] is True and report["override"] is False
    assert report["job"]["found"] is False and report["job"]["front_ends"] == {}  # no job settings: releases only
    assert report["stores"]["local"]["available"] and report["signing"]["hmac"]["available"]
    assert report["stores"]["gs"]["available"] is True  # the test extra installs every store's client

    code, stdout = _doctor(capsys)
    lines = stdout.splitlines()
    assert code == 0
    assert f"installed: torch {torch.__version__}, accelerate {accelerate.__version__}, transformers " \
           f"{transformers.__version__}" in lines
    for label in ("Accelerate FSDP1", "Accelerate FSDP2", 'Accelerate one-process and DDP (protect="all")',
                  "Trainer FSDP1", "Trainer FSDP2", "Trainer one-process and DDP"):
        assert any(line.startswith(label) and line.split()[-1] == "protected" for line in lines), (label, stdout)
    assert lines[-1] == "protected: every path of every installed front end (exit 0)"
    assert any(line.startswith("this job: no settings found (no Accelerate config file given or at ") and
               "the installed releases only are judged" in line for line in lines), stdout

    code, stdout = _doctor(capsys, "--json", "--require", "trainer")
    assert code == 0 and json.loads(stdout)["required"] == TRAINER


def test_automatic_dispatch_off_is_exactly_native_and_exit_1(capsys: pytest.CaptureFixture[str],
                                                             plain_environment: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATCH_ENV, "0")
    code, stdout = _doctor(capsys, "--json", "--require", "fsdp1")
    report = json.loads(stdout)
    assert code == 1 and report["automatic_dispatch"] is False and report["protected"] is False
    assert report["paths"]["fsdp1"]["status"] == "off" and report["paths"]["fsdp1"]["evidence"] == "matches"
    code, stdout = _doctor(capsys)
    assert code == 1
    assert f"automatic dispatch ({PATCH_ENV}=0): off: exactly native" in stdout
    assert "Accelerate FSDP1" in stdout and "off: exactly native (the evidence matches)" in stdout
    assert stdout.splitlines()[-1] == f"  automatic dispatch is off ({PATCH_ENV}=0): unset {PATCH_ENV} to protect them"


def test_the_older_dispatch_switch_is_read_and_named_as_it_was_set(capsys: pytest.CaptureFixture[str],
                                                                   plain_environment: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDEOX_ACCELERATE_PATCHES", "0")  # the name of the design this came from: still honoured
    code, stdout = _doctor(capsys, "--json", "--require", "fsdp1")
    report = json.loads(stdout)
    assert code == 1 and report["automatic_dispatch"] is False and report["paths"]["fsdp1"]["status"] == "off"
    assert report["environment"] == {OVERRIDE_ENV: None, PATCH_ENV: None, "VIDEOX_ACCELERATE_PATCHES": "0",
                                     "ACCELERATE_TXN_PROTECT": None, "ACCELERATE_TXN_REQUIRE_PROTECTION": None}
    code, stdout = _doctor(capsys)
    assert code == 1 and "automatic dispatch (VIDEOX_ACCELERATE_PATCHES=0): off: exactly native" in stdout
    assert stdout.splitlines()[-1] == ("  automatic dispatch is off (VIDEOX_ACCELERATE_PATCHES=0): unset "
                                       "VIDEOX_ACCELERATE_PATCHES to protect them")


def test_a_front_end_not_installed_is_no_failure_unless_required(capsys: pytest.CaptureFixture[str],
                                                                 plain_environment: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # sys.modules[name] = None is how Python marks a package that cannot be imported (import raises
    # ModuleNotFoundError, importlib.util.find_spec answers None): transformers absent, as the doctor sees it.
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, stdout = _doctor(capsys, "--json")
    report = json.loads(stdout)
    assert code == 0 and report["releases"]["transformers"] is None
    assert report["required"] == ["fsdp1", "fsdp2", "ddp"]
    for name in TRAINER:
        assert report["paths"][name]["status"] == "not installed"
        assert report["paths"][name]["missing_packages"] == ["transformers"]
        assert report["paths"][name]["protected"] is None
    code, stdout = _doctor(capsys)
    assert code == 0 and "transformers not installed" in stdout
    assert "Trainer FSDP1                                   not installed (transformers)" in stdout

    code, stdout = _doctor(capsys, "--require", "trainer-ddp")
    assert code == 1 and stdout.splitlines()[-1] == "NOT protected: Trainer one-process and DDP (exit 1)"


def test_an_unknown_path_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--json", "--require", "fsdp1,fsdp3"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "unknown path 'fsdp3'" in captured.err and "trainer-fsdp2" in captured.err


# --- Changed releases (subprocesses) ----------------------------------------------------------------------------------


def test_a_renamed_parameter_is_named_and_nothing_is_protected(changed: dict[str, Any]) -> None:
    """``python -m accelerate_txn doctor`` on an Accelerate whose ``load_fsdp_optimizer`` renamed a parameter."""
    result = changed["renamed"]
    assert result["code"] == 1, result["err"]
    lines = result["out"].splitlines()
    for label in ("Accelerate FSDP1", "Accelerate FSDP2", "Trainer one-process and DDP"):
        index = next(i for i, line in enumerate(lines) if line.startswith(label))
        assert lines[index].endswith("NOT protected"), lines[index]
        assert any(RENAMED in line for line in lines[index + 1:index + 3]), lines[index:index + 3]
    assert "Traceback" not in result["err"]
    assert lines[-2].startswith("NOT protected: Accelerate FSDP1, Accelerate FSDP2, ")
    assert lines[-1].startswith(f"  these run native Accelerate or Trainer after one warning; set {OVERRIDE_ENV}=1")


def test_the_trainer_relies_on_the_accelerate_pieces_too(changed: dict[str, Any]) -> None:
    required, overridden, accelerate_only = changed["renamed several"]
    report = json.loads(required["out"])
    assert required["code"] == 1 and report["required"] == TRAINER and report["protected"] is False
    for name in TRAINER:
        assert report["paths"][name]["status"] == "not protected"
        assert any(RENAMED in line for line in report["paths"][name]["differences"])

    # The override covers the pieces; the Trainer's own check of the signatures it calls still runs native (a
    # Trainer that calls load_fsdp_optimizer(..., optimizer_index) cannot call this one).
    report = json.loads(overridden["out"])
    assert overridden["code"] == 1 and report["override"] is True
    assert _statuses(report) == {"fsdp1": "override", "fsdp2": "override", "ddp": "override",
                                 "trainer-fsdp1": "not protected", "trainer-fsdp2": "not protected",
                                 "trainer-ddp": "not protected"}
    assert all("this Trainer lacks transformers.trainer.load_fsdp_optimizer" in report["paths"][name]["differences"][0]
               for name in TRAINER)
    assert accelerate_only["code"] == 0
    assert accelerate_only["out"].splitlines()[-1] == \
        "protected at your own risk (override): the paths required (fsdp1, fsdp2, ddp) (exit 0)"


def test_a_change_to_a_body_the_fsdp_paths_run_leaves_the_other_paths_protected(
        changed: dict[str, Any]) -> None:
    everything, subset, trainer, override = changed["fsdp1 several"]
    report = json.loads(everything["out"])
    assert everything["code"] == 1
    # save_fsdp_optimizer: FSDP1's sharded save and both paths' FULL_STATE_DICT save run its body (its code is a piece
    # of both), and the Trainer calls it on FSDP2 too; one process and DDP never do.
    assert _statuses(report) == {"fsdp1": "not protected", "fsdp2": "not protected", "ddp": "protected",
                                 "trainer-fsdp1": "not protected", "trainer-fsdp2": "not protected",
                                 "trainer-ddp": "protected"}
    for name in ("fsdp1", "fsdp2", "trainer-fsdp1", "trainer-fsdp2"):
        (line,) = report["paths"][name]["differences"]
        assert line.startswith(f"accelerate {report['releases']['accelerate']}: {CHANGED}"), line
        # Compared with the outline recorded for this release (the changed copy keeps its version number).
        assert line.endswith(": other statements, the same calls in the same order"), line

    assert subset["code"] == 0, subset["out"]
    lines = subset["out"].splitlines()
    assert lines[-1] == "protected: the paths required (ddp, trainer-ddp) (exit 0)"
    assert any(line.startswith("Accelerate FSDP1") and line.endswith("NOT protected  (not required)") for line in lines)
    assert any(line.startswith("Accelerate FSDP2") and line.endswith("NOT protected  (not required)") for line in lines)

    report = json.loads(trainer["out"])
    assert trainer["code"] == 1 and [name for name in TRAINER if not report["paths"][name]["protected"]] == \
        ["trainer-fsdp1", "trainer-fsdp2"]

    assert override["code"] == 0, override["out"]
    lines = override["out"].splitlines()
    assert any(line.startswith("Accelerate FSDP1") and line.endswith("protected at your own risk (override)")
               for line in lines)
    assert f"override ({OVERRIDE_ENV}): set (1): paths whose pieces differ take the protected path at your own risk" \
        in lines
    assert lines[-1] == "protected at your own risk (override): every path of every installed front end (exit 0)"
