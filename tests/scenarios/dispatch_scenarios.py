"""Rank code for the dispatch decision: which FSDP setups run protected, which fall back to native Accelerate
(with one warning, or refused when opted in explicitly), and the one INFO line per Accelerator that says why
protection is off. Several checks per launched process group."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.scenarios import _error, _local_state, _same, _train


class Blocky(torch.optim.Optimizer):
    """SGD that also keeps one statistic per block of 4 elements (like an 8-bit optimizer's absmax per
    quantisation block): state that is not shaped like its parameter."""

    def __init__(self, params: Any, lr: float = 1e-2, block: int = 4) -> None:
        super().__init__(params, {"lr": lr, "block": block})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["absmax"] = torch.zeros((p.numel() + group["block"] - 1) // group["block"])
                state["step"] += 1
                flat = p.grad.reshape(-1)
                padded = torch.nn.functional.pad(flat, (0, state["absmax"].numel() * group["block"] - flat.numel()))
                state["absmax"].copy_(padded.view(-1, group["block"]).abs().amax(1))
                p.add_(p.grad, alpha=-group["lr"])
        return loss


class Counting(torch.optim.SGD):
    """SGD with momentum that also keeps a small dict per parameter: not a tensor, not a scalar. Native FSDP1
    (use_orig_params=True) saves and loads it."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("stats", {"updates": 0})["updates"] += 1
        return loss


@contextmanager
def _observed() -> Iterator[dict[str, list[str]]]:
    """RuntimeWarnings and accelerate_txn log records raised inside the block: ``info`` every record (INFO and above),
    ``logged_warnings`` those at WARNING and above (what Python's default logging level shows)."""
    seen: dict[str, list[str]] = {"warnings": [], "info": [], "logged_warnings": []}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen["info"].append(record.getMessage())
            if record.levelno >= logging.WARNING:
                seen["logged_warnings"].append(record.getMessage())

    logger = logging.getLogger("accelerate_txn")
    handler, level = Collect(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        seen["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                            and "accelerate-txn" in str(w.message)]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _setup(optimizer: Callable[..., torch.optim.Optimizer], seed: int = 0, **kwargs: Any) -> tuple[Any, Any, Any]:
    accelerator = fsdp_accelerator(**kwargs)
    torch.manual_seed(seed)
    model = accelerator.prepare(TinyModel())
    return accelerator, model, accelerator.prepare(optimizer(model.parameters()))


def _differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Like ``_same``, also comparing non-tensor state values (``Counting``'s dicts) by equality."""
    bad = [n for n in expected["params"] if not torch.equal(expected["params"][n], got["params"][n])]
    if set(expected["optim"]) != set(got["optim"]):
        bad.append("optimizer state parameters")
    for name in set(expected["optim"]) & set(got["optim"]):
        for key, value in expected["optim"][name].items():
            other = got["optim"][name].get(key)
            same = torch.equal(value, other) if torch.is_tensor(value) and torch.is_tensor(other) else value == other
            if not same:
                bad.append(f"optim {name}.{key}")
    return bad


def _has_manifest(path: Path) -> bool:
    return (path / accelerate_txn.MANIFEST).is_file()


def _counting(params: Any) -> torch.optim.Optimizer:
    return Counting(params, lr=1e-2, momentum=0.9)


def fallbacks(root: str) -> dict[str, Any]:
    obs: dict[str, Any] = {}
    base = Path(root)
    # 1. Not parameter-shaped state that native handles: native save and load, one warning, one INFO line.
    acc, model, opt = _setup(_counting)
    with _observed() as seen:
        acc.save_state(str(base / "counting_0"))  # no state yet: nothing unsupported, protected
        _train(acc, model, opt, None, 2, seed=1)
        acc.save_state(str(base / "counting_1"))
        acc.save_state(str(base / "counting_2"))
        expected = _local_state(model, opt)
        acc.load_state(str(base / "counting_2"))  # the live state decides: native
    obs["counting_manifests"] = [_has_manifest(base / f"counting_{i}") for i in range(3)]
    obs["counting_seen"] = seen
    obs["counting_reloaded"] = _differences(expected, _local_state(model, opt))
    # ... and a fresh optimizer (no live state yet) loading that native checkpoint: the checkpoint decides.
    fresh, fresh_model, fresh_opt = _setup(_counting, seed=5)
    with _observed() as seen:
        obs["fresh_counting_error"] = _error(lambda: fresh.load_state(str(base / "counting_2")))
    obs["fresh_counting_seen"] = seen
    obs["fresh_counting_entries"] = len(_local_state(fresh_model, fresh_opt)["optim"])
    # An explicit opt-in refuses instead, with the reason, on every rank.
    explicit, explicit_model, explicit_opt = _setup(_counting, seed=6)
    accelerate_txn.patch_accelerate_fsdp(explicit)
    _train(explicit, explicit_model, explicit_opt, None, 1, seed=2)
    obs["counting_explicit"] = _error(lambda: explicit.save_state(str(base / "counting_explicit")))
    obs["counting_explicit_nothing_written"] = not (base / "counting_explicit").exists()

    # 2. State of another shape (quantised blocks): native FSDP1 itself cannot save it; the library does not
    # add an error of its own, it warns and hands over.
    blocky, blocky_model, blocky_opt = _setup(lambda params: Blocky(params))
    _train(blocky, blocky_model, blocky_opt, None, 1, seed=3)
    with _observed() as seen:
        obs["blocky_native_error"] = _error(lambda: blocky.save_state(str(base / "blocky")))
    obs["blocky_seen"] = seen
    accelerate_txn.patch_accelerate_fsdp(blocky)
    obs["blocky_explicit"] = _error(lambda: blocky.save_state(str(base / "blocky_explicit")))

    # 3. Setups that run native by configuration: one INFO line each, no warning.
    def native_by_configuration(name: str, accelerator: Any, model: Any, optimizer: Any) -> None:
        _train(accelerator, model, optimizer, None, 1, seed=4)
        with _observed() as seen:
            obs[f"{name}_error"] = _error(lambda: [accelerator.save_state(str(base / f"{name}_{i}")) for i in range(2)])
        obs[f"{name}_seen"] = seen
        obs[f"{name}_manifest"] = _has_manifest(base / f"{name}_0")

    # LOCAL_STATE_DICT (FSDP1): not protected; only the dispatch decision the wrappers take runs here.
    from accelerate_txn.accelerate import patch as _patch

    local_type = _setup(_adamw, state_dict_type="LOCAL_STATE_DICT")[0]
    with _observed() as seen:
        obs["local_state_dict_protected"] = [_patch._protected(local_type), _patch._protected(local_type)]
    obs["local_state_dict_seen"] = seen
    opted_out = _setup(_adamw)
    accelerate_txn.unpatch_accelerate_fsdp(opted_out[0])
    native_by_configuration("opted_out", *opted_out)
    env_off = _setup(_adamw)
    os.environ[accelerate_txn.runtime.versions.PATCH_ENV] = "0"
    try:
        native_by_configuration("env_off", *env_off)
    finally:
        del os.environ[accelerate_txn.runtime.versions.PATCH_ENV]
    fsdp2 = fsdp_accelerator(fsdp_version=2)
    torch.manual_seed(0)
    raw = TinyModel()  # FSDP2: model and optimizer are prepared together
    native_by_configuration("fsdp2", fsdp2, *fsdp2.prepare(raw, _adamw(raw.parameters())))
    # A supported setup says nothing.
    native_by_configuration("protected", *_setup(_adamw))
    # Strict mode: a setup that would run native (LOCAL_STATE_DICT) is refused on every rank, nothing written; the
    # public answer says the same without saving.
    local, local_model, local_opt = _setup(_adamw, state_dict_type="LOCAL_STATE_DICT")
    found = accelerate_txn.protection(local)
    obs["local_protection"] = {"protected": found.protected, "path": found.path, "reason": found.reason,
                               "fix": found.fix}
    accelerate_txn.configure_checkpointing(local, require_protection=True)
    _train(local, local_model, local_opt, None, 1, seed=4)
    obs["strict_error"] = _error(lambda: local.save_state(str(base / "strict")))
    obs["strict_load_error"] = _error(lambda: local.load_state(str(base / "protected_0")))
    obs["strict_nothing_written"] = not (base / "strict").exists()
    return obs


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def sharding(root: str, strategy: str) -> dict[str, Any]:
    """Protected round trip (fresh model and optimizer) under ``strategy`` on this world size; what FSDP made
    of the requested strategy; and whether the library warned."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    def build(seed: int) -> tuple[Any, Any, Any]:
        accelerator = fsdp_accelerator()
        if strategy:
            accelerator.state.fsdp_plugin.sharding_strategy = ShardingStrategy[strategy]
        torch.manual_seed(seed)
        model = accelerator.prepare(TinyModel())
        return accelerator, model, accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))

    acc, model, opt = build(0)
    obs: dict[str, Any] = {"strategies": sorted({u.sharding_strategy.name for u in FSDP.fsdp_modules(model)})}
    _train(acc, model, opt, None, 2, seed=1)
    path = Path(root) / f"sharding_{strategy or 'default'}"
    with _observed() as seen:
        obs["save_error"] = _error(lambda: acc.save_state(str(path)))
        expected = _local_state(model, opt)
        fresh, fresh_model, fresh_opt = build(7)
        obs["load_error"] = _error(lambda: fresh.load_state(str(path)))
    obs["seen"] = seen
    obs["manifest"] = _has_manifest(path)
    obs["differences"] = _same(expected, _local_state(fresh_model, fresh_opt))
    obs["optimizer_entries"] = len(_local_state(fresh_model, fresh_opt)["optim"])
    return obs
