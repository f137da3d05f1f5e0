"""What a user reads from the launcher (``python -m accelerate_txn.testing run``), run for real on tiny scripts
(2 ranks, gloo, the launcher's hard timeout and pytest's):

* a setting the harness refuses, found before the start (an option) or by the workers (the script's own plugin,
  an ``--auto-wrap`` class or a ``-m`` module that does not import): one line on stderr, ``... run: error: WHAT. FIX``,
  once for the job, exit status 2 (argparse's, for a bad option), no traceback on any rank;
* a script's exception: its traceback starts at the script's own first frame (no frame of the launcher's worker or
  of ``runpy``), with the exception's type, message and cause intact;
* each echoed line carries one rank prefix, ``[rankN] ``: PyTorch's own ``[rankN]:`` (its ``sys.excepthook`` after
  ``init_process_group``) is not doubled onto it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from accelerate_txn.testing import run_script

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 300  # the launcher's hard limit per job: a hang guard only (a job takes seconds)
PROG = "python -m accelerate_txn.testing run"
ONE_PREFIX = re.compile(r"\[rank[01]\] (?!\[rank\d+\])")  # one launcher prefix, not followed by another

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

OWN_LOCAL_STATE_DICT_PLUGIN = """\
from accelerate import Accelerator, FullyShardedDataParallelPlugin

print("before the Accelerator", flush=True)
# LOCAL_STATE_DICT is not protected (its saves run native): the launcher, a test of the protected path, refuses it.
accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="LOCAL_STATE_DICT"))
print("after the Accelerator: must not run", flush=True)
"""

FAILING = """\
import torch.distributed as dist

dist.init_process_group("gloo")  # installs torch's sys.excepthook, which prefixes each line with "[rankN]: "


def load(rank):
    try:
        {}["missing"]
    except KeyError as cause:
        raise ValueError(f"the script's own error on rank {rank}:\\nsecond line of the message") from cause


load(dist.get_rank())
"""


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accelerate_txn.testing", "run", "-n", "2", "--timeout", str(JOB_TIMEOUT), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=JOB_TIMEOUT + 120, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})


# --- a refused setting: one line with the fix, exit status 2 ---------------------------------------------------

REFUSALS = {
    "the script's own plugin (found by the workers)": (
        ["own_plugin.py"],
        "error: The script's FullyShardedDataParallelPlugin with state_dict_type LOCAL_STATE_DICT ",
        "--state-dict-type SHARDED_STATE_DICT"),
    "--state-dict-type (found before the start)": (
        ["--state-dict-type", "LOCAL_STATE_DICT", "own_plugin.py"],
        "error: state_dict_type='LOCAL_STATE_DICT' (--state-dict-type LOCAL_STATE_DICT) cannot run on this CPU harness",
        "Use SHARDED_STATE_DICT or FULL_STATE_DICT"),
    "--auto-wrap (found by the workers)": (
        ["--auto-wrap", "nosuch_module.Block", "own_plugin.py"],
        "error: auto_wrap='nosuch_module.Block' (--auto-wrap nosuch_module.Block): cannot import it "
        "(No module named 'nosuch_module')",
        "Give the import path of a module class"),
    "-m (found by the workers)": (
        ["-m", "nosuch_module"],
        "error: -m nosuch_module: No module named nosuch_module.",
        "Give a module importable from the working directory"),
}


@pytest.mark.parametrize("args, what, fix", list(REFUSALS.values()), ids=list(REFUSALS))
def test_a_refused_setting_is_one_line_with_the_fix_once_and_exit_status_2(
        tmp_path: Path, args: list[str], what: str, fix: str) -> None:
    (tmp_path / "own_plugin.py").write_text(OWN_LOCAL_STATE_DICT_PLUGIN)
    completed = _cli(tmp_path, *args)
    report = completed.stdout + completed.stderr
    assert completed.returncode == 2, report
    [line] = completed.stderr.splitlines()  # exactly one line, not one per rank
    assert line.startswith(f"{PROG}: {what}") and fix in line, line
    assert "Traceback" not in report and "CheckpointConfigurationError" not in report, report
    assert "must not run" not in completed.stdout, report
    if args == ["own_plugin.py"]:  # the script ran up to its Accelerator on both ranks, echoed as usual
        assert sorted(completed.stdout.splitlines()) == ["[rank0] before the Accelerator",
                                                         "[rank1] before the Accelerator"], report


def test_run_script_reports_a_refusal_in_the_workers_in_its_result(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "own_plugin.py").write_text(OWN_LOCAL_STATE_DICT_PLUGIN)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the job keeps its refusal files
    result = run_script("own_plugin.py", cwd=tmp_path, num_processes=2, timeout=JOB_TIMEOUT)
    assert result.returncode == 2 and result.returncodes == [2, 2], result.describe()
    assert result.refusal is not None and result.refusal.startswith(
        "The script's FullyShardedDataParallelPlugin with state_dict_type LOCAL_STATE_DICT"), result.describe()
    assert "--state-dict-type SHARDED_STATE_DICT" in result.refusal and "\n" not in result.refusal
    assert result.summary().startswith(f"refused: {result.refusal}")
    assert result.output == ["before the Accelerator\n"] * 2, result.describe()  # no traceback on any rank
    assert not list((tmp_path / "tmp").iterdir()), "the job's refusal files were left behind"


# --- a script's exception: its own frames, one prefix per line ---------------------------------------------------

def _traceback(lines: list[str]) -> list[str]:
    """The lines of the last ``Traceback (most recent call last):`` block (the one raised, after its cause)."""
    starts = [index for index, line in enumerate(lines) if line == "Traceback (most recent call last):"]
    assert len(starts) == 2, lines  # the cause's, then the exception's
    return lines[starts[1]:]


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "-m module"])
def test_a_scripts_traceback_starts_at_its_own_frame_with_one_rank_prefix_per_line(
        tmp_path: Path, as_module: bool) -> None:
    (tmp_path / "failing.py").write_text(FAILING)
    completed = _cli(tmp_path, *(["-m", "failing"] if as_module else ["failing.py"]))
    report = completed.stdout + completed.stderr
    assert completed.returncode == 1, report
    echoed = completed.stdout.splitlines()
    assert echoed and all(ONE_PREFIX.match(line) for line in echoed), report  # also: no "[rank1] [rank1]: "
    for rank in (0, 1):
        own = [line[len(f"[rank{rank}] "):] for line in echoed if line.startswith(f"[rank{rank}] ")]
        assert not [line for line in own if line.startswith("[rank")], report
        traceback = _traceback(own)
        assert traceback[1] == f'  File "{tmp_path / "failing.py"}", line 13, in <module>', report
        assert traceback[-2:] == [f"ValueError: the script's own error on rank {rank}:", "second line of the message"]
        assert "The above exception was the direct cause of the following exception:" in own, report
        assert [line for line in own if line.startswith("KeyError")] == ["KeyError: 'missing'"], report
        frames = [line for line in own if line.startswith("  File ")]
        assert frames and not [line for line in frames if "accelerate_txn" in line or "runpy" in line], report
    assert completed.stderr.splitlines()[-1].startswith(f"{PROG}: rank "), report


def test_the_results_output_keeps_what_each_rank_wrote_from_the_scripts_first_frame(tmp_path: Path) -> None:
    # The echo drops torch's own prefix; the result's output and the rank logs are each rank's text as written.
    (tmp_path / "failing.py").write_text(FAILING)
    result = run_script("failing.py", cwd=tmp_path, num_processes=2, timeout=JOB_TIMEOUT, log_dir=tmp_path / "logs")
    assert result.returncode == 1 and result.refusal is None, result.describe()
    for rank, text in enumerate(result.output):
        lines = [line.removeprefix(f"[rank{rank}]: ") for line in text.splitlines()]
        traceback = _traceback(lines)
        assert traceback[1] == f'  File "{tmp_path / "failing.py"}", line 13, in <module>', text
        assert f"ValueError: the script's own error on rank {rank}:" in traceback, text
        assert (tmp_path / "logs" / f"rank{rank}.log").read_text() == text
