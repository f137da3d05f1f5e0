"""``accelerate-txn quarantine CHECKPOINT --reason TEXT`` and ``release CHECKPOINT``, and what the other commands show
of a quarantined checkpoint: ``list`` (status ``quarantined`` with the reason, never the one a resume takes),
``latest`` (skips it), ``verify`` (still verifies it, and says so), ``inspect`` (says so), ``prune`` (neither counts
nor deletes it, and says so). Exit statuses: 0 done, 2 for what is not a complete checkpoint or a missing reason.

Checkpoints are real: published by a one-process Accelerator (``save_training_checkpoint``), in a directory and under
an ``s3://`` prefix of the loopback S3 server."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import save_training_checkpoint
from tests.support.single import stepped_accelerator

REASON = "loss NaN 3 steps after resume"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory with checkpoint_0..2 of one run."""
    accelerator = stepped_accelerator()[0]
    for number in range(3):
        save_training_checkpoint(accelerator, tmp_path / f"checkpoint_{number}")
    return tmp_path


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_quarantine_sets_a_checkpoint_aside_for_list_latest_verify_inspect_and_prune(cli: Any, run: Path) -> None:
    target = run / "checkpoint_2"
    before = _tree(target)
    done = cli("quarantine", target, "--reason", REASON)
    assert done.code == 0, done.err
    assert f"{target}: quarantined by " in done.out and REASON in done.out and f"accelerate-txn release {target}" in done.out
    assert _tree(target) == before
    record = json.loads((run / ".checkpoint_2.quarantine.json").read_text())
    assert record["reason"] == REASON and record["user"] and record["host"] and record["released"] is None

    listed = cli("list", run, "--json")
    rows = {row["name"]: row for row in listed.json()["checkpoints"]}
    assert rows["checkpoint_2"]["status"] == "quarantined" and rows["checkpoint_2"]["quarantine"]["reason"] == REASON
    assert REASON in rows["checkpoint_2"]["reason"] and not rows["checkpoint_2"]["would_load"]
    assert listed.json()["would_load"] == str(run / "checkpoint_1") and rows["checkpoint_1"]["quarantine"] is None
    table = cli("list", run)
    assert "quarantined" in table.out and "checkpoint_2: quarantined by" in table.out
    assert "load_state() would resume from checkpoint_1" in table.out

    latest = cli("latest", run)
    assert latest.code == 0 and latest.out.strip() == str(run / "checkpoint_1")

    verified = cli("verify", target, "--full")
    assert verified.code == 0 and f"{target}: valid" in verified.out and REASON in verified.out, verified.err
    assert cli("verify", target, "--json").json()["quarantine"]["reason"] == REASON
    inspected = cli("inspect", target)
    assert inspected.code == 0 and REASON in inspected.out and "'accelerate-txn release" in inspected.out
    assert cli("inspect", target, "--json").json()["quarantine"]["reason"] == REASON

    planned = cli("prune", run, "--keep", "1", "--dry-run", "--json").json()
    assert planned["would_delete"] == [str(run / "checkpoint_0")] and str(target) not in planned["kept"]
    pruned = cli("prune", run, "--keep", "1")
    assert pruned.code == 0 and "deleted: checkpoint_0" in pruned.out, pruned.err
    assert "quarantined (never counted nor deleted): checkpoint_2" in pruned.out
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["checkpoint_1", "checkpoint_2"]

    released = cli("release", target, "--json")
    assert released.code == 0 and released.json()["released"] and released.json()["mark"]["released"]["user"]
    assert cli("latest", run).out.strip() == str(target)
    again = cli("release", target)
    assert again.code == 0 and "is not quarantined: nothing to release" in again.out


def test_quarantining_again_is_unchanged_and_every_checkpoint_set_aside_leaves_latest_with_none(cli: Any,
                                                                                             run: Path) -> None:
    for number in range(3):
        assert cli("quarantine", run / f"checkpoint_{number}", "--reason", REASON).code == 0
    same = cli("quarantine", run / "checkpoint_0", "--reason", REASON, "--json")
    assert same.code == 0 and same.json()["changed"] is False and same.json()["quarantined"] is True
    none = cli("latest", run)
    assert none.code == 1 and none.out == "" and "checkpoint_2: quarantined by" in none.err and REASON in none.err
    assert "would find no checkpoint to resume from" in cli("list", run).out


def test_what_is_not_a_complete_checkpoint_is_a_usage_error(cli: Any, run: Path) -> None:
    legacy = run / "checkpoint_7"
    legacy.mkdir()
    (legacy / "random_states_0.pkl").write_bytes(b"native")
    staging = run / ".checkpoint_8.staging-abc-def"
    staging.mkdir()
    cases = {legacy: "has no checkpoint manifest", staging: "staging", run: "is a run directory",
             run / "checkpoint_0" / "random_states_0.pkl": "a file, not a checkpoint directory"}
    for path, words in cases.items():
        refused = cli("quarantine", path, "--reason", REASON)
        assert refused.code == 2 and words in refused.err and refused.out == "", (path, refused.err)
    assert cli("quarantine", run / "checkpoint_0").code == 2  # --reason is required
    empty = cli("quarantine", run / "checkpoint_0", "--reason", " ")
    assert empty.code == 2 and "needs a reason" in empty.err
    assert not list(run.glob(".*.quarantine.json"))


def test_a_checkpoint_under_an_s3_prefix(cli: Any, s3_server: Any) -> None:
    from tests.support.s3_server import BUCKET

    prefix = f"s3://{BUCKET}/cli-quarantine-{uuid.uuid4().hex[:8]}"
    accelerator = stepped_accelerator()[0]
    for number in range(2):
        save_training_checkpoint(accelerator, f"{prefix}/checkpoint_{number}")
    target = f"{prefix}/checkpoint_1"
    assert cli("quarantine", target, "--reason", REASON).code == 0
    listed = cli("list", prefix, "--json").json()
    assert {row["name"]: row["status"] for row in listed["checkpoints"]} == {"checkpoint_1": "quarantined",
                                                                             "checkpoint_0": "complete"}
    assert listed["would_load"] == f"{prefix}/checkpoint_0"
    latest = cli("latest", prefix)
    assert latest.code == 0 and latest.out.strip() == f"{prefix}/checkpoint_0"
    verified = cli("verify", target)
    assert verified.code == 0 and REASON in verified.out
    assert cli("prune", prefix, "--keep", "1").code == 0
    assert sorted(row["name"] for row in cli("list", prefix, "--json").json()["checkpoints"]) == [
        "checkpoint_0", "checkpoint_1"]  # nothing counted beyond the one selectable checkpoint: nothing deleted
    assert cli("release", target).code == 0
    assert cli("latest", prefix).out.strip() == target
    assert cli("quarantine", f"{prefix}/checkpoint_9", "--reason", REASON).code == 2  # nothing there
