"""FSDP2 scenarios run inside launched gloo ranks (Accelerate ``fsdp_version=2``, DTensor parameters, forced on
CPU by ``fsdp_accelerator``). Each scenario performs several checks in one process group and returns
observations that tests/fsdp/test_fsdp2.py asserts on."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.corruption_scenarios import flip_middle_byte
from tests.scenarios.scenarios import _error, warmup_lambda


def _build(seed: int, *, width: int = 16, lr: float = 1e-2, optimizer: str = "adamw") -> tuple[Any, ...]:
    accelerator = fsdp_accelerator(fsdp_version=2)
    torch.manual_seed(seed)
    raw = TinyModel(width=width)
    opt = (torch.optim.AdamW(raw.parameters(), lr=lr) if optimizer == "adamw"
           else torch.optim.SGD(raw.parameters(), lr=lr, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_lambda, warmup=3))
    model, opt, scheduler = accelerator.prepare(raw, opt, scheduler)  # FSDP2: prepared together
    return accelerator, model, opt, scheduler


def _train(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + accelerator.process_index)
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def next_step_differences(train: Any, original: tuple[Any, ...], restored: tuple[Any, ...]) -> list[str]:
    """One step of ``train`` from the restored run (accelerator, model, optimizer, scheduler) and one from the
    original, both from the restored global RNG state; what then differs (empty: the same next step)."""
    restored_rng = torch.get_rng_state()
    train(*restored, 1, seed=5)
    torch.set_rng_state(restored_rng)
    train(*original, 1, seed=5)
    return _differences(_snapshot(*original[1:]), _snapshot(*restored[1:]), ("params", "optim", "scheduler"))


def _local(value: Any) -> Any:
    return value.to_local().detach().clone() if hasattr(value, "to_local") else (
        value.detach().clone() if torch.is_tensor(value) else value)


def _snapshot(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """This rank's local shards of parameters and optimizer state (keyed by name), the scheduler, the RNG."""
    names = {id(p): n for n, p in model.named_parameters()}
    raw = getattr(optimizer, "optimizer", optimizer)
    return {
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "optim": {names[id(p)]: {k: _local(v) for k, v in s.items()} for p, s in raw.state.items() if s},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in raw.param_groups],
        "scheduler": scheduler.scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _differences(a: dict[str, Any], b: dict[str, Any], parts: tuple[str, ...] = ("params", "optim", "groups",
                                                                                   "scheduler", "rng")) -> list[str]:
    found = []
    for part in parts:
        if part in ("params", "optim"):
            if set(a[part]) != set(b[part]):
                found.append(f"{part} keys {sorted(a[part])} vs {sorted(b[part])}")
            found += [f"{part}.{n}" for n in set(a[part]) & set(b[part]) if not _equal(a[part][n], b[part][n])]
        elif not _equal(a[part], b[part]):
            found.append(part)
    return sorted(found)


@contextlib.contextmanager
def _reads() -> Iterator[list[tuple[str, int]]]:
    """Every tensor element DCP reads from storage in this process: (top-level state-dict key, i.e. "model" or
    "optimizer", elements) per read item. Counted where every storage reader hands a read tensor to the load
    planner (``commit_tensor``), DCP's own ``FileSystemReader`` and the library's direct reader alike."""
    import math

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    seen: list[tuple[str, int]] = []
    original = DefaultLoadPlanner.commit_tensor

    def commit_tensor(self: Any, read_item: Any, tensor: Any) -> Any:
        seen.append((read_item.dest_index.fqn.split(".")[0], math.prod(read_item.lengths)))
        return original(self, read_item, tensor)

    DefaultLoadPlanner.commit_tensor = commit_tensor
    try:
        yield seen
    finally:
        DefaultLoadPlanner.commit_tensor = original


def roundtrip(root: str) -> dict[str, Any]:
    """Protected save; load right after save in the same process; exact resume into a fresh model and optimizer
    (parameters, optimizer, groups, scheduler, RNG) and the next step equal; a checkpoint saved before the first
    step into a fresh optimizer; the descriptor's FSDP2 layout."""
    from accelerate_txn.accelerate.patch import _protected

    base = Path(root)
    obs: dict[str, Any] = {"installed": accelerate_txn.accelerate.patch.installed()}
    acc, model, opt, sched = _build(0)
    obs["dtensor"] = type(next(model.parameters())).__name__
    obs["protected"] = _protected(acc)
    _train(acc, model, opt, sched, 3, seed=1)
    path = base / "c1"
    obs["save_error"] = _error(lambda: acc.save_state(str(path)))
    expected = _snapshot(model, opt, sched)
    obs["files"] = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    manifest_path = next((p for p in path.glob("*.json")), None)
    obs["manifest_name"] = manifest_path.name if manifest_path else None
    if manifest_path is not None:
        manifest = json.loads(manifest_path.read_text())
        component = manifest["components"][""]
        obs["descriptor_model"] = component["models"][0]
    # accelerate #3896: load_state right after save_state in the same process.
    obs["same_process_error"] = _error(lambda: acc.load_state(str(path)))
    obs["same_process_differences"] = _differences(expected, _snapshot(model, opt, sched))
    # Into the optimizer it was saved from, one step later: DCP reads into its own state tensors, in place.
    _train(acc, model, opt, sched, 1, seed=9)
    before = {(id(p), key): value for p, state in opt.optimizer.state.items() for key, value in state.items()
              if hasattr(value, "to_local") and value.dim() > 0}  # held: a fresh tensor cannot reuse their memory
    obs["stepped_error"] = _error(lambda: acc.load_state(str(path)))
    after = {(id(p), key): value for p, state in opt.optimizer.state.items() for key, value in state.items()
             if hasattr(value, "to_local") and value.dim() > 0}
    obs["stepped_in_place"] = bool(before) and before.keys() == after.keys() and all(
        after[key] is value for key, value in before.items())
    obs["stepped_differences"] = _differences(expected, _snapshot(model, opt, sched))

    # A fresh model (other seed), optimizer with no state, scheduler at step 0.
    acc2, model2, opt2, sched2 = _build(7)
    torch.manual_seed(1234 + acc2.process_index)  # RNG elsewhere: the restore must bring it back
    obs["fresh_state_before"] = len(opt2.optimizer.state)
    with _reads() as reads:
        obs["fresh_error"] = _error(lambda: acc2.load_state(str(path)))
    obs["optimizer_elements_read"] = sum(n for where, n in reads if where == "optimizer")
    obs["optimizer_elements_local"] = sum(v.to_local().numel() if hasattr(v, "to_local") else v.numel()
                                          for s in opt2.optimizer.state.values() for v in s.values()
                                          if torch.is_tensor(v))
    obs["optimizer_elements_global"] = sum(v.numel() for s in opt2.optimizer.state.values() for v in s.values()
                                           if torch.is_tensor(v))
    obs["fresh_differences"] = _differences(expected, _snapshot(model2, opt2, sched2))
    obs["fresh_step"] = acc2.step
    obs["saved_step"] = acc.step
    # The next step from the restored state equals the next step of the original run (dropout draws from the
    # global RNG, which both continue from the restored state).
    obs["next_step_differences"] = next_step_differences(_train, (acc, model, opt, sched), (acc2, model2, opt2, sched2))
    # SGD with momentum, saved before the first step (no optimizer state at all), into a fresh optimizer.
    acc3, model3, opt3, sched3 = _build(3, optimizer="sgd")
    early = base / "before_first_step"
    obs["early_save_error"] = _error(lambda: acc3.save_state(str(early)))
    expected3 = _snapshot(model3, opt3, sched3)
    acc4, model4, opt4, sched4 = _build(4, optimizer="sgd")
    _train(acc4, model4, opt4, sched4, 1, seed=2)  # live state that the checkpoint does not have
    opt4.zero_grad(set_to_none=True)
    obs["early_error"] = _error(lambda: acc4.load_state(str(early)))
    obs["early_differences"] = _differences(expected3, _snapshot(model4, opt4, sched4),
                                            ("params", "optim", "groups", "scheduler"))
    # AdamW saved before its first step, into a fresh AdamW: still no state (no dummy step that would leave step=1).
    acc5, _model5, opt5, _sched5 = _build(3)
    early_adam = base / "adamw_before_first_step"
    acc5.save_state(str(early_adam))
    obs["early_adam_saver_state"] = len(opt5.optimizer.state)  # the save did not step it
    obs["early_adam_saved_entries"] = sorted(_dcp_entries(early_adam / "optimizer_0"))
    acc6, _model6, opt6, _sched6 = _build(4)
    obs["early_adam_error"] = _error(lambda: acc6.load_state(str(early_adam)))
    obs["early_adam_state"] = len(opt6.optimizer.state)

    # The protected writer's format is native Accelerate's: the same entries, shapes, dtypes and chunks.
    protected_dir, native_dir = base / "format_protected", base / "format_native"
    acc.save_state(str(protected_dir))
    accelerate_txn.unpatch_accelerate_fsdp(acc)
    acc.save_state(str(native_dir))
    obs["format_native_manifest"] = (native_dir / accelerate_txn.MANIFEST).is_file()
    obs["format_differences"] = sorted(
        key for key in set(_dcp_entries(protected_dir / "optimizer_0")) | set(_dcp_entries(native_dir / "optimizer_0"))
        if _dcp_entries(protected_dir / "optimizer_0").get(key) != _dcp_entries(native_dir / "optimizer_0").get(key))
    obs["format_entries"] = len(_dcp_entries(native_dir / "optimizer_0"))
    obs.update(_tied_roundtrip(base / "tied"))
    return obs


class TiedModel(torch.nn.Module):
    """An embedding whose weight the output layer shares (one parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def _tied_roundtrip(path: Path) -> dict[str, Any]:
    def build(seed: int) -> tuple[Any, ...]:
        accelerator = fsdp_accelerator(fsdp_version=2, auto_wrap=None)
        torch.manual_seed(seed)
        raw = TiedModel()
        opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_lambda, warmup=3))
        return (accelerator, *accelerator.prepare(raw, opt, scheduler))

    acc, model, opt, sched = build(0)
    generator = torch.Generator().manual_seed(acc.process_index)
    for _ in range(2):
        acc.backward(model(torch.randint(0, 10, (4,), generator=generator)).pow(2).mean())
        opt.step()
        opt.zero_grad(set_to_none=True)
    obs: dict[str, Any] = {"tied_save_error": _error(lambda: acc.save_state(str(path)))}
    expected = _snapshot(model, opt, sched)
    acc2, model2, opt2, sched2 = build(5)
    obs["tied_load_error"] = _error(lambda: acc2.load_state(str(path)))
    obs["tied_differences"] = _differences(expected, _snapshot(model2, opt2, sched2), ("params", "optim", "scheduler"))
    obs["tied_still_tied"] = model2.head.weight is model2.emb.weight
    obs["tied_manifest"] = (path / accelerate_txn.MANIFEST).is_file()
    return obs


def _dcp_entries(directory: Path) -> dict[str, Any]:
    """Each DCP entry's path, and for tensors its size, dtype and chunks (offsets, sizes)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    entries = {}
    for key, stored in metadata.state_dict_metadata.items():
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(stored, "chunks", []))
        properties = getattr(stored, "properties", None)
        entries[key] = (metadata.planner_data[key], tuple(getattr(stored, "size", ())),
                        str(getattr(properties, "dtype", "")), chunks)
    return entries


def refusals(root: str) -> dict[str, Any]:
    """A flipped byte in a DCP payload refused on every rank before anything changed; a load hook failing on one
    rank raises the same error on every rank and marks the Accelerator failed until a load succeeds; a checkpoint
    of another model refused before mutation."""
    base = Path(root)
    rank = int(os.environ["RANK"])
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(0)
    _train(acc, model, opt, sched, 2, seed=1)
    path = base / "good"
    acc.save_state(str(path))
    expected = _snapshot(model, opt, sched)

    # Corruption: one flipped byte in rank 1's optimizer shard; every rank refuses, nothing changes anywhere.
    damaged = base / "damaged"
    if rank == 0:
        import shutil

        shutil.copytree(path, damaged)
        flip_middle_byte(damaged / "optimizer_0" / "__1_0.distcp")
    acc.wait_for_everyone()
    acc2, model2, opt2, sched2 = _build(7)
    _train(acc2, model2, opt2, sched2, 1, seed=3)
    before = _snapshot(model2, opt2, sched2)
    obs["corrupt_error"] = _error(lambda: acc2.load_state(str(damaged)))
    obs["corrupt_unchanged"] = _differences(before, _snapshot(model2, opt2, sched2))
    # Same model and optimizer then load the intact copy exactly.
    obs["intact_error"] = _error(lambda: acc2.load_state(str(path)))
    obs["intact_differences"] = _differences(expected, _snapshot(model2, opt2, sched2))

    # check_finite on DTensor shards: a NaN in rank 1's local shard refuses the save on every rank.
    accelerate_txn.configure_checkpointing(acc2, check_finite=True)
    obs["finite_clean_error"] = _error(lambda: acc2.save_state(str(base / "finite_clean")))
    head = dict(model2.named_parameters())["head.weight"]
    if rank == 1:
        with torch.no_grad():
            head.to_local()[0, 0] = float("nan")
    obs["finite_error"] = _error(lambda: acc2.save_state(str(base / "finite_nan")))
    obs["finite_nothing_published"] = not (base / "finite_nan").exists()
    accelerate_txn.configure_checkpointing(acc2, check_finite=False)

    # Another model (wider layers): refused before mutation.
    acc3, model3, opt3, sched3 = _build(5, width=24)
    before3 = _snapshot(model3, opt3, sched3)
    obs["configuration_error"] = _error(lambda: acc3.load_state(str(path)))
    obs["configuration_unchanged"] = _differences(before3, _snapshot(model3, opt3, sched3))

    # Rank fault: a load hook that raises on rank 1 only.
    acc4, model4, opt4, sched4 = _build(9)

    def broken_load_hook(models: Any, input_dir: str) -> None:
        if rank == 1:
            raise RuntimeError("load hook failed on rank 1")

    handle = acc4.register_load_state_pre_hook(broken_load_hook)
    obs["rank_fault_error"] = _error(lambda: acc4.load_state(str(path)))
    loss = model4(torch.randn(2, 16)).sum()
    acc4.backward(loss)
    obs["step_after_failed_restore"] = _error(opt4.step)
    opt4.zero_grad(set_to_none=True)
    handle.remove()
    acc4.register_load_state_pre_hook(lambda models, input_dir: None)
    obs["recovery_error"] = _error(lambda: acc4.load_state(str(path)))
    obs["recovered_differences"] = _differences(expected, _snapshot(model4, opt4, sched4),
                                                ("params", "optim", "groups", "scheduler"))

    # A native FSDP2 checkpoint (no manifest) of an SGD run: the optimizer preflight checks it against the live
    # optimizer before anything changes; the matching optimizer restores it exactly through the protected loader.
    acc5, model5, opt5, sched5 = _build(2, optimizer="sgd")
    accelerate_txn.unpatch_accelerate_fsdp(acc5)
    _train(acc5, model5, opt5, sched5, 2, seed=4)
    legacy = base / "native_sgd"
    acc5.save_state(str(legacy))
    expected5 = _snapshot(model5, opt5, sched5)
    acc6, model6, opt6, sched6 = _build(6)  # AdamW
    _train(acc6, model6, opt6, sched6, 1, seed=3)
    before6 = _snapshot(model6, opt6, sched6)
    obs["legacy_other_optimizer_error"] = _error(lambda: acc6.load_state(str(legacy)))
    obs["legacy_other_optimizer_unchanged"] = _differences(before6, _snapshot(model6, opt6, sched6))
    acc7, model7, opt7, sched7 = _build(8, optimizer="sgd")
    obs["legacy_error"] = _error(lambda: acc7.load_state(str(legacy)))
    obs["legacy_differences"] = _differences(expected5, _snapshot(model7, opt7, sched7),
                                             ("params", "optim", "groups", "scheduler"))
    return obs


_CHANGED_SAVE: list[Any] = []  # the original of changed_save_fsdp_optimizer


def changed_save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, output_dir: Any,
                                optimizer_index: int = 0, use_dcp: bool = True, staging: Any = None) -> Any:
    """Accelerate's ``save_fsdp_optimizer`` with one more parameter: a changed piece of the FSDP2 path."""
    return _CHANGED_SAVE[-1](fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index, use_dcp)


def unvalidated_and_native(root: str) -> dict[str, Any]:
    """FSDP2 where a private piece of its path changed runs native with one warning and one INFO line; and what
    native Accelerate itself does with the before-the-first-step checkpoint (for the record)."""
    from accelerate.utils import fsdp_utils

    from accelerate_txn.accelerate.patch import _protected
    from accelerate_txn.compat.evidence import forget
    from accelerate_txn.runtime import versions as _versions
    from tests.scenarios.dispatch_scenarios import _observed

    base = Path(root)
    obs: dict[str, Any] = {}
    # What a user without the override sees (the override would take the protected path: that is its purpose).
    os.environ.pop(_versions.OVERRIDE_ENV, None)
    original = fsdp_utils.save_fsdp_optimizer
    # Another function in place of the one the protected FSDP2 save replaces (one more parameter), as a release
    # that changed it would have: the evidence reads the function the name resolves to now.
    _CHANGED_SAVE.append(original)
    fsdp_utils.save_fsdp_optimizer = changed_save_fsdp_optimizer
    forget()
    try:
        acc = _build(0)[0]
        with _observed() as seen:
            obs["protected"] = [_protected(acc), _protected(acc)]
            obs["save_error"] = _error(lambda: acc.save_state(str(base / "native")))
    finally:
        fsdp_utils.save_fsdp_optimizer = original
        forget()
    obs["seen"] = seen
    obs["manifest"] = (base / "native" / accelerate_txn.MANIFEST).is_file()
    obs["model_saved"] = (base / "native" / "pytorch_model_fsdp_0" / ".metadata").is_file()

    # Native Accelerate (this Accelerator opted out) loading an SGD checkpoint saved (protected) before the first
    # step into an optimizer that already has momentum: its read template comes from the live state.
    acc3 = _build(3, optimizer="sgd")[0]
    early = base / "early"
    acc3.save_state(str(early))
    acc4, model4, opt4, sched4 = _build(4, optimizer="sgd")
    accelerate_txn.unpatch_accelerate_fsdp(acc4)
    _train(acc4, model4, opt4, sched4, 1, seed=2)
    obs["native_early_error"] = _error(lambda: acc4.load_state(str(early)))
    # AdamW saved before its first step, natively restored into a fresh AdamW.
    acc5 = _build(3)[0]
    early_adam = base / "early_adam"
    acc5.save_state(str(early_adam))
    acc6 = _build(4)[0]
    accelerate_txn.unpatch_accelerate_fsdp(acc6)
    obs["native_early_adam_error"] = _error(lambda: acc6.load_state(str(early_adam)))
    return obs


def _build_fsdp1(seed: int) -> tuple[Any, ...]:
    accelerator = fsdp_accelerator()
    torch.manual_seed(seed)
    model = accelerator.prepare(TinyModel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_lambda, warmup=3))
    opt, scheduler = accelerator.prepare(opt, scheduler)
    return accelerator, model, opt, scheduler


def save_fsdp1_and_fsdp2(root: str) -> None:
    """Protected FSDP1 and FSDP2 checkpoints of a trained run (for the world-size refusal)."""
    for version, build in (("fsdp1", _build_fsdp1), ("fsdp2", _build)):
        acc, model, opt, sched = build(0)
        _train(acc, model, opt, sched, 2, seed=1)
        acc.save_state(str(Path(root) / version))


def world_size_change(root: str) -> dict[str, Any]:
    """Load both checkpoints on this (other) world size: refused before anything changes, naming the opt-in."""
    obs: dict[str, Any] = {}
    for version, build in (("fsdp1", _build_fsdp1), ("fsdp2", _build)):
        acc, model, opt, sched = build(5)
        _train(acc, model, opt, sched, 1, seed=2)
        before = _snapshot(model, opt, sched)
        obs[f"{version}_error"] = _error(lambda acc=acc, version=version: acc.load_state(str(Path(root) / version)))
        obs[f"{version}_unchanged"] = _differences(before, _snapshot(model, opt, sched))
    return obs
