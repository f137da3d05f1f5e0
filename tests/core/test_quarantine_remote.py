"""Quarantine in object storage (``core.quarantine`` on ``core.remote``'s layout), on the loopback S3 server, Azurite
and the fake GCS server (``tests.support``): the mark is one object beside the checkpoint's prefix, written
create-only; the checkpoint's own objects never change; retention under the prefix neither counts nor deletes a
quarantined checkpoint; a mirrored run (``configure_checkpointing(mirror=...)``) skips a checkpoint set aside in either
tier, and ``load_state()`` falls back to the previous one.

Checkpoints are real: a one-process Accelerator (``protect="all"``) saves them to URLs and to a mirrored local tier."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_txn
from accelerate_txn import MANIFEST, save_training_checkpoint
from accelerate_txn.core import quarantine
from accelerate_txn.core import remote as objects
from accelerate_txn.store import object_store
from tests.support.single import stepped_accelerator

pytestmark = [pytest.mark.timeout(600)]
REASON = "loss NaN 3 steps after resume"


@pytest.fixture(params=["s3", "az", "gs"])
def prefix(request: pytest.FixtureRequest) -> str:
    """A fresh prefix on the loopback server of each kind of object store."""
    if request.param == "s3":
        from tests.support.s3_server import BUCKET

        request.getfixturevalue("s3_server")
        return f"s3://{BUCKET}/quarantine-{uuid.uuid4().hex[:8]}"
    if request.param == "az":
        from tests.support.azurite import CONTAINER

        request.getfixturevalue("azurite")
        return f"az://{CONTAINER}/quarantine-{uuid.uuid4().hex[:8]}"
    from tests.support.fakegcs import BUCKET as GCS_BUCKET

    request.getfixturevalue("fake_gcs")
    return f"gs://{GCS_BUCKET}/quarantine-{uuid.uuid4().hex[:8]}"


def _accelerator(tmp_path: Path, **project: Any) -> tuple[Any, Any, Any]:
    accelerator, model, optimizer = stepped_accelerator(0, **project)
    accelerate_txn.configure_checkpointing(accelerator, protect="all", cache_dir=tmp_path / "cache")
    return accelerator, model, optimizer


def _step(model: Any, optimizer: Any) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _objects(prefix: str, name: str) -> dict[str, int]:
    return object_store(prefix).list(f"{prefix}/{name}")


def test_a_mark_beside_a_prefix_sets_the_checkpoint_aside_and_retention_keeps_it(prefix: str, tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    accelerator, model, optimizer = _accelerator(tmp_path)
    for number in range(3):
        save_training_checkpoint(accelerator, f"{prefix}/checkpoint_{number}")
        _step(model, optimizer)
    store = object_store(prefix)
    run_id = objects.read_manifest(store, f"{prefix}/checkpoint_0")["run_id"]
    before = _objects(prefix, "checkpoint_0")

    mark = accelerate_txn.quarantine_checkpoint(f"{prefix}/checkpoint_0", reason=REASON)
    assert mark["reason"] == REASON and mark["checkpoint"] == "checkpoint_0"
    assert _objects(prefix, "checkpoint_0") == before  # nothing under the checkpoint's prefix changed
    assert store.size(f"{prefix}/.checkpoint_0{quarantine.SUFFIX}") is not None
    assert [name for name in objects.layout(store, prefix)] and ".checkpoint_0.quarantine.json" not in objects.layout(
        store, prefix)  # the layout of checkpoints does not take the mark for one
    assert quarantine.remote_mark(store, f"{prefix}/checkpoint_0").reason == REASON
    assert accelerate_txn.quarantine_checkpoint(f"{prefix}/checkpoint_0", reason=REASON) == mark  # unchanged

    caplog.set_level(logging.INFO, logger="accelerate_txn.core.remote")
    deleted = objects.prune(store, prefix, run_id, 1)
    assert deleted == [f"{prefix}/checkpoint_1"]  # limit 1 of the selectable ones: checkpoint_2 stays, 0 is kept aside
    assert _objects(prefix, "checkpoint_0") == before
    assert any("keeping" in r.getMessage() and REASON in r.getMessage() for r in caplog.records)

    released = accelerate_txn.release_checkpoint(f"{prefix}/checkpoint_0")
    assert released is not None and released["released"] is not None
    assert quarantine.remote_mark(store, f"{prefix}/checkpoint_0") is None
    assert quarantine.read_remote(store, f"{prefix}/checkpoint_0").released == released["released"]  # on record
    assert objects.prune(store, prefix, run_id, 1) == [f"{prefix}/checkpoint_0"]  # counted again


def test_a_mirrored_run_skips_a_checkpoint_set_aside_in_either_tier(prefix: str, tmp_path: Path) -> None:
    accelerator, model, optimizer = _accelerator(tmp_path, project_dir=str(tmp_path / "run"),
                                                 automatic_checkpoint_naming=True)
    accelerate_txn.configure_checkpointing(accelerator, mirror=prefix)
    weights = []
    for _ in range(3):
        accelerator.save_state()
        accelerate_txn.wait_for_checkpoint(accelerator)
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
        _step(model, optimizer)
    local = tmp_path / "run" / "checkpoints"
    store = object_store(prefix)
    assert objects.read_manifest(store, f"{prefix}/checkpoint_2") is not None  # mirrored

    def restored() -> int:
        accelerator.load_state()
        return next(index for index, saved in enumerate(weights)
                    if all(torch.equal(saved[name], p) for name, p in model.named_parameters()))

    assert restored() == 2
    accelerate_txn.quarantine_checkpoint(local / "checkpoint_2", reason=REASON)  # the local copy only
    assert restored() == 1  # not the mirror's copy of the same checkpoint either
    accelerate_txn.quarantine_checkpoint(f"{prefix}/checkpoint_1", reason=REASON)  # the mirror's copy only
    assert restored() == 0  # nor the local copy of it
    accelerate_txn.release_checkpoint(local / "checkpoint_2")
    assert restored() == 2
    assert (local / "checkpoint_1" / MANIFEST).is_file() and (local / "checkpoint_2" / MANIFEST).is_file()


def test_an_explicit_url_still_loads_with_a_warning(prefix: str, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    accelerator, model, _optimizer = _accelerator(tmp_path)
    save_training_checkpoint(accelerator, f"{prefix}/checkpoint_0")
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    accelerate_txn.quarantine_checkpoint(f"{prefix}/checkpoint_0", reason=REASON)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    caplog.set_level(logging.WARNING)
    accelerator.load_state(f"{prefix}/checkpoint_0")
    assert all(torch.equal(saved[name], p) for name, p in model.named_parameters())
    assert any(r.getMessage().startswith(f"Loading {prefix}/checkpoint_0, which is quarantined") for r in caplog.records)


def test_what_is_not_a_committed_checkpoint_is_refused_and_nothing_is_written(prefix: str) -> None:
    store = object_store(prefix)
    store.write_new(f"{prefix}/checkpoint_5/.txn-abc-0123/random_states_0.pkl", b"an unfinished upload")
    with pytest.raises(accelerate_txn.CheckpointConfigurationError, match="has no checkpoint manifest"):
        accelerate_txn.quarantine_checkpoint(f"{prefix}/checkpoint_5", reason=REASON)
    assert store.size(f"{prefix}/.checkpoint_5{quarantine.SUFFIX}") is None
