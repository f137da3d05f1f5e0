"""A transformers ``Trainer`` with FSDP on CPU (gloo), for tests of Trainer checkpointing without GPUs.

``TrainingArguments(use_cpu=True)`` silently turns FSDP off (the Accelerator becomes ``MULTI_CPU``), and FSDP1's
default ``sync_module_states`` raises on CPU. :func:`force_fsdp_trainer` takes a Trainer built with
``use_cpu=True`` in each rank of a gloo job and forces the same CPU FSDP plugin the rest of this harness uses onto its
Accelerator (``_cpu_fsdp.force_fsdp``), then sets ``trainer.is_fsdp_enabled``, which Trainer reads to choose its FSDP
save and resume paths. Call it right after constructing the Trainer, before ``train``.
"""

from __future__ import annotations

from typing import Any

from ._cpu_fsdp import check_state_dict_type, force_fsdp, make_plugin


def force_fsdp_trainer(trainer: Any, *, fsdp_version: int = 1, auto_wrap: type | None = None,
                       state_dict_type: str = "SHARDED_STATE_DICT") -> Any:
    """Make ``trainer`` (built with ``TrainingArguments(use_cpu=True)`` in a gloo process group) train, save and
    resume with FSDP1 or FSDP2 on CPU; returns it. ``auto_wrap``: the module class FSDP wraps in units of its own
    (e.g. ``LlamaDecoderLayer``; ``None``: the model is one unit). Every rank calls it."""
    check_state_dict_type(state_dict_type, fsdp_version, f"force_fsdp_trainer(state_dict_type={state_dict_type!r})")
    plugin = make_plugin(fsdp_version=fsdp_version, state_dict_type=state_dict_type, auto_wrap=auto_wrap)
    force_fsdp(trainer.accelerator, plugin)
    trainer.is_fsdp_enabled = True
    return trainer
