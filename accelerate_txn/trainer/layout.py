"""Trainer's checkpoint layout: which files a ``checkpoint-N`` holds, which rank wrote each, which ones a resume
reads, and the training record a Trainer manifest carries. File logic only (no process group).

A native Trainer save writes, into ``checkpoint-N``: the model (FSDP ``SHARDED_STATE_DICT``:
``pytorch_model_fsdp_0/``, a DCP directory; otherwise ``model.safetensors`` and ``config.json``), the optimizer
(``optimizer_0/`` under FSDP, else ``optimizer.pt``), ``scheduler.pt``, ``scaler.pt`` when there is a scaler,
``rng_state_{rank}.pth`` per rank (``rng_state.pth`` with one process), ``trainer_state.json``, and
``training_args.bin``. Trainer treats the RNG files and ``scheduler.pt`` as optional on resume; here every file the
save wrote is in the inventory, and the files a resume needs are listed in the manifest (``trainer.required``) and
checked for every saving rank. :class:`TrainerRules` are the selection rules of a Trainer checkpoint, used by the
resume and by the command line (torch is never imported here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..core.manifest import list_tree
from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from ..runtime.versions import checkpoint_compatibility
from .order import order_record

TRAINER_STATE = "trainer_state.json"
RNG_TEMPLATE = "rng_state_{rank}.pth"
RNG_SINGLE = "rng_state.pth"
#: Per-rank file templates: the rank in the name wrote the file (``core.manifest.writer_rank``).
RANK_TEMPLATES = (RNG_TEMPLATE,)
#: Files a Trainer resume reads that ``core.manifest.loader_may_read`` does not already cover: an unlisted one in a
#: published checkpoint is refused.
LOADER_PATTERNS = (re.compile(r"trainer_state\.json\Z"), re.compile(r".*config\.json\Z"))
_RNG = re.compile(r"rng_state_(\d+)\.pth\Z")
FRONTEND = "transformers.Trainer"
"""The ``frontend`` of a Trainer manifest."""


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
    the arguments that decide what a resume replays. Informational except ``world_size``, ``required`` and
    ``data_order`` (what decides the resumed data order and position, compared at a resume: :mod:`.order`)."""
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
        "data_order": order_record(trainer),
    }


def rng_files(world: int) -> list[str]:
    return [RNG_SINGLE] if world <= 1 else [RNG_TEMPLATE.format(rank=rank) for rank in range(world)]


def required_files(record: dict[str, Any], present: set[str]) -> list[str]:
    """The files a resume of a checkpoint saved as ``record`` reads, which every save must have written:
    ``trainer_state.json``; unless ``save_only_model``, every saving rank's RNG file and, under FSDP
    ``SHARDED_STATE_DICT``, the model's and optimizer's DCP ``.metadata`` (``FULL_STATE_DICT``: Accelerate's full
    ``pytorch_model_fsdp.bin`` and ``optimizer.bin``, which rank 0 writes); ``scheduler.pt`` when the save wrote one
    (``present``: the files written)."""
    required = [TRAINER_STATE]
    if not record.get("save_only_model"):
        required += rng_files(int(record["world_size"]))
        if record.get("state_dict_type") == "SHARDED_STATE_DICT":
            required += ["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"]
        elif record.get("state_dict_type") == "FULL_STATE_DICT":
            required += ["pytorch_model_fsdp.bin", "optimizer.bin"]
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


def is_trainer_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and manifest.get("frontend") == FRONTEND


def check_record(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A Trainer manifest's record is there and every file a resume reads is in its inventory, for every saving
    rank (:func:`check_files`); returns the record. Raises :class:`CheckpointIntegrityError`."""
    record = manifest.get("trainer")
    if not isinstance(record, dict) or not isinstance(record.get("world_size"), int) \
            or not isinstance(record.get("required"), list):
        raise CheckpointIntegrityError(f"{path}: its manifest has no Trainer record: it is not a Trainer checkpoint "
                                       "(resume it with the front end that saved it)")
    check_files(path, set(manifest["files"]), record, [str(name) for name in record["required"]])
    return record


def legacy_world(names: set[str]) -> int:
    """The world size a native (manifest-less) Trainer checkpoint was saved by, from its RNG files (1 if none)."""
    ranks = [int(match.group(1)) for name in names if "/" not in name and (match := _RNG.fullmatch(name))]
    return max(ranks) + 1 if ranks else 1


class TrainerRules:
    """``core.select.CandidateRules`` of a Trainer checkpoint resumed on ``world`` ranks (``None``: the saving world
    of each checkpoint, as the command line checks them). ``offline``: the command line's checks, without torch (it
    never imports torch to list or verify): no comparison with the installed torch, and DCP ``.metadata`` files are
    hash-checked against the manifest but not re-read for chunk coverage (the save checked coverage before it
    published, and the hash proves the file is the one it checked)."""

    components: set[str] = set()  # Trainer manifests record no Accelerate components

    def __init__(self, world: int | None, *, offline: bool = False) -> None:
        self.world = world
        self.offline = offline
        self.dcp_coverage = not offline  # read by ``core.select.check_candidate``

    def private_patterns(self) -> list[re.Pattern[str]]:
        return list(LOADER_PATTERNS)

    def allow_legacy(self) -> bool:
        return True  # a native Trainer checkpoint is resumed when nothing complete exists (never preferred)

    def check_required(self, path: Path, manifest: dict[str, Any] | None) -> None:
        if manifest is not None:
            check_record(path, manifest)
            reason = None if self.offline else checkpoint_compatibility(manifest.get("versions") or {})
            if reason:
                raise CheckpointConfigurationError(f"Cannot resume from {path}: {reason}")
            return
        names = set(list_tree(path))
        present_rng = any(re.fullmatch(r"rng_state(_\d+)?\.pth", name) for name in names)
        record = {"world_size": self.world if self.world is not None else legacy_world(names),
                  "save_only_model": not present_rng,
                  "state_dict_type": "SHARDED_STATE_DICT" if "pytorch_model_fsdp_0/.metadata" in names
                  or any(name.startswith("pytorch_model_fsdp_0/") for name in names) else None}
        check_files(path, names, record, required_files(record, names))
        empty = sorted(name for name, size in list_tree(path).items() if size == 0 and name.endswith((".pth", ".pt")))
        if empty:
            raise CheckpointIntegrityError(f"{path / empty[0]} is empty: the save was interrupted")


def _plain(value: Any) -> Any:
    """``value`` as JSON (enums and other objects by their text)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(getattr(value, "value", value))
