"""Seeded random-instant crash sweep: ``python -m tests.crash_sweep --trials 50 [--fsdp-version 2] [--async]
[--state-dict-type FULL_STATE_DICT]``.

Each trial trains a fresh 2-rank FSDP run on CPU (automatic naming, ``total_limit=2``, a save every step),
SIGKILLs every rank at an instant drawn from ``(seed, trial)`` over several saves, checks the checkpoint
directory, and restarts: the newest complete checkpoint must be selected and restored exactly, the next save
published, leftovers removed, no published checkpoint lost or corrupt (see tests/scenarios/crash_harness.py). Prints
one line per trial and a summary; exits 1 if any trial failed. ``make crash-sweep`` runs it with 50 trials.

``--fsdp-version 1`` (the default) runs the ranks of tests/scenarios/crash_scenarios.py (FSDP1); ``--fsdp-version 2``
those of tests/scenarios/crash_fsdp2.py (Accelerate's FSDP2: ``fully_shard``, DTensor parameters; the restart compares
each rank's local shards). ``--async`` (FSDP1 or FSDP2): every save is asynchronous (``async_save=True``), so kills land
in the background write, hash, publish and retention as well; a returned save then proves only the previous one
published. ``--state-dict-type FULL_STATE_DICT`` (FSDP1 or FSDP2, with or without ``--async``): every save is a
``FULL_STATE_DICT`` one (Accelerate's FSDP1 default: rank 0 writes the whole ``pytorch_model_fsdp.bin`` and
``optimizer.bin`` into staging) instead of the default ``SHARDED_STATE_DICT``; the same invariants, the restart
comparing each rank's local shards (a restore on the same world is exact). ``--seed S`` and ``--dir D`` (keep the run
directories) as usual.

``--trainer``: the transformers Trainer front end instead (tests/scenarios/trainer_kills.py, FSDP1, ``save_total_limit=2``, a
save every 2 steps): one uninterrupted reference run, then per trial the whole job SIGKILLed at an instant drawn
from ``(seed, trial)``, the directory checked, and ``resume_from_checkpoint=True`` compared with the reference
(newest complete checkpoint taken, its optimizer state restored bitwise, final weights and optimizer bitwise).
With ``--state-dict-type FULL_STATE_DICT`` (the Trainer's default) the reference and every trial save FULL checkpoints
(``model.safetensors``, ``pytorch_model_fsdp.bin``, ``optimizer.bin``, ...), and the final checkpoint's whole model and
optimizer files are compared with the reference's as well.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tests.scenarios.crash_harness import summary, sweep
from tests.scenarios.crash_scenarios import ASYNC_ENV, STATE_DICT_TYPE_ENV, STATE_DICT_TYPES

#: The module whose ``main`` each rank runs, per FSDP version (``crash_harness.Job``'s ``entry``).
ENTRIES = {1: "tests.scenarios.crash_scenarios", 2: "tests.scenarios.crash_fsdp2"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--dir", type=Path, default=None, help="keep the run directories here (default: temporary)")
    parser.add_argument("--fsdp-version", type=int, choices=sorted(ENTRIES), default=1,
                        help="1: FSDP1 (FullyShardedDataParallel); 2: FSDP2 (fully_shard, DTensor parameters)")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="every save asynchronous (async_save=True): kills land in background writes")
    parser.add_argument("--trainer", action="store_true",
                        help="the transformers Trainer front end (FSDP1) instead of Accelerator.save_state")
    parser.add_argument("--state-dict-type", choices=STATE_DICT_TYPES, default="SHARDED_STATE_DICT",
                        help="the FSDP state dict type of every save (FULL_STATE_DICT: Accelerate's FSDP1 default and "
                             "the Trainer's)")
    args = parser.parse_args(argv)
    if args.trainer:
        return trainer_sweep(args.trials, args.seed, args.dir, args.state_dict_type)
    if args.asynchronous:
        os.environ[ASYNC_ENV] = "1"  # read by the ranks (inherited) and by this process's crash invariants
    os.environ[STATE_DICT_TYPE_ENV] = args.state_dict_type  # read by the ranks (inherited)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crash-sweep-") as scratch:
        directory = args.dir or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        mode = (", asynchronous saves" if args.asynchronous else "") + f", {args.state_dict_type}"
        print(f"crash sweep: FSDP{args.fsdp_version}{mode}, {args.trials} trials, seed {args.seed}, in {directory}",
              flush=True)
        trials = sweep(directory, args.trials, args.seed, log=lambda line: print(line, flush=True),
                       entry=ENTRIES[args.fsdp_version])
    print(summary(trials))
    print(f"wall time {time.monotonic() - started:.0f}s")
    return 1 if any(t.problems for t in trials) else 0


def trainer_sweep(trials: int, seed: int, keep: Path | None, state_dict_type: str = "SHARDED_STATE_DICT") -> int:
    """``--trainer``: a reference run, then ``trials`` random-instant kills, each followed by a checked restart."""
    from tests.scenarios.trainer_kills import random_kill_trial, reference_run

    started = time.monotonic()
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="crash-sweep-trainer-") as scratch:
        directory = keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        print(f"crash sweep: Trainer FSDP1, {state_dict_type}, {trials} trials, seed {seed}, in {directory}",
              flush=True)
        reference = reference_run(directory / "reference" / "run", state_dict_type)
        for trial in range(trials):
            where, problems = random_kill_trial(directory / f"trial{trial}", reference, seed * 1000 + trial,
                                                state_dict_type)
            print(f"trial {trial}: {where}: {'OK' if not problems else '; '.join(problems)}", flush=True)
            if problems:
                failed.append(f"  trial {trial} ({where}): " + "; ".join(problems))
    print(f"crash sweep: Trainer, {trials} trials, {len(failed)} failed", *failed, sep="\n")
    print(f"wall time {time.monotonic() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
