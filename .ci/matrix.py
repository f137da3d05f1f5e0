#!/usr/bin/env python3
"""Run the version matrix: the pytest arguments after ``--`` on every (Python, torch, Accelerate) job of the
validated table, accelerate_txn/validated.json (``make test-matrix``; .ci/run calls it after ``make test``).

Standard library only, so any Python 3.10+ can drive it. One virtual environment per (Python, torch): torch is
installed once and Accelerate is swapped inside it (``pip install accelerate==X``) job after job; the
environment is deleted when its jobs are done (several GB each) unless ``--keep``. The job equal to the default
pins (this interpreter's Python, torch and Accelerate from constraints.txt) is skipped: ``make test`` already runs
the whole suite there. Every job checks that the installed versions are the ones asked for and that
accelerate_txn itself calls the pair validated, then runs pytest with the override variables removed, so the
protected path runs because the table says so. pytest's exit code 5 (no tests collected) is a failure.

Pins: the versions in constraints.txt apply, except torch and Accelerate, which come from the table. Some pins
name releases that do not support an older Python (numpy 2.4 and filelock 4.3 need Python 3.11+): for a Python
other than this interpreter's, when pip cannot resolve the pinned set it says so and retries with the table's
torch and Accelerate pinned only. The machine-wide pip constraint (a torch cap on some machines) is replaced by
these pins for the matrix's own pip calls; nothing outside the matrix environments is changed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "accelerate_txn" / "validated.json"
CONSTRAINTS = ROOT / "constraints.txt"
UNSET = ("VIDEOX_ACCELERATE_ALLOW_UNVALIDATED", "VIDEOX_ACCELERATE_PATCHES")
NOISE = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$")
PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
_REMOVALS: list[subprocess.Popen[bytes]] = []


@dataclass(frozen=True)
class Job:
    python: str
    torch: str
    accelerate: str

    def __str__(self) -> str:
        return f"Python {self.python}, torch {self.torch}, accelerate {self.accelerate}"


@dataclass
class Outcome:
    job: Job
    install_s: float = 0.0
    test_s: float = 0.0
    result: str = "not run"


def jobs() -> list[Job]:
    table = json.loads(TABLE.read_text(encoding="utf-8"))
    return [Job(python, row["torch"], row["accelerate"]) for row in table["pairs"] for python in row["python"]]


def pins() -> dict[str, str]:
    found = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            found[name.strip().lower()] = version.strip()
    return found


def host_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _say(message: str) -> None:
    print(f"[matrix] {message}", flush=True)


def _run(command: list[str], env: dict[str, str], cwd: Path = ROOT) -> int:
    """Run ``command``, streaming its output without the machine's find-links noise; its exit code."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if not NOISE.match(line.rstrip("\n")):
            print(line, end="", flush=True)
    return process.wait()


def find_interpreter(version: str) -> str:
    """An interpreter for Python ``version`` ("3.13"): this one, ``python3.13`` on PATH, or pyenv's newest 3.13.x."""
    if version == host_python():
        return sys.executable
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    installed = sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", "python")),
                       key=lambda path: [int(part) for part in re.findall(r"\d+", Path(path).parents[1].name)])
    candidates = [shutil.which(f"python{version}"), *reversed(installed)]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    raise SystemExit(f"[matrix] No Python {version} interpreter found (looked for python{version} on PATH and in "
                     f"{pyenv_root}/versions). Install it (for example `pyenv install {version}`) and run again.")


class Environment:
    """One virtual environment for one (Python, torch); Accelerate is swapped inside it."""

    def __init__(self, directory: Path, python: str, torch: str, constraints: Path) -> None:
        self.directory, self.python, self.torch = directory, python, torch
        self.bin = directory / "bin" / "python"
        self.constraints = constraints
        self.editable_installed = False

    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in UNSET}
        # Replaces the machine-wide constraint file (pip config), which may cap torch below the table's release.
        env["PIP_CONSTRAINT"] = str(self.constraints)
        return env

    def pip(self, *requirements: str) -> int:
        return _run([str(self.bin), *PIP, *requirements], self.env())

    def create(self) -> int:
        shutil.rmtree(self.directory, ignore_errors=True)
        code = _run([find_interpreter(self.python), "-m", "venv", str(self.directory)], self.env())
        return code or self.pip(f"torch=={self.torch}")

    def use_accelerate(self, version: str) -> int:
        if self.editable_installed:
            return self.pip(f"accelerate=={version}")
        code = self.pip(f"accelerate=={version}", "-e", ".[test]")
        self.editable_installed = code == 0
        return code

    def check(self, job: Job) -> str | None:
        """Why this environment is not the job's pair validated by accelerate_txn, or None."""
        code = ("import json, sys, torch, accelerate\n"
                "from accelerate_txn.accelerate.versions import unvalidated\n"
                "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'torch': torch.__version__,"
                " 'accelerate': accelerate.__version__, 'unvalidated': unvalidated()}))")
        probe = subprocess.run([str(self.bin), "-c", code], cwd=ROOT, env=self.env(), capture_output=True, text=True,
                               check=False)
        if probe.returncode != 0:
            return f"importing torch, accelerate and accelerate_txn failed:\n{probe.stderr[-3000:]}"
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        _say(f"installed: Python {seen['python']}, torch {seen['torch']}, accelerate {seen['accelerate']}")
        if (seen["python"], seen["torch"].split("+")[0], seen["accelerate"]) != (job.python, job.torch, job.accelerate):
            return f"expected {job}, found {seen}"
        if seen["unvalidated"]:
            return f"accelerate_txn does not call this table pair validated: {seen['unvalidated']}"
        return None

    def remove(self) -> None:
        """Delete the environment in the background (several GB take a while) so the next one starts at once;
        :func:`main` waits for every removal before it exits."""
        self.constraints.unlink(missing_ok=True)
        if self.directory.exists():
            trash = self.directory.with_name(f"{self.directory.name}.removing-{os.getpid()}")
            self.directory.rename(trash)
            _REMOVALS.append(subprocess.Popen(["rm", "-rf", str(trash)]))


def _constraints_file(directory: Path, keep_pins: bool) -> Path:
    """constraints.txt without its torch and Accelerate lines (or without any pin but those of the table)."""
    path = directory.parent / f"{directory.name}.constraints.txt"
    lines = [f"{name}=={version}" for name, version in pins().items() if keep_pins and name not in ("torch", "accelerate")]
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def run_group(python: str, torch: str, group: list[Job], pytest_args: list[str], root: Path,
              keep: bool) -> list[Outcome]:
    directory = root / f"py{python}-torch{torch}"
    root.mkdir(parents=True, exist_ok=True)
    outcomes = [Outcome(job) for job in group]
    started = time.monotonic()
    env = Environment(directory, python, torch, _constraints_file(directory, keep_pins=True))
    _say(f"== Python {python}, torch {torch}: creating {directory.relative_to(ROOT)} ==")
    code = env.create()
    if code and python != host_python():
        _say(f"constraints.txt's pins do not all install on Python {python}; retrying with only torch and "
             "accelerate pinned (from the table)")
        env = Environment(directory, python, torch, _constraints_file(directory, keep_pins=False))
        code = env.create()
    create_s = time.monotonic() - started
    _say(f"venv + torch {torch} on Python {python}: {create_s:.0f} s (exit {code})")
    try:
        for index, outcome in enumerate(outcomes):
            job = outcome.job
            if code:
                outcome.result = f"environment failed (pip exit {code})"
                continue
            step = time.monotonic()
            pip_exit = env.use_accelerate(job.accelerate)
            failure = f"installing accelerate failed (pip exit {pip_exit})" if pip_exit else env.check(job)
            outcome.install_s = time.monotonic() - step + (create_s if index == 0 else 0.0)
            _say(f"{job}: install {time.monotonic() - step:.0f} s")
            if failure:
                outcome.result = failure
                _say(f"FAILED {job}: {failure}")
                continue
            step = time.monotonic()
            _say(f"{job}: pytest {shlex.join(pytest_args)}")
            rc = _run([str(env.bin), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args], env.env())
            outcome.test_s = time.monotonic() - step
            outcome.result = {0: "passed", 5: "FAILED: pytest collected no tests (exit 5)"}.get(
                rc, f"FAILED: pytest exit {rc}")
            _say(f"{job}: tests {outcome.test_s:.0f} s, {outcome.result}")
    finally:
        if not keep:
            env.remove()
            _say(f"removing {directory.relative_to(ROOT)} (in the background)")
    return outcomes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="only these Pythons (repeatable), e.g. 3.13")
    parser.add_argument("--torch", action="append", help="only these torch releases (repeatable), e.g. 2.7.0")
    parser.add_argument("--accelerate", action="append", help="only these Accelerate releases (repeatable)")
    parser.add_argument("--include-default", action="store_true", help="also run the job that make test covers")
    parser.add_argument("--keep", action="store_true", help="keep the environments (default: delete each when done)")
    parser.add_argument("--envs", type=Path, default=ROOT / ".venv-matrix", help="where environments are created")
    parser.add_argument("--list", action="store_true", help="print the jobs and exit")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs in every job")
    options = parser.parse_args(argv)

    default = pins()
    selected = [job for job in jobs()
                if (not options.python or job.python in options.python)
                and (not options.torch or job.torch in options.torch)
                and (not options.accelerate or job.accelerate in options.accelerate)
                and (options.include_default
                     or (job.python, job.torch, job.accelerate) != (host_python(), default["torch"], default["accelerate"]))]
    if options.list:
        for job in selected:
            print(job)
        return 0
    if not selected:
        _say("no job matches the filters")
        return 1
    if not options.pytest_args:
        parser.error("give the pytest arguments after --")

    groups: dict[tuple[str, str], list[Job]] = {}
    for job in selected:
        groups.setdefault((job.python, job.torch), []).append(job)
    started = time.monotonic()
    for stale in options.envs.glob("*.removing-*"):  # left by an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    outcomes: list[Outcome] = []
    try:
        for (python, torch), group in groups.items():
            outcomes += run_group(python, torch, group, options.pytest_args, options.envs.resolve(), options.keep)
    finally:
        for removal in _REMOVALS:
            removal.wait()

    _say(f"== summary ({time.monotonic() - started:.0f} s in all) ==")
    for outcome in outcomes:
        _say(f"{outcome.job!s:<48} install {outcome.install_s:5.0f} s  tests {outcome.test_s:5.0f} s  {outcome.result}")
    failed = sum(outcome.result != "passed" for outcome in outcomes)
    print(f"matrix: {len(outcomes) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
