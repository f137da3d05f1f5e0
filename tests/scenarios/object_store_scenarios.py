"""Code that runs inside launched ranks for the object-store tests of Azure Blob and Google Cloud Storage (real gloo
process groups; the loopback Azurite of ``tests.support.azurite`` or fake-gcs-server of ``tests.support.fakegcs``, reached through
the inherited ``AZURE_STORAGE_CONNECTION_STRING`` or ``STORAGE_EMULATOR_HOST``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from accelerate_txn import configure_checkpointing
from tests.scenarios.scenarios import _build, _error, _local_state, _same, _train


def roundtrip(parent: str, cache: str) -> dict[str, Any]:
    """Two FSDP1 saves to ``az://`` or ``gs://`` URLs (``checkpoint_1``, ``checkpoint_2``), then a restore of the newest into a
    fresh model and optimizer from a fresh cache (another machine): the state must be the saved one, bitwise."""
    from accelerate_txn.store.azure import AzureStore
    from accelerate_txn.store.gcs import GcsStore

    scheme = parent.split("://", 1)[0]
    store = {"az": AzureStore, "gs": GcsStore}[scheme]()
    obs: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    acc, model, opt, sched = _build(0)
    configure_checkpointing(acc, cache_dir=cache)
    for number, steps in ((1, 2), (2, 1)):
        _train(acc, model, opt, sched, steps, seed=number)
        obs[f"returned_{number}"] = str(acc.save_state(f"{parent}/checkpoint_{number}"))
    expected = _local_state(model, opt)
    expected_rng = torch.rand(3)
    expected_lr = sched.get_last_lr()
    obs["objects"] = sorted(store.list(f"{parent}/checkpoint_2"))
    acc.wait_for_everyone()

    acc2, model2, opt2, sched2 = _build(7)
    configure_checkpointing(acc2, cache_dir=f"{cache}-load")
    obs["before_differences"] = len(_same(expected, _local_state(model2, opt2)))  # the check can fail
    torch.manual_seed(999)
    obs["error"] = _error(lambda: acc2.load_state(f"{parent}/checkpoint_2"))
    obs["differences"] = _same(expected, _local_state(model2, opt2))
    obs["rng"] = torch.equal(torch.rand(3), expected_rng)
    obs["lr"] = sched2.get_last_lr() == expected_lr
    obs["copies"] = sorted(str(path.relative_to(f"{cache}-load")) for path in Path(f"{cache}-load").glob(f"{scheme}/*/*/*"))
    return obs
