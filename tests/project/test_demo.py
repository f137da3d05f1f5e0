"""``make demo`` end to end: 2-process FSDP training on CPU, kill -9 mid-save, resume, bitwise proof."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERDICT = "lost nothing: parameters and optimizer state bitwise identical to the uninterrupted run"


@pytest.mark.timeout(900)
def test_demo_kill_mid_save_and_resume_loses_nothing(tmp_path: Path) -> None:
    """The demo exits 0 and prints its verdict; on failure its whole output is shown."""
    output = tmp_path / "demo-output"
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--output", str(output)],
        cwd=REPO, capture_output=True, text=True, timeout=840, stdin=subprocess.DEVNULL,  # a hang guard only
    )
    report = f"exit status {completed.returncode}\n--- stdout ---\n{completed.stdout}\n--- stderr ---\n{completed.stderr}"
    assert completed.returncode == 0, report
    assert VERDICT in completed.stdout, report
    assert "cleaned up by that save: yes" in completed.stdout, report
    assert not list((output / "crashed-run" / "checkpoints").glob(".*.staging-*")), report


def _make_dry_run(target: str, venv: Path) -> list[str]:
    """The commands ``make -n TARGET`` would run with ``VENV=venv``, one per line."""
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    # Under a parent make (CI's `make test`), MAKEFLAGS would add "Entering directory" lines: run it as a user would.
    environment = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    completed = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"], cwd=REPO,
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=environment)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.splitlines()


def _pip_installs(commands: list[str]) -> list[str]:
    return [command for command in commands if "pip install " in command]


def test_make_demo_installs_the_package_without_extras(tmp_path: Path) -> None:
    """On a fresh clone ``make demo`` creates .venv with torch and the package's base dependencies: no extra."""
    commands = _make_dry_run("demo", tmp_path / "venv")
    installs = _pip_installs(commands)
    assert installs, commands
    assert any("torch==2.13.0" in command and command.endswith(" -e .") for command in installs), installs
    assert not any(".[" in command for command in installs), f"make demo installs an extra: {installs}"
    assert any("-m venv" in command for command in commands), commands
    assert commands[-1].endswith("examples/demo.py --output demo-output"), commands


def _marked(venv: Path, *markers: str) -> None:
    """Fake a built environment: its marker files, newer than pyproject.toml and constraints.txt."""
    venv.mkdir()
    newest = max((REPO / name).stat().st_mtime for name in ("pyproject.toml", "constraints.txt"))
    for age, marker in enumerate(markers):  # in build order, each newer than the one before
        (venv / marker).touch()
        os.utime(venv / marker, (newest + 10 + age, newest + 10 + age))


def test_make_demo_after_make_venv_installs_nothing(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _marked(venv, ".base-installed", ".installed")
    commands = _make_dry_run("demo", venv)
    assert not _pip_installs(commands), commands
    assert not any("-m venv" in command for command in commands), commands


def test_make_venv_after_make_demo_adds_the_extras_to_the_same_environment(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _marked(venv, ".base-installed")
    commands = _make_dry_run("venv", venv)
    installs = _pip_installs(commands)
    assert len(installs) == 1 and installs[0].endswith("-e '.[test,clients]'"), commands
    assert not any("-m venv" in command for command in commands), f"make venv recreates the environment: {commands}"


def test_building_the_base_layer_alone_does_not_reinstall_the_extras(tmp_path: Path) -> None:
    """A .venv from before the layers (.installed only): the base layer is built, the extras are not installed again."""
    venv = tmp_path / "venv"
    _marked(venv, ".installed")
    installs = _pip_installs(_make_dry_run("venv", venv))
    assert installs and not any(".[" in command for command in installs), installs
