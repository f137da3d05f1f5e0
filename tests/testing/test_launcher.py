"""The launcher of unmodified scripts (``accelerate_txn.testing.run_script``, ``python -m accelerate_txn.testing
run``): a real example-style training script, written here, runs as one 2-process FSDP job on CPU.

* FSDP1 and FSDP2 are forced on the script's own ``Accelerator``; the model is sharded; a plugin the script passes
  is respected; ``sys.argv``, ``__main__`` and ``sys.path`` are exactly those of ``python script.py ARGS``.
* The launcher never installs accelerate-txn's patch: with the script's ``import accelerate_txn`` its checkpoints
  have a manifest, without it they are native (no manifest, ``save_state`` unwrapped).
* Supervision: the first failing rank's exit status, the others killed after the grace with everything they
  started; the timeout kills the job; a kill trigger kills the whole job (``kill -9``) and a rerun resumes from the
  newest complete checkpoint; Ctrl-C on the command line kills every worker; bad options are refused before any
  process starts.

Every job has the launcher's hard timeout and pytest's; no step is timed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn import MANIFEST
from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.testing import ScriptResult, run_script
from accelerate_txn.testing._cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 300.0  # the launcher's hard limit per job: a hang guard only (a job takes seconds)

TRAIN = '''\
"""A tiny example-style training script: its own Accelerator, model, optimizer, data loader, save_state."""
import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import ProjectConfiguration, set_seed
{import_line}

def report(accelerator, **fields):
    print("REPORT " + json.dumps({{"rank": accelerator.process_index, **fields}}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=2, help="0: train and save until killed")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--own_plugin", type=int, default=0, help="pass FullyShardedDataParallelPlugin(fsdp_version=N)")
    args = parser.parse_args()
    set_seed(0)
    kwargs = {{}}
    if args.own_plugin:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=args.own_plugin,
                                                               state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=args.output_dir), **kwargs)
    # Natively, on CPU, this plugin raises (sync_module_states needs a GPU); the launcher turns both off.
    gpu_only = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=True, cpu_ram_efficient_loading=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    full = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 5, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    if args.resume:
        done = [name for name in os.listdir(args.output_dir) if name.startswith("checkpoint-")]
        latest = max(done, key=lambda name: int(name.split("-")[1]))
        accelerator.load_state(os.path.join(args.output_dir, latest))
        step = int(latest.split("-")[1])
        report(accelerator, resumed=latest)
    report(accelerator, name=__name__, argv=sys.argv, file=__file__, path0=sys.path[0],
           distributed_type=accelerator.distributed_type.name, num_processes=accelerator.num_processes,
           fsdp_version=accelerator.state.fsdp_plugin.fsdp_version, device=accelerator.device.type, full=full,
           local=sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()),
           units=sum(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules()),
           protected="accelerate_txn" in sys.modules, save_state=type(Accelerator.__dict__["save_state"]).__name__,
           gpu_only_plugin=[gpu_only.sync_module_states, gpu_only.cpu_ram_efficient_loading])
    batches = iter(loader)
    while args.max_steps == 0 or step < args.max_steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{{step}}"))
        if accelerator.is_main_process:
            print(f"saved checkpoint-{{step}}", flush=True)
    report(accelerator, finished=step)


if __name__ == "__main__":
    main()
'''


def _script(directory: Path, protected: bool) -> Path:
    path = directory / ("train_protected.py" if protected else "train.py")
    path.write_text(TRAIN.format(import_line="import accelerate_txn  # protects save_state/load_state" if protected
                                 else ""))
    return path


def _reports(result: ScriptResult) -> list[dict[str, Any]]:
    """Every rank's ``REPORT`` lines merged into one dict per rank."""
    merged: list[dict[str, Any]] = []
    for text in result.output:
        fields: dict[str, Any] = {}
        for line in text.splitlines():
            if line.startswith("REPORT "):
                fields.update(json.loads(line[len("REPORT "):]))
        merged.append(fields)
    return merged


def _checkpoints(output: Path) -> dict[str, bool]:
    """Each named checkpoint directory: whether it has a manifest."""
    return {path.name: (path / MANIFEST).is_file() for path in sorted(output.glob("checkpoint-*"))}


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


# --- FSDP1 and FSDP2 on the script's own Accelerator; with and without the import ------------------------------

@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp1_job_runs_the_script_as_python_would_and_the_import_protects_it(tmp_path: Path) -> None:
    script = _script(tmp_path, protected=True)
    args = ["--output_dir", str(tmp_path / "out"), "--max_steps", "2"]
    result = run_script(script.name, args, cwd=tmp_path, num_processes=2, fsdp_version=1, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.describe()
    reports = _reports(result)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["finished"] == 2, result.describe()
        assert (report["distributed_type"], report["num_processes"], report["fsdp_version"], report["device"]) == (
            "FSDP", 2, 1, "cpu")
        assert 0 < report["local"] < report["full"], f"rank {rank} holds the whole model: not sharded {report}"
        assert report["units"] == 3, f"every Linear and the root are FSDP units: {report}"
        assert report["name"] == "__main__" and report["argv"] == [script.name, *args]
        assert report["file"] == str(script) and report["path0"] == str(tmp_path)
        assert report["protected"] and report["save_state"] == "FunctionWrapper"
        assert report["gpu_only_plugin"] == [False, False]
    assert sum(report["local"] for report in reports) >= reports[0]["full"]
    assert "saved checkpoint-2" in result.output[0]
    assert _checkpoints(tmp_path / "out") == {"checkpoint-1": True, "checkpoint-2": True}


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp2_from_the_scripts_own_plugin_without_the_import_runs_native(tmp_path: Path) -> None:
    script = _script(tmp_path, protected=False)
    args = ["--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--own_plugin", "2"]
    result = run_script(script, args, num_processes=2, timeout=JOB_TIMEOUT)  # FSDP settings: the script's
    assert result.returncode == 0, result.describe()
    for rank, report in enumerate(_reports(result)):
        assert (report["rank"], report["finished"]) == (rank, 1), result.describe()
        assert (report["distributed_type"], report["num_processes"], report["fsdp_version"]) == ("FSDP", 2, 2)
        assert 0 < report["local"] < report["full"], f"rank {rank} holds the whole model: not sharded {report}"
        assert report["units"] == 1, f"the script's plugin wraps nothing: the model is one unit {report}"
        assert not report["protected"] and report["save_state"] == "function", "the launcher installed the patch"
    assert _checkpoints(tmp_path / "out") == {"checkpoint-1": False}
    assert (tmp_path / "out" / "checkpoint-1" / "pytorch_model_fsdp_0").is_dir()  # a real native FSDP save


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_kill_on_output_kills_the_whole_job_and_a_rerun_resumes_from_the_newest_complete_checkpoint(
        tmp_path: Path) -> None:
    script = _script(tmp_path, protected=True)
    out = tmp_path / "out"
    # Trains and saves until killed: the kill lands somewhere after save 2 (mid-save or mid-step), whatever the speed.
    killed = run_script(script, ["--output_dir", str(out), "--max_steps", "0"], num_processes=2, fsdp_version=2,
                        timeout=JOB_TIMEOUT, kill_on_output="saved checkpoint-2")
    assert killed.kill_reason == "rank 0 printed 'saved checkpoint-2'", killed.describe()
    assert (killed.returncode, killed.returncodes, killed.timed_out) == (137, [137, 137], False), killed.describe()
    after_kill = _checkpoints(out)
    assert {"checkpoint-1", "checkpoint-2"} <= set(after_kill) and all(after_kill.values()), (
        f"a named checkpoint without a manifest after kill -9: {after_kill}")
    newest = max(int(name.split("-")[1]) for name in after_kill)

    resumed = run_script(script, ["--output_dir", str(out), "--max_steps", str(newest + 1), "--resume"],
                         num_processes=2, fsdp_version=2, timeout=JOB_TIMEOUT)
    assert resumed.returncode == 0, resumed.describe()
    for rank, report in enumerate(_reports(resumed)):
        assert (report["rank"], report["resumed"], report["finished"]) == (
            rank, f"checkpoint-{newest}", newest + 1), resumed.describe()
        assert (report["fsdp_version"], report["units"], report["protected"]) == (2, 3, True), report
    assert _checkpoints(out)[f"checkpoint-{newest + 1}"] is True


# --- __main__, sys.argv and sys.path exactly as python gives them ---------------------------------------------

PROBE = '''\
"""The probe's docstring."""
import json
import sys

import helper  # a module next to the script: importable because its directory is first on sys.path


def describe():
    import __main__
    return {"name": __name__, "argv": sys.argv, "file": __file__, "path0": sys.path[0], "doc": __doc__,
            "package": __package__, "spec": __spec__ and [__spec__.name, __spec__.origin], "loader": type(__loader__).__name__,
            "main_is_this": __main__.__dict__ is globals(), "builtins": type(__builtins__).__name__,
            "helper": helper.VALUE, "annotation": type(annotated.__annotations__["x"]).__name__}


def annotated(x: int) -> None:  # no `from __future__ import annotations` here: the annotation is the class
    pass


if __name__ == "__main__":
    print("PROBE " + json.dumps(describe()), flush=True)
    sys.exit(5)
'''


def _probe(text: str) -> dict[str, Any]:
    return json.loads(next(line for line in text.splitlines() if line.startswith("PROBE "))[len("PROBE "):])


@pytest.mark.timeout(600)
def test_argv_main_and_sys_path_are_exactly_those_of_python_script_args(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 'next to the script'\n")
    args = ["a b", "--flag", "-m", "--"]
    native = subprocess.run([sys.executable, "sub/probe.py", *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert native.returncode == 5, native.stderr
    launched = run_script("sub/probe.py", args, cwd=tmp_path, num_processes=1, timeout=JOB_TIMEOUT)
    assert launched.returncode == 5 and launched.returncodes == [5], launched.describe()
    assert _probe(launched.output[0]) == _probe(native.stdout)
    assert _probe(native.stdout)["argv"] == ["sub/probe.py", *args]  # the comparison sees what it compares


ENDING = '''\
import atexit, os, sys, threading

class AbortsInTeardown:
    def __del__(self):  # runs only if the interpreter is torn down (module globals cleared)
        os.abort()

keep = AbortsInTeardown()
release = threading.Event()
atexit.register(lambda: print("atexit handler ran", flush=True))

def late():
    release.wait()
    print("non-daemon thread ended", flush=True)

threading.Thread(target=late).start()
print("unflushed line", end="")  # left in the buffer: the worker flushes it
release.set()
if len(sys.argv) > 1:
    sys.exit(int(sys.argv[1]))
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("code", [None, 0, 4])
def test_a_script_ends_as_under_python_up_to_the_interpreter_teardown(tmp_path: Path, code: int | None) -> None:
    # Success: every exit step python takes runs (non-daemon threads joined, atexit handlers, buffers flushed) and the
    # worker exits 0 without the interpreter's teardown, where PyTorch's gloo threads can abort a finished process
    # (here a __del__ that would abort stands in for it). A failing exit status ends exactly as under python.
    (tmp_path / "ending.py").write_text(ENDING)
    args = [] if code is None else [str(code)]
    native = subprocess.run([sys.executable, "ending.py", *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    launched = run_script("ending.py", args, cwd=tmp_path, num_processes=1, timeout=JOB_TIMEOUT)
    for line in ("unflushed line", "non-daemon thread ended", "atexit handler ran"):
        assert line in launched.output[0] and line in native.stdout, (line, launched.describe(), native.stdout)
    assert native.returncode == -signal.SIGABRT  # python tears the interpreter down: the stand-in aborts
    if code:
        assert launched.returncodes == [128 + signal.SIGABRT], launched.describe()  # the same teardown as python
    else:
        assert launched.returncodes == [0], launched.describe()


@pytest.mark.timeout(600)
def test_the_command_line_runs_a_module_exactly_as_python_dash_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE)
    (tmp_path / "helper.py").write_text("VALUE = 'in the working directory'\n")
    native = subprocess.run([sys.executable, "-m", "probe_module", "x", "--y"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert native.returncode == 5, native.stderr
    monkeypatch.chdir(tmp_path)
    code = cli_main(["run", "-n", "1", "--timeout", str(JOB_TIMEOUT), "-m", "probe_module", "x", "--y"])
    captured = capsys.readouterr()
    assert code == 5, captured.out + captured.err
    assert "run: rank 0 failed first, exit status 5" in captured.err
    echoed = [line[len("[rank0] "):] for line in captured.out.splitlines() if line.startswith("[rank0] PROBE ")]
    assert len(echoed) == 1, captured.out
    assert _probe(echoed[0]) == _probe(native.stdout)
    assert _probe(native.stdout)["argv"][1:] == ["x", "--y"] and _probe(native.stdout)["spec"][0] == "probe_module"


# --- supervision: failures, timeout, Ctrl-C -------------------------------------------------------------------

BLOCKER = '''\
"""Each rank starts a child process, says so, then blocks forever, except rank --fail-rank, which waits until every
other rank has said so, then exits with --fail-code."""
import argparse
import os
import pathlib
import subprocess
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-code", type=int, default=0)
args = parser.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
directory = pathlib.Path(args.dir)
if rank == args.fail_rank:
    others = [directory / f"child{r}.pid" for r in range(world) if r != rank]
    deadline = time.monotonic() + 240
    while not all(path.exists() for path in others) and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(args.fail_code)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
(directory / f"child{rank}.tmp").write_text(str(child.pid))
(directory / f"child{rank}.tmp").rename(directory / f"child{rank}.pid")
print(f"ready rank {rank} pid {os.getpid()} child {child.pid}", flush=True)
threading.Event().wait()
'''


def _blocker(tmp_path: Path) -> Path:
    path = tmp_path / "blocker.py"
    path.write_text(BLOCKER)
    return path


def _children(tmp_path: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(tmp_path.glob("child*.pid"))]


@pytest.mark.timeout(600)
def test_a_failing_rank_decides_the_exit_status_and_nothing_of_the_job_survives(tmp_path: Path) -> None:
    # Rank 1 exits 3 once rank 0 has started its child and blocks for good: rank 0 must be killed after the grace,
    # its child with it (its process group), and the job's status is rank 1's.
    result = run_script(_blocker(tmp_path), ["--dir", str(tmp_path), "--fail-rank", "1", "--fail-code", "3"],
                        num_processes=2, grace=1.0, timeout=JOB_TIMEOUT, log_dir=tmp_path / "logs")
    assert (result.returncode, result.first_failure, result.returncodes) == (3, 1, [137, 3]), result.describe()
    assert result.killed_after_grace == [0] and not result.timed_out and result.kill_reason is None
    assert "rank 1 failed first, exit status 3" in result.summary()
    children = _children(tmp_path)
    assert len(children) == 1 and f"child {children[0]}" in result.output[0]
    assert [pid for pid in children if _alive(pid)] == [], "a process the script started outlived the job"
    assert [(tmp_path / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)] == result.output


@pytest.mark.timeout(600)
def test_the_timeout_kills_every_worker(tmp_path: Path) -> None:
    result = run_script(_blocker(tmp_path), ["--dir", str(tmp_path)], num_processes=2, timeout=6.0)
    assert result.timed_out and result.returncode == 124, result.describe()
    assert all(code != 0 for code in result.returncodes), result.describe()
    assert "timed out after" in result.summary()
    assert [pid for pid in _children(tmp_path) if _alive(pid)] == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_the_command_line_echoes_each_rank_and_ctrl_c_or_sigterm_kills_the_whole_job(
        tmp_path: Path, signum: int, status: int, said: str) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "accelerate_txn.testing", "run", "-n", "2", "--timeout",
         str(JOB_TIMEOUT), str(_blocker(tmp_path)), "--dir", str(tmp_path)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    ready: dict[int, str] = {}
    lines: list[str] = []
    try:
        for line in launcher.stdout:  # ends at EOF if the launcher dies: pytest's timeout bounds a hang
            lines.append(line)
            for rank in (0, 1):
                if line.startswith(f"[rank{rank}] ready rank {rank} "):
                    ready[rank] = line
            if len(ready) == 2:
                break
        assert len(ready) == 2, "".join(lines) + launcher.stderr.read()
        launcher.send_signal(signum)
        try:
            _, stderr = launcher.communicate(timeout=240)  # a hang guard only
        except subprocess.TimeoutExpired:  # say where the launcher hangs: faulthandler prints every thread's stack
            launcher.send_signal(signal.SIGABRT)
            _, stderr = launcher.communicate(timeout=60)
            pytest.fail(f"the launcher did not end within 240 s of the signal; its threads:\n{stderr}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == status, stderr
    assert f"{said}: every worker was killed" in stderr
    workers = [int(ready[rank].split(" pid ")[1].split()[0]) for rank in (0, 1)]
    assert [pid for pid in workers + _children(tmp_path) if _alive(pid)] == []
    assert len(_children(tmp_path)) == 2


# --- refusals: before any process starts ------------------------------------------------------------------------

def test_bad_options_are_refused_before_any_process_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "never_run.py"
    script.write_text("raise SystemExit('must not run')\n")
    with pytest.raises(CheckpointConfigurationError, match=r"LOCAL_STATE_DICT.*does not protect LOCAL_STATE_DICT.*"
                       r"SHARDED_STATE_DICT or FULL_STATE_DICT"):
        run_script(script, state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(CheckpointConfigurationError, match=r"state_dict_type='half': use one of SHARDED_STATE_DICT, "
                       r"FULL_STATE_DICT\."):
        run_script(script, fsdp_version=2, state_dict_type="half")
    with pytest.raises(CheckpointConfigurationError, match=r"fsdp_version=3: use 1 \(FSDP1\) or 2"):
        run_script(script, fsdp_version=3)
    with pytest.raises(CheckpointConfigurationError, match=r"auto_wrap='Linear': give the module class"):
        run_script(script, auto_wrap="Linear")
    with pytest.raises(ValueError, match=r"num_processes=0: give the number of worker processes"):
        run_script(script, num_processes=0)
    with pytest.raises(FileNotFoundError, match=r"missing.py: no such script"):
        run_script("missing.py", cwd=tmp_path)
    with pytest.raises(ValueError, match=r"never_run.py exists already, so the job would be killed at once"):
        run_script(script, kill_on_path=script)
    with pytest.raises(CheckpointConfigurationError, match=r"ranks_per_node=3: give the ranks of one emulated node "
                       r"\(an FSDP1 hybrid shard group\), a divisor of num_processes=4"):
        run_script(script, num_processes=4, ranks_per_node=3)
    with pytest.raises(CheckpointConfigurationError, match=r"the sizes multiply to 4, but the job has num_processes=2"):
        run_script(script, num_processes=2, parallelism={"dp_replicate_size": 2, "dp_shard_size": 2})
    with pytest.raises(CheckpointConfigurationError, match=r"give sizes .* of dp_replicate_size.*unknown: \['dp_size'\]"):
        run_script(script, num_processes=2, parallelism={"dp_size": 2})
    with pytest.raises(CheckpointConfigurationError, match=r"a ParallelismConfig mesh needs FSDP2"):
        run_script(script, num_processes=4, fsdp_version=1, parallelism={"dp_replicate_size": 2, "dp_shard_size": 2})

    with pytest.raises(SystemExit) as exited:
        cli_main(["run", "--state-dict-type", "LOCAL_STATE_DICT", str(script)])
    assert exited.value.code == 2
    assert "run: error: state_dict_type='LOCAL_STATE_DICT'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli_main(["run", "--fsdp-version", "3", str(script)])
    assert exited.value.code == 2 and "invalid choice: 3" in capsys.readouterr().err


def test_the_plugin_a_script_passes_is_kept_where_it_can_run_on_cpu_and_overridden_where_asked() -> None:
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    from accelerate_txn.testing._cpu_fsdp import plugin_for_script

    own = FullyShardedDataParallelPlugin(fsdp_version=1)  # Accelerate's FSDP1 default: FULL_STATE_DICT, which runs
    assert plugin_for_script(own).state_dict_type.name == "FULL_STATE_DICT"
    local = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(CheckpointConfigurationError, match=r"The script's FullyShardedDataParallelPlugin with "
                       r"state_dict_type LOCAL_STATE_DICT .*does not protect.*--state-dict-type SHARDED_STATE_DICT"):
        plugin_for_script(local)
    own.sync_module_states = True  # what a GPU script asks for (built on CPU, Accelerate would raise)
    kept = plugin_for_script(own, state_dict_type="SHARDED_STATE_DICT")
    assert kept is own and kept.state_dict_type.name == "SHARDED_STATE_DICT"
    assert type(kept.state_dict_config).__name__ == "ShardedStateDictConfig", "a FULL config left under SHARDED"
    assert type(kept.optim_state_dict_config).__name__ == "ShardedOptimStateDictConfig"
    assert (kept.sync_module_states, kept.cpu_ram_efficient_loading, kept.auto_wrap_policy) == (False, False, None)
    assert isinstance(plugin_for_script(own, auto_wrap=torch.nn.Linear).auto_wrap_policy, ModuleWrapPolicy)
    with pytest.raises(CheckpointConfigurationError, match=r"fsdp_version=1, \.\.\.\)\) but the launcher was asked "
                       r"for FSDP2\. Leave out the launcher's fsdp_version"):
        plugin_for_script(own, fsdp_version=2)
    default = plugin_for_script(None, fsdp_version=2)  # no plugin of the script: fsdp_accelerator's defaults
    assert (default.fsdp_version, default.state_dict_type.name, default.auto_wrap_policy,
            default.transformer_cls_names_to_wrap) == (2, "SHARDED_STATE_DICT", transformer_auto_wrap_policy, ["Linear"])


def test_fsdp1_hybrid_sharding_on_cpu_makes_nodes_that_divide_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from torch.distributed.fsdp import ShardingStrategy

    from accelerate_txn.testing._cpu_fsdp import RANKS_PER_NODE_ENV, hybrid_ranks_per_node, make_plugin

    monkeypatch.delenv(RANKS_PER_NODE_ENV, raising=False)
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        hybrid = SimpleNamespace(fsdp_version=1, sharding_strategy=strategy)
        assert hybrid_ranks_per_node(hybrid, 4) == 2  # default: two replicas
        assert hybrid_ranks_per_node(hybrid, 4, 4) == 4
    with pytest.raises(CheckpointConfigurationError, match=r"FSDP1 _HYBRID_SHARD_ZERO2 on CPU: 3 ranks per node do "
                       r"not divide the 4 ranks into equal nodes; give ranks_per_node"):
        hybrid_ranks_per_node(hybrid, 4, 3)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "1")  # what the launcher's ranks_per_node (--ranks-per-node) sets
    assert hybrid_ranks_per_node(hybrid, 4) == 1
    full = SimpleNamespace(fsdp_version=1, sharding_strategy=ShardingStrategy.FULL_SHARD)
    assert hybrid_ranks_per_node(full, 4) is None
    with pytest.raises(CheckpointConfigurationError, match=r"ranks_per_node=2 applies to FSDP1 hybrid sharding only "
                       r"\(sharding_strategy HYBRID_SHARD or _HYBRID_SHARD_ZERO2\); this plugin shards with FULL_SHARD"):
        hybrid_ranks_per_node(full, 4, 2)
    assert make_plugin(sharding_strategy="hybrid_shard").sharding_strategy is ShardingStrategy.HYBRID_SHARD
    with pytest.raises(CheckpointConfigurationError, match=r"sharding_strategy='HYBRID_SHARD' is FSDP1's setting; "
                       r"FSDP2 hybrid sharding is a ParallelismConfig"):
        make_plugin(fsdp_version=2, sharding_strategy="HYBRID_SHARD")


_MESH_SCRIPT = """
import json, os, sys
import torch
import accelerate_txn
from accelerate import Accelerator

accelerator = Accelerator()
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
optimizer.zero_grad()
accelerator.save_state(sys.argv[1])
weight = next(model.parameters())
print("REPORT " + json.dumps({"mesh": list(accelerator.torch_device_mesh.shape),
                              "names": list(accelerator.torch_device_mesh.mesh_dim_names),
                              "placements": [str(p) for p in weight.placements]}))
"""


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_command_line_builds_an_hsdp_mesh_from_accelerate_launchs_parallelism_sizes(tmp_path: Path) -> None:
    script = tmp_path / "mesh.py"
    script.write_text(_MESH_SCRIPT)
    out = tmp_path / "checkpoint"
    completed = subprocess.run(
        [sys.executable, "-m", "accelerate_txn.testing", "run", "-n", "4", "--fsdp-version", "2",
         "--dp-replicate-size", "2", "--dp-shard-size", "2", "--timeout", str(JOB_TIMEOUT), str(script), str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=JOB_TIMEOUT + 60, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in completed.stdout.splitlines() if "REPORT " in line]
    assert len(reports) == 4
    assert all(report == {"mesh": [2, 2], "names": ["dp_replicate", "dp_shard"],
                          "placements": ["R", "S(0)"]} for report in reports), reports
    manifest = json.loads((out / "checkpoint_manifest.json").read_text())
    assert manifest["components"][""]["models"][0]["fsdp"] == [
        {"fsdp_version": 2, "mesh": [2, 2], "mesh_dims": ["dp_replicate", "dp_shard_cp"]}]
