"""Ranks of tests/accelerate/test_full_state_dict_kills.py: an FSDP1 ``FULL_STATE_DICT`` run (Accelerate's FSDP1
default) killed inside native Accelerate's own writes, then restarted with ``load_state()``; native
(``ACCELERATE_TXN_PATCHES=0``) and protected alike.

The run is tests/scenarios/crash_scenarios.py's (automatic naming, ``total_limit=2``, the reference state of every
checkpoint written before its save, the state dict type from ``ACCELERATE_TXN_SWEEP_STATE_DICT_TYPE``). This module
adds kill points inside the files native Accelerate writes, through the same ``ACCELERATE_TXN_KILL_AT`` variable as the
library's points (test instrumentation: every ``torch.save`` to a named file passes :func:`_killing_save`):

* ``native-write:torn:FILE`` (``@R`` for rank ``R`` only): the first half of ``FILE``'s bytes written, then ``SIGKILL``
  -- a process killed while it writes ``FILE``, deterministically;
* ``native-write:before:PREFIX``: ``SIGKILL`` before the first file whose name starts with ``PREFIX`` is written.

The restart (:func:`observe_restart`, spec ``{"observe": root}``) builds a fresh run (other initial values than any
saved), calls ``load_state()`` with automatic selection, and records on each rank the error it raised (or none), then
which parts of the live state equal each checkpoint's reference state (:func:`matching`): what it resumed from, part
by part. It records before it raises, so a restart that fails still reports what it had changed.
"""

from __future__ import annotations

import functools
import io
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accelerate_txn.core import faults
from tests.scenarios import crash_scenarios

ENTRY = __name__
TORN = "native-write:torn:"
BEFORE = "native-write:before:"
COMPONENTS = ("model", "optimizer", "scheduler", "rng", "step")


def _armed(name: str) -> str | None:
    """``"torn"``, ``"before"`` or None: what the armed kill (if any) does at a write of the file ``name``."""
    if not os.environ.get(faults.KILL_ENV):
        return None
    spec = faults.KILL_AT.read()
    if spec is None:
        return None
    target, rank, _count = spec
    if rank is not None and rank != int(os.environ["RANK"]):
        return None
    if target == TORN + name:
        return "torn"
    if target.startswith(BEFORE) and name.startswith(target[len(BEFORE):]):
        return "before"
    return None


def _killing_save(original: Any) -> Any:
    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        how = _armed(os.path.basename(os.fspath(f))) if isinstance(f, (str, os.PathLike)) else None
        if how == "torn":
            buffer = io.BytesIO()
            original(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(obj, f, *args, **kwargs)

    return save


def matching(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The parts of :data:`COMPONENTS` in which ``got`` (a ``crash_scenarios.capture``) is bitwise ``expected``."""
    e, g = expected["local"], got["local"]
    same = []
    if e["params"].keys() == g["params"].keys() and all(torch.equal(v, g["params"][k]) for k, v in e["params"].items()):
        same.append("model")
    if expected["param_groups"] == got["param_groups"] and e["optim"].keys() == g["optim"].keys() and all(
            value.keys() == g["optim"][name].keys() and all(torch.equal(v, g["optim"][name][k]) for k, v in value.items())
            for name, value in e["optim"].items()):
        same.append("optimizer")
    if expected["scheduler"] == got["scheduler"]:
        same.append("scheduler")
    er, gr = expected["rng"], got["rng"]
    en, gn = er["numpy"], gr["numpy"]
    if (torch.equal(er["torch"], gr["torch"]) and er["python"] == gr["python"]
            and en[0] == gn[0] and np.array_equal(en[1], gn[1]) and tuple(en[2:]) == tuple(gn[2:])):
        same.append("rng")
    if expected["step"] == got["step"]:
        same.append("step")
    return same


def observe_restart(spec: dict[str, Any]) -> None:
    """``load_state()`` in a fresh run of ``spec["observe"]``; writes ``obs/rank<R>.json`` (see the module docstring),
    then re-raises the restore's error, if any."""
    import accelerate_txn

    root = Path(spec["observe"])
    rank = int(os.environ["RANK"])
    accelerator, model, optimizer, scheduler = crash_scenarios._auto(root, crash_scenarios.RESUME_SEED)
    checkpoints = root / "checkpoints"
    obs: dict[str, Any] = {
        "protection": str(accelerate_txn.protection(accelerator)),
        "entries": {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(checkpoints.iterdir()) if p.is_dir()},
    }
    error: Exception | None = None
    try:
        accelerator.load_state()
        obs["error"] = None
    except Exception as exc:  # recorded, then raised again below
        error = exc
        obs["error"] = f"{type(exc).__name__}: {exc}"
    live = crash_scenarios.capture(accelerator, model, optimizer, scheduler)
    obs["matches"] = {f"checkpoint_{n}": matching(crash_scenarios._read_ref(root, n), live)
                      for n in range(2) if crash_scenarios.ref_path(root, n, rank).exists()}
    crash_scenarios.write_json(Path(spec["obs"]) / f"rank{rank}.json", obs)
    if error is not None:
        raise error


def main(spec_path: str) -> None:
    """Entry of one rank: the kill points above in every ``torch.save`` of this process, then ``crash_scenarios``'s
    run (a spec with ``fresh``) or :func:`observe_restart` (a spec with ``observe``)."""
    torch.save = _killing_save(torch.save)
    crash_scenarios.main(spec_path, lambda spec: observe_restart(spec) if spec.get("observe")
                         else crash_scenarios.run(spec))
