"""Run an unmodified training script on N CPU processes as one FSDP job: the launcher's side.

:func:`start_script` starts ``num_processes`` workers (``_worker.py``), each with the environment torchrun gives
its workers, in a session of its own; :meth:`ScriptJob.wait` supervises them and returns a :class:`ScriptResult`.
Every worker runs the script as ``python script.py ARGS`` would, with FSDP forced on every ``Accelerator`` it
constructs; the launcher never imports the script and never turns accelerate-txn's patch on in the workers (the
script's own ``import accelerate_txn`` does).

Supervision, by the processes' exit statuses polled within deadlines (no step is timed):

* every line a worker prints (stdout and stderr merged) is kept per rank, and optionally echoed as
  ``[rankN] line`` and written to ``rankN.log``; the echo carries one rank prefix per line: PyTorch's own
  ``[rankN]:`` (its ``sys.excepthook`` after ``init_process_group``, its logging) is replaced by the launcher's;
* a setting the harness refuses inside a worker (the script's own plugin with ``LOCAL_STATE_DICT``, say) ends that
  worker with status 2 and a one-line message in a file of its own; the result carries it once (``refusal``);
* the first worker that fails decides the exit status; the others get ``grace`` seconds to end on their own (they
  usually fail at their next collective), then are killed: nothing waits forever on a dead peer;
* after ``timeout`` seconds the workers' stacks are dumped into their output (``SIGUSR1``) and the job is killed;
* a kill trigger (``kill_on_output``, ``kill_on_path``) or :meth:`ScriptJob.kill` sends ``SIGKILL`` to the whole
  job at once, as a kill test needs;
* on every way out (success, failure, timeout, Ctrl-C) each worker's whole process group is killed and reaped, so
  nothing the script started (data-loader workers, helpers) outlives the job;
* if the launching process itself is killed (``kill -9`` too), each worker kills its process group as soon as it
  sees its lifeline close (``_lifeline.py``, shared with :func:`~accelerate_txn.testing.launch`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import CheckpointConfigurationError
from ._cpu_fsdp import (
    RANKS_PER_NODE_ENV,
    REFUSAL_FILE_ENV,
    STATE_DICT_TYPES,
    UNSUPPORTED_STATE_DICT_TYPES,
    refuse_unsupported,
    state_dict_kind,
)
from ._lifeline import LIFELINE_FD_ENV, lifeline
from ._processes import LaunchError, free_port, rank_environment

WORKER = Path(__file__).resolve().with_name("_worker.py")
POLL = 0.02  # the supervision loop's poll interval (a poll inside deadlines, never a synchronisation)
KILL_WAIT = 60.0  # a hang guard only: a SIGKILLed process ends once the kernel has freed it
STACK_DUMP_WAIT = 2.0  # a moment for the stack dumps of a timed-out job before it is killed
TIMED_OUT = 124  # the exit status of timeout(1)
KILLED = 128 + signal.SIGKILL
REFUSED = 2  # a usage error's exit status, as argparse's: a setting the harness refuses


def shell_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: a death by signal ``N`` is ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class ScriptResult:
    """How a script run ended. Exit statuses are as a shell reports them (a death by signal ``N`` is ``128 + N``).

    ``returncode``: 0 when every rank exited 0; else the status of the first rank that failed; :data:`TIMED_OUT`
    (124) after the timeout; 137 (``SIGKILL``) when the job was killed on request (``kill_reason`` says why);
    :data:`REFUSED` (2) when a worker refused a setting the harness cannot run (``refusal``: what, and the fix, in
    one line; the workers print no traceback for it).
    ``output``: each rank's stdout and stderr, merged, in rank order, as the rank wrote it.
    """

    returncode: int
    returncodes: list[int]
    output: list[str]
    timed_out: bool = False
    kill_reason: str | None = None
    first_failure: int | None = None
    killed_after_grace: list[int] = field(default_factory=list)
    seconds: float = 0.0
    refusal: str | None = None

    def summary(self) -> str:
        """One line: how the job ended."""
        if self.timed_out:
            what = f"timed out after {self.seconds:.0f}s: every worker was killed"
        elif self.kill_reason is not None:
            what = f"killed (SIGKILL, the whole job): {self.kill_reason}"
        elif self.refusal is not None:
            what = f"refused: {self.refusal}"
        elif self.first_failure is not None:
            what = f"rank {self.first_failure} failed first, exit status {self.returncodes[self.first_failure]}"
            if self.killed_after_grace:
                what += f"; rank(s) {self.killed_after_grace} did not end within the grace period and were killed"
        else:
            what = "every rank exited 0"
        return f"{what} (exit statuses {self.returncodes}, exit status {self.returncode})"

    def describe(self, lines: int = 40) -> str:
        """:meth:`summary` and the last ``lines`` lines of each rank's output."""
        tails = "".join(f"--- rank {rank} (exit status {code}), last {lines} lines ---\n"
                        + "".join(text.splitlines(keepends=True)[-lines:])
                        for rank, (code, text) in enumerate(zip(self.returncodes, self.output)))
        return f"{self.summary()}\n{tails}"

    def check(self) -> ScriptResult:
        """This result if every rank exited 0; else raises :class:`LaunchError` with :meth:`describe`."""
        if self.returncode != 0:
            raise LaunchError(self.describe())
        return self


def _settings(fsdp_version: int | None, state_dict_type: str | None, auto_wrap: Any) -> dict[str, Any]:
    """The FSDP settings the workers apply, checked here so that a bad option fails before any process starts."""
    if fsdp_version not in (None, 1, 2):
        raise CheckpointConfigurationError(f"fsdp_version={fsdp_version!r}: use 1 (FSDP1) or 2 (FSDP2), or None "
                                           "for the script's own plugin's version (FSDP1 without one).")
    kind = None
    if state_dict_type is not None:
        kind = state_dict_kind(state_dict_type)
        refuse_unsupported(kind, f"state_dict_type={state_dict_type!r} (--state-dict-type {kind})",
                           "Use SHARDED_STATE_DICT or FULL_STATE_DICT, the configurations accelerate-txn protects.")
        if kind not in STATE_DICT_TYPES or kind in UNSUPPORTED_STATE_DICT_TYPES:
            runs = [name for name in STATE_DICT_TYPES if name not in UNSUPPORTED_STATE_DICT_TYPES]
            raise CheckpointConfigurationError(f"state_dict_type={state_dict_type!r}: use one of {', '.join(runs)}.")
    if auto_wrap is None:
        wrap = "keep"
    elif auto_wrap is False or (isinstance(auto_wrap, str) and auto_wrap.lower() == "none"):
        wrap = "none"
    elif isinstance(auto_wrap, type):
        wrap = f"{auto_wrap.__module__}.{auto_wrap.__qualname__}"
    elif isinstance(auto_wrap, str) and "." in auto_wrap.strip(".") and " " not in auto_wrap:
        wrap = auto_wrap
    else:
        raise CheckpointConfigurationError(
            f"auto_wrap={auto_wrap!r}: give the module class FSDP wraps as a class or its import path "
            "('torch.nn.Linear', 'mymodel.Block'), 'none' for no policy (the model is one FSDP unit), or None to "
            "keep the script's own policy (torch.nn.Linear when the script passes no plugin).")
    return {"fsdp_version": fsdp_version, "state_dict_type": kind, "auto_wrap": wrap}


class ScriptJob:
    """The ``num_processes`` workers of one script run (see :func:`start_script`).

    ``processes`` are the workers' ``subprocess.Popen`` objects, rank order; each leads its own process group.
    Call :meth:`wait` (or use the job as a context manager) so that nothing it started is left running.
    """

    def __init__(self, command: list[str], num_processes: int, *, env: dict[str, str], cwd: Path, timeout: float,
                 grace: float, stream: TextIO | None, log_dir: Path | None, kill_on_output: str | None,
                 kill_on_path: Path | None) -> None:
        self.num_processes = num_processes
        self.timeout = timeout
        self.grace = grace
        self.kill_on_output = kill_on_output
        self.kill_on_path = kill_on_path
        self.processes: list[subprocess.Popen[bytes]] = []
        self._lines: list[list[str]] = [[] for _ in range(num_processes)]
        self._lock = threading.Lock()
        self._stream = stream
        self._kill_reason: str | None = None
        self._kill_requested: str | None = None  # set by request_kill (a signal handler), acted on by wait
        self._result: ScriptResult | None = None
        self._logs: list[TextIO] = []
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._logs = [(log_dir / f"rank{rank}.log").open("w", encoding="utf-8") for rank in range(num_processes)]
        self._readers: list[threading.Thread] = []
        self._lifeline: int | None = None
        self._refusals: Path | None = Path(tempfile.mkdtemp(prefix="accelerate_txn_refusals_"))
        self._refusal: str | None = None
        self.started = time.monotonic()
        port = free_port()
        read_end, self._lifeline = lifeline()
        try:
            for rank in range(num_processes):
                process = subprocess.Popen(
                    command, cwd=cwd, env={**env, **rank_environment(rank, num_processes, port),
                                           LIFELINE_FD_ENV: str(read_end),
                                           REFUSAL_FILE_ENV: str(self._refusals / f"rank{rank}")},
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(read_end,),
                    start_new_session=True)  # a group of its own: killing it kills what the script started
                self.processes.append(process)
                reader = threading.Thread(target=self._read, args=(rank, process.stdout), daemon=True,
                                          name=f"accelerate_txn.testing rank{rank} output")
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self._signal_groups(signal.SIGKILL)
            self._reap()
            raise
        finally:
            os.close(read_end)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (each also its process group's id), rank order."""
        return [process.pid for process in self.processes]

    def output(self, rank: int) -> str:
        """What rank ``rank`` printed so far (stdout and stderr, merged)."""
        with self._lock:
            return "".join(self._lines[rank])

    def kill(self, reason: str = "killed by the caller") -> None:
        """``SIGKILL`` every worker and everything it started, at once, as ``kill -9`` of the whole job would.
        :meth:`wait` then reports the job as killed (exit status 137) with ``reason``. Safe from any thread."""
        with self._lock:
            if self._kill_reason is None:
                self._kill_reason = reason
        self._signal_groups(signal.SIGKILL)

    def request_kill(self, reason: str) -> None:
        """Ask the supervising :meth:`wait` to kill the whole job as :meth:`kill` does, within one poll interval.
        Safe from a signal handler: it only records the request (no lock, no exception raised mid-poll)."""
        self._kill_requested = reason

    def wait(self) -> ScriptResult:
        """Supervise the job until every worker has ended (see the module docstring); the result.

        Raises ``KeyboardInterrupt`` (or whatever interrupted the wait) after the whole job has been killed.
        """
        if self._result is not None:
            return self._result
        first_failure: int | None = None
        failed_at = 0.0
        timed_out = False
        killed_after_grace: list[int] = []
        try:
            while True:
                if self._kill_requested is not None:
                    self.kill(self._kill_requested)
                codes = [process.poll() for process in self.processes]
                if first_failure is None and self._kill_reason is None:
                    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
                    if failed:
                        first_failure, failed_at = failed[0], time.monotonic()
                if all(code is not None for code in codes) or self._kill_reason is not None:
                    break
                if self.kill_on_path is not None and self.kill_on_path.exists():
                    self.kill(f"{self.kill_on_path} appeared")
                    break
                now = time.monotonic()
                if first_failure is not None and now - failed_at > self.grace:
                    killed_after_grace = [rank for rank, code in enumerate(codes) if code is None]
                    break
                if now - self.started > self.timeout:
                    timed_out = True
                    self._dump_stacks()
                    break
                time.sleep(POLL)
        except BaseException:
            self.kill("interrupted")
            raise
        finally:
            self._signal_groups(signal.SIGKILL)  # the rest of the job, and anything a finished worker left behind
            self._reap()
        returncodes = [shell_status(process.returncode) for process in self.processes]
        if timed_out:
            returncode = TIMED_OUT
        elif self._kill_reason is not None:
            returncode = KILLED
        elif self._refusal is not None:
            returncode = REFUSED
        elif first_failure is not None:
            returncode = returncodes[first_failure]
        else:
            returncode = 0
        self._result = ScriptResult(returncode, returncodes, [self.output(rank) for rank in range(self.num_processes)],
                                    timed_out=timed_out, kill_reason=self._kill_reason, first_failure=first_failure,
                                    killed_after_grace=killed_after_grace, seconds=time.monotonic() - self.started,
                                    refusal=self._refusal)
        return self._result

    def __enter__(self) -> ScriptJob:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._result is None:
            self.kill("the with block ended before the job did")
            self.wait()

    # --- internals ------------------------------------------------------------------------------------------------

    def _read(self, rank: int, pipe: Any) -> None:
        torch_prefix = re.compile(rf"\[rank{rank}\]: ?")  # PyTorch's own prefix of this rank's lines
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            with self._lock:
                self._lines[rank].append(line)
                shown = line if line.endswith("\n") else line + "\n"
                if self._logs:
                    self._logs[rank].write(shown)
                    self._logs[rank].flush()
                if self._stream is not None:
                    # One prefix per line: torch's excepthook (installed by init_process_group) and its logging
                    # start this rank's lines with "[rankN]:", which would read "[rankN] [rankN]: ...".
                    torchs = torch_prefix.match(shown)
                    echoed = shown[torchs.end():] if torchs else shown
                    try:
                        self._stream.write(f"[rank{rank}] {echoed}")
                        self._stream.flush()
                    except (BrokenPipeError, ValueError):  # the reader of the echo went away: keep collecting
                        self._stream = None
            if self.kill_on_output is not None and self.kill_on_output in line:
                self.kill(f"rank {rank} printed {self.kill_on_output!r}")
        pipe.close()

    def _signal_groups(self, sig: int) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):  # the group has ended (every member exited)
                pass

    def _dump_stacks(self) -> None:
        alive = [process for process in self.processes if process.poll() is None]
        for process in alive:
            process.send_signal(signal.SIGUSR1)  # the worker's faulthandler prints every thread's stack
        if alive:
            try:
                alive[0].wait(timeout=STACK_DUMP_WAIT)  # a hung worker does not exit: this only gives the dumps time
            except subprocess.TimeoutExpired:
                pass

    def _reap(self) -> None:
        for process in self.processes:
            try:
                process.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                raise LaunchError(f"worker pid {process.pid} survived SIGKILL for {KILL_WAIT:.0f}s") from None
        for reader in self._readers:
            reader.join(timeout=KILL_WAIT)  # ends at EOF: every holder of the pipe is dead
        for log in self._logs:
            log.close()
        if self._lifeline is not None:  # every worker has ended: nothing watches it any more
            os.close(self._lifeline)
            self._lifeline = None
        if self._refusals is not None:  # every worker has ended: its refusal, if any, is complete
            found = [path.read_text(encoding="utf-8").strip()
                     for path in (self._refusals / f"rank{rank}" for rank in range(self.num_processes))
                     if path.is_file()]
            self._refusal = next((text for text in found if text), None)  # the same on every rank that refused
            shutil.rmtree(self._refusals, ignore_errors=True)
            self._refusals = None


def fsdp_environment(settings: dict[str, Any]) -> dict[str, str]:
    """The variables ``accelerate launch --use_fsdp`` sets that a ``FullyShardedDataParallelPlugin`` the script builds
    reads for the fields it leaves out: ``FSDP_VERSION`` and ``FSDP_STATE_DICT_TYPE`` when the launcher is given
    them, and ``FSDP_USE_ORIG_PARAMS=true`` (``accelerate launch``'s default), so that one script runs under
    ``--fsdp-version 1`` and ``2`` as it runs under ``accelerate launch`` with either version."""
    environment = {"FSDP_USE_ORIG_PARAMS": os.environ.get("FSDP_USE_ORIG_PARAMS", "true")}
    if settings.get("fsdp_version") is not None:
        environment["FSDP_VERSION"] = str(settings["fsdp_version"])
    if settings.get("state_dict_type") is not None:
        environment["FSDP_STATE_DICT_TYPE"] = str(settings["state_dict_type"])
    return environment


PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
"""The ``ParallelismConfig`` sizes the launcher's ``parallelism`` option takes."""


def parallelism_environment(parallelism: dict[str, int] | None, num_processes: int,
                            fsdp_version: int | None) -> dict[str, str]:
    """The variables ``accelerate launch --parallelism_config_*`` sets for ``parallelism`` (checked here, before any
    process starts)."""
    if not parallelism:
        return {}
    unknown = sorted(set(parallelism) - set(PARALLELISM_SIZES))
    bad = {name: size for name, size in parallelism.items()
           if isinstance(size, bool) or not isinstance(size, int) or size < 1}
    if unknown or bad:
        raise CheckpointConfigurationError(
            f"parallelism={parallelism!r}: give sizes (integers, 1 or more) of {', '.join(PARALLELISM_SIZES)}"
            f"{f'; unknown: {unknown}' if unknown else ''}.")
    total = 1
    for size in parallelism.values():
        total *= size
    if total != num_processes:
        raise CheckpointConfigurationError(
            f"parallelism={parallelism!r}: the sizes multiply to {total}, but the job has num_processes="
            f"{num_processes}; make them equal.")
    if fsdp_version == 1:
        raise CheckpointConfigurationError(
            "parallelism: a ParallelismConfig mesh needs FSDP2 (fsdp_version=2); FSDP1's hybrid sharding is its "
            "plugin's sharding_strategy='HYBRID_SHARD'.")
    environment = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    for name, size in parallelism.items():
        environment[f"PARALLELISM_CONFIG_{name.upper()}"] = str(size)
    return environment


def nodes_environment(ranks_per_node: int | None, num_processes: int) -> dict[str, str]:
    """The variable that makes every FSDP1 hybrid-sharded model of the job shard over emulated nodes of
    ``ranks_per_node`` ranks (``_cpu_fsdp.hybrid_ranks_per_node``), checked here, before any process starts."""
    if ranks_per_node is None:
        return {}
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
            or num_processes % ranks_per_node:
        raise CheckpointConfigurationError(
            f"ranks_per_node={ranks_per_node!r}: give the ranks of one emulated node (an FSDP1 hybrid shard group), "
            f"a divisor of num_processes={num_processes}.")
    return {RANKS_PER_NODE_ENV: str(ranks_per_node)}


def start_script(
    script: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    *,
    module: bool = False,
    num_processes: int = 2,
    fsdp_version: int | None = None,
    state_dict_type: str | None = None,
    auto_wrap: Any = None,
    timeout: float = 600.0,
    grace: float = 10.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stream: TextIO | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    kill_on_output: str | None = None,
    kill_on_path: str | os.PathLike[str] | None = None,
    parallelism: dict[str, int] | None = None,
    ranks_per_node: int | None = None,
) -> ScriptJob:
    """Start ``python script ARGS`` (``module=True``: ``python -m script ARGS``) on ``num_processes`` CPU
    processes as one FSDP job; returns the running :class:`ScriptJob` (call :meth:`ScriptJob.wait`).

    Each worker gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1`` unless set,
    ``CUDA_VISIBLE_DEVICES=""`` (a CPU job; ``env`` may override it), the FSDP variables ``accelerate launch
    --use_fsdp`` gives (:func:`fsdp_environment`), then ``env``. It runs the script as ``__main__``
    exactly as ``python script ARGS`` would (``sys.argv``, the script's directory first on ``sys.path``), with
    Accelerate imported first and every ``Accelerator`` the script constructs put on FSDP on CPU: ``cpu=True``,
    then the FSDP plugin (``sync_module_states`` and ``cpu_ram_efficient_loading`` off), as
    :func:`fsdp_accelerator` does; every transformers ``TrainingArguments`` (TRL's configs too) is built with
    ``use_cpu=True``, so a Trainer script's Trainer joins the job. It does not import accelerate-txn: the
    script's own ``import accelerate_txn`` decides whether checkpoints are protected.

    FSDP settings (``None``: not given): ``fsdp_version`` 1 or 2; ``state_dict_type`` ``"SHARDED_STATE_DICT"`` or
    ``"FULL_STATE_DICT"`` (``"LOCAL_STATE_DICT"`` is refused: accelerate-txn does not protect it); ``auto_wrap`` the
    module class FSDP wraps (a class or its import path), or ``"none"``. Given settings override a plugin the
    script passes itself (``Accelerator(fsdp_plugin=...)``); the rest come from that plugin, else from
    :func:`fsdp_accelerator`'s defaults (FSDP1, ``SHARDED_STATE_DICT``, ``torch.nn.Linear`` wrapped).

    ``parallelism``: an N-D mesh for FSDP2, as ``accelerate launch --parallelism_config_*`` gives it (for example
    ``{"dp_replicate_size": 2, "dp_shard_size": 2}``, HSDP on 4 processes; also ``tp_size``, ``cp_size``): set as
    the environment Accelerate reads (``ACCELERATE_USE_PARALLELISM_CONFIG``, ``PARALLELISM_CONFIG_*``); the product
    of the sizes must be ``num_processes``. A ``ParallelismConfig`` the script passes itself is used as given. Either
    way its device mesh is built on CPU.

    FSDP1 hybrid sharding (a script's plugin with ``sharding_strategy="HYBRID_SHARD"`` or ``"_HYBRID_SHARD_ZERO2"``,
    or ``FSDP_SHARDING_STRATEGY`` in ``env`` as ``accelerate launch --fsdp_sharding_strategy`` sets it for a plugin
    that leaves it out): the ranks form emulated nodes of ``ranks_per_node`` consecutive ranks (default: half the
    processes, two replicas); each node is one shard group, as torch makes each GPU node's devices one.

    Supervision: ``timeout`` seconds for the whole job, then every worker is killed; after the first failure the
    others get ``grace`` seconds, then are killed. ``stream``: where to echo each line as ``[rankN] line``;
    ``log_dir``: also write ``rankN.log`` there. Kill tests: ``kill_on_output`` (a text any rank prints) or
    ``kill_on_path`` (a file that appears; relative to ``cwd``) sends ``SIGKILL`` to the whole job at once.

    Raises ``CheckpointConfigurationError`` for FSDP settings the harness cannot run, ``ValueError`` for bad process
    options and ``FileNotFoundError`` for a missing script, before any process starts. A setting found only in the
    workers (the script's own plugin) is refused there: the result's ``returncode`` is 2 and its ``refusal`` the
    message.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: give the number of worker processes, 1 or more.")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r}: give the job's hard time limit in seconds, more than 0.")
    if not grace >= 0:
        raise ValueError(f"grace={grace!r}: give the seconds the other ranks get after a failure, 0 or more.")
    settings = _settings(fsdp_version, state_dict_type, auto_wrap)
    workdir = Path(cwd) if cwd is not None else Path.cwd()
    target = os.fspath(script)
    if not module and not (workdir / target).is_file():
        raise FileNotFoundError(f"{target}: no such script (looked in {workdir}); give a path relative to cwd or "
                                "an absolute one, or module=True (-m) for a module name.")
    if module and (not target or target.startswith("-")):
        raise ValueError(f"module={target!r}: give a module name, as for python -m.")
    if kill_on_output is not None and not kill_on_output:
        raise ValueError("kill_on_output='': give the text whose printing kills the job (every line contains '').")
    watched = None if kill_on_path is None else (workdir / kill_on_path)
    if watched is not None and watched.exists():
        raise ValueError(f"kill_on_path={os.fspath(kill_on_path)!r}: {watched} exists already, so the job would be "
                         "killed at once; remove it first, or name a file the script creates.")
    worker_env = {**os.environ}
    worker_env.setdefault("OMP_NUM_THREADS", "1")
    worker_env.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive when printed: the echo and kill_on_output need it
    worker_env["CUDA_VISIBLE_DEVICES"] = ""
    worker_env.update(fsdp_environment(settings))
    worker_env.update(parallelism_environment(parallelism, num_processes, fsdp_version))
    worker_env.update(nodes_environment(ranks_per_node, num_processes))
    worker_env.update(env or {})
    command = [sys.executable, str(WORKER), json.dumps(settings), *(["-m"] if module else []), target,
               *[os.fspath(arg) for arg in args]]
    return ScriptJob(command, num_processes, env=worker_env, cwd=workdir, timeout=float(timeout),
                     grace=float(grace), stream=stream, log_dir=Path(log_dir) if log_dir is not None else None,
                     kill_on_output=kill_on_output, kill_on_path=watched)


def run_script(
    script: str | os.PathLike[str],
    args: list[str] | tuple[str, ...] = (),
    **options: Any,
) -> ScriptResult:
    """Run ``python script ARGS`` on ``num_processes`` CPU processes as one FSDP job and wait for it: the result.

    Takes the options of :func:`start_script` (``module``, ``num_processes``, ``fsdp_version``,
    ``state_dict_type``, ``auto_wrap``, ``timeout``, ``grace``, ``env``, ``cwd``, ``stream``, ``log_dir``,
    ``kill_on_output``, ``kill_on_path``, ``parallelism``, ``ranks_per_node``). Does not raise when the script
    fails: check ``returncode``, or call :meth:`ScriptResult.check`.
    """
    with start_script(script, args, **options) as job:
        return job.wait()
