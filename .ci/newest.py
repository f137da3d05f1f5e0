#!/usr/bin/env python3
"""The canary on the newest releases (``make test-newest``, the fourth step of .ci/run): the newest torch,
Accelerate and transformers the package index serves, whatever the table and the evidence say.

1. Ask the index for the newest release of each (``pip index versions``, with pip's own configuration: the same
   index the installs use; no release is written down here). ``--torch``, ``--accelerate``, ``--transformers`` name
   a release instead.
2. Install them into a fresh environment (.venv-newest, by uv, with the environment-building code of .ci/matrix.py):
   the three releases, this package editable with its test extra, the other pins of constraints.txt; when those pins
   do not resolve with the newest releases, again with the three releases pinned only. uv and its download cache
   are the matrix's (.venv-matrix) when make test-matrix left them there, as in .ci/run: what it downloaded last
   (the newest torch of the table) is not downloaded again.
3. Ask the gate there: ``accelerate_txn.runtime.versions.unprotected()`` for the Accelerate front end, and
   ``accelerate_txn.trainer.versions.differing(Trainer, path)`` for the Trainer, on FSDP1 and FSDP2.
4. Run the tests of each front end and path the gate protects: the matrix subset (MATRIX_TESTS, FSDP1; and
   MATRIX_FSDP2_TESTS) and the Trainer subset (TRAINER_NEWEST_TESTS, FSDP1; TRAINER_NEWEST_FSDP2_TESTS), as the
   Makefile defines them. A front end the gate turns native is reported with the gate's reasons and its tests are
   not run (they would test native behaviour).

The verdict (:func:`decide`), in the issue's words: a release that does not install, or whose changed piece the
gate turns native with its warning, is reported and passes; a combination the gate accepts and whose protected tests
fail fails CI (exit 1): the evidence missed a change, fix the evidence. pytest's exit 5 (no tests collected) is a
failure, and so is a gate that cannot answer on releases that install and import. The environment (several GB) is
deleted at the end unless ``--keep``. Standard library only, as .ci/matrix.py.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix  # .ci/matrix.py: the installer, the environment, the pins

ROOT = matrix.ROOT
PACKAGES = ("torch", "accelerate", "transformers")

#: Run in the new environment: the releases Python imports, then the gate's answer for each front end and path
#: (``"accelerate fsdp1"`` -> the reasons it runs native; absent: protected). Two lines, so that a gate that fails
#: is told apart from releases that do not import.
PROBE = """\
import json, sys
import torch, accelerate, transformers
print("RELEASES " + json.dumps({"python": "%d.%d" % sys.version_info[:2], "torch": torch.__version__,
                                "accelerate": accelerate.__version__, "transformers": transformers.__version__}))
sys.stdout.flush()
from transformers import Trainer
from accelerate_txn.runtime.versions import unprotected
from accelerate_txn.trainer.versions import differing
native = {f"accelerate {path}": reasons for path, reasons in unprotected().items()}
for path in ("fsdp1", "fsdp2"):
    found = differing(Trainer, path)
    if found:
        native[f"trainer {path}"] = [difference.describe() for difference in found]
print("GATE " + json.dumps(native))
"""


def _say(message: str) -> None:
    print(f"[newest] {message}", flush=True)


@dataclass(frozen=True)
class Suite:
    """The tests of one front end on one path (``key``: ``"trainer fsdp2"``, as the probe names the gate's answer)."""

    name: str
    key: str
    args: tuple[str, ...]


@dataclass
class Probe:
    """What the new environment holds: the releases, why they did not install (``problem``), or the gate's answer
    (``native``: each suite key it turns native -> why), or why the gate could not answer (``gate_error``)."""

    releases: dict[str, str]
    problem: str | None = None
    native: dict[str, list[str]] = field(default_factory=dict)
    gate_error: str | None = None


@dataclass
class Verdict:
    code: int  # the exit status: 1 only when tests the gate protects failed, or the gate failed
    lines: list[str]  # the summary, one line each


def _outcome(code: int) -> str:
    return {0: "passed", 5: "FAILED: pytest collected no tests (exit 5)"}.get(code, f"FAILED: pytest exit {code}")


def decide(probe: Probe, suites: Sequence[Suite], run: Callable[[Suite], int],
           notes: dict[str, str] | None = None) -> Verdict:
    """Run (``run``: the suite's pytest exit status) the suites the gate protects and decide: an install that failed
    or a suite the gate turns native is reported and passes; a protected suite that fails (exit 5 included) fails.
    ``notes``: what to add to a suite's line (its key -> text; pytest's summary and the time it took), read once the
    suite ran."""
    notes = {} if notes is None else notes
    if probe.problem is not None:
        return Verdict(0, [f"NOT INSTALLABLE (reported, passes): {probe.problem}"])
    if probe.gate_error is not None:
        return Verdict(1, [f"FAILED: the gate could not answer on these releases: {probe.gate_error}"])
    lines, failed = [], False
    for suite in suites:
        reasons = probe.native.get(suite.key)
        if reasons:
            lines.append(f"{suite.name}: NATIVE, the gate's warning (reported, passes; its tests not run):")
            lines += [f"    {reason}" for reason in reasons]
            continue
        outcome = _outcome(run(suite))
        failed = failed or outcome != "passed"
        note = f" ({notes[suite.key]})" if suite.key in notes else ""
        lines.append(f"{suite.name}: protected; its tests {outcome}{note}" +
                     (" -- the gate accepts these releases: the evidence missed a change, fix the evidence"
                      if outcome != "passed" else ""))
    others = {key: reasons for key, reasons in probe.native.items() if key not in {suite.key for suite in suites}}
    for key, reasons in others.items():  # the one-process and DDP path: reported, no suite of its own here
        lines.append(f"{key}: NATIVE, the gate's warning (reported):")
        lines += [f"    {reason}" for reason in reasons]
    return Verdict(1 if failed else 0, lines)


def newest_release(package: str) -> str | None:
    """The newest (final) release of ``package`` the package index serves, as pip is configured to ask it."""
    answer = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "--disable-pip-version-check", package],
                            capture_output=True, text=True, check=False, timeout=300)
    found = re.search(rf"^{re.escape(package)} \(([^)\s]+)\)$", answer.stdout, flags=re.MULTILINE | re.IGNORECASE)
    if found is None:
        _say(f"pip index versions {package} (exit {answer.returncode}): {(answer.stderr or answer.stdout)[-1500:]}")
    return found.group(1) if found else None


def probe(env: matrix.Environment, wanted: dict[str, str]) -> Probe:
    """The releases the environment imports and the gate's answer there."""
    answer = subprocess.run([str(env.bin), "-c", PROBE], cwd=ROOT, env=env.env(), capture_output=True, text=True,
                            check=False, timeout=600)
    found = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in answer.stdout.splitlines() if line.startswith(("RELEASES ", "GATE "))}
    if "RELEASES" not in found:
        return Probe(wanted, problem=f"installed, but torch, Accelerate or transformers does not import:\n"
                                     f"{answer.stderr[-3000:]}")
    releases = found["RELEASES"]
    seen = {package: releases[package].split("+")[0] for package in PACKAGES}
    if seen != {package: wanted[package] for package in PACKAGES}:
        return Probe(releases, problem=f"the installer put other releases in place: {seen}, not {wanted}")
    if "GATE" not in found:
        return Probe(releases, gate_error=f"importing accelerate_txn or asking its gate failed:\n{answer.stderr[-3000:]}")
    return Probe(releases, native=found["GATE"])


def _pytest(env: matrix.Environment, suite: Suite) -> tuple[int, str]:
    """pytest on one suite in the environment (no override variable set), streamed; its exit status and its
    summary line."""
    _say(f"{suite.name}: pytest {shlex.join(suite.args)}")
    process = subprocess.Popen([str(env.bin), "-m", "pytest", "-q", "-p", "no:cacheprovider", *suite.args],
                               cwd=ROOT, env=env.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        if not matrix.NOISE.match(line.rstrip("\n")):
            print(line, end="", flush=True)
            if re.search(r"\d+ (passed|failed|errors?|deselected)|no tests ran", line):
                last = line.strip(" =\n")
    return process.wait(), last or "no pytest summary"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for package in PACKAGES:
        parser.add_argument(f"--{package}", metavar="RELEASE", help=f"this {package} release, not the newest")
    parser.add_argument("--python", default=matrix.host_python(), help="the Python of the environment (default: this one)")
    parser.add_argument("--fsdp2-tests", default="", metavar="PYTEST_ARGS",
                        help="the Accelerate front end's FSDP2 tests (MATRIX_FSDP2_TESTS), one string")
    parser.add_argument("--trainer-tests", default="", metavar="PYTEST_ARGS",
                        help="the Trainer's FSDP1 tests (TRAINER_NEWEST_TESTS), one string")
    parser.add_argument("--trainer-fsdp2-tests", default="", metavar="PYTEST_ARGS",
                        help="the Trainer's FSDP2 tests (TRAINER_NEWEST_FSDP2_TESTS), one string")
    parser.add_argument("--envs", type=Path, default=ROOT / ".venv-newest", help="where the environment is created")
    parser.add_argument("--cache", type=Path,
                        help="where uv and its download cache live (default: the matrix's, .venv-matrix, when make "
                             "test-matrix left it there: what it downloaded last is not downloaded again; else --envs)")
    parser.add_argument("--installer", choices=("uv", "pip"), default="uv")
    parser.add_argument("--keep", action="store_true", help="keep the environment (default: delete it at the end)")
    parser.add_argument("pytest_args", nargs="*", help="after --: the Accelerate front end's FSDP1 tests (MATRIX_TESTS)")
    options = parser.parse_args(argv)
    suites = [Suite(name, key, tuple(args))
              for name, key, args in (("Accelerate FSDP1", "accelerate fsdp1", options.pytest_args),
                                      ("Accelerate FSDP2", "accelerate fsdp2", shlex.split(options.fsdp2_tests)),
                                      ("Trainer FSDP1", "trainer fsdp1", shlex.split(options.trainer_tests)),
                                      ("Trainer FSDP2", "trainer fsdp2", shlex.split(options.trainer_fsdp2_tests)))
              if args]
    if not suites:
        parser.error("name the tests: after --, and/or --fsdp2-tests, --trainer-tests, --trainer-fsdp2-tests")

    started = time.monotonic()
    wanted: dict[str, str] = {"python": options.python}
    named = [package for package in PACKAGES if getattr(options, package)]
    for package in PACKAGES:
        release = getattr(options, package) or newest_release(package)
        if release is None:
            return summary(Verdict(0, [f"NOT RUN (reported, passes): the package index did not name a {package} "
                                       "release (pip index versions failed; see above)"]), wanted, named, [], started)
        wanted[package] = release
    timings = [f"asking the index: {time.monotonic() - started:.0f} s"]
    _say("releases: " + ", ".join(f"{p} {wanted[p]}" for p in PACKAGES) + f" (Python {options.python}): "
         + ("the newest the index serves" if not named else f"{', '.join(named)} named, the others the newest"))
    root = options.envs.resolve()
    try:
        verdict, releases = run_canary(options, suites, wanted, root, timings)
    finally:
        if not options.keep:
            step = time.monotonic()
            _say(f"removing {root}")
            shutil.rmtree(root, ignore_errors=True)
            timings.append(f"removing the environment: {time.monotonic() - step:.0f} s")
    return summary(verdict, releases, named, timings, started)


def summary(verdict: Verdict, releases: dict[str, str], named: list[str], timings: list[str], started: float) -> int:
    """Print the summary (the releases, the time each part took, the verdict's lines); the exit status."""
    _say("== summary ==")
    _say("releases: " + ", ".join(f"{name} {releases.get(name, '?')}{' (named)' if name in named else ''}"
                                  for name in ("python", *PACKAGES)))
    for line in [*timings, *verdict.lines]:
        _say(line)
    minutes = (time.monotonic() - started) / 60
    print(f"newest: {'passed' if verdict.code == 0 else 'FAILED'} in {minutes:.1f} minutes", flush=True)
    return verdict.code


def run_canary(options: argparse.Namespace, suites: Sequence[Suite], wanted: dict[str, str], root: Path,
               timings: list[str]) -> tuple[Verdict, dict[str, str]]:
    """Install ``wanted`` into a fresh environment under ``root``, ask the gate there, run what it protects."""
    cache = options.cache or (ROOT / ".venv-matrix" if (ROOT / ".venv-matrix" / "uv-tool" / "bin" / "uv").exists()
                              else root)
    directory = root / f"py{options.python}-torch{wanted['torch']}"
    root.mkdir(parents=True, exist_ok=True)
    installer = matrix.uv_installer(cache.resolve()) if options.installer == "uv" else matrix.Installer()
    requirements = (f"accelerate=={wanted['accelerate']}", f"transformers=={wanted['transformers']}", "-e", ".[test]")
    step = time.monotonic()
    for keep_pins in (True, False):
        constraints = matrix.constraints_file(directory, keep_pins, drop=PACKAGES)
        env = matrix.Environment(directory, options.python, wanted["torch"], constraints, installer)
        code = env.create(*requirements)
        if code == 0 or not keep_pins:
            break
        _say("constraints.txt's other pins do not resolve with these releases; again with only torch, Accelerate "
             "and transformers pinned")
    pins = "with constraints.txt's other pins" if keep_pins else "only the three releases pinned"
    timings.append(f"install: {time.monotonic() - step:.0f} s ({installer.name}, {pins}; exit {code})")
    if code:
        return Verdict(0, [f"NOT INSTALLABLE (reported, passes): {installer.name} exit {code} installing "
                           f"{', '.join(f'{p} {wanted[p]}' for p in PACKAGES)} (its output is above)"]), wanted
    step = time.monotonic()
    found = probe(env, wanted)
    timings.append(f"asking the gate: {time.monotonic() - step:.0f} s")
    for key, reasons in found.native.items():
        _say(f"the gate turns {key} native ({len(reasons)} piece(s) changed; the summary names them)")
    notes: dict[str, str] = {}

    def run(suite: Suite) -> int:
        began = time.monotonic()
        code, last = _pytest(env, suite)
        notes[suite.key] = f"{last}; {time.monotonic() - began:.0f} s with pytest's start"
        return code

    return decide(found, suites, run, notes), {**wanted, **found.releases}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
