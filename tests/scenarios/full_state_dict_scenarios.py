"""Rank functions: FSDP ``FULL_STATE_DICT`` (Accelerate's FSDP1 default, the Trainer's default) through the protected
path: a real Accelerator on CPU (gloo), the plugin switched to ``FULL_STATE_DICT`` before ``prepare``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn import MANIFEST
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error, _local_state, _same, _train


def full_accelerator(fsdp_version: int, **kwargs: Any) -> Any:
    """An FSDP Accelerator on CPU whose plugin uses ``FULL_STATE_DICT`` (set before anything is prepared, with the
    state-dict configs Accelerate derives for it: ``offload_to_cpu``, ``rank0_only``)."""
    accelerator = fsdp_accelerator(fsdp_version=fsdp_version, **kwargs)
    plugin = accelerator.state.fsdp_plugin
    plugin.state_dict_config = None
    plugin.optim_state_dict_config = None
    plugin.set_state_dict_type("FULL_STATE_DICT")
    return accelerator


def build(fsdp_version: int, seed: int, **kwargs: Any) -> tuple[Any, Any, Any]:
    accelerator = full_accelerator(fsdp_version, **kwargs)
    torch.manual_seed(seed)
    raw = TinyModel()
    if fsdp_version == 2:  # FSDP2: model and optimizer prepared together
        model, optimizer = accelerator.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    else:
        model = accelerator.prepare(raw)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def round_trip(root: str, fsdp_version: int) -> dict[str, Any]:
    """Save, train on, restore (same and fresh objects), a damaged file refused before anything changes, and native
    Accelerate reading the protected checkpoint with the library switched off."""
    base = Path(root)
    obs: dict[str, Any] = {}
    accelerator, model, optimizer = build(fsdp_version, 0)
    obs["protection"] = str(accelerate_txn.protection(accelerator))
    _train(accelerator, model, optimizer, None, 2, seed=1)
    saved = _local_state(model, optimizer)
    obs["save_error"] = _error(lambda: accelerator.save_state(str(base / "checkpoint_0")))
    manifest = base / "checkpoint_0" / MANIFEST
    obs["manifest"] = manifest.is_file()
    obs["files"] = sorted(p.name for p in (base / "checkpoint_0").iterdir())
    _train(accelerator, model, optimizer, None, 2, seed=2)
    obs["moved_on"] = bool(_same(saved, _local_state(model, optimizer)))
    obs["load_error"] = _error(lambda: accelerator.load_state(str(base / "checkpoint_0")))
    obs["restored"] = _same(saved, _local_state(model, optimizer))
    fresh, fresh_model, fresh_optimizer = build(fsdp_version, 7)
    obs["fresh_load_error"] = _error(lambda: fresh.load_state(str(base / "checkpoint_0")))
    obs["fresh_restored"] = _same(saved, _local_state(fresh_model, fresh_optimizer))
    # A damaged byte in the full optimizer file (rank 0 wrote it): refused on every rank before anything changes.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        damaged = base / "damaged"
        damaged.mkdir()
        for path in (base / "checkpoint_0").iterdir():
            (damaged / path.name).write_bytes(path.read_bytes())
        data = bytearray((damaged / "optimizer.bin").read_bytes())
        data[len(data) // 2] ^= 0x01
        (damaged / "optimizer.bin").write_bytes(bytes(data))
    accelerator.wait_for_everyone()
    _train(accelerator, model, optimizer, None, 1, seed=3)
    before = _local_state(model, optimizer)
    obs["damaged_error"] = _error(lambda: accelerator.load_state(str(base / "damaged")))
    obs["damaged_untouched"] = _same(before, _local_state(model, optimizer))
    # Native Accelerate reads the protected checkpoint (the manifest is one more file it ignores).
    os.environ["ACCELERATE_TXN_PATCHES"] = "0"
    try:
        native, native_model, native_optimizer = build(fsdp_version, 9)
        obs["native_load_error"] = _error(lambda: native.load_state(str(base / "checkpoint_0")))
        obs["native_restored"] = _same(saved, _local_state(native_model, native_optimizer))
    finally:
        del os.environ["ACCELERATE_TXN_PATCHES"]
    return obs


def asynchronous(root: str, fsdp_version: int) -> dict[str, Any]:
    """An asynchronous save of a full checkpoint is the state at the moment ``save_state`` returned: the script trains
    on (in place, through ``optimizer.step``) while the background publishes, and the restore equals that moment."""
    base = Path(root)
    obs: dict[str, Any] = {}
    accelerator, model, optimizer = build(fsdp_version, 0)
    accelerate_txn.configure_checkpointing(accelerator, async_save=True)
    _train(accelerator, model, optimizer, None, 2, seed=1)
    saved = _local_state(model, optimizer)
    handle = accelerator.save_state(str(base / "checkpoint_0"))
    _train(accelerator, model, optimizer, None, 2, seed=2)  # while the save may still be in flight
    obs["wait_error"] = _error(lambda: accelerate_txn.wait_for_checkpoint(accelerator))
    obs["published"] = str(handle) == str(base / "checkpoint_0") and (base / "checkpoint_0" / MANIFEST).is_file()
    obs["load_error"] = _error(lambda: accelerator.load_state(str(base / "checkpoint_0")))
    obs["restored"] = _same(saved, _local_state(model, optimizer))
    return obs


def elastic_save(root: str, fsdp_version: int) -> dict[str, Any]:
    """Save a full checkpoint on this world."""
    accelerator, model, optimizer = build(fsdp_version, 0)
    _train(accelerator, model, optimizer, None, 2, seed=1)
    accelerator.save_state(str(Path(root) / "checkpoint_0"))
    return {"world": accelerator.num_processes}


def elastic_load(root: str, fsdp_version: int) -> dict[str, Any]:
    """Resume that checkpoint on this world, without allow_reshard, and save it again (``checkpoint_1``): the full
    files of both saves hold the whole state, comparable across worlds."""
    accelerator = build(fsdp_version, 5)[0]
    error = _error(lambda: accelerator.load_state(str(Path(root) / "checkpoint_0")))
    if error is None:
        accelerator.save_state(str(Path(root) / "checkpoint_1"))
    return {"error": error, "world": accelerator.num_processes}


def full_files_differences(first: str, second: str) -> list[str]:
    """The tensors that differ between two full checkpoints' model and optimizer files (bitwise)."""
    found = []
    for name in ("pytorch_model_fsdp.bin", "optimizer.bin"):
        one = torch.load(Path(first) / name, weights_only=True)
        other = torch.load(Path(second) / name, weights_only=True)
        if name == "optimizer.bin":
            one, other = one["state"], other["state"]
            one = {f"{key}.{k}": v for key, state in one.items() for k, v in state.items()}
            other = {f"{key}.{k}": v for key, state in other.items() for k, v in state.items()}
        if set(one) != set(other):
            found.append(f"{name}: keys {sorted(set(one) ^ set(other))}")
        found += [f"{name}: {key}" for key in sorted(set(one) & set(other))
                  if not (torch.equal(one[key], other[key]) if torch.is_tensor(one[key]) else one[key] == other[key])]
    return found
