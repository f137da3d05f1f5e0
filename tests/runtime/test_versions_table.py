"""The one validated-version table (accelerate_txn/validated.json), the record of what ran, and everything that reads
it: the README copy, constraints.txt's default pair, the CI matrix (.ci/matrix.py) and the matrix subset defined in
the Makefile. (What decides protection, the evidence: tests/compat/test_evidence.py.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch

from accelerate_txn.compat.evidence import recorded
from accelerate_txn.runtime import versions as _versions
from accelerate_txn.runtime.versions import (
    TESTED,
    markdown_table,
)

REPO = Path(__file__).resolve().parents[2]
MATRIX = REPO / ".ci" / "matrix.py"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def _pins() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


# --- the table itself ---------------------------------------------------------------------------------------

def test_table_rows_are_exact_releases_with_tested_pythons_and_one_row_per_pair_of_series() -> None:
    raw = json.loads((REPO / "accelerate_txn" / "validated.json").read_text(encoding="utf-8"))
    assert len(raw["pairs"]) == len(TESTED)
    for pair in TESTED:
        assert re.fullmatch(r"\d+\.\d+\.\d+", pair.torch) and re.fullmatch(r"\d+\.\d+\.\d+", pair.accelerate), pair
        assert pair.python and set(pair.python) <= set(PYTHONS), pair
    series = [pair.series for pair in TESTED]
    assert len(series) == len(set(series)), "two rows validate the same pair of minor series"


def test_table_covers_the_promised_slice() -> None:
    series = {pair.series for pair in TESTED}
    assert {("2.13", f"1.{minor}") for minor in range(7, 17)} <= series  # every Accelerate minor 1.7 to 1.16
    assert ("2.7", "1.7") in series  # the design's own pair
    assert ("2.14", "1.15") in series  # torch 2.14.1 is the release pip installs by default on the CI machine
    assert {(f"2.{minor}", "1.15") for minor in range(8, 13)} <= series  # every torch minor 2.8 to 2.12
    assert {pair.series[0] for pair in TESTED} == {f"2.{minor}" for minor in range(7, 16)}  # every torch minor
    assert {("2.15", "1.15"), ("2.15", "1.16")} <= series  # the newest torch with the two newest Accelerate minors
    assert max(tuple(map(int, pair.torch.split("."))) for pair in TESTED)[:2] == (2, 15)
    assert {python for pair in TESTED for python in pair.python} == set(PYTHONS)


def test_every_row_of_the_table_passed_the_fsdp2_tests() -> None:
    # Every Accelerate of the table (1.7 and later) supports FSDP2 (fsdp_version=2), and every row passed the FSDP2
    # tests: the FSDP2 evidence is recorded for every release of the table (tests/compat/test_evidence.py).
    assert all(pair.fsdp2 for pair in TESTED)


def test_transformers_rows_are_exact_releases_on_validated_pairs_each_keyed_in_the_trainer_internals() -> None:
    # The Trainer front end's rows (issue 18: at least the newest transformers release that installs here and the
    # newest 4.x). Each row's transformers release must have its evidence recorded (the gate checks the installed
    # Trainer's pieces against it), and its torch/Accelerate pair must be one the Accelerate front end validated (the
    # Trainer front end runs on the same transaction core and FSDP restores).
    from packaging.requirements import Requirement
    from packaging.version import Version

    from accelerate_txn.trainer import internals as trainer_internals
    from accelerate_txn.trainer import versions as trainer_versions

    rows = trainer_versions.ROWS
    for row in rows:
        assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in (row.transformers, row.torch, row.accelerate)), row
        assert row.python and set(row.python) <= set(PYTHONS), row
        assert row.series[1:] in _versions.VALIDATED, row
        assert row.transformers in recorded()["releases"]["transformers"], row  # its evidence is recorded
    assert len({row.series for row in rows}) == len(rows), "two rows validate the same series"
    assert {"4.57", "5.24"} <= {row.series[0] for row in rows}  # the newest 4.x, the newest release that installs
    assert trainer_internals.DEFAULT_SERIES == max((row.series[0] for row in rows), key=Version)
    assert set(recorded()["releases"]["transformers"]) == {row.transformers for row in rows}  # nothing else
    # The trainer extra's floor is the oldest validated transformers minor; make test installs a validated row.
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    (line,) = re.findall(r'^trainer = \["(.*)"\]$', pyproject, flags=re.MULTILINE)  # tomllib: Python 3.11+ only
    floor = Requirement(line)
    assert floor.name == "transformers" and str(floor.specifier) == f">={min((r.series[0] for r in rows), key=Version)}"
    pins = _pins()
    assert any((row.transformers, row.torch, row.accelerate) == (pins["transformers"], pins["torch"], pins["accelerate"])
               for row in rows)
    trainer_doc = (REPO / "docs" / "trainer.md").read_text(encoding="utf-8")
    assert all(f"transformers {row.transformers}" in trainer_doc for row in rows)


def test_requires_python_floor_is_a_tested_python() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    (floor,) = re.findall(r'^requires-python = ">=(\d+\.\d+)"$', pyproject, flags=re.MULTILINE)
    assert floor in {python for pair in TESTED for python in pair.python}


def test_default_pins_are_a_tested_pair_on_the_default_python() -> None:
    # constraints.txt pins the environment make test builds (Python 3.11 on the CI machine).
    pins = _pins()
    assert any((pair.torch, pair.accelerate) == (pins["torch"], pins["accelerate"]) and "3.11" in pair.python
               for pair in TESTED)


def test_readme_shows_the_table_read_by_the_code() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = markdown_table()
    assert table in readme, f"README's validated table differs from accelerate_txn/validated.json; it should read:\n{table}"
    assert len(table.splitlines()) == len(TESTED) + 2


# --- CI reads the same table --------------------------------------------------------------------------------

def _matrix(*args: str) -> list[str]:
    completed = subprocess.run([sys.executable, str(MATRIX), *args], cwd=REPO, capture_output=True, text=True,
                               timeout=120, check=True)
    return completed.stdout.splitlines()


def test_ci_matrix_runs_every_table_job_except_the_one_make_test_covers() -> None:
    every = [f"Python {python}, torch {pair.torch}, accelerate {pair.accelerate}"
             for pair in TESTED for python in pair.python]
    assert _matrix("--list", "--include-default") == every
    pins = _pins()
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    default = f"Python {host}, torch {pins['torch']}, accelerate {pins['accelerate']}"
    assert _matrix("--list") == [job for job in every if job != default]
    assert _matrix("--list", "--python", "3.13") == ["Python 3.13, torch 2.12.1, accelerate 1.12.0",
                                                    "Python 3.13, torch 2.12.1, accelerate 1.15.0"]


def _series(job: str) -> tuple[str, str, str]:
    python, torch_release, accelerate_release = re.fullmatch(
        r"Python (\S+), torch (\S+), accelerate (\S+)", job).groups()  # type: ignore[union-attr]
    return python, ".".join(torch_release.split(".")[:2]), ".".join(accelerate_release.split(".")[:2])


def test_ci_runs_a_covering_set_every_torch_accelerate_and_python_minor_at_least_once() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    (recipe,) = re.findall(r"^test-matrix:\n\t(.*)$", makefile, flags=re.MULTILINE)
    assert "--cover" in recipe.split() and "make test-matrix" in (REPO / ".ci" / "run").read_text(encoding="utf-8")
    covered = [_series(job) for job in _matrix("--cover", "--list")]
    pins = _pins()
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    default = _series(f"Python {host}, torch {pins['torch']}, accelerate {pins['accelerate']}")
    run = [*covered, default]  # make test runs the default pair, with the whole suite
    assert {torch_minor for _, torch_minor, _ in run} == {pair.series[0] for pair in TESTED}
    assert {accelerate_minor for _, _, accelerate_minor in run} == {pair.series[1] for pair in TESTED}
    assert {python for python, _, _ in run} == {python for pair in TESTED for python in pair.python}
    assert default not in covered
    # The diagonal: each torch minor with its own Accelerate minor where the table has that pair.
    assert {("2.7", "1.7"), ("2.8", "1.8"), ("2.9", "1.9"), ("2.10", "1.10"), ("2.11", "1.11"), ("2.12", "1.12"),
            ("2.13", "1.13"), ("2.14", "1.14")} <= {(t, a) for _, t, a in covered}
    # The edges: the newest torch with the newest Accelerate; the default torch with the oldest and the newest.
    newest = max(TESTED, key=lambda pair: (_release(pair.torch), _release(pair.accelerate)))
    assert newest.series in {(t, a) for _, t, a in covered}
    assert {(default[1], "1.7"), (default[1], "1.16")} <= {(t, a) for _, t, a in covered}
    assert len(covered) <= len({pair.series[0] for pair in TESTED}) + 3, "the covering set grew: CI time"


def _release(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def test_covering_set_of_a_rectangle_is_its_diagonal_plus_edges_and_every_row_is_reachable() -> None:
    matrix = _matrix_module()
    torches, accelerates = ["2.7.0", "2.8.0", "2.9.0"], ["1.7.0", "1.8.0", "1.9.0", "1.10.0"]
    table = [matrix.Job("3.11", t, a) for t in torches for a in accelerates]
    chosen = {(job.torch, job.accelerate) for job in matrix.cover(table, "2.8.0")}
    assert chosen == {("2.7.0", "1.7.0"), ("2.8.0", "1.8.0"), ("2.9.0", "1.9.0"),  # diagonal
                      ("2.9.0", "1.10.0"), ("2.8.0", "1.7.0"), ("2.8.0", "1.10.0")}  # edges
    # An Accelerate minor only one torch has, and a Python only one row has, are still chosen.
    table = [matrix.Job("3.11", "2.7.0", "1.7.0"), matrix.Job("3.11", "2.8.0", "1.7.0"),
             matrix.Job("3.12", "2.8.0", "1.7.0"), matrix.Job("3.11", "2.7.0", "1.9.0")]
    chosen_jobs = set(matrix.cover(table, "2.8.0"))
    assert {job.python for job in chosen_jobs} == {"3.11", "3.12"}
    assert {job.accelerate for job in chosen_jobs} == {"1.7.0", "1.9.0"}


def _selected_by(variable: str) -> set[str]:
    """The tests (name and parameters) the Makefile's ``variable`` (pytest arguments) selects, as pytest collects them."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    (line,) = re.findall(rf"^{variable} \?= (.*)$", makefile, flags=re.MULTILINE)
    completed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                *shlex.split(line)], cwd=REPO, capture_output=True, text=True, timeout=300,
                               check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return {node.split("::", 1)[1] for node in completed.stdout.splitlines() if "::" in node}


def test_matrix_subset_in_the_makefile_selects_each_promised_check() -> None:
    selected = _selected_by("MATRIX_TESTS")
    promised = {  # what the matrix must cover -> the test (name, or name and parameters, up to "-") checking it
        "save and fresh-optimizer restore":
            "test_roundtrip_restores_params_optimizer_scheduler_rng_and_private_state_exactly[orig_params]",
        "publish": "test_save_publishes_a_manifest_and_leaves_no_staging[orig_params]",
        "kill mid-save": "test_kill_9_mid_save_leaves_previous_checkpoint_selected_and_next_save_unblocked",
        "corruption refusal": "test_damaged_or_mismatched_checkpoint_is_rejected_on_every_rank_before_any_change"
                              "[orig_params-",
        "rank fault in a hook": "test_hook_raising_on_one_rank_makes_every_rank_raise_and_publishes_nothing[orig_params]",
        "rank fault in DCP": "test_dcp_checkpoint_exception_on_one_rank_is_raised_on_every_rank",
        "ranks disagree": "test_ranks_with_different_configuration_raise_the_same_explained_error",
    }
    missing = {check: test for check, test in promised.items()
               if not any(node == test or (test.endswith("-") and node.startswith(test)) for node in selected)}
    assert not missing, f"MATRIX_TESTS no longer selects: {missing}"
    # Compact: one round-trip launch (orig_params), not the flat_params one as well.
    assert not any("flat_params" in node for node in selected)


def test_full_matrix_is_every_torch_release_of_the_table_with_every_accelerate_release() -> None:
    host = f"{sys.version_info.major}.{sys.version_info.minor}"
    torches = {pair.torch for pair in TESTED}
    accelerates = {pair.accelerate for pair in TESTED}
    listed = _matrix("--rectangle", "--include-default", "--list")
    assert len(listed) == len(torches) * len(accelerates)
    assert set(listed) == {f"Python {host}, torch {t}, accelerate {a}" for t in torches for a in accelerates}
    assert "make test-matrix-full" not in (REPO / ".ci" / "run").read_text(encoding="utf-8")  # not CI: hours


def _matrix_module() -> Any:
    spec = importlib.util.spec_from_file_location("ci_matrix", MATRIX)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_matrix"] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["ci_matrix"]
    return module


def test_full_matrix_record_has_one_cell_per_pair_and_says_why_cells_failed() -> None:
    matrix = _matrix_module()
    outcomes = [
        matrix.Outcome(matrix.Job("3.11", "2.7.0", "1.7.0", True), result="passed", finished="2026-12-02 10:00"),
        matrix.Outcome(matrix.Job("3.11", "2.7.0", "1.15.0", False), result="FAILED: pytest exit 1",
                       finished="2026-12-02 10:05"),
        matrix.Outcome(matrix.Job("3.11", "2.15.0", "1.7.0", False), result="installing accelerate failed (uv exit 1)",
                       finished="2026-12-02 11:00"),
    ]
    text = matrix.record(outcomes, ["--rectangle", "--", "tests/x.py"])
    lines = text.splitlines()
    assert "`python3 .ci/matrix.py --rectangle -- tests/x.py`" in text and "3 cells, 1 passed, 2 not." in text
    assert "from 2026-12-02 10:00 to 2026-12-02 11:00 UTC" in text
    assert "| torch \\ Accelerate | 1.7.0 | 1.15.0 |" in lines
    assert "| 2.7.0 | passed (table) | **tests failed** |" in lines
    assert "| 2.15.0 | not installable | not run |" in lines
    assert "- torch 2.7.0, Accelerate 1.15.0: FAILED: pytest exit 1" in lines
    # An interrupted run says so, cell by cell.
    pending = [matrix.Job("3.11", "2.15.0", "1.15.0", False)]
    text = matrix.record(outcomes, ["--rectangle", "--", "tests/x.py"], pending)
    assert "4 cells, 1 passed, 2 not, 1 not run yet" in text
    assert "| 2.15.0 | not installable | not run yet |" in text.splitlines()


def test_full_matrix_resume_keeps_only_cells_that_passed_with_the_same_tests(tmp_path: Path) -> None:
    matrix = _matrix_module()
    path = tmp_path / "run.md"
    assert matrix.load_record(path, ["tests/x.py"]) == []  # no record yet: every cell runs
    passed = matrix.Outcome(matrix.Job("3.11", "2.7.0", "1.7.0", True), 10.0, 20.0, "passed", "2026-12-02 10:00")
    failed = matrix.Outcome(matrix.Job("3.11", "2.7.0", "1.15.0", False), result="FAILED: pytest exit 1")
    matrix.write_record(path, [passed, failed], [], ["--rectangle"], ["tests/x.py"])
    assert "| 2.7.0 | passed (table) | **tests failed** |" in path.read_text(encoding="utf-8").splitlines()
    assert matrix.load_record(path, ["tests/x.py"]) == [passed]
    assert matrix.load_record(path, ["tests/y.py"]) == []  # other tests: nothing is kept


def test_fsdp2_rows_of_the_table_are_the_fsdp2_validated_series_and_ci_runs_the_fsdp2_tests_there() -> None:
    raw = json.loads((REPO / "accelerate_txn" / "validated.json").read_text(encoding="utf-8"))["pairs"]
    marked = {(row["torch"], row["accelerate"]) for row in raw if row.get("fsdp2")}
    assert {pair.series for pair in TESTED if (pair.torch, pair.accelerate) in marked} == \
        {pair.series for pair in TESTED if pair.fsdp2}
    assert all(isinstance(row.get("fsdp2", False), bool) for row in raw), "\"fsdp2\" is true or false, not a string"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    for target in ("test-matrix", "test-matrix-table"):
        (recipe,) = re.findall(rf"^{target}:\n\t(.*)$", makefile, flags=re.MULTILINE)
        assert "--fsdp2-tests '$(MATRIX_FSDP2_TESTS)'" in recipe, target
    listed = _matrix("--list", "--include-default", "--fsdp2-tests", "tests/fsdp/test_fsdp2.py")
    with_fsdp2 = {line.removesuffix(" (+ FSDP2 tests)") for line in listed if line.endswith(" (+ FSDP2 tests)")}
    assert with_fsdp2 == {f"Python {python}, torch {row['torch']}, accelerate {row['accelerate']}"
                          for row in raw if row.get("fsdp2") for python in row["python"]}


def test_matrix_fsdp2_tests_select_the_fsdp2_round_trip_refusal_and_kill() -> None:
    selected = _selected_by("MATRIX_FSDP2_TESTS")
    assert "test_fsdp2_save_is_protected_and_published_with_a_manifest" in selected
    assert "test_resume_into_a_fresh_model_and_optimizer_is_exact_and_continues_identically" in selected
    assert "test_flipped_byte_in_a_dcp_payload_is_refused_on_every_rank_before_anything_changes" in selected
    # the whole-job kill -9 mid-write and exact restart, as one link on its own (not the 13-launch chain fixture)
    assert "test_fsdp2_whole_job_kill_mid_flush_of_a_fresh_run_then_exact_restart" in selected
    assert not any(node.startswith("test_fsdp2_kill_9_then_restart_restores_newest_complete_exactly[")
                   for node in selected)
    assert len(selected) <= 8  # compact: CI runs it on every FSDP2 row of its covering set


def _probe_tests(directory: Path) -> tuple[Path, Path]:
    (directory / "test_main.py").write_text("def test_main():\n    assert True\n", encoding="utf-8")
    (directory / "test_fsdp2_probe.py").write_text(
        "import os, pathlib\n\ndef test_fsdp2():\n"
        "    pathlib.Path(os.environ['PROBE_MARK']).write_text('ran')\n"
        "    assert os.environ.get('PROBE_FAIL') != '1'\n", encoding="utf-8")
    return directory / "test_main.py", directory / "test_fsdp2_probe.py"


@pytest.mark.parametrize("fsdp2_row", [True, False])
def test_matrix_job_runs_the_fsdp2_tests_only_on_fsdp2_rows_and_says_when_they_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsdp2_row: bool) -> None:
    # A real job of the matrix in this very environment (the default pair, already installed: nothing to install),
    # running two real pytest sessions on probe tests.
    matrix = _matrix_module()
    main_tests, fsdp2_tests = _probe_tests(tmp_path)
    installed = f"{sys.version_info.major}.{sys.version_info.minor}"
    job = matrix.Job(installed, torch.__version__.split("+")[0], accelerate.__version__, True, fsdp2_row)
    env = matrix.Environment(Path(sys.executable).parents[1], installed, job.torch, tmp_path / "c.txt", matrix.Installer())
    env.bin = Path(sys.executable)
    env.accelerate, env.editable_installed = job.accelerate, True
    mark = tmp_path / "mark"
    monkeypatch.setenv("PROBE_MARK", str(mark))
    outcome = matrix.Outcome(job)
    matrix.run_job(env, 0, 0.0, outcome, [str(main_tests)], [str(fsdp2_tests)])
    assert outcome.result == "passed"
    assert mark.exists() == fsdp2_row
    if fsdp2_row:
        monkeypatch.setenv("PROBE_FAIL", "1")
        failed = matrix.Outcome(job)
        matrix.run_job(env, 0, 0.0, failed, [str(main_tests)], [str(fsdp2_tests)])
        assert failed.result == "FAILED: pytest exit 1 (the FSDP2 tests)"
