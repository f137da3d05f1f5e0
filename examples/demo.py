"""accelerate-txn demo: 2-process FSDP training on CPU, kill -9 in the middle of a save, resume, lose nothing.

Phases (each a real 2-rank gloo job of ``examples/demo_train.py``, started here with torchrun's environment):

1. reference: an uninterrupted run of ``STEPS`` steps that never saves: what the training computes when nothing
   interrupts it (so a save that changed the training would show as a difference too);
2. crash: the same run in a fresh project, ``save_state()`` every ``SAVE_EVERY`` steps; during save number
   ``CRASH_AT_SAVE`` rank 0 blocks inside a save pre-hook (the staging directory exists, the manifest is not
   written). Once its marker appears every process of the job gets SIGKILL, and the directory is listed: the
   complete checkpoints plus the hidden staging leftover;
3. resume: the job restarts in the same project and calls ``load_state()`` with no argument, which selects the
   newest *complete* checkpoint, then trains on to ``STEPS``; its next save must succeed and clean the leftover;
4. proof: final parameters, optimizer state, scheduler, RNG and data-stream state of every rank, and the loss
   of every step after the resume point, are compared bitwise with the reference run.

Where the time goes (about 18 CPU-seconds in all): three jobs of two ranks, each rank a fresh interpreter that
imports torch, Accelerate and FSDP (about 2 of its 2.5 CPU-seconds), plus this process's own imports and the
proof; and five saves (two complete and one killed in the crash job, two after the resume), each written and
fsynced by both ranks. On 2 cores with other work running it took 17 s; under heavy load, several times that.

Exit status: 0 if nothing was lost, 1 if anything differs, 2 if a job failed or timed out.
Usage: ``python examples/demo.py --output demo-output``
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

# Run this checkout's library (also in the ranks, via PYTHONPATH), even where the installed copy is stale.
REPO = Path(__file__).resolve().parents[1]
if (REPO / "accelerate_txn" / "__init__.py").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from accelerate_txn import MANIFEST  # noqa: E402
from accelerate_txn.store.posix import LOCK_NAME  # noqa: E402
from accelerate_txn.testing import free_port  # noqa: E402

WORLD_SIZE = 2
STEPS = 12
SAVE_EVERY = 3
CRASH_AT_SAVE = 3
JOB_TIMEOUT = 300.0  # seconds, per job: a hang guard only (a job takes seconds; a loaded 2-core machine, ~50 s)
KILL_TIMEOUT = 60.0  # a hang guard only: a SIGKILLed process exits once the kernel frees it
POLL = 0.05
WORKER = Path(__file__).resolve().with_name("demo_train.py")
VERDICT = "lost nothing: parameters and optimizer state bitwise identical to the uninterrupted run"
MAX_SHOWN = 15  # differences listed on failure


class DemoFailure(RuntimeError):
    """A job failed, hung or did something the demo did not expect (exit status 2)."""


def say(text: str = "") -> None:
    """Print one progress line immediately."""
    print(text, flush=True)


class Job:
    """``WORLD_SIZE`` rank processes of ``demo_train.py``, each with the environment torchrun would give it."""

    def __init__(self, name: str, output: Path, worker_args: list[str]) -> None:
        self.name = name
        self.logs = [output / "logs" / f"{name}_rank{rank}.log" for rank in range(WORLD_SIZE)]
        self.processes: list[subprocess.Popen[bytes]] = []
        port = free_port()
        for rank in range(WORLD_SIZE):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            self.logs[rank].parent.mkdir(parents=True, exist_ok=True)
            with self.logs[rank].open("wb") as log:
                command = [sys.executable, str(WORKER), *worker_args,
                           "--result", str(output / "results" / f"{name}_rank{rank}.pt")]
                self.processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL))

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, rank order."""
        return [process.pid for process in self.processes]

    def failed(self) -> str | None:
        """A description of the first rank that exited with an error, or ``None``."""
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code not in (None, 0):
                return f"{self.name}: rank {rank} exited with status {code}"
        return None

    def wait(self, timeout: float = JOB_TIMEOUT) -> None:
        """Wait for every rank to exit successfully; kill the job on a failure or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in self.processes):
            problem = self.failed()
            if problem is None and time.monotonic() > deadline:
                problem = f"{self.name}: still running after {timeout:.0f}s (hung?)"
            if problem is not None:
                self.kill()
                raise DemoFailure(problem)
            time.sleep(POLL)
        problem = self.failed()
        if problem is not None:
            raise DemoFailure(problem)

    def kill(self) -> None:
        """SIGKILL every rank that is still alive and reap it (bounded wait)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        for process in self.processes:
            try:
                process.wait(timeout=KILL_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise DemoFailure(f"{self.name}: pid {process.pid} survived SIGKILL for {KILL_TIMEOUT:.0f}s") from None

    def tail(self, lines: int = 25) -> str:
        """The last lines of every rank's log, for failure reports."""
        parts = []
        for rank, log in enumerate(self.logs):
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"--- {self.name} rank {rank} ({log}) ---\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)


def lock_is_free(checkpoints: Path) -> bool:
    """Whether the library's OS lock on ``checkpoints`` can be taken right now (it is released at once)."""
    with (checkpoints / LOCK_NAME).open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def short_name(name: str) -> str:
    """A directory name for the listing: a staging directory's two 32-digit ids shortened to the run's first 8."""
    stem, marker, ids = name.partition(".staging-")
    return f"{stem}{marker}{ids[:8]}…" if marker else name


def describe_listing(checkpoints: Path, indent: str = "      ") -> list[str]:
    """Human-readable lines for every entry of a checkpoints directory (names shortened to keep it narrow)."""
    entries = sorted(checkpoints.iterdir(), key=lambda p: p.name.lstrip("."))
    width = max(len(short_name(entry.name)) + 1 for entry in entries)
    lines = []
    for entry in entries:
        shown = short_name(entry.name) + ("/" if entry.is_dir() else "")
        if entry.name == LOCK_NAME:
            what = f"lock file (OS lock {'free' if lock_is_free(checkpoints) else 'HELD'})"
        elif ".staging-" in entry.name:
            what = f"staging leftover ({len(list(entry.rglob('*')))} files, no manifest)"
        elif (entry / MANIFEST).is_file():
            what = "complete (manifest present)"
        else:
            what = "incomplete"
        lines.append(f"{indent}{shown:<{width}}  {what}")
    return lines


def wait_for_marker(job: Job, marker: Path, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
    """Poll until rank 0 writes ``marker`` (the save is in progress); fail if a rank dies or time runs out."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        problem = job.failed()
        if problem is None and any(process.poll() is not None for process in job.processes):
            problem = f"{job.name}: a rank finished without reaching save #{CRASH_AT_SAVE}"
        if problem is None and time.monotonic() > deadline:
            problem = f"{job.name}: save #{CRASH_AT_SAVE} not reached within {timeout:.0f}s"
        if problem is not None:
            job.kill()
            raise DemoFailure(problem)
        time.sleep(POLL)
    return json.loads(marker.read_text())


def train_args(mode: str, project: Path, marker: Path | None = None) -> list[str]:
    """Command-line arguments of ``demo_train.py``."""
    args = ["--mode", mode, "--project", str(project), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--crash-at-save", str(CRASH_AT_SAVE)]
    return args + (["--marker", str(marker)] if marker is not None else [])


def run_job(name: str, output: Path, args: list[str], jobs: list[Job]) -> tuple[Job, float]:
    """Start a job, wait for it, and return it with its wall time."""
    start = time.monotonic()
    job = Job(name, output, args)
    jobs.append(job)
    job.wait()
    return job, time.monotonic() - start


def job_log(output: Path, name: str, rank: int) -> str:
    """One rank's combined stdout and stderr of one job."""
    return (output / "logs" / f"{name}_rank{rank}.log").read_text(errors="replace")


def load_results(output: Path, name: str) -> list[dict[str, Any]]:
    """Every rank's result file of one job (written by ``demo_train.py``, so trusted: full unpickling)."""
    return [torch.load(output / "results" / f"{name}_rank{rank}.pt", weights_only=False)
            for rank in range(WORLD_SIZE)]


def differences(reference: dict[str, Any], resumed: dict[str, Any], from_step: int) -> tuple[list[str], dict[str, int]]:
    """What differs (bitwise) between one rank's reference and resumed results, and how much was compared."""
    bad: list[str] = []
    counts = {"params": 0, "optim": 0, "losses": 0}
    if set(reference["params"]) != set(resumed["params"]):
        bad.append(f"parameter names {sorted(reference['params'])} vs {sorted(resumed['params'])}")
    for name in sorted(set(reference["params"]) & set(resumed["params"])):
        counts["params"] += 1
        if not torch.equal(reference["params"][name], resumed["params"][name]):
            delta = (reference["params"][name] - resumed["params"][name]).abs().max().item()
            bad.append(f"parameter {name} (max abs difference {delta:.3g})")
    if set(reference["optim"]) != set(resumed["optim"]):
        bad.append(f"optimizer state for {sorted(reference['optim'])} vs {sorted(resumed['optim'])}")
    for name in sorted(set(reference["optim"]) & set(resumed["optim"])):
        ours, theirs = reference["optim"][name], resumed["optim"][name]
        for key in sorted(set(ours) | set(theirs)):
            counts["optim"] += 1
            a, b = ours.get(key), theirs.get(key)
            same = torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b
            if not same:
                bad.append(f"optimizer state {name}.{key}")
    for step in range(from_step + 1, STEPS + 1):
        counts["losses"] += 1
        a, b = reference["losses"].get(step), resumed["losses"].get(step)
        if a is None or b is None or a != b:
            bad.append(f"loss at step {step}: {a!r} vs {b!r}")
    sched_a = {k: v for k, v in reference["scheduler"].items() if k != "lr_lambdas"}
    sched_b = {k: v for k, v in resumed["scheduler"].items() if k != "lr_lambdas"}
    if sched_a != sched_b:
        bad.append(f"LR scheduler state {sched_a} vs {sched_b}")
    if not torch.equal(reference["torch_rng"], resumed["torch_rng"]):
        bad.append("torch RNG state (dropout) at the end")
    if not torch.equal(reference["data_rng"], resumed["data_rng"]):
        bad.append("data generator state at the end")
    if reference["final_step"] != resumed["final_step"]:
        bad.append(f"final step {reference['final_step']} vs {resumed['final_step']}")
    return bad, counts


def loss_table(reference: dict[int, float], resumed: dict[int, float], from_step: int,
               indent: str = "      ") -> list[str]:
    """Rank 0's loss of every step after the resume point in both runs, one row per step."""
    lines = [f"{indent}rank 0 loss after the resume point:", f"{indent}  step   reference     resumed"]
    for step in range(from_step + 1, STEPS + 1):
        cells = [f"{run[step]:10.6f}" if step in run else f"{'missing':>10}" for run in (reference, resumed)]
        same = "" if reference.get(step) == resumed.get(step) else "  DIFFERENT"
        lines.append(f"{indent}  {step:>4}  {cells[0]}  {cells[1]}{same}")
    return lines


def fail(message: str, jobs: list[Job]) -> NoReturn:
    """Report an infrastructure failure with the jobs' log tails and exit 2."""
    say(f"\nDEMO FAILED: {message}")
    for job in jobs:
        say(job.tail())
    sys.exit(2)


def demo(output: Path) -> int:
    """Run the four phases; return the exit status (0 nothing lost, 1 something differs)."""
    jobs: list[Job] = []
    try:
        return _phases(output, jobs)
    except DemoFailure as exc:
        fail(str(exc), jobs)
    finally:
        for job in jobs:  # never leave a rank behind, whatever happened
            try:
                job.kill()
            except DemoFailure as exc:
                say(f"warning: {exc}")


def _phases(output: Path, jobs: list[Job]) -> int:
    started = time.monotonic()
    say(f"accelerate-txn demo: {WORLD_SIZE}-process FSDP1 training on CPU (gloo), {STEPS} steps, "
        f"save_state() every {SAVE_EVERY} steps, total_limit=2")
    say(f"everything under {output}/")

    reference_project = output / "reference"
    say(f"[1/4] reference: the same training, never interrupted and never saved, in {reference_project}")
    _, seconds = run_job("reference", output, train_args("reference", reference_project), jobs)
    reference = load_results(output, "reference")
    if any(r["saves"] for r in reference) or (reference_project / "checkpoints").exists():
        raise DemoFailure(f"the reference run saved a checkpoint into {reference_project}")
    say(f"      {seconds:.1f}s: trained steps 1-{reference[0]['final_step']}")

    project = output / "crashed-run"
    checkpoints = project / "checkpoints"
    marker = output / "save-in-progress.json"
    crash_step = CRASH_AT_SAVE * SAVE_EVERY
    say(f"[2/4] crash: same run in {project}; rank 0 blocks inside save #{CRASH_AT_SAVE} (step {crash_step})")
    start = time.monotonic()
    job = Job("crash", output, train_args("crash", project, marker))
    jobs.append(job)
    info = wait_for_marker(job, marker)
    staging = Path(info["save_dir"])
    if ".staging-" not in staging.name or not staging.is_dir():
        raise DemoFailure(f"the blocked save writes into {staging}, not into a staging directory")
    if (staging / MANIFEST).exists():
        raise DemoFailure(f"{staging} already has a manifest: the save is not in progress")
    held = not lock_is_free(checkpoints)
    say(f"      {time.monotonic() - start:.1f}s: save in progress into {short_name(staging.name)} "
        f"(no manifest yet; directory lock {'held' if held else 'NOT held'})")
    if not held:
        raise DemoFailure("the directory lock is not held while a save is in progress")
    say(f"      kill -9 {' '.join(str(pid) for pid in job.pids)} (every process of the job)")
    job.kill()
    codes = [process.returncode for process in job.processes]
    if codes != [-signal.SIGKILL] * WORLD_SIZE:
        raise DemoFailure(f"the crash job's ranks ended with {codes}, not SIGKILL")
    say(f"      on disk after the kill ({checkpoints}):")
    for line in describe_listing(checkpoints):
        say(line)
    complete_before = sorted(p.name for p in checkpoints.iterdir() if (p / MANIFEST).is_file())

    say(f"[3/4] resume: restart in {project}; load_state() with no argument, train on to step {STEPS}")
    _, seconds = run_job("resume", output, train_args("resume", project), jobs)
    resumed = load_results(output, "resume")
    start_step = resumed[0]["start_step"]
    first_save = resumed[0]["saves"][0] if resumed[0]["saves"] else None
    say(f"      {seconds:.1f}s: resumed from {Path(resumed[0]['resumed_from']).name} at step {start_step} "
        f"(newest complete checkpoint; the leftover was not a candidate)")
    say(f"      next automatic name checkpoint_{resumed[0]['next_save_iteration']}")
    for line in job_log(output, "resume", 0).splitlines():
        if "staging directory left by a writer" in line:
            shown = line.strip().replace(f"{checkpoints}/", "").replace(staging.name, short_name(staging.name))
            say(f"      library log: {shown}")

    say("[4/4] proof")
    problems: list[str] = []
    expected_from = complete_before[-1] if complete_before else None
    if Path(resumed[0]["resumed_from"]).name != expected_from:
        problems.append(f"resumed from {resumed[0]['resumed_from']}, expected the newest complete {expected_from}")
    if any(r["start_step"] != start_step for r in resumed):
        problems.append(f"ranks resumed at different steps {[r['start_step'] for r in resumed]}")
    if first_save is None:
        problems.append("the resumed run never saved")
    else:
        ok = first_save["manifest"] and not any(".staging-" in name for name in first_save["listing"])
        say(f"      next save after resume (step {first_save['step']}): published {Path(first_save['path']).name} "
            f"with {MANIFEST}: {'yes' if first_save['manifest'] else 'NO'}")
        say("      the killed saver's lock did not block it")
        say(f"      staging leftover {short_name(staging.name)} cleaned up by that save: "
            f"{'yes' if ok and not staging.exists() else 'NO'}")
        if not ok or staging.exists():
            problems.append(f"after the first save after resume the directory holds {first_save['listing']}")
    final_listing = sorted(p.name for p in checkpoints.iterdir() if p.name != LOCK_NAME)
    say(f"      final checkpoints: {', '.join(final_listing)}")
    if any(".staging-" in name for name in final_listing):
        problems.append(f"staging leftovers remain: {final_listing}")
    for rank, (ours, theirs) in enumerate(zip(reference, resumed)):
        bad, counts = differences(ours, theirs, start_step)
        status = "identical" if not bad else f"{len(bad)} DIFFERENCES"
        say(f"      rank {rank}: {counts['params']} parameter shards, {counts['optim']} optimizer state tensors, "
            f"losses of steps {start_step + 1}-{STEPS},")
        say(f"              scheduler, RNG and data position: {status}")
        problems += [f"rank {rank}: {item}" for item in bad]
    for line in loss_table(reference[0]["losses"], resumed[0]["losses"], start_step):
        say(line)
    say(f"total {time.monotonic() - started:.1f}s")
    if problems:
        say(f"RESULT: something was lost or differs ({len(problems)} findings):")
        for problem in problems[:MAX_SHOWN]:
            say(f"  - {problem}")
        if len(problems) > MAX_SHOWN:
            say(f"  ... and {len(problems) - MAX_SHOWN} more")
        return 1
    say(VERDICT)
    return 0


def main() -> None:
    """Parse ``--output``, start from an empty output directory and run the demo."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("demo-output"), help="everything goes here (emptied)")
    output = parser.parse_args().output.absolute()
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    sys.exit(demo(output))


if __name__ == "__main__":
    main()
