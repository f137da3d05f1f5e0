"""The canary on the newest releases (.ci/newest.py, ``make test-newest``, the fourth step of .ci/run): the Makefile
target and the CI step, the tests it selects, and its verdict -- a release that does not install, or that the gate
turns native, is reported and passes; protected tests that fail (or collect nothing) fail. No network here: the
verdict is decided on crafted probe results, and the probe runs in this very environment."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate
import pytest
import torch
import transformers

from tests.support.overlay import accelerate_with_a_renamed_parameter

REPO = Path(__file__).resolve().parents[2]
CANARY_VARIABLES = ("MATRIX_TESTS", "MATRIX_FSDP2_TESTS", "TRAINER_NEWEST_TESTS", "TRAINER_NEWEST_FSDP2_TESTS")


def _newest() -> Any:
    """.ci/newest.py as a module (it imports .ci/matrix.py as ``matrix``)."""
    spec = importlib.util.spec_from_file_location("ci_newest", REPO / ".ci" / "newest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_newest"] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["ci_newest"]
    return module


def _variable(name: str) -> list[str]:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    (line,) = re.findall(rf"^{name} \?= (.*)$", makefile, flags=re.MULTILINE)
    return shlex.split(line)


# --- the Makefile target and the CI step ---------------------------------------------------------------------------

def test_make_test_newest_passes_every_subset_to_the_canary_and_ci_runs_it_after_the_matrix() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    (recipe,) = re.findall(r"^test-newest:\n\t((?:.*\\\n)*.*)$", makefile, flags=re.MULTILINE)
    words = recipe.replace("\\\n", " ")
    assert words.startswith("$(PYTHON) .ci/newest.py ")
    for option, variable in (("--fsdp2-tests", "MATRIX_FSDP2_TESTS"), ("--trainer-tests", "TRAINER_NEWEST_TESTS"),
                             ("--trainer-fsdp2-tests", "TRAINER_NEWEST_FSDP2_TESTS")):
        assert f"{option} '$({variable})'" in words, option
    assert words.rstrip().endswith("-- $(MATRIX_TESTS)")
    assert re.search(r"^\.PHONY: .*\btest-newest\b", makefile, flags=re.MULTILINE)

    run = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    steps = re.findall(r'^step "[^"]*" (.*)$', run, flags=re.MULTILINE)
    assert steps == ["make test", "make docs", "make test-matrix", "make test-newest"]  # the fourth, after the matrix
    # On CI the trap removes the canary's environment too, whatever happens (the canary removes it itself as well).
    (trap,) = re.findall(r"trap '(rm -rf [^']*)' EXIT", run)
    assert ".venv-newest" in trap.split()
    assert ".venv-newest" in re.findall(r"^clean:\n\t(.*)$", makefile, flags=re.MULTILINE)[0].split()


# --- the tests it selects --------------------------------------------------------------------------------------

def _collected(arguments: list[str]) -> list[str]:
    completed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                *arguments], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return [node for node in completed.stdout.splitlines() if "::" in node]


@pytest.mark.parametrize("variable", CANARY_VARIABLES)
def test_every_name_the_canary_selects_with_k_collects_a_test(variable: str) -> None:
    # Each alternative of the -k expression names a real test: a renamed test must not silently drop out of the
    # canary (pytest would still collect the others, and exit 5 only when all are gone).
    arguments = _variable(variable)
    expression = arguments[arguments.index("-k") + 1]
    alternatives = expression.split(" or ")
    assert all(re.fullmatch(r"\w+", name) for name in alternatives), expression  # only "a or b or c"
    names = [node.split("::", 1)[1].lower() for node in _collected(arguments)]
    dead = [name for name in alternatives if not any(name.lower() in node for node in names)]
    assert not dead, f"{variable}: -k names no collected test: {dead}"


def test_the_trainer_subset_covers_a_protected_save_kill_and_exact_resume_and_a_damaged_shard_on_both_paths() -> None:
    fsdp1 = {node.split("::", 1)[1] for node in _collected(_variable("TRAINER_NEWEST_TESTS"))}
    fsdp2 = {node.split("::", 1)[1] for node in _collected(_variable("TRAINER_NEWEST_FSDP2_TESTS"))}
    # FSDP1: a protected save with its manifest; kill -9 at each phase of a save, of one rank and of the whole job,
    # each resumed; the last run ends exactly as the uninterrupted one.
    assert "test_a_protected_trainer_save_publishes_a_checkpoint_with_a_manifest_and_no_staging_leftovers" in fsdp1
    chain = [node for node in fsdp1 if node.startswith("test_kill_9_at_each_phase_of_a_trainer_save")]
    assert any(node.endswith("-job]") for node in chain) and any(node.endswith("-rank]") for node in chain)
    assert "test_fsdp1_resume_restores_the_optimizer_and_ends_exactly_as_an_uninterrupted_run" in fsdp1
    # FSDP2: the whole job killed mid-save resumes exactly; damaged shards (and every other file class) refused.
    assert fsdp2 == {"test_kill_9_of_the_whole_job_mid_save_resumes_from_the_previous_complete_checkpoint_exactly",
                     "test_each_damaged_file_class_is_refused_on_every_rank_before_anything_is_loaded"}
    # Not the random-instant kill: its instant is drawn from the reference run's timing (a loaded machine can end
    # the job before it), which a canary cannot afford.
    assert not any("random_instant" in node for node in fsdp1 | fsdp2)
    # Every one is a Trainer test of one path: FSDP1 ones run the FSDP1 fixtures, FSDP2 ones the FSDP2 fixtures.
    assert all(node.split("[")[0] in _tests_using("fsdp1_", "tests/trainer/test_trainer.py") for node in fsdp1)
    assert all(node in _tests_using("fsdp2_", "tests/trainer/test_trainer.py") for node in fsdp2)


def _tests_using(prefix: str, path: str) -> set[str]:
    """The test functions of ``path`` one of whose parameters (a fixture) starts with ``prefix``, directly or through
    a fixture of the module that does."""
    import ast

    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    functions = {node.name: [arg.arg for arg in node.args.args] for node in tree.body if isinstance(node, ast.FunctionDef)}
    fixtures = {name for name, args in functions.items() if not name.startswith("test_")}
    via = {name for name in fixtures if any(arg.startswith(prefix) for arg in functions[name])}
    return {name for name, args in functions.items() if name.startswith("test_")
            and any(arg.startswith(prefix) or arg in via for arg in args)}


# --- the verdict ---------------------------------------------------------------------------------------------------

def _suites(newest: Any) -> list[Any]:
    return [newest.Suite("Accelerate FSDP1", "accelerate fsdp1", ("tests/a.py",)),
            newest.Suite("Accelerate FSDP2", "accelerate fsdp2", ("tests/b.py",)),
            newest.Suite("Trainer FSDP1", "trainer fsdp1", ("tests/c.py",)),
            newest.Suite("Trainer FSDP2", "trainer fsdp2", ("tests/d.py",))]


RELEASES = {"python": "3.11", "torch": "2.99.0", "accelerate": "1.99.0", "transformers": "9.0.0"}


def _runner(codes: dict[str, int]) -> tuple[list[str], Any]:
    ran: list[str] = []

    def run(suite: Any) -> int:
        ran.append(suite.key)
        return codes.get(suite.key, 0)

    return ran, run


def test_a_release_that_does_not_install_is_reported_and_passes_without_running_anything() -> None:
    newest = _newest()
    ran, run = _runner({})
    verdict = newest.decide(newest.Probe(RELEASES, problem="uv exit 1 installing transformers 9.0.0"), _suites(newest),
                            run)
    assert verdict.code == 0 and ran == []
    assert verdict.lines == ["NOT INSTALLABLE (reported, passes): uv exit 1 installing transformers 9.0.0"]


def test_a_front_end_the_gate_turns_native_is_reported_with_its_reasons_and_its_tests_are_not_run() -> None:
    newest = _newest()
    reason = "transformers 9.0.0: transformers.trainer.Trainer._save_checkpoint (its code) differs from every release"
    probe = newest.Probe(RELEASES, native={"trainer fsdp1": [reason], "trainer fsdp2": [reason],
                                           "common": ["accelerate 1.99.0: something"]})
    ran, run = _runner({"trainer fsdp1": 1, "trainer fsdp2": 1})  # they would fail: native Trainer is unprotected
    verdict = newest.decide(probe, _suites(newest), run)
    assert verdict.code == 0
    assert ran == ["accelerate fsdp1", "accelerate fsdp2"]  # the front end the gate protects still runs
    assert "Trainer FSDP1: NATIVE, the gate's warning (reported, passes; its tests not run):" in verdict.lines
    assert f"    {reason}" in verdict.lines
    assert "Accelerate FSDP1: protected; its tests passed" in verdict.lines
    assert "common: NATIVE, the gate's warning (reported):" in verdict.lines  # no suite of its own: reported too


@pytest.mark.parametrize(("code", "says"), [(1, "FAILED: pytest exit 1"),
                                            (5, "FAILED: pytest collected no tests (exit 5)")])
def test_protected_tests_that_fail_or_collect_nothing_fail_the_canary(code: int, says: str) -> None:
    newest = _newest()
    ran, run = _runner({"trainer fsdp2": code})
    verdict = newest.decide(newest.Probe(RELEASES), _suites(newest), run)
    assert verdict.code == 1
    assert ran == ["accelerate fsdp1", "accelerate fsdp2", "trainer fsdp1", "trainer fsdp2"]
    assert (f"Trainer FSDP2: protected; its tests {says} -- the gate accepts these releases: the evidence missed a "
            "change, fix the evidence") in verdict.lines
    ran, run = _runner({})
    assert newest.decide(newest.Probe(RELEASES), _suites(newest), run).code == 0  # all protected, all passed


def test_a_gate_that_cannot_answer_on_releases_that_import_fails_the_canary() -> None:
    newest = _newest()
    ran, run = _runner({})
    verdict = newest.decide(newest.Probe(RELEASES, gate_error="AttributeError: ..."), _suites(newest), run)
    assert verdict.code == 1 and ran == []


# --- the probe, in this very environment ---------------------------------------------------------------------------

def _here(newest: Any, tmp_path: Path) -> tuple[Any, dict[str, str]]:
    env = newest.matrix.Environment(Path(sys.executable).parents[1], newest.matrix.host_python(), "",
                                    tmp_path / "c.txt", newest.matrix.Installer())
    env.bin = Path(sys.executable)
    installed = {"torch": torch.__version__.split("+")[0], "accelerate": accelerate.__version__,
                 "transformers": transformers.__version__}
    return env, installed


def test_the_probe_reads_the_releases_and_the_gate_of_the_environment(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    newest = _newest()
    env, installed = _here(newest, tmp_path)
    probe = newest.probe(env, installed)  # the default pins: every front end and path protected by the evidence
    assert probe.problem is None and probe.gate_error is None and probe.native == {}, probe
    assert {package: probe.releases[package].split("+")[0] for package in installed} == installed
    # Other releases than the ones asked for: reported as an install problem, not run.
    assert "other releases" in newest.probe(env, {**installed, "torch": "2.99.0"}).problem

    # An Accelerate that renamed a parameter of a function every protected path replaces: the gate turns both front
    # ends native on both paths, naming the piece; the canary runs none of their tests and passes.
    monkeypatch.setenv("PYTHONPATH", str(accelerate_with_a_renamed_parameter(tmp_path / "renamed")))
    changed = newest.probe(env, installed)
    assert changed.problem is None and changed.gate_error is None, changed
    assert {"accelerate fsdp1", "accelerate fsdp2", "trainer fsdp1", "trainer fsdp2"} <= set(changed.native)
    assert all(any("load_fsdp_optimizer" in reason for reason in reasons) for reasons in changed.native.values())
    ran, run = _runner({})
    assert newest.decide(changed, _suites(newest), run).code == 0 and ran == []


def test_the_newest_release_is_what_the_index_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    newest = _newest()
    answers = {"torch": SimpleNamespace(returncode=0, stdout="torch (2.99.0)\nAvailable versions: 2.99.0, 2.98.1\n",
                                        stderr=""),
               "accelerate": SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No matching distribution")}
    asked: list[list[str]] = []

    def answer(command: list[str], **_: Any) -> SimpleNamespace:
        asked.append(command)
        return answers[command[-1]]

    monkeypatch.setattr(newest.subprocess, "run", answer)
    assert newest.newest_release("torch") == "2.99.0"
    assert newest.newest_release("accelerate") is None
    assert asked[0][:5] == [sys.executable, "-m", "pip", "index", "versions"]
