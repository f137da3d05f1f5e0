"""The Trainer's random-instant kill, one trial at a time: used by tests/trainer/test_trainer.py (one seeded draw in
``make test``) and by ``python -m tests.crash_sweep --trainer`` (many draws).

A trial runs the FSDP1 Trainer of tests/scenarios/trainer_scenarios.py (``save_total_limit=2``, a save every 2 steps, to step
:data:`STEPS`), SIGKILLs the whole job at an instant drawn from the seed, uniform over :data:`WINDOW_STEPS` train+save
steps (the step time measured on the uninterrupted reference run), checks the directory, then restarts with
``resume_from_checkpoint=True`` and compares with the reference. It returns the problems it found (none: it passed).

``state_dict_type``: the Trainer's FSDP ``state_dict_type`` of the reference and of every trial (default
``SHARDED_STATE_DICT``; ``FULL_STATE_DICT`` is the Trainer's own default: ``model.safetensors``,
``pytorch_model_fsdp.bin``, ``optimizer.bin`` and the RNG files, rank 0 writing the whole tensors). The comparison is
the same for both (each rank's local shards and optimizer state, which a restore on the same world puts back
exactly); for ``FULL_STATE_DICT`` the restart's final checkpoint's whole model and optimizer files are also compared
with the reference's, tensor for tensor (:func:`full_files_differences`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from accelerate_txn.testing import launch
from tests.scenarios.crash_harness import KILLED, JobResult, run_to_completion, run_until_killed_after
from tests.scenarios.crash_scenarios import fully_verified

ENTRY = "tests.scenarios.trainer_scenarios"
STEPS = 8  # train to step 8, a save every 2 steps
#: The kill instant is uniform over this many of the run's :data:`STEPS` train+save steps from the start of the
#: training loop (fewer than all: a job killed later than the reference's step time predicts still trains).
WINDOW_STEPS = 5
TIMEOUT = 240  # per launch: a hung group fails instead of stalling


def equal(one: Any, other: Any) -> bool:
    """Bitwise equality of nested tensors, lists and values."""
    if isinstance(one, torch.Tensor) or isinstance(other, torch.Tensor):
        return isinstance(one, torch.Tensor) and isinstance(other, torch.Tensor) and torch.equal(one, other)
    if isinstance(one, (list, tuple)) and isinstance(other, (list, tuple)):
        return len(one) == len(other) and all(equal(a, b) for a, b in zip(one, other))
    return bool(one == other)


def same_weights(one: list[dict[str, Any]], other: list[dict[str, Any]]) -> bool:
    return all(equal(a["weights"], b["weights"]) for a, b in zip(one, other))


def trainer_report(root: Path) -> dict[str, Any]:
    """Every ``checkpoint-N`` of ``root`` fully verified (every hash), and the hidden leftovers."""
    complete, broken = fully_verified(root)
    leftovers = sorted(p.name for p in root.iterdir() if ".staging-" in p.name or ".deleting-" in p.name)
    return {"complete": complete, "broken": broken, "leftovers": leftovers}


def observed(directory: Path, name: str, kind: str) -> list[dict[str, Any] | None]:
    """What each rank of job ``name`` recorded as ``kind`` (``began``: when training began; None: not recorded)."""
    paths = [directory / "obs" / name / f"rank{rank}.{kind}.pt" for rank in range(2)]
    return [torch.load(path, weights_only=False) if path.exists() else None for path in paths]


def reference_run(root: Path, state_dict_type: str = "SHARDED_STATE_DICT") -> list[dict[str, Any]]:
    """The uninterrupted FSDP1 run to step :data:`STEPS` with ``save_total_limit=2`` (checkpoint-6 and -8 remain):
    each rank's result (weights, optimizer state at each save and at the end, loop time; ``output_dir``: ``root``)."""
    results = launch("tests.scenarios.trainer_scenarios:train", 2,
                     args=(str(root), None, STEPS, 1, 2, None, None, state_dict_type), timeout=TIMEOUT)
    return [{**result, "output_dir": str(root), "state_dict_type": state_dict_type} for result in results]


def _full_tensors(checkpoint: Path) -> dict[str, Any]:
    """The whole tensors (and other values) of a Trainer ``FULL_STATE_DICT`` checkpoint's model and optimizer files."""
    from safetensors.torch import load_file

    found: dict[str, Any] = {f"model.safetensors: {k}": v for k, v in load_file(checkpoint / "model.safetensors").items()}
    found.update({f"pytorch_model_fsdp.bin: {k}": v
                  for k, v in torch.load(checkpoint / "pytorch_model_fsdp.bin", weights_only=True).items()})
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    for key, state in optimizer["state"].items():
        found.update({f"optimizer.bin: state {key}.{name}": value for name, value in state.items()})
    found["optimizer.bin: param_groups"] = optimizer["param_groups"]
    return found


def full_files_differences(expected: Path, got: Path) -> list[str]:
    """What differs, bitwise, between the whole model and optimizer files of two Trainer ``FULL_STATE_DICT``
    checkpoints (``model.safetensors``, ``pytorch_model_fsdp.bin``, ``optimizer.bin``); empty: the same."""
    reference, final = _full_tensors(expected), _full_tensors(got)
    if not reference or reference.keys() != final.keys():
        return [f"the files hold other entries: {sorted(reference)} vs {sorted(final)}"]
    return [name for name, value in reference.items() if not equal(value, final[name])]


def kill_instant(seed: int, reference: list[dict[str, Any]]) -> tuple[float, float]:
    """(delay, window): the seed's kill instant, uniform over :data:`WINDOW_STEPS` of the reference's steps."""
    window = WINDOW_STEPS / STEPS * max(result["loop_seconds"] for result in reference)
    return random.Random(f"trainer-kill:{seed}").uniform(0.0, window), window


def random_kill_trial(directory: Path, reference: list[dict[str, Any]], seed: int,
                      state_dict_type: str = "SHARDED_STATE_DICT") -> tuple[str, list[str]]:
    """One trial in ``directory``: (where the kill landed, the problems found; none when it passed). ``reference``:
    :func:`reference_run`'s result with the same ``state_dict_type``."""
    if reference[0].get("state_dict_type", "SHARDED_STATE_DICT") != state_dict_type:
        raise ValueError(f"the reference run saved {reference[0].get('state_dict_type')}, the trial {state_dict_type}")
    delay, window = kill_instant(seed, reference)
    where = f"seed {seed}: the job was killed {delay:.2f}s into a {window:.2f}s window"
    root = directory / "run"
    spec = {"output_dir": str(root), "max_steps": STEPS, "fsdp_version": 1, "save_total_limit": 2, "resume": None,
            "state_dict_type": state_dict_type}
    # The ranks wait to be killed once done: a run faster than the reference's window is killed after its end (all
    # saved), never found ended; how fast the machine is never decides the outcome.
    killed, early = run_until_killed_after({**spec, "hold": True}, directory, "killed", "rank0.began.pt", delay,
                                           entry=ENTRY)
    if early:
        return where, [f"rank(s) {early} had ended before the kill\n{killed.describe()}"]
    if killed.returncodes != [KILLED, KILLED]:
        return where, [f"exit statuses {killed.returncodes}, not SIGKILL\n{killed.describe()}"]
    problems: list[str] = []
    report = trainer_report(root)
    complete = report["complete"]
    where += f", complete {complete}"
    if report["broken"]:
        problems.append(f"a half-written or corrupt checkpoint-N: {report}")  # never one under a final name
    saved = directory / "obs" / "killed" / "rank0.saved.json"
    returned = json.loads(saved.read_text())["returned"] if saved.exists() else None
    # Every save that returned is published and kept (retention keeps two); at most one newer was published (killed
    # between its publish and its return); a kill during retention may leave the one it was about to delete.
    if complete and complete != list(range(complete[0], complete[-1] + 1, 2)):
        problems.append(f"complete checkpoints are not consecutive saves: {report}")
    if returned is None and complete not in ([], [2]):
        problems.append(f"no save returned, yet {complete} are complete")
    if returned is not None and not (returned in complete and complete[-1] in (returned, returned + 2)):
        problems.append(f"the save of checkpoint-{returned} returned, complete after the kill: {complete}")
    if problems:
        return where, problems
    # The restart: resume_from_checkpoint=True (nothing complete yet: a fresh start, as a script would do).
    restart = run_to_completion({**spec, "resume": True if complete else None}, directory, "restart", entry=ENTRY)
    return where, restart_problems(directory, restart, reference, complete)


def restart_problems(directory: Path, restart: JobResult, reference: list[dict[str, Any]],
                      complete: list[int]) -> list[str]:
    problems = []
    began = observed(directory, "restart", "began")
    final = [torch.load(directory / "obs" / "restart" / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for rank in range(2):
        start = began[rank]
        if start is None or start["step"] != (complete[-1] if complete else 0):
            problems.append(f"rank {rank} began at {None if start is None else start['step']}, not at the newest "
                            f"complete checkpoint ({complete})")
        elif complete and not equal(start["optimizer"], reference[rank]["optimizer_at_save"][complete[-1]]):
            problems.append(f"rank {rank}: the optimizer state of checkpoint-{complete[-1]} was not restored bitwise")
        if not (final[rank]["optimizer"] and equal(final[rank]["optimizer"], reference[rank]["optimizer"])):
            problems.append(f"rank {rank}: the final optimizer state differs from the uninterrupted run's")
    if [result["step"] for result in final] != [STEPS] * 2:
        problems.append(f"the restart ended at steps {[result['step'] for result in final]}, not {STEPS}")
    if not same_weights(final, reference):
        problems.append("the final weights differ from the uninterrupted run's")
    after = trainer_report(directory / "run")
    if after != {"complete": [6, 8], "broken": {}, "leftovers": []}:
        problems.append(f"after the restart: {after}")
    elif reference[0].get("state_dict_type") == "FULL_STATE_DICT":
        last = f"checkpoint-{STEPS}"
        differing = full_files_differences(Path(reference[0]["output_dir"]) / last, directory / "run" / last)
        if differing:
            problems.append(f"the whole model and optimizer files of {last} differ from the uninterrupted run's: "
                            f"{differing}")
    return problems
