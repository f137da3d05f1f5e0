"""Rank code of the quarantine tests (tests/core/test_quarantine.py): a 2-rank FSDP1 job (gloo) whose script sets
the checkpoint it resumed from aside, on every rank at once, and falls back with ``load_state()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import accelerate_txn
from tests.scenarios.scenarios import _build, _local_state, _same, _train


def fall_back_on_every_rank(root: str) -> dict[str, Any]:
    """Two checkpoints; every rank quarantines the newest at the same moment (no collective: each finds the mark
    the first one wrote, or writes the same one); ``load_state()`` restores the older one on every rank; rank 0
    alone releases it; ``load_state()`` restores the newest again. Retention (``total_limit=1``) then keeps the
    quarantined one while a save publishes."""
    accelerator, model, optimizer, scheduler = _build(0, project_dir=root, automatic_checkpoint_naming=True)
    _train(accelerator, model, optimizer, scheduler, 2, seed=0)
    accelerator.save_state()
    older = _local_state(model, optimizer)
    _train(accelerator, model, optimizer, scheduler, 2, seed=1)
    accelerator.save_state()
    newest = _local_state(model, optimizer)
    bad = Path(root) / "checkpoints" / "checkpoint_1"
    accelerator.wait_for_everyone()
    mark = accelerate_txn.quarantine_checkpoint(bad, reason="loss NaN 3 steps after resume")
    accelerator.wait_for_everyone()
    _train(accelerator, model, optimizer, scheduler, 1, seed=2)
    accelerator.load_state()
    fell_back = _same(older, _local_state(model, optimizer))
    accelerator.wait_for_everyone()
    released = accelerate_txn.release_checkpoint(bad) if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    accelerator.load_state()
    back = _same(newest, _local_state(model, optimizer))
    accelerate_txn.quarantine_checkpoint(bad, reason="set aside again")
    accelerator.wait_for_everyone()
    accelerator.project_configuration.total_limit = 1
    _train(accelerator, model, optimizer, scheduler, 1, seed=3)
    accelerator.save_state()
    names = sorted(p.name for p in (Path(root) / "checkpoints").iterdir() if not p.name.startswith("."))
    return {"mark": mark, "fell_back": fell_back, "released": released is not None, "back": back, "names": names}
