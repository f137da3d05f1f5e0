"""Code that runs inside the ranks of the crash-consistency tests (started by tests/scenarios/crash_harness.py).

One process per rank, started with ``subprocess.Popen`` and the environment torchrun would give it, so that the
test can ``kill -9`` it. A run is described by a JSON spec; it may

1. ``calibrate``: time a few train+save steps (the random-instant sweep sizes its kill window with it);
2. ``resume`` a run directory: ``load_state()`` with automatic selection (optionally with a crash point armed
   during the restore), compare everything restored with the reference the training run recorded for the
   selected checkpoint, then take the next save and report the checkpoint directory after it;
3. train and save every step (automatic naming, ``total_limit=2``) in the resumed run (``continue``) or in a
   ``fresh`` run directory, ``saves`` times with a crash point armed during one chosen save
   (``kill_save``/``kill_spec``), or (``saves`` null) until the parent kills the job at a random instant.

Before every save each rank writes ``refs/checkpoint_<N>.rank<R>.pt``: its local state as it will be saved
(parameter and optimizer shards, param groups, scheduler, Python/NumPy/torch RNG, ``accelerator.step``). It is
written before the save starts, so a checkpoint published just before a kill has its reference too; an attempt
that was never published is overwritten by the next attempt at the same number. After every returned save each
rank writes ``progress.rank<R>.json`` (the newest checkpoint number whose save returned on that rank). All
files are written atomically (temporary name, then ``os.replace``): a kill never leaves a torn one.

Observations go to ``<obs>/rank<R>.json``; the pytest side asserts on them.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accelerate_txn.accelerate.selection import checkpoint_candidates
from accelerate_txn.core.faults import KILL_ENV
from accelerate_txn.core.manifest import MANIFEST, read_manifest, verify_manifest
from accelerate_txn.core.select import numbered_checkpoints
from accelerate_txn.errors import CheckpointIntegrityError, NoCheckpointError
from tests.scenarios.scenarios import _build, _local_state, _same, _train

TOTAL_LIMIT = 2
RESUME_SEED = 7  # the resumed model starts from other values than any saved one: a skipped restore shows


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, value: Any) -> None:
    _write_atomic(path, json.dumps(value, indent=1, sort_keys=True).encode())


def _rank() -> int:
    return int(os.environ["RANK"])


# --- what a checkpoint must restore ---------------------------------------------------------------------------

def _scheduler_state(scheduler: Any) -> dict[str, Any]:
    state = getattr(scheduler, "scheduler", scheduler).state_dict()
    return {key: state[key] for key in ("last_epoch", "_step_count", "_last_lr", "base_lrs")}


def capture(accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """This rank's state as a checkpoint saved now records it."""
    raw = getattr(optimizer, "optimizer", optimizer)
    return {
        "local": _local_state(model, optimizer),
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in raw.param_groups],
        "scheduler": _scheduler_state(scheduler),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "step": accelerator.step,
    }


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs (bitwise) between two :func:`capture` results; empty means an exact restore."""
    bad = _same(expected["local"], got["local"])
    if expected["param_groups"] != got["param_groups"]:
        bad.append(f"optimizer param_groups {expected['param_groups']} != {got['param_groups']}")
    if expected["scheduler"] != got["scheduler"]:
        bad.append(f"scheduler {expected['scheduler']} != {got['scheduler']}")
    if not torch.equal(expected["rng"]["torch"], got["rng"]["torch"]):
        bad.append("torch RNG state")
    if expected["rng"]["python"] != got["rng"]["python"]:
        bad.append("Python RNG state")
    e, g = expected["rng"]["numpy"], got["rng"]["numpy"]
    if not (e[0] == g[0] and np.array_equal(e[1], g[1]) and tuple(e[2:]) == tuple(g[2:])):
        bad.append("NumPy RNG state")
    if expected["step"] != got["step"]:
        bad.append(f"accelerator.step {expected['step']} != {got['step']}")
    return bad


def ref_path(root: Path, number: int, rank: int) -> Path:
    return Path(root) / "refs" / f"checkpoint_{number}.rank{rank}.pt"


def _write_ref(root: Path, number: int, state: dict[str, Any]) -> None:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    _write_atomic(ref_path(root, number, _rank()), buffer.getvalue())


def _read_ref(root: Path, number: int) -> dict[str, Any]:
    return torch.load(ref_path(root, number, _rank()), weights_only=False)  # our own test file


# --- the checkpoint directory, file level (also used by the parent after a kill) -------------------------------

def fully_verified(root: Path) -> tuple[list[int], dict[str, str]]:
    """The numbers of the ``checkpoint_N``/``checkpoint-N`` under ``root`` that verify completely (every recorded
    hash), and why each other one does not."""
    complete: list[int] = []
    broken: dict[str, str] = {}
    for number, path in numbered_checkpoints(root):
        try:
            manifest = read_manifest(path)
            if manifest is None:
                raise CheckpointIntegrityError("no completion manifest")
            verify_manifest(path, manifest, full=True)
            complete.append(number)
        except CheckpointIntegrityError as exc:
            broken[path.name] = str(exc)
    return complete, broken


def directory_report(checkpoints: Path) -> dict[str, Any]:
    """Every ``checkpoint_N`` fully verified (every recorded hash), the automatic choice, and leftovers."""
    checkpoints = Path(checkpoints)
    complete, broken = fully_verified(checkpoints)
    candidates, _reasons = checkpoint_candidates(checkpoints)
    names = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    leftovers = [n for n in names if ".staging-" in n or ".deleting-" in n]
    return {
        "complete": complete,
        "broken": broken,
        "selected": candidates[0].name if candidates else None,
        "leftovers": leftovers,
        "staged_manifests": [n for n in leftovers if ".staging-" in n and (checkpoints / n / MANIFEST).is_file()],
    }


# --- the run --------------------------------------------------------------------------------------------------

def _save(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, root: Path, kill_spec: str | None) -> int:
    """Train one step, record the reference for the next checkpoint, save (with ``kill_spec`` armed)."""
    number = accelerator.project_configuration.iteration
    _train(accelerator, model, optimizer, scheduler, 1, seed=1000 * number)
    _write_ref(root, number, capture(accelerator, model, optimizer, scheduler))
    if kill_spec:
        os.environ[KILL_ENV] = kill_spec
    try:
        accelerator.save_state()
    finally:
        os.environ.pop(KILL_ENV, None)
    write_json(root / f"progress.rank{_rank()}.json", {"returned": number, "time": time.time()})
    return number


#: ``1``: every save of the run is asynchronous (``async_save=True``); the sweep's ``--async`` sets it.
ASYNC_ENV = "ACCELERATE_TXN_SWEEP_ASYNC"


def asynchronous() -> bool:
    return os.environ.get(ASYNC_ENV) == "1"


#: The FSDP ``state_dict_type`` of every save of the run (unset: ``SHARDED_STATE_DICT``); the sweep's
#: ``--state-dict-type`` sets it. ``FULL_STATE_DICT`` (Accelerate's FSDP1 default): rank 0 writes native's whole
#: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` into staging; the restart still compares each rank's local shards,
#: which a restore on the same world puts back exactly.
STATE_DICT_TYPE_ENV = "ACCELERATE_TXN_SWEEP_STATE_DICT_TYPE"
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


def state_dict_type() -> str:
    kind = os.environ.get(STATE_DICT_TYPE_ENV) or "SHARDED_STATE_DICT"
    if kind not in STATE_DICT_TYPES:
        raise ValueError(f"{STATE_DICT_TYPE_ENV}={kind!r}: use one of {', '.join(STATE_DICT_TYPES)}")
    return kind


def _auto(root: Path, seed: int) -> tuple:
    built = _build(seed, project_dir=str(root), automatic_checkpoint_naming=True, total_limit=TOTAL_LIMIT,
                   state_dict_type=state_dict_type())
    if asynchronous():
        import accelerate_txn

        accelerate_txn.configure_checkpointing(built[0], async_save=True)
    return built


def _resume(root: Path, kill_load: str | None) -> tuple[dict[str, Any], tuple]:
    """Restore the newest complete checkpoint, compare it with its reference, take the next save."""
    built = _auto(root, RESUME_SEED)
    accelerator, model, optimizer, scheduler = built
    obs: dict[str, Any] = {}
    if kill_load:
        os.environ[KILL_ENV] = kill_load
    try:
        accelerator.load_state()
        number = accelerator.project_configuration.iteration - 1
        obs["selected"] = f"checkpoint_{number}"
        obs["differences"] = differences(_read_ref(root, number), capture(accelerator, model, optimizer, scheduler))
    except NoCheckpointError as exc:  # the killed run published nothing: training starts from scratch
        obs["selected"] = None
        obs["no_checkpoint"] = str(exc)
    finally:
        os.environ.pop(KILL_ENV, None)
    started = time.monotonic()
    obs["next_save"] = f"checkpoint_{_save(*built, root, None)}"
    if asynchronous():  # the restart's next save must be published before the directory is reported
        import accelerate_txn

        accelerate_txn.wait_for_checkpoint(accelerator)
    obs["next_save_seconds"] = time.monotonic() - started
    accelerator.wait_for_everyone()
    if _rank() == 0:
        obs["after_next_save"] = directory_report(root / "checkpoints")
    return obs, built


def _calibrate(root: Path, steps: int = 3) -> float:
    """Seconds per train+save step of a fresh run (the first save, which warms up, not counted)."""
    built = _auto(root, 0)
    _save(*built, root, None)
    started = time.monotonic()
    for _ in range(steps - 1):
        _save(*built, root, None)
    return (time.monotonic() - started) / (steps - 1)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    rank = _rank()
    obs_path = Path(spec["obs"]) / f"rank{rank}.json"
    obs: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    built = None
    if spec.get("calibrate"):
        obs["step_seconds"] = _calibrate(Path(spec["calibrate"]))
    if spec.get("resume"):
        obs["resume"], built = _resume(Path(spec["resume"]), spec.get("kill_load"))
    write_json(obs_path, obs)
    if spec.get("continue"):
        root = Path(spec["resume"])
    elif spec.get("fresh"):
        root = Path(spec["fresh"])
        built = _auto(root, int(spec.get("seed", 0)))
    else:
        return obs
    assert built is not None
    built[0].wait_for_everyone()  # every rank has written its observations
    if rank == 0:
        write_json(root / "loop-started.json", {"time": time.time()})  # the sweep's kill window opens
    saved = []
    saves = spec["saves"]  # None: until the harness kills the job, however late its kill instant lands
    parent = os.getppid()
    index = 0
    while saves is None or index < int(saves):
        if saves is None and os.getppid() != parent:
            break  # orphaned: the harness that was to kill this job is gone
        index += 1
        kill_spec = spec.get("kill_spec") if index == spec.get("kill_save") else None
        saved.append(_save(*built, root, kill_spec))
    obs["loop_saved"] = saved  # reached only when nothing killed this process
    write_json(obs_path, obs)
    return obs


def main(spec_path: str, scenario: Any = None) -> None:
    """Entry point of one rank: ``python -c 'from tests.scenarios.crash_scenarios import main; main(SPEC)'``; other scenario
    modules pass their own ``scenario(spec)`` (default: :func:`run`)."""
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for stacks before killing a hang
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(_get_pg_default_device|Multiple backends are registered).*")
    spec = json.loads(Path(spec_path).read_text())
    finished: list[bool] = []
    atexit.register(_end_without_teardown, finished)  # before the scenario's: runs after every handler it registers
    try:
        (scenario or run)(spec)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finished.append(True)


def _end_without_teardown(finished: list[bool]) -> None:
    """The last ``atexit`` handler of a rank: once the scenario finished (every outcome recorded, the exit hooks and
    the other handlers run), end without the interpreter's teardown, where gloo's worker threads can abort a process
    that finished ("terminate called without an active exception", SIGABRT: pytorch/pytorch#179291; see
    accelerate_txn/testing/_worker.py). A scenario that raised ends as usual."""
    if finished:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
