"""The 2-rank FSDP1 authenticated-checkpoint scenario (tests/test_signing_fsdp.py): a checkpoint saved under an HMAC
signing key; a copy forged consistently without the key (its scheduler payload replaced by a real, loadable one and
the manifest's rows rewritten to match, the authenticator kept) is refused on every rank before anything changed,
automatic selection skips it for the genuine one, the genuine one restores exactly, and, with no verification key,
the same forgery loads (what XXH3 alone cannot tell)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import configure_checkpointing, latest_training_checkpoint

from ._corruption_scenarios import _build, _error, _perturb, _rank, _train, differences, rewrite_rows, snapshot

FORGED_EPOCH = 4242


def forge_scheduler(case_dir: Path) -> None:
    """Replace the scheduler state with a loadable one of another epoch; rewrite its manifest row to match."""
    path = case_dir / "scheduler.bin"
    state = torch.load(path, weights_only=True)
    state["last_epoch"] = FORGED_EPOCH
    torch.save(state, path)
    rewrite_rows(case_dir, ["scheduler.bin"])


def signed_restore(root: str, key: str) -> dict[str, Any]:
    root_path = Path(root)
    saver = _build(0)
    configure_checkpointing(saver.acc, signing_key=key)
    _train(saver, 3, seed=1)
    genuine, forged = root_path / "run" / "checkpoint_0", root_path / "run" / "checkpoint_1"
    saver.acc.save_state(str(genuine))
    saved = snapshot(saver)
    if _rank() == 0:
        shutil.copytree(genuine, forged)
        forge_scheduler(forged)
    saver.acc.wait_for_everyone()

    loader = _build(7)
    configure_checkpointing(loader.acc, verification_keys=[key])
    _train(loader, 1, seed=9)
    _perturb(loader, 1)
    before = snapshot(loader)
    refused = _error(lambda: loader.acc.load_state(str(forged)))
    obs: dict[str, Any] = {"refused": refused, "changed": differences(before, snapshot(loader)),
                           "same_as_saved": [k for k in saved if k not in differences(before, saved)],
                           "latest": latest_training_checkpoint(root_path / "run", loader.acc)}
    _perturb(loader, 2)
    obs["genuine"] = _error(lambda: loader.acc.load_state(str(genuine)))
    obs["genuine_differences"] = differences(saved, snapshot(loader))

    configure_checkpointing(loader.acc, verification_keys=())  # no key: the consistent forgery passes every hash
    _perturb(loader, 3)
    obs["unkeyed"] = _error(lambda: loader.acc.load_state(str(forged)))
    obs["unkeyed_epoch"] = loader.sched.scheduler.last_epoch
    return obs
