"""``python -m accelerate_txn.testing run``: an unmodified training script on N CPU processes with FSDP forced on.

Exit status: the job's (:class:`~accelerate_txn.testing.ScriptResult` ``returncode``: 0, the first failing rank's
status, 124 after the timeout, 137 when killed by a kill trigger), 2 for a usage error, 130 on Ctrl-C and 143 on
``SIGTERM`` (the whole job killed first in both cases).

A usage error is one line on stderr, ``python -m accelerate_txn.testing run: error: WHAT. FIX``, whether it is found
before any process starts (a bad option) or by the workers (a setting of the script's own the harness refuses,
such as its plugin's ``FULL_STATE_DICT``): once for the job, no traceback, no per-rank copies.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ._launcher import PARALLELISM_SIZES, ScriptJob, ScriptResult, start_script

PROG = "python -m accelerate_txn.testing"
USAGE_ERROR = 2

EPILOG = """\
Every worker runs SCRIPT as `python SCRIPT ARGS` would (sys.argv, __main__, the script's directory on sys.path),
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
OMP_NUM_THREADS=1 unless set, and no visible GPU. Every Accelerator the script constructs runs FSDP on CPU with
gloo; every transformers TrainingArguments (TRL's configs too) gets use_cpu=True, so Trainer and TRL scripts run
as the same FSDP job. The launcher does not install accelerate-txn's checkpoint protection: the script's own
`import accelerate_txn` does, so the same script can be run with and without it.

Options after SCRIPT are the script's. FSDP options not given come from a FullyShardedDataParallelPlugin the
script passes itself, else: FSDP1, SHARDED_STATE_DICT, every torch.nn.Linear wrapped.

examples:
  python -m accelerate_txn.testing run --fsdp-version 2 train.py --output_dir out --checkpointing_steps 2
  python -m accelerate_txn.testing run --kill-on-output "saved checkpoint-4" train.py --output_dir out
  python -m accelerate_txn.testing run -n 4 -m mypackage.train --epochs 1
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="CPU test launcher of accelerate-txn.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="run")
    run = commands.add_parser(
        "run", help="run a training script on N CPU processes with FSDP forced on",
        description="Run an unmodified training script on N CPU processes as one FSDP job (gloo).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("-n", "--num-processes", type=int, default=2, metavar="N", help="worker processes (default 2)")
    run.add_argument("--fsdp-version", type=int, choices=(1, 2), default=None,
                     help="FSDP1 or FSDP2 (default: the script's plugin's, else 1)")
    run.add_argument("--state-dict-type", default=None, metavar="TYPE",
                     help="SHARDED_STATE_DICT or FULL_STATE_DICT (default: the script's plugin's, else "
                          "SHARDED_STATE_DICT); LOCAL_STATE_DICT is refused: accelerate-txn does not protect it")
    run.add_argument("--auto-wrap", default=None, metavar="CLASS",
                     help="import path of the module class FSDP wraps, e.g. torch.nn.Linear or mymodel.Block; "
                          "'none' for no policy (default: the script's plugin's, else torch.nn.Linear)")
    for size in PARALLELISM_SIZES:
        run.add_argument(f"--{size.replace('_', '-')}", type=int, default=None, metavar="N", dest=size,
                         help=f"ParallelismConfig {size} (FSDP2 on an N-D mesh, as accelerate launch's "
                              f"--parallelism_config_{size})")
    run.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                     help="FSDP1 HYBRID_SHARD/_HYBRID_SHARD_ZERO2 (the script's plugin's, or FSDP_SHARDING_STRATEGY): "
                          "the ranks of one emulated node, i.e. of one shard group (default: half the processes)")
    run.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                     help="hard time limit of the whole job; then every worker is killed, exit status 124 "
                          "(default 600)")
    run.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                     help="after a rank fails, how long the others may take to end before they are killed "
                          "(default 10)")
    run.add_argument("--log-dir", default=None, metavar="DIR", help="also write each rank's output to DIR/rankN.log")
    run.add_argument("--kill-on-output", default=None, metavar="TEXT",
                     help="kill -9 the whole job as soon as any rank prints a line containing TEXT (exit status 137)")
    run.add_argument("--kill-on-path", default=None, metavar="PATH",
                     help="kill -9 the whole job as soon as PATH exists (exit status 137)")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m would")
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")
    return parser


class _Stop:
    """The handler of SIGINT and SIGTERM while a job runs: it records the signal and asks the job's supervision to
    kill every worker (``ScriptJob.request_kill``), so that no exception is raised at an arbitrary point of the
    supervision loop (one raised inside ``Popen.poll`` could leave that process unreapable)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.job: ScriptJob | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self.job is not None:
            self.job.request_kill("interrupted" if signum == signal.SIGINT else "terminated")
        elif signum == signal.SIGINT:  # no job yet (nothing started): as Python's default handler
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)


STOPS = {signal.SIGINT, signal.SIGTERM}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the job with its output echoed as ``[rankN] line`` (one
    prefix per line), return the exit status."""
    parser = _parser()
    options = parser.parse_args(argv)
    import threading

    def start() -> ScriptJob:
        try:
            return start_script(
                options.script, options.args, module=options.module, num_processes=options.num_processes,
                fsdp_version=options.fsdp_version, state_dict_type=options.state_dict_type,
                auto_wrap=options.auto_wrap, timeout=options.timeout, grace=options.grace, stream=sys.stdout,
                log_dir=options.log_dir, kill_on_output=options.kill_on_output, kill_on_path=options.kill_on_path,
                parallelism={size: getattr(options, size) for size in PARALLELISM_SIZES
                             if getattr(options, size) is not None} or None,
                ranks_per_node=options.ranks_per_node)
        except (ValueError, FileNotFoundError) as exc:  # CheckpointConfigurationError is a ValueError
            parser.exit(USAGE_ERROR, f"{PROG} run: error: {exc}\n")

    if threading.current_thread() is not threading.main_thread():  # only the main thread may handle signals
        job = start()
        try:
            result = job.wait()
        except KeyboardInterrupt:
            sys.stderr.write(f"{PROG} run: interrupted: every worker was killed\n")
            return 128 + signal.SIGINT
        return _report(result)

    stop = _Stop()
    previous = {signum: signal.signal(signum, stop) for signum in STOPS}
    try:
        # Held back while the workers start, so that the handler always finds the job to stop: a signal that
        # arrives meanwhile is handled as soon as the job exists.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:
            stop.job = start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        result = stop.job.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stop.signum is not None:
        what = "interrupted" if stop.signum == signal.SIGINT else "terminated"
        sys.stderr.write(f"{PROG} run: {what}: every worker was killed\n")
        return 128 + stop.signum
    return _report(result)


def _report(result: ScriptResult) -> int:
    if result.refusal is not None and result.returncode == USAGE_ERROR:  # not when a timeout or a kill ended it
        sys.stderr.write(f"{PROG} run: error: {result.refusal}\n")  # as a refusal before the start reads
        return USAGE_ERROR
    if result.returncode != 0:
        sys.stderr.write(f"{PROG} run: {result.summary()}\n")
    return result.returncode
