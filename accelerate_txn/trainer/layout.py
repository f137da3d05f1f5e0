"""Trainer's checkpoint layout: which files a ``checkpoint-N`` holds, which rank wrote each, which ones a resume
reads, and the training record a Trainer manifest carries. File logic only (no process group).

A native Trainer save writes, into ``checkpoint-N``: the model (FSDP ``SHARDED_STATE_DICT``:
``pytorch_model_fsdp_0/``, a DCP directory; otherwise ``model.safetensors`` and ``config.json``), the optimizer
(``optimizer_0/`` under FSDP, else ``optimizer.pt``), ``scheduler.pt``, ``scaler.pt`` when there is a scaler,
``rng_state_{rank}.pth`` per rank (``rng_state.pth`` with one process), ``trainer_state.json``, and
``training_args.bin``. Trainer treats the RNG files and ``scheduler.pt`` as optional on resume; here every file the
save wrote is in the inventory, and the files a resume needs are listed in the manifest (``trainer.required``) and
checked for every saving rank.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointIntegrityError

TRAINER_STATE = "trainer_state.json"
RNG_TEMPLATE = "rng_state_{rank}.pth"
RNG_SINGLE = "rng_state.pth"
#: Per-rank file templates: the rank in the name wrote the file (``core.manifest.writer_rank``).
RANK_TEMPLATES = (RNG_TEMPLATE,)
#: Files a Trainer resume reads that ``core.manifest.loader_may_read`` does not already cover: an unlisted one in a
#: published checkpoint is refused.
LOADER_PATTERNS = (re.compile(r"trainer_state\.json\Z"), re.compile(r".*config\.json\Z"))
_RNG = re.compile(r"rng_state_(\d+)\.pth\Z")


def backend(trainer: Any) -> str:
    """``"FSDP1"``, ``"FSDP2"``, ``"DeepSpeed"``, ``"distributed"`` (DDP or several CPU processes) or ``"single"``."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = trainer.accelerator.state.fsdp_plugin
        return f"FSDP{getattr(plugin, 'fsdp_version', 1)}"
    return "distributed" if trainer.args.world_size > 1 else "single"


def state_dict_type(trainer: Any) -> str | None:
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    kind = trainer.accelerator.state.fsdp_plugin.state_dict_type
    return str(getattr(kind, "name", kind)).rsplit(".", 1)[-1]


def training_record(trainer: Any) -> dict[str, Any]:
    """What the manifest records of the saving Trainer (``trainer`` key): the world, the backend, the global step and
    the arguments that decide what a resume replays. Informational except ``world_size`` and ``required``."""
    args = trainer.args
    return {
        "world_size": int(args.world_size),
        "backend": backend(trainer),
        "state_dict_type": state_dict_type(trainer),
        "global_step": int(trainer.state.global_step),
        "save_only_model": bool(args.save_only_model),
        "arguments": {name: _plain(getattr(args, name, None)) for name in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "num_train_epochs", "seed",
            "data_seed", "learning_rate", "lr_scheduler_type", "save_steps", "save_total_limit")},
    }


def rng_files(world: int) -> list[str]:
    return [RNG_SINGLE] if world <= 1 else [RNG_TEMPLATE.format(rank=rank) for rank in range(world)]


def required_files(record: dict[str, Any], present: set[str]) -> list[str]:
    """The files a resume of a checkpoint saved as ``record`` reads, which every save must have written:
    ``trainer_state.json``; unless ``save_only_model``, every saving rank's RNG file and, under FSDP
    ``SHARDED_STATE_DICT``, the model's and optimizer's DCP ``.metadata``; ``scheduler.pt`` when the save wrote one
    (``present``: the files written)."""
    required = [TRAINER_STATE]
    if not record.get("save_only_model"):
        required += rng_files(int(record["world_size"]))
        if record.get("state_dict_type") == "SHARDED_STATE_DICT":
            required += ["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"]
        if "scheduler.pt" in present:
            required.append("scheduler.pt")
    elif record.get("state_dict_type") == "SHARDED_STATE_DICT":
        required.append("pytorch_model_fsdp_0/.metadata")
    return sorted(required)


def check_files(directory: Path, names: set[str], record: dict[str, Any], required: list[str]) -> None:
    """Every required file is among ``names`` (an inventory, or a staged tree), and the RNG files are exactly
    those of the saving world's ranks; raises :class:`CheckpointIntegrityError` naming the first missing file."""
    missing = [name for name in required if name not in names]
    if missing:
        raise CheckpointIntegrityError(
            f"{Path(directory) / missing[0]} is missing ({len(missing)} file(s) a Trainer resume reads: "
            f"{', '.join(missing)}): the save did not complete on every rank. It is not a complete checkpoint; resume "
            "from an older one (resume_from_checkpoint=True skips it)."
        )
    world = int(record.get("world_size", 1))
    ranks = {int(match.group(1)) for name in names if "/" not in name and (match := _RNG.fullmatch(name))}
    if ranks and ranks != set(range(world)):
        raise CheckpointIntegrityError(
            f"{directory}: RNG files of ranks {sorted(ranks)} for a world of {world} rank(s): not every saving rank "
            "contributed (or the directory was altered). It is not a complete checkpoint."
        )


def _plain(value: Any) -> Any:
    """``value`` as JSON (enums and other objects by their text)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(getattr(value, "value", value))
