"""The sharded restores of an Accelerator: the FSDP2 model (with the plugin's state-dict options), and each
prepared optimizer with its model, FSDP1 (:mod:`..fsdp.fsdp1`) or FSDP2 (:mod:`..fsdp.fsdp2`), with the group-order
rule of the Accelerator (an LR scheduler depends on group order: no reordering then)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..fsdp import fsdp1, fsdp2
from ..runtime.accelerate_internals import prepared_models, prepared_optimizers, prepared_schedulers
from .descriptor import is_fsdp2_sharded


def _allow_reorder(accelerator: Any, allow_reorder: bool | None) -> bool:
    return not prepared_schedulers(accelerator) if allow_reorder is None else allow_reorder


def validate_optimizer_checkpoint(accelerator: Any, input_dir: Path) -> None:
    """Check every FSDP optimizer checkpoint of ``accelerator`` in ``input_dir`` against the live models and
    optimizers (entries, shapes, groups, completeness) without changing anything and without collectives: the
    protected load runs this on every rank before the restore touches any state."""
    validate = fsdp2.validate_fsdp2_optimizer if is_fsdp2_sharded(accelerator) else fsdp1.validate_fsdp1_optimizer
    allow_reorder = _allow_reorder(accelerator, None)
    for index, (model, optimizer) in enumerate(zip(prepared_models(accelerator), prepared_optimizers(accelerator))):
        validate(model, optimizer, Path(input_dir) / f"optimizer_{index}", allow_reorder)


def load_sharded_optimizer(accelerator: Any, optimizer: Any, model: Any, input_dir: str, index: int,
                           *, allow_reorder: bool | None = None) -> None:
    """Restore FSDP1 optimizer ``index`` of ``accelerator`` from ``input_dir/optimizer_<index>``, reading only this
    rank's elements (:func:`..fsdp.fsdp1.load_fsdp1_optimizer`). Collective over the model's process group."""
    fsdp1.load_fsdp1_optimizer(optimizer, model, input_dir, index,
                               allow_reorder=_allow_reorder(accelerator, allow_reorder))


def load_fsdp2_optimizer(accelerator: Any, optimizer: Any, model: Any, input_dir: str, index: int,
                         *, allow_reorder: bool | None = None) -> None:
    """Restore FSDP2 optimizer ``index`` of ``accelerator`` from ``input_dir/optimizer_<index>``
    (:func:`..fsdp.fsdp2.load_fsdp2_optimizer`). Collective."""
    fsdp2.load_fsdp2_optimizer(optimizer, model, input_dir, index,
                               allow_reorder=_allow_reorder(accelerator, allow_reorder))


def load_fsdp2_model(fsdp_plugin: Any, model: Any, directory: str) -> Any:
    """Restore an FSDP2 model from ``directory`` (its ``pytorch_model_fsdp_<i>``) with the state-dict options
    Accelerate 1.13-1.15 derive from the plugin (``_prepare_sd_options``: CPU offload and rank-0 broadcast from its
    ``state_dict_config``), through :func:`..fsdp.fsdp2.load_fsdp2_model`. Collective."""
    config = fsdp_plugin.state_dict_config
    return fsdp2.load_fsdp2_model(model, directory, cpu_offload=bool(getattr(config, "offload_to_cpu", False)),
                                  broadcast_from_rank0=bool(getattr(config, "rank0_only", False)))


def verify_restored(model: Any, optimizer: Any, directory: Path) -> None:
    """After a restore, every parameter with saved state has live state with every key the checkpoint recorded
    for it (FSDP1 or FSDP2, by the model's type)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        fsdp2.verify_restored_fsdp2(model, optimizer, directory)
    else:
        fsdp1.verify_restored_fsdp1(model, optimizer, directory)
