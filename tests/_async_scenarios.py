"""Asynchronous protected saves, run inside launched ranks (real gloo, real Accelerate FSDP1, real DCP files).

Each scenario makes several checks in one process group and returns observations for tests/test_async_save.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn import CheckpointError, configure_checkpointing, register_checkpoint_state, wait_for_checkpoint
from tests._scenarios import _build, _error, _local_state, _same, _train


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

    from accelerate_txn import _async

    group = _async.background_group()
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
    return obs


def async_killable(root: str) -> None:
    """Async saves every step; run with ``ACCELERATE_TXN_KILL_AT`` naming a background point of save 3."""
    acc, model, opt, sched = _build(0, project_dir=root, automatic_checkpoint_naming=True, total_limit=3)
    configure_checkpointing(acc, async_save=True)
    for step in range(3):
        _train(acc, model, opt, sched, 1, seed=step)
        acc.save_state()
    try:
        wait_for_checkpoint(acc)
    except CheckpointError:
        pass  # the killed rank's peers fail here; the test asserts on the directory
    raise AssertionError("unreachable: rank 1 is killed in the third save's background write")


def async_resume(root: str) -> dict[str, Any]:
    checkpoints = Path(root) / "checkpoints"
    obs: dict[str, Any] = {"before": _listing(checkpoints), "complete_before": _complete(checkpoints)}
    acc, model, opt, sched = _build(3, project_dir=root, automatic_checkpoint_naming=True, total_limit=3)
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
