"""Seeded random-instant crash sweep: ``python -m tests.crash_sweep --trials 50 [--seed S] [--dir D]``.

Each trial trains a fresh 2-rank FSDP1 run on CPU (automatic naming, ``total_limit=2``, a save every step),
SIGKILLs every rank at an instant drawn from ``(seed, trial)`` over several saves, checks the checkpoint
directory, and restarts: the newest complete checkpoint must be selected and restored exactly, the next save
published, leftovers removed, no published checkpoint lost or corrupt (see tests/_crash_harness.py). Prints
one line per trial and a summary; exits 1 if any trial failed. ``make crash-sweep`` runs it with 50 trials.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests._crash_harness import summary, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--dir", type=Path, default=None, help="keep the run directories here (default: temporary)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crash-sweep-") as scratch:
        directory = args.dir or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        print(f"crash sweep: {args.trials} trials, seed {args.seed}, in {directory}", flush=True)
        trials = sweep(directory, args.trials, args.seed, log=lambda line: print(line, flush=True))
    print(summary(trials))
    print(f"wall time {time.monotonic() - started:.0f}s")
    return 1 if any(t.problems for t in trials) else 0


if __name__ == "__main__":
    sys.exit(main())
