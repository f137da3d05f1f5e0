"""Rank code for the sharded-optimizer restore matrix: every configuration is saved in one launch and restored
into freshly created models and optimizers in another (fresh processes: the real resume)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn import configure_checkpointing
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests._scenarios import _error, _local_state, _same, _train


class OtherModel(TinyModel):
    """A second model class, so two models in one Accelerator have distinct default roles."""


class ScaledModel(TinyModel):
    """TinyModel times a 1-element FSDP unit: with 2 ranks, rank 1's shard of that unit is only padding."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = torch.nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale(torch.ones(1, 1))


def _optimizer(kind: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(groups, lr=1e-2, amsgrad=True)
    if kind == "sgd_momentum":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2)
    raise ValueError(kind)


def _groups(model: Any, reverse: bool) -> list[dict[str, Any]]:
    """Two parameter groups (body / head, different learning rates) and one empty group."""
    body = [p for n, p in model.named_parameters() if "head" not in n]
    head = [p for n, p in model.named_parameters() if "head" in n]
    groups = [{"params": body, "lr": 1e-2}, {"params": head, "lr": 1e-3}, {"params": [], "lr": 5e-3}]
    return groups[::-1] if reverse else groups


# Parameter CPU offload cannot run here: FSDP pins the offloaded shards, which needs an accelerator.
CONFIGS: dict[str, dict[str, Any]] = {
    "orig_adamw_groups": {"use_orig_params": True, "optimizer": "adamw", "steps": 2, "groups": True},
    "flat_adam_amsgrad": {"use_orig_params": False, "optimizer": "adam_amsgrad", "steps": 2},
    "orig_sgd_momentum": {"use_orig_params": True, "optimizer": "sgd_momentum", "steps": 2},
    "flat_sgd": {"use_orig_params": False, "optimizer": "sgd", "steps": 2},
    "orig_before_first_step": {"use_orig_params": True, "optimizer": "adamw", "steps": 0},
    "flat_one_row_head": {"use_orig_params": False, "optimizer": "adamw", "steps": 2, "odd_rows": 1},
    "orig_two_models": {"use_orig_params": True, "optimizer": "adamw", "steps": 2, "models": 2},
    "flat_padding_only_shard": {"use_orig_params": False, "optimizer": "adamw", "steps": 2, "scaled": True},
    "orig_padding_only_shard": {"use_orig_params": True, "optimizer": "adamw", "steps": 2, "scaled": True},
}


# Used only to load checkpoints of another configuration (rejections).
OTHER: dict[str, dict[str, Any]] = {
    "orig_sgd_groups": {"use_orig_params": True, "optimizer": "sgd_momentum", "groups": True},
}


def _build(name: str, seed: int, *, reverse_groups: bool = False) -> tuple[Any, list[Any], list[Any]]:
    config = CONFIGS.get(name) or OTHER[name]
    accelerator = fsdp_accelerator(use_orig_params=config["use_orig_params"], cpu_offload=config.get("cpu_offload", False))
    torch.manual_seed(seed)
    first = ScaledModel if config.get("scaled") else TinyModel
    raw = [(first if index == 0 else OtherModel)(odd_rows=config.get("odd_rows", 5))
           for index in range(config.get("models", 1))]
    prepared = accelerator.prepare(*raw)  # FSDP1: wrap the models first, build optimizers on them
    models = list(prepared) if isinstance(prepared, tuple) else [prepared]
    optimizers = [_optimizer(config["optimizer"], _groups(model, reverse_groups) if config.get("groups")
                             else model.parameters()) for model in models]
    prepared = accelerator.prepare(*optimizers)
    return accelerator, models, list(prepared) if isinstance(prepared, tuple) else [prepared]


def _states(models: list[Any], optimizers: list[Any]) -> list[dict[str, Any]]:
    return [_local_state(model, optimizer) for model, optimizer in zip(models, optimizers)]


def save_matrix(root: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    for name, config in CONFIGS.items():
        accelerator, models, optimizers = _build(name, 0)
        for model, optimizer in zip(models, optimizers):
            _train(accelerator, model, optimizer, None, config["steps"], seed=1)
        accelerator.save_state(str(Path(root) / name))
        torch.save(_states(models, optimizers), Path(root) / f"{name}.expected_{rank}.pt")
    return {"saved": sorted(CONFIGS)}


def load_matrix(root: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    obs: dict[str, Any] = {}
    for name, config in CONFIGS.items():
        # Fresh models (other initial values) and fresh optimizers; groups in reverse order when there are groups.
        accelerator, models, optimizers = _build(name, 7, reverse_groups=bool(config.get("groups")))
        accelerator.load_state(str(Path(root) / name))
        expected = torch.load(Path(root) / f"{name}.expected_{rank}.pt", weights_only=True)
        got = _states(models, optimizers)
        obs[name] = {"differences": [d for e, g in zip(expected, got) for d in _same(e, g)],
                     "entries": sum(len(g["optim"]) for g in got)}
        # Training continues from the restored state.
        for model, optimizer in zip(models, optimizers):
            _train(accelerator, model, optimizer, None, 1, seed=5)
    # The layout-agnostic fallback (FSDP's own conversion) restores the same optimizer state.
    from accelerate_txn._fsdp_optimizer import _load_by_conversion

    for name in ("orig_adamw_groups", "flat_adam_amsgrad"):
        accelerator, models, optimizers = _build(name, 7)
        _load_by_conversion(accelerator, optimizers[0].optimizer, models[0], Path(root) / name / "optimizer_0",
                            allow_reorder=True)
        expected = torch.load(Path(root) / f"{name}.expected_{rank}.pt", weights_only=True)
        got = _states(models, optimizers)
        obs[f"fallback_{name}"] = [d for d in _same({"params": {}, "optim": expected[0]["optim"]},
                                                    {"params": {}, "optim": got[0]["optim"]})]
    # Parameter CPU offload with flat parameters is refused with the fix (FSDP's offload needs pinned memory, so
    # only the preflight can run here: no forward pass).
    offload = fsdp_accelerator(use_orig_params=False, cpu_offload=True)
    offload_model = offload.prepare(TinyModel())
    offload.prepare(torch.optim.AdamW(offload_model.parameters(), lr=1e-2))
    obs["offload_flat"] = _error(lambda: offload.save_state(str(Path(root) / "offload")))
    # Rejections, each before any model or optimizer state changes.
    legacy = Path(root) / "legacy_groups"  # a manifest-less copy: only the optimizer checks guard it
    missing = Path(root) / "missing_moment"  # ... and one without exp_avg_sq of body.0.weight
    if rank == 0:
        import pickle
        import shutil

        from accelerate_txn._manifest import read_dcp_metadata

        shutil.copytree(Path(root) / "orig_adamw_groups", legacy)
        (legacy / accelerate_txn.MANIFEST).unlink()
        shutil.copytree(legacy, missing)
        metadata = read_dcp_metadata(missing / "optimizer_0")
        for key in [k for k in metadata.state_dict_metadata if k.endswith("body.0.weight.exp_avg_sq")]:
            del metadata.state_dict_metadata[key]
            del metadata.planner_data[key]
        (missing / "optimizer_0" / ".metadata").write_bytes(pickle.dumps(metadata))
    accelerator, models, optimizers = _build("orig_adamw_groups", 7)
    configure_checkpointing(accelerator, allow_legacy=True)
    before = _states(models, optimizers)
    obs["missing_moment"] = _error(lambda: accelerator.load_state(str(Path(root) / "missing_moment")))
    obs["missing_moment"]["unchanged"] = not [d for e, g in zip(before, _states(models, optimizers)) for d in _same(e, g)]
    # Wrong optimizer type / changed group membership.
    accelerator2, models2, optimizers2 = _build("orig_sgd_groups", 7)
    before2 = _states(models2, optimizers2)
    obs["wrong_type"] = _error(lambda: accelerator2.load_state(str(legacy)))
    obs["wrong_type"]["unchanged"] = not [d for e, g in zip(before2, _states(models2, optimizers2)) for d in _same(e, g)]
    accelerator3, models3, optimizers3 = _build("orig_adamw_groups", 7)
    # Move one parameter from the head group to the body group: same parameters, other membership.
    groups = optimizers3[0].optimizer.param_groups
    groups[0]["params"].append(groups[1]["params"].pop())
    before3 = _states(models3, optimizers3)
    obs["membership"] = _error(lambda: accelerator3.load_state(str(legacy)))
    obs["membership"]["unchanged"] = not [d for e, g in zip(before3, _states(models3, optimizers3)) for d in _same(e, g)]
    return obs
