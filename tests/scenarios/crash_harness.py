"""Parent side of the crash-consistency tests: start a real 2-rank job, kill it with ``SIGKILL``, read what it
observed, and the seeded random-instant sweep (``make crash-sweep`` runs :func:`sweep` via tests/crash_sweep.py).

A job is ``WORLD`` processes started with ``subprocess.Popen`` and the environment torchrun gives its workers
(MASTER_ADDR/PORT, RANK, WORLD_SIZE, ...); each runs :func:`tests.scenarios.crash_scenarios.main`. Every wait has a
deadline (:data:`LAUNCH_TIMEOUT` per job): a hang fails the test, after the ranks dumped their stacks into their
logs (``SIGUSR1``, see ``main``). Synchronisation is by polling the filesystem and the processes' exit status,
with a deadline; the only sleep that is not a poll interval is the random delay that chooses the kill instant.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate_txn.testing import free_port
from tests.scenarios.crash_scenarios import asynchronous, directory_report, ref_path, write_json

WORLD = 2
LAUNCH_TIMEOUT = 600.0  # a hang guard per job: the 7 jobs of a chain took 220 s in all on 2 heavily loaded cores
# After one rank is killed, the others must fail on their own within this (no hang). A hang guard only: the
# survivors learn of the death at once (their peer's sockets close), so a correct run takes seconds even on a loaded
# machine; counted from that death, not from the launch, so a slow start never shortens it.
SURVIVOR_TIMEOUT = 120.0
POLL = 0.02
REPO = Path(__file__).resolve().parents[2]
KILLED = -signal.SIGKILL


@dataclass
class JobResult:
    """How each rank ended and what it observed."""

    returncodes: list[int | None]
    obs: list[dict[str, Any]]
    logs: list[str]
    seconds: float
    first_dead: int | None = None          # the rank that died first (killed at its crash point, or failed)
    survivors_exited: dict[int, int] = field(default_factory=dict)  # rank -> exit code, ended on their own
    survivors_killed: list[int] = field(default_factory=list)        # ranks the harness had to SIGKILL

    def describe(self) -> str:
        tails = "\n".join(f"--- rank {r} (exit {code}) log tail ---\n{log[-3000:]}"
                          for r, (code, log) in enumerate(zip(self.returncodes, self.logs)))
        return f"exit codes {self.returncodes} after {self.seconds:.1f}s\n{tails}"


class Job:
    """One launched 2-rank job: ``WORLD`` real processes in one gloo process group."""

    def __init__(self, spec: dict[str, Any], directory: Path, name: str, entry: str = "tests.scenarios.crash_scenarios") -> None:
        self.directory = Path(directory)
        self.name = name
        self.obs_dir = self.directory / "obs" / name
        spec = {**spec, "obs": str(self.obs_dir)}
        spec_path = self.directory / "specs" / f"{name}.json"
        write_json(spec_path, spec)
        port = free_port()
        self.log_paths = [self.directory / "logs" / f"{name}.rank{rank}.log" for rank in range(WORLD)]
        self.log_paths[0].parent.mkdir(parents=True, exist_ok=True)
        code = f"from {entry} import main; main({str(spec_path)!r})"  # entry: the ranks' module (FSDP1 default)
        env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_TXN_KILL_AT"}
        self.started = time.monotonic()
        self.deadline = self.started + LAUNCH_TIMEOUT
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(WORLD):
            with self.log_paths[rank].open("wb") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-c", code], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                    env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                         "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
                         "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}))

    def alive(self) -> list[int]:
        return [rank for rank, p in enumerate(self.processes) if p.poll() is None]

    def _timeout(self, what: str) -> None:
        self.kill_all(dump_stacks=True)
        raise AssertionError(f"job {self.name}: {what} within {LAUNCH_TIMEOUT:.0f}s\n{self.result().describe()}")

    def wait_first_exit(self) -> int:
        """The rank that exits first (polling with the job's deadline)."""
        while True:
            for rank, process in enumerate(self.processes):
                if process.poll() is not None:
                    return rank
            if time.monotonic() > self.deadline:
                self._timeout("no rank exited")
            time.sleep(POLL)

    def wait_all(self, limit: float | None = None) -> list[int]:
        """Wait for every rank to exit (up to ``limit`` seconds from now, else up to the job's deadline); the ranks
        still alive."""
        end = time.monotonic() + limit if limit is not None else self.deadline
        while self.alive() and time.monotonic() < end:
            time.sleep(POLL)
        if limit is None and self.alive():
            self._timeout("the ranks did not all exit")
        return self.alive()

    def wait_for_file(self, path: Path) -> None:
        """Poll for ``path`` (written by a rank); fails if a rank exits first or the deadline passes."""
        while not path.exists():
            if len(self.alive()) < WORLD:
                self.kill_all()
                raise AssertionError(f"job {self.name}: a rank exited before writing {path}\n"
                                     f"{self.result().describe()}")
            if time.monotonic() > self.deadline:
                self._timeout(f"{path} did not appear")
            time.sleep(POLL)

    def kill_all(self, dump_stacks: bool = False) -> None:
        alive = [self.processes[rank] for rank in self.alive()]
        if dump_stacks and alive:
            for process in alive:
                process.send_signal(signal.SIGUSR1)
            try:
                alive[0].wait(timeout=2.0)  # a moment for the stack dumps (a hung rank does not exit)
            except subprocess.TimeoutExpired:
                pass
        for process in alive:
            process.send_signal(signal.SIGKILL)
        for process in alive:
            process.wait(timeout=120)  # a hang guard only: a SIGKILLed process exits once the kernel frees it

    def result(self) -> JobResult:
        obs = []
        for rank in range(WORLD):
            path = self.obs_dir / f"rank{rank}.json"
            obs.append(json.loads(path.read_text()) if path.exists() else {})
        logs = [p.read_text(errors="replace") if p.exists() else "" for p in self.log_paths]
        return JobResult([p.poll() for p in self.processes], obs, logs, time.monotonic() - self.started)


def run_to_completion(spec: dict[str, Any], directory: Path, name: str,
                      entry: str = "tests.scenarios.crash_scenarios") -> JobResult:
    """A job that must finish normally on every rank."""
    job = Job(spec, directory, name, entry)
    job.wait_all()
    result = job.result()
    assert result.returncodes == [0] * WORLD, f"job {name} failed\n{result.describe()}"
    return result


def run_until_crash_point(spec: dict[str, Any], directory: Path, name: str, whole_job: bool,
                          entry: str = "tests.scenarios.crash_scenarios") -> JobResult:
    """A job with a crash point armed: wait for the first rank to die; then, like torchrun, SIGKILL the rest
    (``whole_job``), or give the surviving ranks :data:`SURVIVOR_TIMEOUT` to fail on their own (every rank must
    raise, none may hang) and SIGKILL whichever did not."""
    job = Job(spec, directory, name, entry)
    first = job.wait_first_exit()
    survivors_exited: dict[int, int] = {}
    if whole_job:
        job.kill_all()
    else:
        stuck = job.wait_all(SURVIVOR_TIMEOUT)
        survivors_exited = {rank: job.processes[rank].returncode for rank in range(WORLD)
                            if rank != first and rank not in stuck}
        job.kill_all(dump_stacks=True)
    result = job.result()
    result.first_dead = first
    result.survivors_exited = survivors_exited
    result.survivors_killed = [] if whole_job else [r for r in range(WORLD) if r != first and r not in survivors_exited]
    return result


def run_until_killed_after(spec: dict[str, Any], directory: Path, name: str, started: str, delay: float,
                           entry: str = "tests.scenarios.crash_scenarios") -> tuple[JobResult, list[int]]:
    """A job whose every rank is SIGKILLed ``delay`` seconds after the file ``started`` (relative to the job's
    ``obs`` directory, written by a rank when its loop begins) appeared, as when a node is lost. Returns the result
    and the ranks that had already exited before the kill (a job that ended early: no kill at that instant)."""
    job = Job(spec, directory, name, entry)
    job.wait_for_file(job.obs_dir / started)
    kill_at = time.monotonic() + delay
    while time.monotonic() < kill_at and len(job.alive()) == WORLD:
        time.sleep(min(POLL, max(0.0, kill_at - time.monotonic())))
    early = [rank for rank in range(WORLD) if rank not in job.alive()]
    job.kill_all()
    return job.result(), early


# --- invariants after a kill ----------------------------------------------------------------------------------

def returned_save(root: Path) -> int | None:
    """The newest checkpoint whose save returned on rank 0 before the kill (a lower bound: the kill may land
    between the return and this record)."""
    path = Path(root) / "progress.rank0.json"
    return json.loads(path.read_text())["returned"] if path.exists() else None


def crash_invariants(root: Path) -> tuple[dict[str, Any], list[str]]:
    """File-level checks right after a kill: every ``checkpoint_N`` present verifies completely (every hash),
    no checkpoint whose save returned (asynchronous saves: that was published) and that retention keeps is lost,
    automatic selection names the newest complete one, and every complete one has its reference state. Returns
    the report and the violations."""
    report = directory_report(Path(root) / "checkpoints")
    complete = report["complete"]
    problems = [f"{name} is present but not a complete checkpoint: {why}" for name, why in report["broken"].items()]
    returned = returned_save(root)
    newest = max(complete) if complete else None
    if returned is not None and asynchronous():
        # An asynchronous save returns once staged: its return proves the previous one published (every save
        # waits for the one in flight first), not itself. Retention runs only after a publish.
        if returned >= 1 and returned - 1 not in complete:
            problems.append(f"checkpoint_{returned - 1} (published before save {returned} returned) is lost: "
                            f"complete {complete}")
        if newest is not None and newest not in (returned - 1, returned, returned + 1):
            problems.append(f"newest complete checkpoint_{newest}, but the last returned save was {returned}")
    elif returned is not None:
        if returned not in complete:
            problems.append(f"checkpoint_{returned} (its save returned) is lost: complete {complete}")
        if newest is not None and newest not in (returned, returned + 1):
            problems.append(f"newest complete checkpoint_{newest}, but the last returned save was {returned}")
        if newest == returned and returned >= 1 and returned - 1 not in complete:
            problems.append(f"checkpoint_{returned - 1} is lost although no newer one than checkpoint_{returned} "
                            f"was published (total_limit keeps two): complete {complete}")
    elif complete not in ([], [0]):
        problems.append(f"no save returned, yet complete checkpoints {complete}")
    expected = f"checkpoint_{newest}" if newest is not None else None
    if report["selected"] != expected:
        problems.append(f"automatic selection picks {report['selected']}, the newest complete is {expected}")
    for number in complete:
        for rank in range(WORLD):
            if not ref_path(root, number, rank).exists():
                problems.append(f"checkpoint_{number} has no reference state of rank {rank}")
    report["returned"] = returned
    return report, problems


def restart_problems(obs: list[dict[str, Any]], expected_selected: str | None) -> list[str]:
    """What a restart (``crash_scenarios._resume``) must show: the expected checkpoint selected and restored
    exactly on every rank, the next save published, every leftover removed after it, nothing broken."""
    problems = []
    for rank, rank_obs in enumerate(obs):
        resume = rank_obs.get("resume")
        if resume is None:
            problems.append(f"rank {rank} recorded no restart observations")
            continue
        if resume["selected"] != expected_selected:
            problems.append(f"rank {rank} restored {resume['selected']}, expected {expected_selected}")
        if resume.get("differences"):
            problems.append(f"rank {rank}: restore not exact: {resume['differences']}")
    after = (obs[0].get("resume") or {}).get("after_next_save")
    if after is not None:
        next_save = obs[0]["resume"]["next_save"]
        if next_save not in [f"checkpoint_{n}" for n in after["complete"]]:
            problems.append(f"the next save {next_save} is not a complete checkpoint: {after}")
        if after["leftovers"]:
            problems.append(f"leftovers remain after the next save: {after['leftovers']}")
        if after["broken"]:
            problems.append(f"broken checkpoints after the next save: {after['broken']}")
        if after["selected"] != next_save:
            problems.append(f"after the next save, selection picks {after['selected']}, not {next_save}")
        if expected_selected is not None and expected_selected not in [f"checkpoint_{n}" for n in after["complete"]]:
            problems.append(f"the restored {expected_selected} was lost by the next save's retention: {after}")
    return problems


# --- the seeded random-instant sweep --------------------------------------------------------------------------

WINDOW_STEPS = 5.0  # the kill instant is uniform over this many train+save steps from the loop's start
SWEEP_SAVES = None  # saves per trial loop: until killed, so every trial is killed mid-loop whatever the step time


@dataclass
class Trial:
    index: int
    delay: float
    window: float
    report: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def had_complete(self) -> bool:
        return bool(self.report.get("complete"))


def trial_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"crash-sweep:{seed}:{index}")



# --------------------------------------------------------------------------------------------- kill chains


@dataclass(frozen=True)
class Link:
    """One kill in a chain: where (``NAME`` or ``NAME@RANK``), whether the whole job dies, which checkpoints are
    complete right after it, and the spec of the job it kills."""

    kill_spec: str
    whole_job: bool
    complete_after: list[int]
    spec: dict[str, Any] = field(default_factory=dict)

    @property
    def point(self) -> str:
        return self.kill_spec.split("@")[0]

    @property
    def killed_rank(self) -> int | None:
        return int(self.kill_spec.split("@")[1]) if "@" in self.kill_spec else None

    @property
    def id(self) -> str:
        return f"{self.point}-{'whole-job' if self.whole_job else f'rank{self.killed_rank}'}"


@dataclass
class Outcome:
    link: Link
    kill: JobResult
    report: dict[str, Any]             # the checkpoint directory right after the kill (directory_report)
    problems: list[str]                # crash_invariants' violations
    restart: JobResult | None = None   # the job that restarts from this kill (a killed restore is no restart)


def _link_spec(link: Link, root: Path) -> dict[str, Any]:
    spec = {key: value for key, value in link.spec.items() if key != "fresh"}
    spec["kill_spec"] = link.kill_spec
    if link.point.startswith("load:"):
        spec.update(resume=str(root), kill_load=link.kill_spec)
    elif link.spec.get("fresh"):
        spec.update(fresh=str(root), seed=0)
    else:
        spec["resume"] = str(root)
    return spec


def run_chain(links: tuple[Link, ...], directory: Path, key: Callable[[Link], str],
              entry: str = "tests.scenarios.crash_scenarios") -> dict[str, Outcome | BaseException]:
    """Run every kill of ``links`` in one run directory (``directory / "run"``), each job restarting from the
    previous kill, then a final restart; ``{key(link): Outcome}``. A job that hung or failed becomes the outcome of
    every link not yet checked."""
    root = Path(directory) / "run"
    outcomes: dict[str, Outcome | BaseException] = {}
    waiting: list[Outcome] = []  # kills whose restart has not run yet (a killed restore is no restart)
    try:
        for index, link in enumerate(links):
            kill = run_until_crash_point(_link_spec(link, root), directory, f"link{index}", link.whole_job, entry)
            if not link.point.startswith("load:"):
                for outcome in waiting:
                    outcome.restart = kill
                waiting.clear()
            report, problems = crash_invariants(root)
            waiting.append(Outcome(link, kill, report, problems))
            outcomes[key(link)] = waiting[-1]
        final = run_to_completion({"resume": str(root)}, directory, "final", entry)
        for outcome in waiting:
            outcome.restart = final
    except AssertionError as exc:
        for link in links:
            outcomes.setdefault(key(link), exc)
    return outcomes


def sweep(directory: Path, trials: int, seed: int, log: Callable[[str], None] = print,
          entry: str = "tests.scenarios.crash_scenarios") -> list[Trial]:
    """``trials`` random-instant whole-job kills, each in a fresh run directory, each verified by a restart.

    Job ``j`` restarts trial ``j - 1`` (selection, exact restore, next save, leftovers) and then trains trial
    ``j`` from scratch until the harness SIGKILLs every rank at an instant drawn from ``(seed, j)``, uniform
    over :data:`WINDOW_STEPS` train+save steps from the start of the loop; the step time is measured (job 0
    calibrates, every restart times its next save). ``trials + 1`` launches in all.
    """
    directory = Path(directory)
    done: list[Trial] = []
    step_times: list[float] = []
    for job_index in range(trials + 1):
        spec: dict[str, Any] = {}
        if job_index == 0:
            spec["calibrate"] = str(directory / "calibration")
        else:
            spec["resume"] = str(directory / f"trial{job_index - 1}")
        if job_index < trials:
            spec.update(fresh=str(directory / f"trial{job_index}"), seed=seed + job_index, saves=SWEEP_SAVES)
        job = Job(spec, directory, f"job{job_index}", entry)
        root = directory / f"trial{job_index}"
        try:
            if job_index < trials:
                job.wait_for_file(root / "loop-started.json")
            else:
                job.wait_all()
        except AssertionError as exc:  # this job failed before its trial began: record it, go on with the next
            if done:
                done[-1].problems.append(f"its restart failed: {exc}")
            if job_index < trials:
                done.append(Trial(job_index, 0.0, 0.0, problems=[f"the job never started its loop: {exc}"]))
            continue
        result = job.result()
        step_times += [o["step_seconds"] for o in result.obs if "step_seconds" in o]
        step_times += [o["resume"]["next_save_seconds"] for o in result.obs if "resume" in o]
        if job_index > 0 and not done[-1].report:  # the previous trial never began: nothing to restart
            pass
        elif job_index > 0:  # the restart of the previous trial
            previous = done[-1]
            expected = previous.report.get("selected")
            previous.problems += restart_problems(result.obs, expected)
            log(f"trial {previous.index}: killed {previous.delay:.2f}s into a {previous.window:.2f}s window, "
                f"complete {previous.report.get('complete')}, restart "
                f"{'OK' if not previous.problems else 'FAILED: ' + '; '.join(previous.problems)}")
        if job_index == trials:
            if result.returncodes != [0] * WORLD:
                done[-1].problems.append(f"the last restart failed\n{result.describe()}")
            break
        if job_index > 0 and [o.get("resume") is not None for o in result.obs] != [True] * WORLD:
            done[-1].problems.append(f"the restart did not complete\n{result.describe()}")
        window = WINDOW_STEPS * statistics.median(step_times)
        delay = trial_rng(seed, job_index).uniform(0.0, window)
        kill_at = time.monotonic() + delay
        while time.monotonic() < kill_at and len(job.alive()) == WORLD:
            time.sleep(min(POLL, max(0.0, kill_at - time.monotonic())))
        early = [rank for rank in range(WORLD) if rank not in job.alive()]
        job.kill_all()
        trial = Trial(job_index, delay, window)
        if early:
            trial.problems.append(f"rank(s) {early} exited before the kill\n{job.result().describe()}")
        trial.report, problems = crash_invariants(root)
        trial.problems += problems
        done.append(trial)
    return done


def summary(trials: list[Trial]) -> str:
    failed = [t for t in trials if t.problems]
    lines = [f"crash sweep: {len(trials)} trials, {sum(t.had_complete for t in trials)} with a complete checkpoint "
             f"at the kill, {len(failed)} failed"]
    for trial in failed:
        lines.append(f"  trial {trial.index} (kill after {trial.delay:.2f}s): " + "; ".join(trial.problems))
    return "\n".join(lines)
