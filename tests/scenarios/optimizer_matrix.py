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
from tests.scenarios.scenarios import _error, _local_state, _same, _train


class OtherModel(TinyModel):
    """A second model class, so two models in one Accelerator have distinct default roles."""


class ScaledModel(TinyModel):
    """TinyModel times a 1-element FSDP unit: with 2 ranks, rank 1's shard of that unit is only padding."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = torch.nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale(torch.ones(1, 1))


class CountingSGD(torch.optim.SGD):
    """SGD with momentum that also keeps Python-number state per parameter (an int and a float): scalars that
    DCP stores as bytes entries rather than tensors."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["updates"] = state.get("updates", 0) + 1
                    state["last_lr"] = float(group["lr"])
        return loss


# Every torch.optim family whose state is parameter-shaped tensors plus scalars, with the flags that change
# which state keys exist. Nothing in the library lists these classes: the rule is read from the state.
OPTIMIZERS: dict[str, Any] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2),
    "adam_amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    "adam_foreach": lambda groups: torch.optim.Adam(groups, lr=1e-2, foreach=True),
    "adamw_fused_amsgrad": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True, amsgrad=True),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9),
    "sgd_nesterov": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-2),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2, initial_accumulator_value=0.1),
    "rmsprop_centered_momentum": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, centered=True, momentum=0.9),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=1e-2),
    "radam": lambda groups: torch.optim.RAdam(groups, lr=1e-2),
    "adamax": lambda groups: torch.optim.Adamax(groups, lr=1e-2),
    "adadelta": lambda groups: torch.optim.Adadelta(groups, lr=1.0),
    "asgd": lambda groups: torch.optim.ASGD(groups, lr=1e-2, t0=1),
    "rprop": lambda groups: torch.optim.Rprop(groups, lr=1e-2),
    "python_scalars": lambda groups: CountingSGD(groups, lr=1e-2, momentum=0.9),
}


def _optimizer(kind: str, groups: Any) -> torch.optim.Optimizer:
    return OPTIMIZERS[kind](groups)


def _groups(model: Any, reverse: bool, options: list[dict[str, Any]] | None = None,
            frozen: str = "") -> list[dict[str, Any]]:
    """Two parameter groups (body / head, different learning rates, optionally other hyperparameters) and one
    empty group. ``frozen="absent"`` leaves frozen parameters out of the optimizer."""
    trained = [(n, p) for n, p in model.named_parameters() if frozen != "absent" or p.requires_grad]
    body = [p for n, p in trained if "head" not in n]
    head = [p for n, p in trained if "head" in n]
    groups = [{"params": body, "lr": 1e-2}, {"params": head, "lr": 1e-3}, {"params": [], "lr": 5e-3}]
    for group, extra in zip(groups, options or []):
        group.update(extra)
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
    # Each family below: exact restore into a fresh optimizer, flat and original parameters alternating.
    "orig_adam_foreach": {"use_orig_params": True, "optimizer": "adam_foreach", "steps": 2},
    "flat_adamw_fused_amsgrad": {"use_orig_params": False, "optimizer": "adamw_fused_amsgrad", "steps": 2},
    "flat_sgd_nesterov": {"use_orig_params": False, "optimizer": "sgd_nesterov", "steps": 2},
    "orig_adagrad": {"use_orig_params": True, "optimizer": "adagrad", "steps": 2},
    "flat_adagrad_before_first_step": {"use_orig_params": False, "optimizer": "adagrad", "steps": 0},
    "orig_adagrad_before_first_step": {"use_orig_params": True, "optimizer": "adagrad", "steps": 0},
    "flat_rmsprop_centered_momentum": {"use_orig_params": False, "optimizer": "rmsprop_centered_momentum", "steps": 2},
    # Groups with other hyperparameters hold other state keys (centered/momentum only in the body group).
    "orig_rmsprop_mixed_groups": {"use_orig_params": True, "optimizer": "rmsprop", "steps": 2, "groups": True,
                                  "group_options": [{"centered": True, "momentum": 0.9}, {"centered": False}]},
    "orig_adam_amsgrad_in_one_group": {"use_orig_params": True, "optimizer": "adamw", "steps": 2, "groups": True,
                                       "group_options": [{"amsgrad": True}, {"amsgrad": False}]},
    "orig_sgd_momentum_in_one_group": {"use_orig_params": True, "optimizer": "sgd", "steps": 2, "groups": True,
                                       "group_options": [{"momentum": 0.0}, {"momentum": 0.9}]},
    "orig_nadam": {"use_orig_params": True, "optimizer": "nadam", "steps": 2},
    "flat_radam": {"use_orig_params": False, "optimizer": "radam", "steps": 2},
    "orig_adamax": {"use_orig_params": True, "optimizer": "adamax", "steps": 2},
    "flat_adadelta": {"use_orig_params": False, "optimizer": "adadelta", "steps": 2},
    "orig_asgd": {"use_orig_params": True, "optimizer": "asgd", "steps": 3},
    "flat_asgd": {"use_orig_params": False, "optimizer": "asgd", "steps": 3},
    "orig_rprop": {"use_orig_params": True, "optimizer": "rprop", "steps": 2},
    "orig_python_scalars": {"use_orig_params": True, "optimizer": "python_scalars", "steps": 2},
    "flat_python_scalars": {"use_orig_params": False, "optimizer": "python_scalars", "steps": 2},
    # Frozen parameters (one inside an FSDP unit that also trains): left out of the optimizer, or in it
    # without state.
    "orig_frozen_absent": {"use_orig_params": True, "optimizer": "adamw", "steps": 2, "groups": True,
                           "frozen": "absent"},
    "orig_frozen_in_optimizer": {"use_orig_params": True, "optimizer": "nadam", "steps": 2, "groups": True,
                                 "frozen": "present"},
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
    if config.get("frozen"):
        for model in raw:  # one parameter of an FSDP unit whose bias still trains, and a whole unit
            model.body[0].weight.requires_grad_(False)
            model.body[3].requires_grad_(False)
    prepared = accelerator.prepare(*raw)  # FSDP1: wrap the models first, build optimizers on them
    models = list(prepared) if isinstance(prepared, tuple) else [prepared]
    optimizers = [_optimizer(config["optimizer"], _groups(model, reverse_groups, config.get("group_options"),
                                                          config.get("frozen", ""))
                             if config.get("groups") else model.parameters()) for model in models]
    prepared = accelerator.prepare(*optimizers)
    return accelerator, models, list(prepared) if isinstance(prepared, tuple) else [prepared]


def _differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Like ``_same`` (bitwise tensors), also comparing Python-scalar state values, type included."""
    bad = [n for n in expected["params"] if not torch.equal(expected["params"][n], got["params"][n])]
    if set(expected["optim"]) != set(got["optim"]):
        bad.append(f"optimizer state keys {sorted(expected['optim'])} vs {sorted(got['optim'])}")
    for name in set(expected["optim"]) & set(got["optim"]):
        if set(expected["optim"][name]) != set(got["optim"][name]):
            bad.append(f"optim {name} keys")
        for key, value in expected["optim"][name].items():
            other = got["optim"][name].get(key)
            if torch.is_tensor(value):
                same = torch.is_tensor(other) and value.shape == other.shape and torch.equal(value, other)
            else:
                same = type(value) is type(other) and value == other
            if not same:
                bad.append(f"optim {name}.{key}")
    return bad


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
        obs[name] = {"differences": [d for e, g in zip(expected, got) for d in _differences(e, g)],
                     "entries": sum(len(g["optim"]) for g in got)}
        # Training continues from the restored state.
        for model, optimizer in zip(models, optimizers):
            _train(accelerator, model, optimizer, None, 1, seed=5)
    # The layout-agnostic fallback (FSDP's own conversion) restores the same optimizer state.
    from accelerate_txn.fsdp.fsdp1 import load_by_conversion as _load_by_conversion

    for name in ("orig_adamw_groups", "flat_adam_amsgrad"):
        accelerator, models, optimizers = _build(name, 7)
        _load_by_conversion(optimizers[0].optimizer, models[0], Path(root) / name / "optimizer_0",
                            allow_reorder=True)
        expected = torch.load(Path(root) / f"{name}.expected_{rank}.pt", weights_only=True)
        got = _states(models, optimizers)
        obs[f"fallback_{name}"] = [d for d in _same({"params": {}, "optim": expected[0]["optim"]},
                                                    {"params": {}, "optim": got[0]["optim"]})]
    # Parameter CPU offload with flat parameters is refused with the fix when opted in explicitly (automatic
    # dispatch runs native instead, see tests/accelerate/test_dispatch.py; FSDP's offload needs pinned memory, so only the
    # dispatch decision can run here: no forward pass).
    offload = accelerate_txn.patch_accelerate_fsdp(fsdp_accelerator(use_orig_params=False, cpu_offload=True))
    offload_model = offload.prepare(TinyModel())
    offload.prepare(torch.optim.AdamW(offload_model.parameters(), lr=1e-2))
    obs["offload_flat"] = _error(lambda: offload.save_state(str(Path(root) / "offload")))
    # Rejections, each before any model or optimizer state changes.
    legacy = Path(root) / "legacy_groups"  # a manifest-less copy: only the optimizer checks guard it
    missing = Path(root) / "missing_moment"  # ... and one without exp_avg_sq of body.0.weight
    if rank == 0:
        import pickle
        import shutil

        from accelerate_txn.core.manifest import read_dcp_metadata

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


def _no_shard(seed: int, use_orig_params: bool) -> tuple[Any, Any, Any]:
    """NO_SHARD on 2 ranks: every rank holds whole flat parameters, a layout the shard geometry does not map,
    so the optimizer restore takes FSDP's own conversion."""
    from torch.distributed.fsdp import ShardingStrategy

    accelerator = fsdp_accelerator(use_orig_params=use_orig_params)
    accelerator.state.fsdp_plugin.sharding_strategy = ShardingStrategy.NO_SHARD
    torch.manual_seed(seed)
    model = accelerator.prepare(TinyModel())
    optimizer = accelerator.prepare(torch.optim.Adam(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def conversion_preflight(root: str) -> dict[str, Any]:
    """The conversion fallback: an exact restore, and a bad checkpoint refused in the preflight, before the
    model weights (loaded before the optimizer) change."""
    import pickle
    import shutil

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from accelerate_txn.accelerate.optimizers import validate_optimizer_checkpoint
    from accelerate_txn.core.manifest import read_dcp_metadata
    from accelerate_txn.fsdp.fsdp1 import _owners
    from accelerate_txn.fsdp.geometry import GeometryMismatch

    rank = int(os.environ["RANK"])
    obs: dict[str, Any] = {}
    for use_orig_params in (True, False):
        tag = "orig" if use_orig_params else "flat"
        accelerator, model, optimizer = _no_shard(0, use_orig_params)
        obs[f"{tag}_strategies"] = sorted({unit.sharding_strategy.name for unit in FSDP.fsdp_modules(model)})
        try:
            _owners(model, optimizer.optimizer, model.process_group)
            obs[f"{tag}_geometry"] = "mapped"
        except GeometryMismatch as exc:
            obs[f"{tag}_geometry"] = f"mismatch: {exc}"
        _train(accelerator, model, optimizer, None, 2, seed=1)
        path = Path(root) / f"no_shard_{tag}"
        accelerator.save_state(str(path))
        expected = _local_state(model, optimizer)
        fresh, fresh_model, fresh_optimizer = _no_shard(7, use_orig_params)
        fresh.load_state(str(path))
        obs[f"{tag}_differences"] = _same(expected, _local_state(fresh_model, fresh_optimizer))
        # A copy without the manifest and without one saved moment: only the optimizer checks can catch it.
        broken = Path(root) / f"no_shard_{tag}_missing_moment"
        if rank == 0:
            shutil.copytree(path, broken)
            (broken / accelerate_txn.MANIFEST).unlink()
            metadata = read_dcp_metadata(broken / "optimizer_0")
            doomed = [k for k in metadata.state_dict_metadata if k.endswith("body.0.weight.exp_avg_sq")]
            for key in doomed:
                del metadata.state_dict_metadata[key]
                del metadata.planner_data[key]
            (broken / "optimizer_0" / ".metadata").write_bytes(pickle.dumps(metadata))
        fresh.wait_for_everyone()
        victim, victim_model, victim_optimizer = _no_shard(9, use_orig_params)
        configure_checkpointing(victim, allow_legacy=True)
        before = _local_state(victim_model, victim_optimizer)
        # Each rank's own preflight refuses it (a rank whose geometry does not map used to skip the checks and
        # leave them to the conversion, after the model weights were loaded).
        obs[f"{tag}_preflight"] = _error(lambda victim=victim, broken=broken: validate_optimizer_checkpoint(victim, broken))
        obs[f"{tag}_missing_moment"] = _error(lambda victim=victim, broken=broken: victim.load_state(str(broken)))
        obs[f"{tag}_unchanged"] = _same(before, _local_state(victim_model, victim_optimizer))
    return obs
