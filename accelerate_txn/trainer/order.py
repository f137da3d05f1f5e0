"""What decides a Trainer resume's data order and position: recorded at every save, compared at every resume of a
protected checkpoint, before Trainer loads anything.

Trainer's resume position is ``global_step`` alone. On resume it computes ``epochs_trained = global_step //
num_update_steps_per_epoch`` and, unless ``ignore_data_skip``, skips ``(global_step % num_update_steps_per_epoch) *
gradient_accumulation_steps`` batches of the live train data loader; ``num_update_steps_per_epoch`` derives from the
live data loader's length (dataset length, per-device batch size, ``dataloader_drop_last``, world size) and
``gradient_accumulation_steps``, and the order of each epoch from the sampler (``train_sampling_strategy`` or
``group_by_length``) and its seed (``data_seed``, else ``seed``). When one of them changed, the resumed run silently
trains on other batches than the uninterrupted one: natively Trainer only logs a warning for a changed batch size
(``compare_trainer_and_checkpoint_args``) and nothing for a changed dataset.

:func:`order_record` is the ``data_order`` key of a Trainer manifest's record (``None`` for what is unknown: a
dataset without a length, a setting this transformers does not have). :func:`order_changes` compares it with the
live Trainer (a key the checkpoint does not record, or ``None`` on either side, is unknown, not a change; a manifest
without ``data_order``, saved before it was recorded, resumes as before); the world size is the world-size check's.
:func:`check_data_order` refuses a change with :class:`~accelerate_txn.errors.CheckpointConfigurationError` naming
each setting with its saved and live values and the ways through; with ``TrainingArguments(ignore_data_skip=True)``
(Trainer's own flag: it does not fast-forward the data, so the order is knowingly not reproduced) the change is
accepted with one warning line on rank 0.

A change is refused whatever the position, not only mid-epoch: the epoch count is itself derived from these
settings, so a checkpoint saved at the end of an epoch is at another epoch and mid-way through it once the number of
update steps per epoch changed (saved at step 10 of 10-step epochs, resumed with 8-step ones: epoch 1, 2 update steps
skipped); and even where the position stays on an epoch boundary (a ``drop_last`` that does not change the length,
a seed change), the next epoch's batches, drawn with the sampler's seed and epoch, differ from the uninterrupted
run's. Telling the harmless coincidences apart would need Trainer's own length arithmetic, per version; the refusal
names the way through instead. Pure functions on JSON values plus one rank phase (the caller's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import CheckpointConfigurationError

logger = logging.getLogger(__name__)

#: The settings recorded, in message order, and how each reads in a message.
SETTINGS = {
    "train_dataset_length": "train dataset length (len(trainer.train_dataset))",
    "per_device_train_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "dataloader_drop_last": "dataloader_drop_last",
    "group_by_length": "group_by_length",
    "train_sampling_strategy": "train_sampling_strategy",
    "sampler_seed": "sampler seed (data_seed, or seed when data_seed is None)",
}


def _length(dataset: Any) -> int | None:
    """``len(dataset)`` where it has one (Trainer's ``has_length``); ``None`` for none or an iterable dataset."""
    if dataset is None:
        return None
    try:
        return len(dataset)
    except (TypeError, AttributeError, NotImplementedError, ValueError):
        return None


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "value", value))


def order_record(trainer: Any) -> dict[str, Any]:
    """The settings of ``trainer`` that decide its resume's data order and position (:data:`SETTINGS`; ``None``:
    unknown or not applicable). The sampler seed is ``None`` for a sequential sampler, whose order it does not
    decide; the batch size with ``auto_find_batch_size``, where Trainer trains with the size it found (not the
    argument) and a resume takes the checkpoint's own (``trainer_state.json``)."""
    args = trainer.args
    strategy = _plain(getattr(args, "train_sampling_strategy", None))
    seed = getattr(args, "data_seed", None)
    seed = getattr(args, "seed", None) if seed is None else seed
    return {
        "train_dataset_length": _length(getattr(trainer, "train_dataset", None)),
        "per_device_train_batch_size": None if getattr(args, "auto_find_batch_size", False)
        else _plain(getattr(args, "per_device_train_batch_size", None)),
        "gradient_accumulation_steps": _plain(getattr(args, "gradient_accumulation_steps", None)),
        "dataloader_drop_last": _plain(getattr(args, "dataloader_drop_last", None)),
        "group_by_length": _plain(getattr(args, "group_by_length", None)),
        "train_sampling_strategy": strategy,
        "sampler_seed": None if strategy == "sequential" else _plain(seed),
    }


def order_changes(saved: Any, live: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, saved, live)`` for each recorded setting that changed. Nothing recorded (a checkpoint saved
    before ``data_order`` was), a setting not recorded, or ``None`` on either side: unknown, not a change."""
    if not isinstance(saved, dict):
        return []
    return [(key, saved[key], live.get(key)) for key in SETTINGS
            if saved.get(key) is not None and live.get(key) is not None and saved[key] != live[key]]


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{SETTINGS[key]} changed from {before!r} (saved) to {after!r} (live)"
                     for key, before, after in changes)


def check_data_order(trainer: Any, path: Path, manifest: dict[str, Any] | None) -> None:
    """This rank: refuse resuming ``path`` when a setting of :data:`SETTINGS` differs from its manifest's record
    (see the module docstring); with ``ignore_data_skip`` accept it, rank 0 logging one warning line. A native
    (manifest-less) checkpoint records nothing: resumed as before. Called in a rank phase, before Trainer loads
    anything."""
    if manifest is None:
        return
    record = manifest.get("trainer") if isinstance(manifest.get("trainer"), dict) else {}
    changes = order_changes(record.get("data_order"), order_record(trainer))
    if not changes:
        return
    step = record.get("global_step")
    if getattr(trainer.args, "ignore_data_skip", False):
        if getattr(trainer.args, "process_index", 0) == 0:
            logger.warning(
                "Resuming from %s with ignore_data_skip=True: the data order is not reproduced (%s; Trainer does not "
                "skip the batches already trained in the resumed epoch)", path, describe(changes))
        return
    raise CheckpointConfigurationError(
        f"Cannot resume from {path}: what decides the data order and position changed: {describe(changes)}. Trainer "
        f"resumes at global step {step} by counting epochs and batches with the live settings, so the resumed run "
        "would silently train on other batches than the uninterrupted one. Nothing was loaded. Resume with the saved "
        "settings; or pass TrainingArguments(ignore_data_skip=True) to resume knowingly without reproducing the data "
        "order (Trainer then does not skip the batches already trained in the resumed epoch); or start a new run "
        "(another output_dir, or no resume_from_checkpoint).")
