"""The in-process CPU harness: a real Accelerate FSDP1 (or FSDP2) ``Accelerator`` on CPU with gloo, and a model.

:func:`fsdp_accelerator` builds ``Accelerator(cpu=True)`` in the gloo process group of the calling rank and forces
FSDP onto it (``_cpu_fsdp``, the same code the launcher applies to unmodified scripts). Call it in every rank of a
job started by :func:`~accelerate_txn.testing.launch` or :func:`~accelerate_txn.testing.start_ranks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointConfigurationError
from ._cpu_fsdp import (
    check_state_dict_type,
    force_fsdp,
    hybrid_nodes,
    make_plugin,
    no_parallelism_environment,
    parallelism_for_cpu,
)


def fsdp_accelerator(
    *,
    use_orig_params: bool = True,
    state_dict_type: str = "SHARDED_STATE_DICT",
    cpu_offload: bool = False,
    auto_wrap: type[torch.nn.Module] | None = torch.nn.Linear,
    project_dir: str | Path | None = None,
    automatic_checkpoint_naming: bool = False,
    total_limit: int | None = None,
    gradient_accumulation_steps: int = 1,
    fsdp_version: int = 1,
    project_config: Any = None,
    parallelism_config: Any = None,
    sharding_strategy: str | None = None,
    ranks_per_node: int | None = None,
    **accelerator_kwargs: Any,
) -> Any:
    """A real ``Accelerator`` using FSDP on CPU (gloo). Call once per process, in every rank.

    Pass either ``project_config`` (an Accelerate ``ProjectConfiguration``) or the shortcuts ``project_dir``,
    ``automatic_checkpoint_naming`` and ``total_limit``, not both. ``state_dict_type``: ``"SHARDED_STATE_DICT"`` or
    ``"FULL_STATE_DICT"`` (both protected; FSDP1's full gather runs with the fix of two torch bugs only CPU meets:
    docs/testing.md, "FULL_STATE_DICT on CPU"), or ``"LOCAL_STATE_DICT"`` (FSDP1 only: not protected, a test of
    the native fallback). ``fsdp_version=2``: Accelerate's FSDP2 (``fully_shard``, DTensor parameters); prepare the
    model and its optimizer together.
    ``auto_wrap``: the module class FSDP wraps in units of its own (``None``: the model is one unit); FSDP2
    finds it by its class name in the model at ``prepare``.
    ``parallelism_config``: an Accelerate ``ParallelismConfig`` for FSDP2 on an N-D mesh (HSDP:
    ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`` on 4 ranks; ``tp_size``), its mesh built on CPU
    (``Accelerator(parallelism_config=...)`` itself refuses one on CPU); the environment of ``accelerate launch
    --parallelism_config_*`` is read as Accelerate reads it.
    ``sharding_strategy`` (FSDP1): a ``ShardingStrategy`` name (``None``: Accelerate's default, FULL_SHARD).
    ``"HYBRID_SHARD"`` and ``"_HYBRID_SHARD_ZERO2"`` shard inside a node and replicate across nodes; on GPUs torch
    takes a node to be ``torch.cuda.device_count()`` consecutive ranks, so here ``ranks_per_node`` consecutive ranks
    form one emulated node (default: half the ranks; 4 ranks are then 2 replicas x 2 shards: shard groups {0, 1}
    and {2, 3}, replica groups {0, 2} and {1, 3}). Accelerate's own FSDP1 preparation builds the groups, with
    ``torch.cpu.device_count()`` reporting ``ranks_per_node`` while it does (``_cpu_fsdp.emulate_nodes``).
    To run a whole training script this way without changing it, see :func:`run_script`.
    """
    check_state_dict_type(state_dict_type, fsdp_version, f"fsdp_accelerator(state_dict_type={state_dict_type!r})")
    shortcuts = {"project_dir": project_dir, "automatic_checkpoint_naming": automatic_checkpoint_naming,
                 "total_limit": total_limit}
    given = sorted(name for name, value in shortcuts.items() if value not in (None, False))
    if project_config is not None and given:
        raise CheckpointConfigurationError(
            f"fsdp_accelerator: pass project_config or {', '.join(given)}, not both (they configure the same "
            "ProjectConfiguration); put those settings into your ProjectConfiguration."
        )

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    plugin = make_plugin(fsdp_version=fsdp_version, state_dict_type=state_dict_type, use_orig_params=use_orig_params,
                         cpu_offload=cpu_offload, auto_wrap=auto_wrap, sharding_strategy=sharding_strategy)
    project = project_config if project_config is not None else ProjectConfiguration(
        project_dir=str(project_dir) if project_dir is not None else None,
        automatic_checkpoint_naming=automatic_checkpoint_naming,
        total_limit=total_limit,
    )
    parallelism = parallelism_for_cpu(parallelism_config)
    with no_parallelism_environment():
        accelerator = Accelerator(cpu=True, project_config=project,
                                  gradient_accumulation_steps=gradient_accumulation_steps, **accelerator_kwargs)
    force_fsdp(accelerator, plugin, parallelism)
    hybrid_nodes(accelerator, plugin, ranks_per_node)
    return accelerator


class TinyModel(torch.nn.Module):
    """A small MLP whose layers FSDP wraps one by one (``auto_wrap=torch.nn.Linear``)."""

    # Its public name, recorded in every checkpoint's training descriptor: moving the class between private
    # modules must not make checkpoints saved with it look like another model's.
    __module__ = "accelerate_txn.testing"

    def __init__(self, width: int = 16, depth: int = 3, odd_rows: int = 5) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1)]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, odd_rows)  # rows not divisible by the world size: padded shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))
