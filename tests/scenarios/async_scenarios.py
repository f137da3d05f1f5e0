"""Asynchronous protected saves, run inside launched ranks (real gloo, real Accelerate FSDP1 and FSDP2, real DCP
files).

Each scenario makes several checks in one process group and returns observations for tests/runtime/test_async_save.py.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn import CheckpointError, configure_checkpointing, register_checkpoint_state, wait_for_checkpoint
from tests.scenarios.scenarios import _build, _error, _local_state, _same, _train, held_dcp_writes


def _listing(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir() if p.name != ".accelerate-txn.lock")


def _complete(checkpoints: Path) -> list[str]:
    """Published checkpoints (a staging directory may already hold its manifest: it is not published)."""
    return sorted(p.name for p in checkpoints.iterdir()
                  if p.name.startswith("checkpoint_") and (p / accelerate_txn.MANIFEST).is_file())


def async_lifecycle(root: str) -> dict[str, Any]:
    """Back-to-back saves, retention, background failures (seen at wait and at the next save), exact restore.

    Run with ``ACCELERATE_TXN_ASYNC_FAIL_AT=1#3,5``: rank 1 raises in the background of async saves 3 and 5.
    """
    rank = int(os.environ["RANK"])
    checkpoints = Path(root) / "checkpoints"
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(0, project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
    configure_checkpointing(acc, async_save=True)
    noise = torch.Generator().manual_seed(100 + rank)
    progress = {"batches": 0}
    register_checkpoint_state(acc, {"noise": noise}, progress)

    # Saves 1 and 2 back to back; training mutates the parameters while save 1 is written.
    _train(acc, model, opt, sched, 2, seed=1)
    acc.step = 5
    first = acc.save_state()
    acc.step = 6  # while save 1 may still be in the background: its manifest must record 5
    obs["handle_type"] = type(first).__name__
    obs["first_path"] = os.fspath(first)
    _train(acc, model, opt, sched, 1, seed=2)
    acc.step = 7
    second = acc.save_state()
    obs["first_done_when_second_returned"] = first.done()  # the second save waited for the first
    obs["second_path"] = str(second.wait())
    import torch.distributed as dist

    from accelerate_txn.core.ranks import background_group

    group = background_group()
    obs["own_group"] = group is not None and group != dist.group.WORLD and dist.get_backend(group) == "gloo"
    obs["after_two"] = _complete(checkpoints)
    obs["manifest_steps"] = [json.loads((checkpoints / name / accelerate_txn.MANIFEST).read_text())["steps"]
                             for name in obs["after_two"]]

    # Save 3 fails in rank 1's background: raised by wait_for_checkpoint on every rank; nothing deleted.
    _train(acc, model, opt, sched, 1, seed=3)
    acc.save_state()
    obs["wait_error"] = _error(lambda: wait_for_checkpoint(acc))
    obs["after_failed"] = _complete(checkpoints)
    # Rank 0 removes the failed save's staging before its own wait returns (other ranks may look earlier).
    obs["after_failed_listing"] = _listing(checkpoints) if rank == 0 else None
    obs["iteration_after_failed"] = acc.project_configuration.iteration
    obs["wait_again"] = wait_for_checkpoint(acc)  # raised once, then settled

    # Save 4 publishes and prunes the oldest; save 5 fails and is raised by the next save call (6).
    acc.save_state()
    wait_for_checkpoint(acc)
    obs["after_fourth"] = _complete(checkpoints)
    _train(acc, model, opt, sched, 1, seed=4)
    acc.save_state()
    obs["next_save_error"] = _error(lambda: acc.save_state())
    obs["after_fifth"] = _complete(checkpoints)

    # Save 7: the round trip. Training runs on during the background write; the checkpoint holds the saved state.
    _train(acc, model, opt, sched, 1, seed=5)
    progress["batches"] = 10 + rank
    noise.manual_seed(555 + rank)
    expected = _local_state(model, opt)
    expected_lr = sched.get_last_lr()
    expected_step = acc.step
    seventh = acc.save_state()
    expected_rng = torch.rand(3)
    expected_noise = torch.rand(3, generator=noise)
    _train(acc, model, opt, sched, 2, seed=6)
    published = seventh.wait()
    obs["seventh"] = published.name
    obs["background_cpu_seconds"] = seventh.cpu_seconds
    obs["after_seventh"] = _complete(checkpoints)
    obs["no_staging_left"] = not [p for p in checkpoints.iterdir() if ".staging-" in p.name]

    acc2, model2, opt2, sched2 = _build(7)
    noise2 = torch.Generator().manual_seed(999)
    progress2 = {"batches": -1}
    register_checkpoint_state(acc2, {"noise": noise2}, progress2)
    torch.manual_seed(12345)
    acc2.load_state(str(published))
    obs["roundtrip_differences"] = _same(expected, _local_state(model2, opt2))
    obs["rng_restored"] = torch.equal(torch.rand(3), expected_rng)
    obs["private_generator_restored"] = torch.equal(torch.rand(3, generator=noise2), expected_noise)
    obs["progress_restored"] = progress2 == progress
    obs["scheduler_restored"] = sched2.get_last_lr() == expected_lr
    obs["step_restored"] = acc2.step == expected_step
    # The same files as a synchronous save of the same Accelerator.
    sync = acc.save_state(str(Path(root) / "sync"), async_save=False)
    obs["sync_type"] = type(sync).__name__
    relative = lambda top: sorted(str(p.relative_to(top)) for p in Path(top).rglob("*"))  # noqa: E731
    obs["same_layout_as_sync"] = relative(published) == relative(sync)
    obs.update(_reused_staging(root, acc, lambda: _local_state(model, opt),
                               lambda seed: _train(acc, model, opt, sched, 1, seed=seed),
                               lambda want, path: _same(want, _restored_state(path))))
    return obs


def _restored_state(path: str) -> dict[str, Any]:
    """This rank's state after a protected load of ``path`` into a freshly built job (as async_lifecycle's)."""
    acc, model, opt, _ = _build(9)
    register_checkpoint_state(acc, {"noise": torch.Generator()}, {"batches": -1})
    acc.load_state(path)
    return _local_state(model, opt)


def _reused_staging(root: str, acc: Any, snapshot: Any, train: Any, differences: Any) -> dict[str, Any]:
    """``reuse_staging_memory``: back-to-back saves (the second called while the first may be in flight, training
    in between) copy into the same host buffers, and each checkpoint restores exactly the state it saved."""
    from accelerate_txn.accelerate.config import checkpoint_config

    def buffers() -> set[int]:
        pool = checkpoint_config(acc).staging_pool
        return {b.data_ptr() for spare in pool._previous.values() for b in spare}

    obs: dict[str, Any] = {}
    configure_checkpointing(acc, reuse_staging_memory=True)
    expected = [snapshot()]
    first = acc.save_state(str(Path(root) / "reuse_1"))
    obs["reuse_pool_after_first"] = buffers()
    train(11)
    expected.append(snapshot())
    second = acc.save_state(str(Path(root) / "reuse_2"))  # waits for the first before copying into its buffers
    obs["reuse_first_done_when_second_returned"] = first.done()
    train(12)
    paths = [str(first.wait()), str(second.wait())]
    obs["reuse_pool_after_second"] = buffers()
    obs["reuse_differences"] = [differences(want, path) for want, path in zip(expected, paths, strict=True)]
    configure_checkpointing(acc, reuse_staging_memory=False)
    obs["reuse_pool_released"] = checkpoint_config(acc).staging_pool is None
    return obs


def _versioned(fsdp_version: int, seed: int, **kwargs: Any) -> tuple:
    """tests.scenarios.scenarios._build (FSDP1) or the FSDP2 equivalent of tests.scenarios.fsdp2_scenarios._build."""
    if fsdp_version == 1:
        return _build(seed, **kwargs)
    import functools

    from accelerate_txn.testing import TinyModel, fsdp_accelerator
    from tests.scenarios.scenarios import warmup_lambda

    accelerator = fsdp_accelerator(fsdp_version=2, **kwargs)
    torch.manual_seed(seed)
    raw = TinyModel()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
    return (accelerator, *accelerator.prepare(raw, optimizer, scheduler))


def async_killable(root: str, fsdp_version: int = 1) -> None:
    """Async saves every step; run with ``ACCELERATE_TXN_KILL_AT`` naming a background point of save 3."""
    acc, model, opt, sched = _versioned(fsdp_version, 0, project_dir=root, automatic_checkpoint_naming=True,
                                        total_limit=3)
    configure_checkpointing(acc, async_save=True)
    for step in range(3):
        _train(acc, model, opt, sched, 1, seed=step)
        acc.save_state()
    try:
        wait_for_checkpoint(acc)
    except CheckpointError:
        pass  # the killed rank's peers fail here; the test asserts on the directory
    raise AssertionError("unreachable: rank 1 is killed in the third save's background write")


def async_resume(root: str, fsdp_version: int = 1) -> dict[str, Any]:
    checkpoints = Path(root) / "checkpoints"
    obs: dict[str, Any] = {"before": _listing(checkpoints), "complete_before": _complete(checkpoints)}
    acc, model, opt, sched = _versioned(fsdp_version, 3, project_dir=root, automatic_checkpoint_naming=True,
                                        total_limit=3)
    configure_checkpointing(acc, async_save=True)
    acc.load_state()
    obs["next_iteration"] = acc.project_configuration.iteration
    _train(acc, model, opt, sched, 1, seed=99)
    acc.save_state()
    acc.end_training()  # waits for the background save before destroying the process group
    obs["after"] = _listing(checkpoints)
    return obs


def async_train_until_killed(root: str) -> None:
    """Async saves 1-3, then rank 0 marks that save 3 returned and both ranks train until killed."""
    acc, model, opt, sched = _build(0, project_dir=root, automatic_checkpoint_naming=True, total_limit=3)
    configure_checkpointing(acc, async_save=True)
    for step in range(3):
        _train(acc, model, opt, sched, 1, seed=step)
        acc.save_state()
    if acc.process_index == 0:
        Path(root, "third-save-returned").write_text("")
    step = 3
    while True:  # the background write of save 3 runs meanwhile; the test kills the job at a random instant
        _train(acc, model, opt, sched, 1, seed=step)
        step += 1


def load_right_after_async_save(root: str) -> dict[str, Any]:
    """``load_state()`` called while an asynchronous save is in flight waits for it and resumes from it."""
    acc, model, opt, sched = _build(0, project_dir=root, automatic_checkpoint_naming=True)
    configure_checkpointing(acc, async_save=True)
    _train(acc, model, opt, sched, 2, seed=1)
    handle = acc.save_state()
    expected = _local_state(model, opt)
    _train(acc, model, opt, sched, 1, seed=2)  # the live state moves on while the save is written
    acc.load_state()  # automatic selection: must wait for the save in flight, then restore it
    return {"published": handle.done(), "restored_from": acc.project_configuration.iteration - 1,
            "differences": _same(expected, _local_state(model, opt))}


# ------------------------------------------------------------------------------------- collective-free staging
_COUNTED = ("all_gather_into_tensor", "_all_gather_base", "all_gather", "all_reduce", "reduce_scatter_tensor",
            "broadcast", "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather_object")


_STATE_DICT_CODE = ("/torch/distributed/fsdp/", "/torch/distributed/checkpoint/state_dict.py")


def _from_state_dict_code() -> bool:
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename.replace("\\", "/") for part in _STATE_DICT_CODE):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _tensor_collectives() -> Iterator[list[str]]:
    """The collectives that FSDP's state-dict code (``torch.distributed.fsdp``, ``checkpoint.state_dict``) runs
    from this thread on the training (default) group while active: the unshards and optimizer-state gathers of a
    native sharded state dict. (accelerate-txn's own rank phases are not counted, and the background thread runs on
    its own thread and group.) Instrumentation, not a mock: every call goes through to the real collective."""
    import threading

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen: list[str] = []
    me = threading.get_ident()
    originals = {name: getattr(c10d, name) for name in _COUNTED}

    def counting(name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if (threading.get_ident() == me and (group is None or group == dist.group.WORLD)
                    and _from_state_dict_code()):
                seen.append(name)
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(c10d, name, counting(name, original))
        if getattr(dist, name, None) is original:
            setattr(dist, name, getattr(c10d, name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            if getattr(dist, name, None) is getattr(c10d, name):
                setattr(dist, name, original)
            setattr(c10d, name, original)


# --------------------------------------------------------------------------------------------------- FSDP2
def fsdp2_async(root: str) -> dict[str, Any]:
    """FSDP2 (DTensor) asynchronous save: collective-free staging in the caller, exact round trip with the
    protected loader and with native Accelerate, the same DCP entries and files as a synchronous save."""
    from accelerate_txn.accelerate.native import native_method
    from tests.scenarios.fsdp2_scenarios import _build as build2
    from tests.scenarios.fsdp2_scenarios import _dcp_entries, _differences, _snapshot
    from tests.scenarios.fsdp2_scenarios import _train as train2

    base = Path(root)
    obs: dict[str, Any] = {}
    acc, model, opt, sched = build2(0)
    configure_checkpointing(acc, async_save=True)
    train2(acc, model, opt, sched, 3, seed=1)
    expected = _snapshot(model, opt, sched)
    with _tensor_collectives() as seen:
        handle = acc.save_state(str(base / "async"))
    obs["caller_collectives"] = seen
    obs["handle_type"] = type(handle).__name__
    train2(acc, model, opt, sched, 2, seed=2)  # the live state moves on during the background write
    obs["published"] = str(handle.wait())
    obs["manifest"] = (base / "async" / accelerate_txn.MANIFEST).is_file()

    acc2, model2, opt2, sched2 = build2(7)
    acc2.load_state(str(base / "async"))
    obs["protected_differences"] = _differences(expected, _snapshot(model2, opt2, sched2))
    acc3, model3, opt3, sched3 = build2(8)
    native_method(acc3, "load_state")(str(base / "async"))  # native Accelerate's own FSDP2 loader
    obs["native_differences"] = _differences(expected, _snapshot(model3, opt3, sched3),
                                             ("params", "optim", "groups", "scheduler"))
    # A synchronous protected save of the restored (identical) state: the same files and DCP entries.
    acc2.save_state(str(base / "sync"), async_save=False)
    relative = lambda top: sorted(str(p.relative_to(top)) for p in Path(top).rglob("*"))  # noqa: E731
    obs["same_files_as_sync"] = relative(base / "async") == relative(base / "sync")
    obs["dcp_differences"] = sorted(
        f"{folder}:{key}" for folder in ("pytorch_model_fsdp_0", "optimizer_0")
        for key in set(_dcp_entries(base / "async" / folder)) | set(_dcp_entries(base / "sync" / folder))
        if _dcp_entries(base / "async" / folder).get(key) != _dcp_entries(base / "sync" / folder).get(key))

    def restored(path: str) -> dict[str, Any]:
        acc4, model4, opt4, sched4 = build2(9)
        acc4.load_state(path)
        return _snapshot(model4, opt4, sched4)

    obs.update(_reused_staging(root, acc, lambda: _snapshot(model, opt, sched),
                               lambda seed: train2(acc, model, opt, sched, 1, seed=seed),
                               lambda want, path: _differences(want, restored(path), ("params", "optim"))))
    return obs


# --------------------------------------------------------------------------------------------------- FSDP1
def _entries(directory: Path) -> dict[str, Any]:
    """Each DCP entry's path, global size and dtype (chunk boxes left out: they depend on who wrote them)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    return {key: (metadata.planner_data[key], tuple(getattr(stored, "size", ())),
                  str(getattr(getattr(stored, "properties", None), "dtype", "")))
            for key, stored in metadata.state_dict_metadata.items()}


def _build_buffered(seed: int, use_orig_params: bool) -> tuple:
    """tests.scenarios.scenarios._build's setup plus a persistent buffer (saved, per rank) and a non-persistent one."""
    import functools

    from accelerate_txn.testing import TinyModel, fsdp_accelerator
    from tests.scenarios.scenarios import warmup_lambda

    accelerator = fsdp_accelerator(use_orig_params=use_orig_params)
    torch.manual_seed(seed)
    raw = TinyModel()
    raw.body[0].register_buffer("scale", torch.rand(3, 2))
    raw.head.register_buffer("scratch", torch.rand(4), persistent=False)
    model = accelerator.prepare(raw)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_lambda, warmup=3))
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _buffers(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return {clean_tensor_name(name): buffer.clone() for name, buffer in model.named_buffers()}


def _first_error(exc: BaseException) -> str:
    """The underlying message of a (DCP-wrapped) load error, without rank-specific tracebacks."""
    import re

    found = re.findall(r"(?:RuntimeError|KeyError): ([^\n]+)", str(exc))
    return found[0] if found else str(exc).splitlines()[0]


def fsdp1_collective_free(root: str, use_orig_params: bool) -> dict[str, Any]:
    """FSDP1 asynchronous save: the caller stages local shards without FSDP collectives; the files hold the
    same DCP entries as native Accelerate's own (collective-built) save and a synchronous protected save, and
    restore exactly with the protected loader and with native Accelerate's load_state."""
    from torch.distributed.checkpoint.api import CheckpointException

    from accelerate_txn.accelerate.native import native_method
    from accelerate_txn.core.manifest import read_dcp_metadata
    from accelerate_txn.fsdp.dcp_optimizer import saved_groups as _saved_groups

    base = Path(root)
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build_buffered(0, use_orig_params)
    configure_checkpointing(acc, async_save=True)
    _train(acc, model, opt, sched, 3, seed=1)
    expected = _local_state(model, opt)
    expected_buffers = _buffers(model)
    with _tensor_collectives() as seen:
        handle = acc.save_state(str(base / "async"))
    obs["async_collectives"] = seen
    _train(acc, model, opt, sched, 2, seed=2)  # the live state moves on during the background write
    handle.wait()

    acc2, model2, opt2, _ = _build_buffered(7, use_orig_params)
    acc2.load_state(str(base / "async"))
    obs["protected_differences"] = _same(expected, _local_state(model2, opt2))
    restored = _buffers(model2)
    obs["persistent_buffer_restored"] = torch.equal(restored["body.0.scale"], expected_buffers["body.0.scale"])
    # Native Accelerate restores optimizer state only into an optimizer that already has state: one step first.
    # Accelerate 1.7-1.12's native FSDP1 optimizer load fails on its own synchronous checkpoints too ("Missing key
    # ... step"): there, check that native load fails the same way on both.
    acc3, model3, opt3, sched3 = _build_buffered(8, use_orig_params)
    _train(acc3, model3, opt3, sched3, 1, seed=3)
    try:
        native_method(acc3, "load_state")(str(base / "async"))
        obs["native_differences"] = _same(expected, _local_state(model3, opt3))
    except (RuntimeError, CheckpointException) as exc:  # DCP wraps the rank's error
        obs["native_differences"] = None
        obs["native_async_error"] = _first_error(exc)
    # Native Accelerate's own save of the same (restored) state is built by native FSDP1, with its collectives;
    # a synchronous protected save (collective-free too: tests/fsdp/test_sync_capture.py) writes the same files.
    with _tensor_collectives() as seen_native:
        native_method(acc2, "save_state")(str(base / "native"))
    obs["sync_collectives"] = len(seen_native)
    acc2.save_state(str(base / "sync"), async_save=False)
    relative = lambda top: sorted(str(p.relative_to(top)) for p in Path(top).rglob("*"))  # noqa: E731
    obs["same_files_as_sync"] = relative(base / "async") == relative(base / "sync")
    if obs["native_differences"] is None:  # the same native failure on native Accelerate's own files
        acc4, model4, opt4, sched4 = _build_buffered(9, use_orig_params)
        _train(acc4, model4, opt4, sched4, 1, seed=3)
        try:
            native_method(acc4, "load_state")(str(base / "native"))
            obs["native_sync_error"] = None
        except (RuntimeError, CheckpointException) as exc:
            obs["native_sync_error"] = _first_error(exc)
    obs["dcp_differences"] = sorted(
        f"{name}/{folder}:{key}" for name in ("async", "sync") for folder in ("pytorch_model_fsdp_0", "optimizer_0")
        for key in set(_entries(base / name / folder)) | set(_entries(base / "native" / folder))
        if _entries(base / name / folder).get(key) != _entries(base / "native" / folder).get(key))
    obs["dcp_entries"] = len(_entries(base / "async" / "optimizer_0"))
    groups = [_saved_groups(read_dcp_metadata(base / name / "optimizer_0"), base / name / "optimizer_0")
              for name in ("async", "sync", "native")]
    obs["same_param_groups"] = groups[0]["param_groups"] == groups[1]["param_groups"] == groups[2]["param_groups"]

    # A rank that cannot stage locally (a user state-dict hook on rank 1's model only) makes every rank build the
    # model state dict natively: no rank waits in a collective the others never join.
    if acc2.process_index == 1:
        model2._register_state_dict_hook(lambda module, state, prefix, local_metadata: None)
    configure_checkpointing(acc2, async_save=True)
    with _tensor_collectives() as seen_declined:
        declined = acc2.save_state(str(base / "declined"))
    declined.wait()
    obs["declined_collectives"] = len(seen_declined)
    acc4, model4, opt4, _ = _build_buffered(9, use_orig_params)
    acc4.load_state(str(base / "declined"))
    obs["declined_differences"] = _same(expected, _local_state(model4, opt4))
    return obs


# --------------------------------------------------------------- exact: any mutation after save_state returned
def _mutations(fsdp_version: int) -> dict[str, Any]:
    """In-place changes a training script may make right after an asynchronous ``save_state`` returned, each a
    function of (model, optimizer, rank). None of them goes through ``optimizer.step``; several bypass autograd's
    version counters (``.data``, ``to_local()``, ``_foreach_`` under ``no_grad``)."""

    def params(model: Any) -> list[Any]:
        return list(model.parameters())

    def state(optimizer: Any) -> list[dict[str, Any]]:
        raw = getattr(optimizer, "optimizer", optimizer)
        return [s for s in raw.state.values() if s]

    def data_add(model: Any, optimizer: Any, rank: int) -> None:
        for p in params(model):
            p.data.add_(1.0)

    def manual_update(model: Any, optimizer: Any, rank: int) -> None:
        for p in params(model):  # a hand-written SGD step through .data
            p.data.sub_(0.5 * torch.ones_like(p.data))

    def foreach_mul(model: Any, optimizer: Any, rank: int) -> None:
        with torch.no_grad():  # an EMA-style update with the fused list ops
            torch._foreach_mul_(params(model), 0.5)

    def clamp(model: Any, optimizer: Any, rank: int) -> None:
        for p in params(model):  # weight clipping
            p.data.clamp_(-1e-3, 1e-3)

    def moments_fill(model: Any, optimizer: Any, rank: int) -> None:
        for s in state(optimizer):
            s["exp_avg_sq"].data.fill_(7.0)
            s["exp_avg"].mul_(3.0)

    def load_state_dict(model: Any, optimizer: Any, rank: int) -> None:
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})

    def set_storage(model: Any, optimizer: Any, rank: int) -> None:
        with torch.no_grad():
            for p in params(model):  # the parameter moved to new memory (a DTensor's too)
                p.data = torch.full_like(p.data, 3.0)

    def other_optimizer(model: Any, optimizer: Any, rank: int) -> None:
        extra = torch.optim.SGD(model.parameters(), lr=10.0)
        for p in params(model):
            p.grad = torch.ones_like(p)
        extra.step()
        extra.zero_grad(set_to_none=True)

    def one_rank_only(model: Any, optimizer: Any, rank: int) -> None:
        if rank == 1:
            data_add(model, optimizer, rank)

    found = {"p.data.add_": data_add, "manual update through p.data": manual_update,
             "torch._foreach_mul_ under no_grad": foreach_mul, "p.data.clamp_": clamp,
             "optimizer state .data.fill_ and mul_": moments_fill, "model.load_state_dict": load_state_dict,
             "another optimizer's step": other_optimizer,
             "one rank only": one_rank_only}
    if fsdp_version == 2:

        def to_local_mul(model: Any, optimizer: Any, rank: int) -> None:
            with torch.no_grad():  # a write below the DTensor dispatch
                for p in params(model):
                    p.to_local().mul_(2.0)

        found["p.to_local().mul_"] = to_local_mul
    else:  # FSDP1 (use_orig_params): the parameter rebound to new memory (a DTensor keeps its local tensor)
        found["new memory through p.data ="] = set_storage
    return found


def async_exact_under_mutation(root: str, fsdp_version: int) -> dict[str, Any]:
    """An asynchronous save holds the state at the moment ``save_state`` returned, whatever the script does next:
    for each mutation, the background writes are held back (a gate on DCP's ``save``: no sleep) until the script
    has mutated the live state, then the checkpoint is restored into a fresh model and compared bitwise with the
    state at ``save_state``."""
    from tests.scenarios.fsdp2_scenarios import _build as build2
    from tests.scenarios.fsdp2_scenarios import _differences, _snapshot

    build = build2 if fsdp_version == 2 else _build
    rank = int(os.environ["RANK"])
    base = Path(root)
    obs: dict[str, Any] = {"differences": {}, "live_changed": {}, "errors": {}}
    acc, model, opt, sched = build(0)
    configure_checkpointing(acc, async_save=True)
    with held_dcp_writes() as gate:
        for index, (name, mutate) in enumerate(_mutations(fsdp_version).items()):
            _train(acc, model, opt, sched, 1, seed=10 + index)
            expected = _snapshot(model, opt, sched)
            gate.clear()
            try:
                handle = acc.save_state(str(base / f"m{index}"))
                mutate(model, opt, rank)  # before anything was written
            finally:
                gate.set()
            obs["errors"][name] = _error(handle.wait)
            obs["live_changed"][name] = _differences(expected, _snapshot(model, opt, sched),
                                                     ("params", "optim")) != []
            acc2, model2, opt2, sched2 = build(9)
            acc2.load_state(str(base / f"m{index}"))
            obs["differences"][name] = _differences(expected, _snapshot(model2, opt2, sched2),
                                                    ("params", "optim", "groups"))
            acc.load_state(str(base / f"m{index}"))  # the next case starts from a sane state
    acc.end_training()
    return obs
