"""PEFT (LoRA) models under FSDP1: Trainer's adapter-only model save, made a full sharded save.

Trainer saves and loads an FSDP model with ``adapter_only=True`` whatever the model (``get_fsdp_ckpt_kwargs``). For a
PEFT model, Accelerate's ``_get_model_state_dict`` then takes ``peft.get_peft_model_state_dict`` of the model it is
given, the FSDP1 wrapper; peft 0.21 picks the adapter's entries by the names of its tuner modules, which carry FSDP1's
``_fsdp_wrapped_module.`` prefix where the state dict's keys do not, so it selects nothing: natively the checkpoint's
``pytorch_model_fsdp_0`` holds no tensor at all, and a resume restores no adapter weight (it keeps the fresh adapter
and the resumed run diverges), silently. FSDP2 (the model itself is sharded in place) saves the adapter's entries.

So, inside a protected save (:func:`saving`) of an FSDP1 ``SHARDED_STATE_DICT`` Trainer, :func:`save_model` (the
wrapper of ``transformers.trainer.save_fsdp_model``) saves a PEFT model with ``adapter_only=False``: the whole sharded
model, frozen base weights and adapter, which the manifest then lists and verifies like any model shard. On a protected
FSDP1 resume, :func:`load_arguments` loads such a checkpoint with ``adapter_only=False`` as well (only when its model
metadata holds tensors: a native adapter-only checkpoint, empty, loads natively). Everything else is unchanged.

Every protected save of a PEFT model (FSDP1 or FSDP2) also writes the active adapter's ``adapter_config.json`` into the
checkpoint (:func:`write_adapter_config`; Trainer writes it only with a ``FULL_STATE_DICT`` model save, through
``save_pretrained``), listed and verified like every file: what ``accelerate-txn export --format peft`` needs to
publish the adapter as ``PeftModel.from_pretrained`` loads it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.manifest import read_dcp_metadata
from .internals import model_save_arguments
from .layout import backend, state_dict_type

#: The Trainer whose protected save runs in this context (``None``: none).
_SAVING: contextvars.ContextVar[Any] = contextvars.ContextVar("accelerate_txn_trainer_saving", default=None)


@contextlib.contextmanager
def saving(trainer: Any) -> Iterator[None]:
    """While inside, ``trainer``'s FSDP1 model saves of a PEFT model write the whole sharded model."""
    token = _SAVING.set(trainer)
    try:
        yield
    finally:
        _SAVING.reset(token)


def _peft_model(model: Any) -> bool:
    from accelerate.utils import is_peft_model

    return bool(is_peft_model(model))


#: The file PEFT's ``save_pretrained`` writes the adapter's configuration into (``peft.utils.CONFIG_NAME``).
ADAPTER_CONFIG = "adapter_config.json"


def write_adapter_config(trainer: Any, tree: Path) -> bool:
    """Rank 0 of a protected save: write the active adapter's ``adapter_config.json`` into the staged checkpoint
    ``tree`` when Trainer's model is a PEFT model and the native save wrote none. Returns whether it wrote one."""
    model = getattr(trainer, "model", None)
    if model is None or not _peft_model(model) or (tree / ADAPTER_CONFIG).exists():
        return False
    adapter = getattr(model, "active_adapter", "default")
    config = getattr(model, "peft_config", {}).get(adapter)
    if config is None:
        return False
    config.save_pretrained(str(tree))  # writes exactly adapter_config.json, as PeftModel.save_pretrained does
    return True


def _full_save(trainer: Any, bound: dict[str, Any]) -> bool:
    """Whether this ``save_fsdp_model``/``load_fsdp_model`` call of ``trainer`` is an FSDP1 sharded (DCP) one of a
    PEFT model asked for its adapter only."""
    return (trainer is not None and bound.get("accelerator") is getattr(trainer, "accelerator", None)
            and backend(trainer) == "FSDP1" and state_dict_type(trainer) == "SHARDED_STATE_DICT"
            and bool(bound.get("adapter_only")) and bool(bound.get("use_dcp", True)) and _peft_model(bound["model"]))


def save_model(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper of Trainer's ``save_fsdp_model`` binding (see the module docstring)."""
    bound = model_save_arguments(args, kwargs)
    if not _full_save(_SAVING.get(), bound):
        return wrapped(*args, **kwargs)
    return wrapped(**{**bound, "adapter_only": False})


def load_arguments(trainer: Any, kind: str | None, bound: dict[str, Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a protected resume's ``load_fsdp_model`` call: ``adapter_only=False`` for an FSDP1 PEFT model
    whose checkpoint holds the whole sharded model (:func:`save_model`), else ``args`` and ``kwargs`` unchanged."""
    if kind != "FSDP1" or not _full_save(trainer, bound):
        return args, kwargs
    directory = Path(bound["input_dir"]) / f"pytorch_model_fsdp_{int(bound['model_index'])}"
    if not read_dcp_metadata(directory).state_dict_metadata:  # a native adapter-only save: nothing to load
        return args, kwargs
    return (), {**bound, "adapter_only": False}
