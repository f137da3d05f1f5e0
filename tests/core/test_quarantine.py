"""Quarantine (``core.quarantine``, ``accelerate_txn.quarantine_checkpoint``/``release_checkpoint``): a complete
checkpoint set aside by an operator or a script is skipped by automatic selection (``load_state()`` falls back to the
previous complete checkpoint), never counted nor deleted by retention, still loaded (with a WARNING) from its explicit
path, and its files never change: the mark is a JSON file beside it.

Checkpoints are real: published by a one-process Accelerator (``protect="all"``, automatic naming) or by
``save_training_checkpoint``; the restores are real ``load_state()`` calls."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_txn
from accelerate_txn import MANIFEST, latest_training_checkpoint, save_training_checkpoint
from accelerate_txn.core import quarantine
from accelerate_txn.core.manifest import read_manifest, verify_manifest
from accelerate_txn.core.select import complete_run_id, prune
from accelerate_txn.errors import CheckpointConfigurationError, CheckpointLockedError, NoCheckpointError
from accelerate_txn.store.posix import POSIX, InUse, retire
from tests.support.single import stepped_accelerator

REASON = "loss NaN 3 steps after resume"


def _step(accelerator: Any, model: Any, optimizer: Any) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _run(tmp_path: Path, total_limit: int | None = None) -> tuple[Any, Any, Any]:
    project = {"project_dir": str(tmp_path), "automatic_checkpoint_naming": True}
    if total_limit is not None:
        project["total_limit"] = total_limit
    accelerator, model, optimizer = stepped_accelerator(0, **project)
    accelerate_txn.configure_checkpointing(accelerator, protect="all")
    return accelerator, model, optimizer


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _same(model: Any, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(weights[name], p) for name, p in model.named_parameters())


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_script_sets_the_newest_aside_and_load_state_falls_back_then_release_brings_it_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    accelerator, model, optimizer = _run(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    accelerator.save_state()
    older = _weights(model)
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    newest = _weights(model)
    assert not _same(model, older)
    bad = checkpoints / "checkpoint_1"
    before = _tree(bad)

    mark = accelerate_txn.quarantine_checkpoint(bad, reason=REASON)
    assert mark["reason"] == REASON and mark["checkpoint"] == "checkpoint_1" and mark["released"] is None
    assert mark["user"] and mark["host"] and mark["time"].endswith("Z") and mark["pid"] == os.getpid()
    assert mark["transaction_id"] == read_manifest(bad)["transaction_id"]
    assert _tree(bad) == before  # nothing inside the checkpoint changed: it still verifies
    verify_manifest(bad, read_manifest(bad), full=True)
    assert (checkpoints / ".checkpoint_1.quarantine.json").is_file()

    _step(accelerator, model, optimizer)  # the diverged run goes on a little, then falls back
    caplog.set_level(logging.WARNING)
    accelerator.load_state()
    assert _same(model, older)
    assert any("Skipping checkpoint" in r.getMessage() and REASON in r.getMessage() for r in caplog.records)
    assert latest_training_checkpoint(checkpoints) == str(checkpoints / "checkpoint_0")

    released = accelerate_txn.release_checkpoint(bad)
    assert released is not None and released["released"]["user"] and released["reason"] == REASON
    record = json.loads((checkpoints / ".checkpoint_1.quarantine.json").read_text())
    assert record["released"] == released["released"]  # who released it stays on record
    accelerator.load_state()
    assert _same(model, newest)
    assert accelerate_txn.release_checkpoint(bad) is None  # nothing left to release: no change


def test_the_usage_page_loop_falls_back_with_the_path_load_training_checkpoint_returns(tmp_path: Path) -> None:
    # docs/usage.md "Setting a checkpoint aside": the path the resume returns is the one set aside, and the next
    # load_training_checkpoint returns the previous complete checkpoint.
    accelerator, model, optimizer = _run(tmp_path)
    accelerator.save_state()
    older = _weights(model)
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    resumed = accelerate_txn.load_training_checkpoint(accelerator)
    assert Path(resumed) == tmp_path / "checkpoints" / "checkpoint_1"
    _step(accelerator, model, optimizer)
    accelerate_txn.quarantine_checkpoint(resumed, reason="loss nan at step 3 after resume")
    resumed = accelerate_txn.load_training_checkpoint(accelerator)
    assert Path(resumed) == tmp_path / "checkpoints" / "checkpoint_0" and _same(model, older)


def test_an_explicit_path_still_loads_a_quarantined_checkpoint_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    accelerator, model, optimizer = _run(tmp_path)
    accelerator.save_state()
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    newest = _weights(model)
    bad = tmp_path / "checkpoints" / "checkpoint_1"
    accelerate_txn.quarantine_checkpoint(bad, reason=REASON)
    _step(accelerator, model, optimizer)
    caplog.set_level(logging.WARNING)
    accelerator.load_state(str(bad))
    assert _same(model, newest)
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Loading ")]
    assert str(bad) in warning and REASON in warning and f"accelerate-txn release {bad}" in warning


def test_retention_never_counts_nor_deletes_a_quarantined_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    accelerator, model, optimizer = _run(tmp_path, total_limit=2)
    checkpoints = tmp_path / "checkpoints"
    accelerator.save_state()
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    accelerate_txn.quarantine_checkpoint(checkpoints / "checkpoint_1", reason=REASON)
    accelerator.load_state()  # back to checkpoint_0; the next saves are checkpoint_2, 3, 4
    caplog.set_level(logging.INFO, logger="accelerate_txn.core.select")
    for _ in range(3):
        _step(accelerator, model, optimizer)
        accelerator.save_state()
    names = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint_1", "checkpoint_3", "checkpoint_4"]  # two selectable besides the quarantined one
    kept = [r.getMessage() for r in caplog.records if "keeping" in r.getMessage() and "checkpoint_1" in r.getMessage()]
    assert len(kept) == 3 and all(REASON in line and "out of the count" in line for line in kept)
    # Released, it counts again: the next retention deletes it (the oldest), and its mark goes with it.
    accelerate_txn.release_checkpoint(checkpoints / "checkpoint_1")
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["checkpoint_4", "checkpoint_5"]
    assert not (checkpoints / ".checkpoint_1.quarantine.json").exists()


def test_a_quarantine_written_after_retention_listed_still_keeps_the_checkpoint(tmp_path: Path) -> None:
    # The mark lands between retention's listing and its rename: retention asks again while it holds the directory
    # claimed (store.retire's keep_if), so the decision it took from the older listing cannot delete it.
    accelerator = stepped_accelerator()[0]
    for number in range(3):
        save_training_checkpoint(accelerator, tmp_path / f"checkpoint_{number}")
    run_id = complete_run_id(tmp_path / "checkpoint_0")

    class LateQuarantine:
        def retire(self, path: Path, run: str, *, keep_if: Any = None) -> Path:
            accelerate_txn.quarantine_checkpoint(path, reason=REASON)
            return POSIX.retire(path, run, keep_if=keep_if)

        def remove_tree(self, path: Path) -> None:
            POSIX.remove_tree(path)

    deleted = prune(tmp_path, run_id, 1, tmp_path / "checkpoint_2", store=LateQuarantine())  # type: ignore[arg-type]
    assert deleted == []
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_retire_refuses_while_a_quarantine_holds_the_checkpoint(tmp_path: Path) -> None:
    # A quarantine writes its mark while holding the directory in use: a retention claiming it meanwhile keeps it.
    accelerator = stepped_accelerator()[0]
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_0")
    target = tmp_path / "checkpoint_0"
    hold = InUse(target)
    assert hold.acquire()
    try:
        with pytest.raises(CheckpointLockedError, match="in use"):
            retire(target, "r0")
    finally:
        hold.release()
    with pytest.raises(CheckpointLockedError, match=f"is kept: {REASON}"):
        retire(target, "r0", keep_if=lambda _path: REASON)
    assert (target / MANIFEST).is_file()


def test_the_mark_binds_one_transaction_a_replacing_save_is_not_set_aside(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The Trainer saves checkpoint-12 again after falling back to checkpoint-10: the new checkpoint is not the one the
    # operator set aside. The replacement's warning names the quarantine it ends.
    accelerator = stepped_accelerator()[0]
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_0")
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_1")
    accelerate_txn.quarantine_checkpoint(tmp_path / "checkpoint_1", reason=REASON)
    assert latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint_0")
    caplog.set_level(logging.WARNING)
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_1")
    replacing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Replacing ")]
    assert replacing and REASON in replacing[0] and "does not apply to the new checkpoint" in replacing[0]
    assert latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint_1")
    assert quarantine.read_local(tmp_path / "checkpoint_1").reason == REASON  # the record stays, bound to the old one


def test_quarantining_again_changes_nothing_and_a_new_reason_keeps_the_old_in_history(tmp_path: Path) -> None:
    # Every rank may call it: the second call finds the same mark and writes nothing.
    accelerator = stepped_accelerator()[0]
    target = tmp_path / "checkpoint_0"
    save_training_checkpoint(accelerator, target)
    first = accelerate_txn.quarantine_checkpoint(target, reason=REASON)
    written = (tmp_path / ".checkpoint_0.quarantine.json").stat()
    assert accelerate_txn.quarantine_checkpoint(target, reason=f"  {REASON} ") == first
    again = (tmp_path / ".checkpoint_0.quarantine.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    accelerate_txn.quarantine_checkpoint(target, reason="grad norm 1e9")
    record = json.loads((tmp_path / ".checkpoint_0.quarantine.json").read_text())
    assert record["reason"] == "grad norm 1e9" and [entry["reason"] for entry in record["history"]] == [REASON]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".accelerate-txn.lock", ".checkpoint_0.quarantine.json",
                                                          "checkpoint_0"]  # no temporary left, no in-use file


def test_what_is_not_a_complete_checkpoint_is_refused(tmp_path: Path) -> None:
    accelerator = stepped_accelerator()[0]
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_0")
    legacy = tmp_path / "checkpoint_1"
    legacy.mkdir()
    (legacy / "random_states_0.pkl").write_bytes(b"native")
    staging = tmp_path / ".checkpoint_2.staging-abc-def"
    staging.mkdir()
    other = tmp_path / "notes"
    other.mkdir()
    link = tmp_path / "checkpoint_3"
    link.symlink_to(tmp_path / "checkpoint_0")
    with pytest.raises(CheckpointConfigurationError, match=r"has no checkpoint manifest.*legacy"):
        accelerate_txn.quarantine_checkpoint(legacy, reason=REASON)
    with pytest.raises(CheckpointConfigurationError, match="staging"):
        accelerate_txn.quarantine_checkpoint(staging, reason=REASON)
    with pytest.raises(CheckpointConfigurationError, match="has no checkpoint manifest"):
        accelerate_txn.quarantine_checkpoint(other, reason=REASON)
    with pytest.raises(CheckpointConfigurationError, match="symbolic link"):
        accelerate_txn.quarantine_checkpoint(link, reason=REASON)
    with pytest.raises(NoCheckpointError, match="does not exist"):
        accelerate_txn.quarantine_checkpoint(tmp_path / "checkpoint_9", reason=REASON)
    with pytest.raises(CheckpointConfigurationError, match="needs a reason"):
        accelerate_txn.quarantine_checkpoint(tmp_path / "checkpoint_0", reason="  ")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(quarantine.SUFFIX)) == []


def test_an_unreadable_mark_sets_the_checkpoint_aside_until_released(tmp_path: Path) -> None:
    accelerator = stepped_accelerator()[0]
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_0")
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_1")
    (tmp_path / ".checkpoint_1.quarantine.json").write_text("{not json")
    assert latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint_0")
    released = accelerate_txn.release_checkpoint(tmp_path / "checkpoint_1")
    assert released is not None and "unreadable" in released["reason"]
    assert latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint_1")


def test_every_checkpoint_set_aside_is_no_checkpoint_at_all_and_says_why(tmp_path: Path) -> None:
    accelerator = stepped_accelerator()[0]
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_0")
    accelerate_txn.quarantine_checkpoint(tmp_path / "checkpoint_0", reason=REASON)
    with pytest.raises(NoCheckpointError, match=rf"checkpoint_0: quarantined by .*{REASON}"):
        latest_training_checkpoint(tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_every_rank_of_an_fsdp_job_sets_the_checkpoint_aside_and_load_state_falls_back(tmp_path: Path) -> None:
    from accelerate_txn.testing import launch

    ranks = launch("tests.scenarios.quarantine_scenarios:fall_back_on_every_rank", 2, args=(str(tmp_path),),
                   timeout=400)
    for obs in ranks:
        assert obs["mark"]["reason"] == REASON and obs["mark"]["checkpoint"] == "checkpoint_1"
        assert obs["fell_back"] == [] and obs["back"] == []  # each rank's own shards, bitwise
        assert obs["names"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=1 besides the quarantined one
    assert [obs["released"] for obs in ranks] == [True, False]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if ".tmp" in p.name] == []
