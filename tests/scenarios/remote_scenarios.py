"""Code that runs inside launched ranks for the object-storage tests (real gloo process groups, the loopback S3
server of ``tests.support.s3_server`` reached through the inherited AWS environment)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import configure_checkpointing, load_training_checkpoint, wait_for_checkpoint
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _build, _error, _local_state, _same, _train, warmup_lambda


def _objects(url: str) -> dict[str, int]:
    from accelerate_txn.store.s3 import S3Store

    return S3Store().list(url)


@contextlib.contextmanager
def _logged(name: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages logged by ``name`` (``level`` and above) while the block runs."""
    lines: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def _build_for(fsdp_version: int, seed: int, **kwargs: Any) -> tuple:
    if fsdp_version == 1:
        return _build(seed, **kwargs)
    accelerator = fsdp_accelerator(fsdp_version=2, **kwargs)  # FSDP2: model and optimizer prepared together
    torch.manual_seed(seed)
    raw = TinyModel(width=16)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
    model, optimizer, scheduler = accelerator.prepare(raw, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def roundtrip(parent: str, cache: str, fsdp_version: int) -> dict[str, Any]:
    """save_state to a URL, then restore into a fresh model and optimizer from it."""
    obs: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    acc, model, opt, sched = _build_for(fsdp_version, 0)
    configure_checkpointing(acc, cache_dir=cache)
    _train(acc, model, opt, sched, 3, seed=1)
    url = f"{parent}/checkpoint_1"
    obs["returned"] = str(acc.save_state(url))
    expected = _local_state(model, opt)
    expected_rng = torch.rand(3)
    expected_lr = sched.get_last_lr()
    obs["objects"] = sorted(_objects(url))
    acc.wait_for_everyone()

    # A restore in a fresh cache (another machine), then again where the copy is already there (reused, verified).
    # Then once more after the cached copy was damaged (it is not fsynced when downloaded: a power loss could do
    # this): the restore's verification fails on it, and it is downloaded again.
    for label, cache_dir in (("fresh", f"{cache}-load"), ("again", f"{cache}-load"), ("damaged", f"{cache}-load")):
        if label == "damaged" and acc.process_index == 0:
            copy = next(Path(cache_dir).rglob("checkpoint_1")) / "pytorch_model_fsdp_0" / "__0_0.distcp"
            data = bytearray(copy.read_bytes())
            data[len(data) // 2] ^= 0x01
            copy.write_bytes(bytes(data))
        acc.wait_for_everyone()
        acc2, model2, opt2, sched2 = _build_for(fsdp_version, 7)
        configure_checkpointing(acc2, cache_dir=cache_dir)
        torch.manual_seed(999)
        with _logged("accelerate_txn.accelerate.load") as lines:
            obs[f"{label}_error"] = _error(lambda acc2=acc2: acc2.load_state(url))
        obs[f"{label}_downloaded_again"] = any("downloading it again" in line for line in lines)
        obs[f"{label}_differences"] = _same(expected, _local_state(model2, opt2))
        obs[f"{label}_rng"] = torch.equal(torch.rand(3), expected_rng)
        obs[f"{label}_lr"] = sched2.get_last_lr() == expected_lr
        obs[f"{label}_copies"] = sorted(p.name for p in Path(cache_dir).rglob("checkpoint_*") if p.is_dir())

    # The explicit API returns the verified local copy it restored from; the log line names the URL and that copy.
    with _logged("accelerate_txn.accelerate.load", logging.INFO) as lines:
        obs["explicit_returned"] = str(load_training_checkpoint(acc2, url))
    obs["explicit_lines"] = [line for line in lines if line.startswith("Resumed from")]

    # A second save of the same name replaces it as a whole: one manifest, one transaction's objects.
    _train(acc, model, opt, sched, 1, seed=2)
    acc.save_state(url)
    obs["replaced_objects"] = sorted(_objects(url))
    # An asynchronous save to a URL: training goes on while it is written, uploaded and committed in the background.
    configure_checkpointing(acc, async_save=True)
    acc.save_state(f"{parent}/checkpoint_2")
    wait_for_checkpoint(acc)
    configure_checkpointing(acc, async_save=False)
    obs["async_objects"] = sorted(_objects(f"{parent}/checkpoint_2"))
    # A name that is not a checkpoint's, and a URL with nothing there: clear errors, nothing changed.
    before = _local_state(model, opt)
    obs["missing_error"] = _error(lambda: acc.load_state(f"{parent}/checkpoint_9"))
    obs["unchanged_after_missing"] = _same(before, _local_state(model, opt)) == []
    return obs


def damaged(url: str, cache: str, fsdp_version: int) -> dict[str, Any]:
    """A load of a damaged remote checkpoint (the test damaged it between two launches): refused on every rank
    before anything is restored."""
    acc, model, opt, _sched = _build_for(fsdp_version, 7)
    configure_checkpointing(acc, cache_dir=cache)
    before = _local_state(model, opt)
    error = _error(lambda: acc.load_state(url))
    return {"error": error, "unchanged": _same(before, _local_state(model, opt)) == []}


def save_many(parent: str, cache: str, names: list[str]) -> dict[str, Any]:
    """One trained state saved under each of ``names`` (for the damage tests)."""
    acc, model, opt, sched = _build_for(1, 0)
    configure_checkpointing(acc, cache_dir=cache)
    _train(acc, model, opt, sched, 2, seed=1)
    for name in names:
        acc.save_state(f"{parent}/{name}")
    return {}


def load_each(parent: str, cache: str, names: list[str]) -> dict[str, Any]:
    """Try to restore each damaged checkpoint into a live model: the error, and whether anything changed."""
    acc, model, opt, _sched = _build_for(1, 7)
    configure_checkpointing(acc, cache_dir=cache)
    before = _local_state(model, opt)
    obs: dict[str, Any] = {}
    for name in names:
        obs[name] = _error(lambda name=name: acc.load_state(f"{parent}/{name}"))
    obs["unchanged"] = _same(before, _local_state(model, opt)) == []
    return obs


def mirrored(root: str, mirror: str, cache: str, steps: int, fsdp_version: int) -> dict[str, Any]:
    """Automatic naming with a mirror: train and save ``steps`` times (total_limit=2), resuming first from the
    newest complete checkpoint of either tier when there is one; returns the state after the last save."""
    acc, model, opt, sched = _build_for(fsdp_version, 0, project_dir=root, automatic_checkpoint_naming=True,
                                        total_limit=2)
    configure_checkpointing(acc, mirror=mirror, cache_dir=cache)
    obs: dict[str, Any] = {"resumed": None}
    if any(Path(root, "checkpoints").glob("checkpoint_*")) or os.environ.get("RESUME") == "1":
        acc.load_state()
        obs["resumed"] = acc.project_configuration.iteration
    done = acc.project_configuration.iteration
    started = time.monotonic()
    if acc.process_index == 0:  # for a test that kills the job: written whole, then renamed
        Path(root).mkdir(parents=True, exist_ok=True)
        Path(root, "loop-started.tmp").write_text(str(done))
        os.replace(Path(root, "loop-started.tmp"), Path(root, "loop-started"))
    for step in range(done, steps):
        _train(acc, model, opt, sched, 1, seed=step)
        acc.save_state()
    wait_for_checkpoint(acc)
    obs["loop_seconds"] = time.monotonic() - started
    state = _local_state(model, opt)  # this rank's shards, bitwise (as lists of floats)
    obs["state"] = {"params": {name: t.tolist() for name, t in state["params"].items()},
                    "optim": {name: {k: v.tolist() if torch.is_tensor(v) else v for k, v in entry.items()}
                              for name, entry in state["optim"].items()}}
    obs["iteration"] = acc.project_configuration.iteration
    return obs


def series(parent: str, cache: str, fsdp_version: int, count: int) -> dict[str, Any]:
    """``count`` saves of one run to ``parent/checkpoint_1`` ... ``checkpoint_<count>``, one training step apart
    (the command-line tests read, damage and prune them)."""
    acc, model, opt, sched = _build_for(fsdp_version, 0)
    configure_checkpointing(acc, cache_dir=cache)
    for number in range(1, count + 1):
        _train(acc, model, opt, sched, 1, seed=number)
        acc.save_state(f"{parent}/checkpoint_{number}")
    return {"objects": sorted(_objects(parent))}


def mirrored_job() -> None:
    """A killable job (``start_ranks``): :func:`mirrored` with the arguments in ``ACCELERATE_TXN_TEST_JOB`` (JSON)."""
    spec = json.loads(os.environ["ACCELERATE_TXN_TEST_JOB"])
    mirrored(spec["root"], spec["mirror"], spec["cache"], spec["steps"], 1)


def mirror_failure(root: str, mirror: str, cache: str) -> dict[str, Any]:
    """A mirror whose uploads fail (its bucket does not exist): the local checkpoint stays published; the error is
    raised on every rank at the next save and at a wait, once."""
    acc, model, opt, sched = _build_for(1, 0, project_dir=root, automatic_checkpoint_naming=True)
    configure_checkpointing(acc, mirror=mirror, cache_dir=cache)
    _train(acc, model, opt, sched, 1, seed=0)
    obs: dict[str, Any] = {"first": _error(acc.save_state)}
    _train(acc, model, opt, sched, 1, seed=1)
    obs["second"] = _error(acc.save_state)  # raises the first upload's error
    obs["wait"] = _error(lambda: wait_for_checkpoint(acc))  # the second save did not run: nothing in flight
    obs["local"] = sorted(p.name for p in Path(root, "checkpoints").iterdir() if p.name.startswith("checkpoint_"))
    return obs


def saved_states(parent: str, cache: str) -> dict[str, Any]:
    """``parent/checkpoint_1`` and ``checkpoint_2`` of one run, one training step apart (``parent``: a URL or a
    local directory); each one's state."""
    acc, model, opt, sched = _build_for(1, 0)
    configure_checkpointing(acc, cache_dir=cache)
    states = {}
    for number in (1, 2):
        _train(acc, model, opt, sched, 1, seed=number)
        acc.save_state(f"{parent}/checkpoint_{number}")
        states[number] = _local_state(model, opt)
    return states


def _wait_for(path: Path, what: str) -> None:
    """Block until ``path`` exists (the test creates it after the other job's step): a poll inside a deadline."""
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared ({what})")
        time.sleep(0.02)


def load_pausing(url: str, cache: str, pause: str, ready: str, go: str) -> dict[str, Any]:
    """Restore ``url`` from the cache ``cache`` (shared with another job). At ``pause`` this job stops until the
    test says ``go``: ``"download"`` after its first downloaded file (its download directory live, the
    ``fetch:during`` point), ``"restore"`` once its copy is published and held, before the restore reads it. It
    creates ``ready`` when it stops there; meanwhile another job restores another checkpoint from the same cache."""
    from accelerate_txn.accelerate import remote
    from accelerate_txn.core import faults

    def stop() -> None:
        Path(ready).write_text("")
        _wait_for(Path(go), "the other job's restore")

    def stop_after(module: Any, name: str) -> None:  # module.name stops once it has returned
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = real(*args, **kwargs)
            stop()
            return value

        setattr(module, name, wrapper)

    if pause == "verified":  # a local checkpoint: every check passed, nothing restored yet
        from accelerate_txn.accelerate import load

        stop_after(load, "_verify")
    elif pause == "download":
        real_point = faults.point

        def point(name: str) -> None:
            if name == "fetch:during" and not Path(ready).exists():
                stop()
            real_point(name)

        faults.point = point  # type: ignore[assignment]
    else:
        stop_after(remote, "fetch")
    acc, model, opt, _sched = _build_for(1, 7)
    configure_checkpointing(acc, cache_dir=cache)
    error = _error(lambda: acc.load_state(url))
    return {"error": error, "state": _local_state(model, opt)}


def load_into(url: str, cache: str) -> dict[str, Any]:
    """Restore ``url`` from the cache ``cache``: the error, and the restored state."""
    acc, model, opt, _sched = _build_for(1, 7)
    configure_checkpointing(acc, cache_dir=cache)
    error = _error(lambda: acc.load_state(url))
    return {"error": error, "state": _local_state(model, opt)}
