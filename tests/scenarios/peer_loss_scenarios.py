"""Code inside the ranks of tests/core/test_peer_loss.py: one rank receives a real signal in the middle of a protected
save or restore, the other must raise the library's error naming it (started by tests/scenarios/crash_harness.py's ``Job``).

A job is one link of a chain run in one automatically named checkpoint directory (``spec["root"]``):

1. ``resume``: ``load_state()`` selects the newest complete checkpoint (every earlier link killed a save or a
   restore; the selection and the restore must work), then one save must publish;
2. ``fault``: rank 1 gets ``spec["signal"]`` at ``spec["instant"]`` of the next save (or of a restore when the
   instant is ``load:...``): a named point of ``accelerate_txn.core.faults`` (``ACCELERATE_TXN_KILL_AT`` with
   ``ACCELERATE_TXN_KILL_SIGNAL``), ``hook`` (a save pre-hook, so inside native ``save_state`` before its
   collectives), or ``before-save`` (right before the call: the other rank waits for it at the arrival check).
   ``handler`` ``"raise"`` installs a Python handler that raises an exception (what a worker with torch elastic's
   handler, or a training framework's, does); ``"default"`` keeps the default action (SIGTERM ends the process at
   once). Every rank writes what its call raised to ``<obs>/rank<R>.json``.

``version`` 1 builds FSDP1, 2 FSDP2; ``async`` makes the armed save asynchronous (the signal reaches the background
write; the error surfaces at ``wait_for_checkpoint``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn.core.faults import KILL_ENV, SIGNAL_ENV
from accelerate_txn.core.manifest import MANIFEST
from accelerate_txn.errors import CheckpointError
from tests.scenarios.crash_scenarios import directory_report, write_json
from tests.scenarios.crash_scenarios import main as crash_main


def _rank() -> int:
    return int(os.environ["RANK"])


def _build(root: Path, version: int) -> Any:
    if version == 2:
        from tests.scenarios.corruption_fsdp2 import build
    else:
        from tests.scenarios.corruption_scenarios import _build as build
    return build(0, project_dir=root, auto=True)


def _train(run: Any) -> None:
    generator = torch.Generator().manual_seed(run.acc.project_configuration.iteration * 10 + _rank())
    run.model(torch.randn(4, run.width, generator=generator)).pow(2).mean().backward()
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    run.acc.step += 1


def _outcome(call: Any) -> dict[str, Any]:
    try:
        value = call()
    except CheckpointError as exc:
        return {"type": type(exc).__name__, "library": True, "message": str(exc), "failures": sorted(exc.failures)}
    except BaseException as exc:  # what a broken path lets through: a raw gloo RuntimeError, DCP's exception, ...
        return {"type": type(exc).__name__, "library": False, "message": str(exc), "failures": None}
    return {"type": None, "value": str(value)}


class SignalRaised(Exception):
    """What the ``raise`` handler raises (as torch elastic's ``SignalException`` does in its processes)."""


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise SignalRaised(f"Process {os.getpid()} got signal: {signum}")


def run(spec: dict[str, Any]) -> None:
    rank = _rank()
    root = Path(spec["root"])
    obs: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    obs_path = Path(spec["obs"]) / f"rank{rank}.json"
    run = _build(root, int(spec["version"]))
    if spec.get("resume"):
        obs["resume"] = _outcome(lambda: run.acc.load_state())
        obs["selected"] = run.acc.project_configuration.iteration - 1
    _train(run)
    obs["save"] = _outcome(lambda: run.acc.save_state())
    if spec.get("instant") is None:  # the last link: a restore and a save, nothing armed
        write_json(obs_path, obs)
        return
    instant, chosen = spec["instant"], spec["signal"]
    if spec["handler"] == "raise":
        signal.signal(getattr(signal, chosen), _raise_on_signal)
    if instant == "before-save":
        pass
    elif instant == "hook":
        def hook(models: Any, weights: Any, output_dir: str) -> None:
            if rank == 1:
                os.kill(os.getpid(), getattr(signal, chosen))

        run.acc.register_save_state_pre_hook(hook)
    else:
        os.environ[KILL_ENV] = f"{instant}@1"
        os.environ[SIGNAL_ENV] = chosen
    write_json(obs_path, obs)  # a rank that dies still leaves what it saw before
    if instant.startswith("load:"):
        obs["fault"] = _outcome(lambda: run.acc.load_state())
    elif spec.get("async"):
        accelerate_txn.configure_checkpointing(run.acc, async_save=True)
        _train(run)
        obs["fault"] = _outcome(lambda: (run.acc.save_state(), accelerate_txn.wait_for_checkpoint(run.acc)))
    else:
        _train(run)
        if instant == "before-save" and rank == 1:  # gone before the call: the others wait for it at the arrival
            os.kill(os.getpid(), getattr(signal, chosen))
        obs["fault"] = _outcome(lambda: run.acc.save_state())
    os.environ.pop(KILL_ENV, None)
    if rank == 0:
        checkpoints = root / "checkpoints"
        obs["report"] = directory_report(checkpoints)
        obs["manifests"] = sorted(p.parent.name for p in checkpoints.glob(f"*/{MANIFEST}"))
    write_json(obs_path, obs)


def main(spec_path: str) -> None:
    """Entry point of one rank: ``python -c 'from tests.scenarios.peer_loss_scenarios import main; main(SPEC)'``."""
    crash_main(spec_path, run)  # ends the process without the interpreter's teardown
