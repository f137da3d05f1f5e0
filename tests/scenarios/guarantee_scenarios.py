"""Scenarios for the guarantee under teardown, per-rank settings and switched-off dispatch, run inside launched
ranks (real gloo, real Accelerate FSDP1/FSDP2, real DCP files); tests/core/test_guarantee_ranks.py asserts on what
each rank returns."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import accelerate_txn
from accelerate_txn import configure_checkpointing, wait_for_checkpoint
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error, _train, held_dcp_writes

# Collectives a checkpoint path could run (torch.distributed's public functions, looked up at call time).
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
                "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "barrier", "monitored_barrier", "all_to_all",
                "all_to_all_single", "send", "recv", "isend", "irecv", "new_group")


def _build(fsdp_version: int, seed: int, root: str | None = None) -> tuple[Any, Any, Any, Any]:
    """A 2-layer-group TinyModel with AdamW and a scheduler; with ``root``, automatic checkpoint naming under it."""
    import functools

    from tests.scenarios.scenarios import warmup_lambda

    project = {"project_dir": root, "automatic_checkpoint_naming": True} if root is not None else {}
    accelerator = fsdp_accelerator(fsdp_version=fsdp_version, **project)
    torch.manual_seed(seed)
    raw = TinyModel(width=16)
    if fsdp_version == 2:
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
        model, optimizer, scheduler = accelerator.prepare(raw, optimizer, scheduler)
    else:
        model = accelerator.prepare(raw)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _local(value: Any) -> Any:
    return value.to_local().detach().clone() if hasattr(value, "to_local") else value.detach().clone()


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's local shards of the parameters and optimizer moments, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    raw = getattr(optimizer, "optimizer", optimizer)
    return {"params": {n: _local(p) for n, p in model.named_parameters()},
            "optim": {names[id(p)]: {k: _local(v) for k, v in s.items() if torch.is_tensor(v)}
                      for p, s in raw.state.items() if s}}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    found = []
    for part in ("params", "optim"):
        if set(a[part]) != set(b[part]):
            found.append(f"{part}: keys differ")
            continue
        for name, value in a[part].items():
            other = b[part][name]
            if isinstance(value, dict):
                if set(value) != set(other) or not all(torch.equal(value[k], other[k]) for k in value):
                    found.append(f"{part}.{name}")
            elif not torch.equal(value, other):
                found.append(f"{part}.{name}")
    return found


# --------------------------------------------------------------------------------- async save, then teardown

def async_save_then_destroy(root: str, fsdp_version: int, bypass: bool) -> dict[str, Any]:
    """An asynchronous save whose background DCP write cannot start before the script has called
    ``destroy_process_group``: the write is held by a gate that the script opens when it calls
    ``destroy_process_group`` (``bypass=False``: through torch.distributed as scripts do; ``bypass=True``: the
    unwrapped function, as a reference bound before accelerate-txn wrapped it would be, and the gate opens only
    after the group is gone)."""

    rank = int(os.environ["RANK"])
    acc, model, opt, sched = _build(fsdp_version, seed=0)
    configure_checkpointing(acc, async_save=True)
    _train(acc, model, opt, sched, 2, seed=1)
    acc.save_state(str(Path(root) / "warm"))  # installs the library's teardown handling (first async save)
    wait_for_checkpoint(acc)
    _train(acc, model, opt, sched, 1, seed=2)
    saved = _state(model, opt)
    torch.save(saved, Path(root) / f"expected_{rank}.pt")

    path = Path(root) / "checkpoint"
    with held_dcp_writes() as gate:
        gate.clear()
        try:
            handle = acc.save_state(str(path))
            obs: dict[str, Any] = {"in_flight_before_destroy": not handle.done()}
            destroy = dist.destroy_process_group
            if bypass:
                destroy.__wrapped__()  # type: ignore[attr-defined]
                gate.set()
            else:
                gate.set()
                destroy()
        finally:
            gate.set()
        obs["initialized_after_destroy"] = dist.is_initialized()
        obs["wait"] = _error(lambda: wait_for_checkpoint(acc))
    obs["published"] = (path / accelerate_txn.MANIFEST).is_file()
    obs["staging_left"] = sorted(p.name for p in Path(root).iterdir() if ".staging-" in p.name)
    obs["library_threads"] = [t.name for t in threading.enumerate() if t.name.startswith("accelerate-txn")]
    from accelerate_txn.core import ranks as _ranks

    obs["background_group_dropped"] = _ranks._BACKGROUND == []
    if obs["published"]:
        from accelerate_txn.core.manifest import read_manifest, verify_manifest

        manifest = read_manifest(path)
        obs["verify_error"] = _error(lambda: verify_manifest(path, manifest, full=True, dcp=True))
    return obs


def load_and_compare(root: str, fsdp_version: int) -> dict[str, Any]:
    """Load ``root/checkpoint`` into a fresh model and compare with what each rank saved."""
    rank = int(os.environ["RANK"])
    acc, model, opt, _sched = _build(fsdp_version, seed=5)
    error = _error(lambda: acc.load_state(str(Path(root) / "checkpoint")))
    expected = torch.load(Path(root) / f"expected_{rank}.pt")
    return {"error": error, "differences": _differences(expected, _state(model, opt)) if error is None else None}


# --------------------------------------------------------------------------------- settings that differ per rank

def setting_invalid_on_one_rank(root: str, variable: str, value: str) -> dict[str, Any]:
    """``variable=value`` on rank 1 only, set before the Accelerators are built: every rank must raise the same
    error for a save, a load and an explicit ``save_training_checkpoint``, none may wait for the others."""
    rank = int(os.environ["RANK"])
    saver, model, opt, sched = _build(1, seed=0)
    _train(saver, model, opt, sched, 1, seed=1)
    good = Path(root) / "good"
    saver.save_state(str(good))  # valid everywhere: its configuration was read before the variable was set
    if rank == 1:
        os.environ[variable] = value
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(1, seed=2)
    _train(acc, model, opt, sched, 1, seed=3)
    obs["save"] = _error(lambda: acc.save_state(str(Path(root) / "bad")))
    loader, *_ = _build(1, seed=4)
    obs["load"] = _error(lambda: loader.load_state(str(good)))
    direct, model, opt, sched = _build(1, seed=5)
    _train(direct, model, opt, sched, 1, seed=6)
    obs["direct"] = _error(lambda: accelerate_txn.save_training_checkpoint(direct, str(Path(root) / "direct")))
    obs["nothing_published"] = not any((Path(root) / name).exists() for name in ("bad", "direct"))
    return obs


# --------------------------------------------------------------------------------- dispatch switched off

def _count_collectives(calls: list[str]) -> list[tuple[Any, str, Any]]:
    patched = []
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
        patched.append((dist, name, original))
    return patched


def dispatch_off_is_native(root: str) -> dict[str, Any]:
    """Run with ``ACCELERATE_TXN_PATCHES=0``: a save and a load make exactly the collectives (and files)
    native Accelerate makes with the library uninstalled."""
    from accelerate_txn.accelerate import patch as _patch

    observed: dict[str, Any] = {}
    for label in ("off", "native"):
        if label == "native":
            _patch.uninstall()
        acc, model, opt, sched = _build(1, seed=0)
        _train(acc, model, opt, sched, 1, seed=1)
        parent = Path(root) / label
        parent.mkdir(exist_ok=True)
        calls: list[str] = []
        patched = _count_collectives(calls)
        try:
            acc.save_state(str(parent / "ckpt"))
            saved = list(calls)
            calls.clear()
            acc.load_state(str(parent / "ckpt"))
            loaded = list(calls)
        finally:
            for module, name, original in patched:
                setattr(module, name, original)
        observed[label] = {"save": saved, "load": loaded, "parent": sorted(os.listdir(parent)),
                           "files": sorted(str(p.relative_to(parent)) for p in parent.rglob("*"))}
    _patch.install()
    return observed


# --------------------------------------------------------------------------------- lineage after a failed save

def lineage_after_failed_async(source: str, out: str, asynchronous_last: bool) -> dict[str, Any]:
    """One rank resumes (elastic) a 2-rank checkpoint; its first asynchronous save fails in the background
    (``ACCELERATE_TXN_ASYNC_FAIL_AT=0#1``), the next save publishes: its manifest must still record the lineage."""
    from tests.scenarios.elastic_scenarios import _build as build_elastic

    accelerator, *_ = build_elastic(1, seed=7)
    configure_checkpointing(accelerator, allow_reshard=True)
    accelerator.load_state(source)
    configure_checkpointing(accelerator, async_save=True)
    obs: dict[str, Any] = {}
    accelerator.save_state(str(Path(out) / "failed"))
    obs["failure"] = _error(lambda: wait_for_checkpoint(accelerator))
    handle = accelerator.save_state(str(Path(out) / "published"), async_save=asynchronous_last)
    if asynchronous_last:
        handle.wait()
    manifest = json.loads((Path(out) / "published" / accelerate_txn.MANIFEST).read_text())
    obs["resharded_from"] = manifest.get("resharded_from")
    return obs


# --------------------------------------------------------------------------------- partial checkpoints on disk

def publish_two(root: str, fsdp_version: int) -> dict[str, Any]:
    """Automatic naming: checkpoint_0 then checkpoint_1; each rank keeps what checkpoint_0 holds."""
    rank = int(os.environ["RANK"])
    acc, model, opt, sched = _build(fsdp_version, seed=0, root=root)
    _train(acc, model, opt, sched, 2, seed=1)
    acc.save_state()
    torch.save(_state(model, opt), Path(root) / f"expected0_{rank}.pt")
    _train(acc, model, opt, sched, 1, seed=2)
    acc.save_state()
    return {"checkpoints": sorted(p.name for p in (Path(root) / "checkpoints").iterdir())}


def resume_around_damage(root: str, fsdp_version: int, damaged: str, allow_reshard: bool) -> dict[str, Any]:
    """An explicit load of the damaged checkpoint is refused on every rank before anything changes; automatic
    selection skips it and resumes exactly from checkpoint_0."""
    rank = int(os.environ["RANK"])
    acc, model, opt, _sched = _build(fsdp_version, seed=9, root=root)
    if allow_reshard:
        configure_checkpointing(acc, allow_reshard=True)
    before = _state(model, opt)
    obs: dict[str, Any] = {"explicit": _error(lambda: acc.load_state(str(Path(root) / "checkpoints" / damaged)))}
    obs["untouched"] = _differences(before, _state(model, opt)) == []
    obs["automatic"] = _error(lambda: acc.load_state())
    expected = torch.load(Path(root) / f"expected0_{rank}.pt")
    obs["differences_to_checkpoint_0"] = _differences(expected, _state(model, opt))
    return obs


# --------------------------------------------------------------------------------- teardown

def teardown_job(root: str) -> None:
    """A whole job in its own interpreter (``python -c``): protected synchronous and asynchronous saves, a load, a
    native save, then the script destroys the process group with an asynchronous save still in flight and exits.
    Prints which library threads are alive after ``destroy_process_group``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    acc, model, opt, sched = _build(1, seed=0)
    _train(acc, model, opt, sched, 1, seed=1)
    acc.save_state(str(Path(root) / "sync"))
    configure_checkpointing(acc, async_save=True)
    acc.save_state(str(Path(root) / "async_1"))
    acc.load_state(str(Path(root) / "async_1"))  # waits for the save in flight first
    accelerate_txn.unpatch_accelerate_fsdp(acc)
    acc.save_state(str(Path(root) / "native"))
    accelerate_txn.patch_accelerate_fsdp(acc)
    _train(acc, model, opt, sched, 1, seed=2)
    acc.save_state(str(Path(root) / "async_2"))  # in flight when the script tears down
    dist.destroy_process_group()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("accelerate-txn")]
    published = (Path(root) / "async_2" / accelerate_txn.MANIFEST).is_file()
    print(json.dumps({"rank": rank, "library_threads": alive, "published": published}), flush=True)


def save_under_a_file(root: str, fsdp_version: int) -> dict[str, Any]:
    """Every kind of save whose destination lies under a regular file (``ENOTDIR``): the patched ``save_state``,
    an asynchronous save, and automatic naming under a project directory inside the file. Each must end with the
    same library error on every rank (rank 0's reservation fails; no rank may touch the path outside a phase)."""
    blocker = Path(root) / "file.txt"
    errors: dict[str, Any] = {}
    acc, model, opt, sched = _build(fsdp_version, seed=0)
    if acc.is_main_process:
        blocker.write_text("a regular file, not a directory")
    acc.wait_for_everyone()
    _train(acc, model, opt, sched, 1, seed=1)
    errors["save_state"] = _error(lambda: acc.save_state(str(blocker / "ckpt")))
    errors["async"] = _error(lambda: accelerate_txn.save_training_checkpoint(
        acc, blocker / "async", async_save=True).wait())
    auto, model2, opt2, sched2 = _build(fsdp_version, seed=0, root=str(blocker / "project"))
    _train(auto, model2, opt2, sched2, 1, seed=1)
    errors["automatic"] = _error(lambda: auto.save_state())
    errors["listing"] = sorted(p.name for p in Path(root).iterdir())
    return errors
