"""Scenarios for object-store FUSE mounts (``store.mounts``), run inside launched ranks (real gloo, real Accelerate
FSDP1/FSDP2); tests/store/test_mounts_ranks.py asserts on what each rank returns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import accelerate_txn
from accelerate_txn import configure_checkpointing
from accelerate_txn.store.mounts import MOUNTINFO_ENV
from tests.scenarios.guarantee_scenarios import _build
from tests.scenarios.scenarios import _error, _train


def save_onto_a_mount(root: str, fsdp_version: int, table: str, url: str | None) -> dict[str, Any]:
    """Every kind of protected save whose destination a crafted mount table says is on gcsfuse (``ROOT/gcs``): the
    patched ``save_state``, an asynchronous save, automatic naming under a project directory there, and (``url``)
    a save to an object store whose local cache is there. Only rank 0 reads the table (ranks may see different
    mounts; the publishing rank decides). Then a save to a local directory, which must still work on every rank."""
    if int(os.environ["RANK"]) == 0:
        os.environ[MOUNTINFO_ENV] = table
    mounted = Path(root) / "gcs"
    observed: dict[str, Any] = {}
    acc, model, opt, sched = _build(fsdp_version, seed=0)
    _train(acc, model, opt, sched, 1, seed=1)
    observed["save_state"] = _error(lambda: acc.save_state(str(mounted / "run" / "checkpoint_0")))
    observed["async"] = _error(lambda: accelerate_txn.save_training_checkpoint(
        acc, mounted / "run" / "checkpoint_1", async_save=True).wait())
    if url is not None:
        configure_checkpointing(acc, cache_dir=mounted / "cache")
        observed["url"] = _error(lambda: acc.save_state(url))
    auto, model2, opt2, sched2 = _build(fsdp_version, seed=0, root=str(mounted / "project"))
    _train(auto, model2, opt2, sched2, 1, seed=1)
    observed["automatic"] = _error(lambda: auto.save_state())
    observed["listing"] = sorted(p.name for p in mounted.iterdir())
    observed["iteration"] = auto.project_configuration.iteration
    local = Path(root) / "local" / "checkpoint_0"
    observed["local"] = _error(lambda: acc.save_state(str(local)))
    observed["local_published"] = (local / accelerate_txn.MANIFEST).is_file()
    return observed
