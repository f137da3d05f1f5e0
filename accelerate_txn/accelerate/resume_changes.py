"""What may change between a checkpoint and the run resuming it, named in the user's terms.

A resume compares the saved training-configuration descriptor with the live one (``descriptor.check_resume``).
Before the generic comparison, this module recognises the differences it can name and decides each one:

* **accepted, with one warning line** (the restore handles them correctly): a ``LambdaLR`` schedule's total
  length (a function value named in :data:`LENGTH_NAMES`); training metadata naming the run's length or its
  logging, evaluation or checkpoint cadence (:data:`RUN_METADATA_KEYS`). ``LambdaLR.load_state_dict`` restores
  the step but never the functions, so the live function with the new length continues from the restored step;
  the restore then sets the optimizer's learning rate to the live schedule's value at that step
  (:func:`continue_live_schedules`), so the first step after the resume already follows the new schedule.
* **refused unless named in** ``configure_checkpointing(accelerator, accept_changes=[...])``: any other value of a
  ``LambdaLR`` function (warmup, number of cycles, power, ...: the schedule's shape, not its extent); a torch
  built-in scheduler's setting (:data:`BUILTIN_SETTINGS`), which ``load_state_dict`` silently restores from the
  checkpoint so the new value would be ignored; any other training-metadata value; a data loader's order setting
  (:data:`ORDER_SETTINGS`: dataset length, batch size, ``drop_last``, shuffle, sampler and batch sampler
  classes, ``split_batches``, ``even_batches``, ``dispatch_batches``, processes sharded over), which changes the
  batches and what a position counted in batches means, so the resumed run would silently train on other batches
  than the uninterrupted one. The refusal prints the exact name to pass (:attr:`Change.name`).
* **refused, even when named**: an order setting of a *stateful* data loader (``use_stateful_dataloader``): its
  saved iterator position is replayed on the changed loader, which can fail part way through the restore (a
  shorter epoch) or resume at another sample.

A setting a checkpoint does not record (saved before it was recorded) is unknown, not a change; so is one that
does not apply on one side (``None``: e.g. ``even_batches`` of a one-process loader, which Accelerate does not shard).
A change of the number of processes alone is left to the world-size check (refused, or resharded with
``allow_reshard``).

Everything else (shapes, optimizer type and groups, world size, a scheduler's class or function, metadata keys
added or removed, ...) is left to the generic comparison and refused as before. Pure functions on JSON values;
every rank computes the same answer from the same (agreed) inputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.jsondiff import differences
from ..errors import CheckpointConfigurationError
from ..fsdp.internals import one_cycle_anneal_strategy, one_cycle_phases, set_last_lr

#: Names of a ``LambdaLR`` function's value (closure variable, default, keyword) that hold the schedule's total
#: length in steps. A change of one of them is accepted: the live function continues with the new length.
LENGTH_NAMES = frozenset({
    "num_training_steps", "num_train_steps", "max_train_steps", "max_steps", "total_steps", "training_steps",
    "total_training_steps", "num_steps", "t_total", "total_iters",
})
#: Names of a ``LambdaLR`` function's warmup length in steps (a change is refused unless accepted by name).
WARMUP_NAMES = frozenset({"num_warmup_steps", "warmup_steps", "num_warmup", "warmup", "warmup_iters"})
#: How other well-known schedule values read in a message.
_LABELS = {"num_cycles": "number of cycles", "power": "power", "lr_end": "final learning rate",
           "lr_init": "initial learning rate", "last_lr_multiple": "last learning-rate multiple"}
#: Training-metadata keys (``configure_checkpointing(metadata=...)``, at any depth) that name the run's length or
#: its logging, evaluation or checkpoint cadence: nothing the restore reads, so a changed value is accepted.
RUN_METADATA_KEYS = frozenset({
    "epochs", "num_epochs", "num_train_epochs", "max_epochs", "max_train_steps", "max_steps", "train_steps",
    "num_training_steps", "total_steps", "logging_steps", "log_every", "log_interval", "eval_steps", "eval_every",
    "eval_interval", "validation_steps", "validation_epochs", "save_steps", "save_every", "save_interval",
    "checkpointing_steps", "checkpoint_every", "checkpoints_total_limit", "save_total_limit",
})


def _attribute(name: str) -> Callable[[Any], Any]:
    return lambda scheduler: getattr(scheduler, name)


def _milestones(scheduler: Any) -> list[int]:
    return sorted(scheduler.milestones.elements())  # a Counter: each milestone as often as it was given


def _pct_start(scheduler: Any) -> float:
    # Not kept as given: OneCycleLR records its first phase's end step, pct_start * total_steps - 1.
    return round((float(one_cycle_phases(scheduler)[0]["end_step"]) + 1) / scheduler.total_steps, 6)


def _three_phase(scheduler: Any) -> bool:
    return len(one_cycle_phases(scheduler)) == 3


#: The settings of torch's built-in schedulers (exact classes of ``torch.optim.lr_scheduler``) that the descriptor
#: records: ``load_state_dict`` restores every one of them from the checkpoint, so a changed value would be
#: silently ignored. Setting name -> how to read it (a setting the installed torch does not have is left out).
BUILTIN_SETTINGS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "StepLR": {"step_size": _attribute("step_size"), "gamma": _attribute("gamma")},
    "MultiStepLR": {"milestones": _milestones, "gamma": _attribute("gamma")},
    "ConstantLR": {"factor": _attribute("factor"), "total_iters": _attribute("total_iters")},
    "LinearLR": {"start_factor": _attribute("start_factor"), "end_factor": _attribute("end_factor"),
                 "total_iters": _attribute("total_iters")},
    "ExponentialLR": {"gamma": _attribute("gamma")},
    "PolynomialLR": {"total_iters": _attribute("total_iters"), "power": _attribute("power")},
    "CosineAnnealingLR": {"T_max": _attribute("T_max"), "eta_min": _attribute("eta_min")},
    "CosineAnnealingWarmRestarts": {"T_0": _attribute("T_0"), "T_mult": _attribute("T_mult"),
                                    "eta_min": _attribute("eta_min")},
    "OneCycleLR": {"total_steps": _attribute("total_steps"), "pct_start": _pct_start, "three_phase": _three_phase,
                   "anneal_strategy": one_cycle_anneal_strategy, "cycle_momentum": _attribute("cycle_momentum")},
    "CyclicLR": {"max_lrs": _attribute("max_lrs"), "total_size": _attribute("total_size"),
                 "step_ratio": _attribute("step_ratio"), "mode": _attribute("mode"), "gamma": _attribute("gamma"),
                 "scale_mode": _attribute("scale_mode"), "cycle_momentum": _attribute("cycle_momentum")},
    "ReduceLROnPlateau": {"mode": _attribute("mode"), "factor": _attribute("factor"), "patience": _attribute("patience"),
                          "threshold": _attribute("threshold"), "threshold_mode": _attribute("threshold_mode"),
                          "cooldown": _attribute("cooldown"), "min_lrs": _attribute("min_lrs"), "eps": _attribute("eps")},
}


def builtin_settings(scheduler: Any) -> dict[str, Any] | None:
    """The recorded settings of a torch built-in scheduler (not JSON-normalised), or None for any other class
    (a subclass included: it may give its attributes another meaning)."""
    kind = type(scheduler)
    if kind.__module__ != "torch.optim.lr_scheduler" or kind.__name__ not in BUILTIN_SETTINGS:
        return None
    settings = {}
    for name, read in BUILTIN_SETTINGS[kind.__name__].items():
        try:
            settings[name] = read(scheduler)
        except (AttributeError, IndexError, KeyError, TypeError, ZeroDivisionError):  # not in this torch release
            continue
    return settings


@dataclass(frozen=True)
class Change:
    """One recognised difference between a checkpoint and the live run.

    ``name`` is what ``configure_checkpointing(accept_changes=[...])`` takes; ``text`` says what changed and
    ``effect`` what resuming with the change does (``explain``: also in a refusal); ``automatic`` changes need no
    name; ``schedule`` is the index of a ``LambdaLR`` whose live functions continue with a new value (its learning
    rate is re-evaluated at the restored step, :func:`continue_live_schedules`); a change that is not
    ``acceptable`` is refused whatever ``accept_changes`` names."""

    name: str
    text: str
    effect: str
    automatic: bool = False
    schedule: int | None = None
    explain: bool = True
    acceptable: bool = True  # False: refused even when named (``effect`` then says why)

    def accepted_line(self) -> str:
        return f"{self.text}: {self.effect}"

    def refused_line(self) -> str:
        if not self.acceptable:
            return f"{self.text}: {self.effect}"
        return f"{self.text}: if accepted, {self.effect}" if self.explain else self.text


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value_pairs(saved: Any, live: Any, found: list[tuple[str, Any, Any]]) -> None:
    """Collect ``(name, saved value, live value)`` for each named value of one function signature that differs, and
    align ``saved`` to ``live`` there so the generic comparison no longer reports it. Names recorded only live
    (a checkpoint written before names were) are dropped from ``live`` after use, so it compares as before."""
    if not isinstance(saved, dict) or not isinstance(live, dict):
        return
    if "partial" in saved and "partial" in live:
        _value_pairs(saved["partial"], live["partial"], found)
        _named_dict(saved, live, "kwargs", found)
        return
    if "function" not in saved or saved.get("function") != live.get("function"):
        return
    _named_list(saved, live, "closure", "closure_names", found)
    _named_list(saved, live, "defaults", "default_names", found)
    _named_dict(saved, live, "keywords", found)


def _named_list(saved: dict[str, Any], live: dict[str, Any], values: str, names_key: str,
                found: list[tuple[str, Any, Any]]) -> None:
    names = live.get(names_key)
    if names_key not in saved:
        # Recorded before names were: read the saved values with the live function's names, which is what the
        # positional comparison always assumed (same function name, same number of values).
        live.pop(names_key, None)
    elif saved[names_key] != names:
        return  # other names: the generic comparison reports the difference
    old, new = saved.get(values), live.get(values)
    if not (isinstance(names, list) and isinstance(old, list) and isinstance(new, list)
            and len(names) == len(old) == len(new)):
        return
    for index, name in enumerate(names):
        if old[index] != new[index]:
            found.append((str(name), old[index], new[index]))
            old[index] = new[index]


def _named_dict(saved: dict[str, Any], live: dict[str, Any], key: str, found: list[tuple[str, Any, Any]]) -> None:
    old, new = saved.get(key), live.get(key)
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(set(old) & set(new)):
            if old[name] != new[name]:
                found.append((name, old[name], new[name]))
                old[name] = new[name]


def _schedule_change(index: int, subject: str, name: str, pairs: list[tuple[Any, Any]]) -> Change:
    distinct = list(dict.fromkeys((_show(old), _show(new)) for old, new in pairs))
    if len(distinct) == 1:
        before, after = distinct[0]
    else:  # the per-group functions changed differently: show every function's value
        before, after = _show([pair[0] for pair in pairs]), _show([pair[1] for pair in pairs])
    steps = " steps" if all(_number(a) and _number(b) for a, b in pairs) else ""
    key = f"schedulers[{index}].{name}"
    if name in LENGTH_NAMES and steps:
        return Change(key, f"{subject}'s total length changed from {before} to {after} steps",
                      "the restored scheduler continues with the new length", automatic=True, schedule=index)
    if name in WARMUP_NAMES:
        return Change(key, f"{subject}'s warmup changed from {before} to {after}{steps}",
                      "the restored scheduler continues with the new warmup", schedule=index)
    label = _LABELS.get(name, f"value {name}")
    return Change(key, f"{subject}'s {label} changed from {before} to {after}",
                  "the restored scheduler continues with the new value", schedule=index)


def _entry_pairs(saved: Any, live: Any) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """``(index, saved entry, live entry)`` of two descriptor lists of the same length, where both are mappings (lists
    of other lengths are another check's: nothing here)."""
    if not (isinstance(saved, list) and isinstance(live, list) and len(saved) == len(live)):
        return []
    return [(index, old, new) for index, (old, new) in enumerate(zip(saved, live))
            if isinstance(old, dict) and isinstance(new, dict)]


def _scheduler_changes(saved: list[Any], live: list[Any]) -> list[Change]:
    changes: list[Change] = []
    for index, old, new in _entry_pairs(saved, live):
        if "settings" not in old:
            new.pop("settings", None)  # recorded before settings were: compare as before
        if old.get("class") != new.get("class") or old.get("optimizer") != new.get("optimizer"):
            continue
        kind = str(new.get("class"))
        subject = "the learning-rate schedule" if len(live) == 1 else f"learning-rate scheduler {index}"
        owner = f"the learning-rate scheduler {kind}" if len(live) == 1 else f"learning-rate scheduler {index}, {kind}"
        if kind == "LambdaLR":
            olds, news = old.get("functions"), new.get("functions")
            if isinstance(olds, list) and isinstance(news, list) and len(olds) == len(news):
                found: list[tuple[str, Any, Any]] = []
                for saved_function, live_function in zip(olds, news):
                    _value_pairs(saved_function, live_function, found)
                for name in dict.fromkeys(name for name, _, _ in found):
                    pairs = [(a, b) for other, a, b in found if other == name]
                    changes.append(_schedule_change(index, subject, name, pairs))
        settings, live_settings = old.get("settings"), new.get("settings")
        if isinstance(settings, dict) and isinstance(live_settings, dict):
            for name in sorted(set(settings) & set(live_settings)):
                before, after = settings[name], live_settings[name]
                if before != after:
                    changes.append(Change(
                        f"schedulers[{index}].{name}",
                        f"{owner}'s {name} changed from {_show(before)} to {_show(after)}",
                        f"load_state_dict restores the saved {_show(before)} and the new value is ignored"))
                    settings[name] = after
    return changes


def _metadata_changes(saved: Any, live: Any, path: str, changes: list[Change]) -> None:
    if not (isinstance(saved, dict) and isinstance(live, dict)):
        return
    for key in sorted(set(saved) & set(live), key=str):
        where = f"{path}.{key}"
        before, after = saved[key], live[key]
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            _metadata_changes(before, after, where, changes)
            continue
        name = f"training{where}"
        if key in RUN_METADATA_KEYS:
            changes.append(Change(name, f"training metadata {where[1:]} changed from {_show(before)} to {_show(after)}",
                                  "the next checkpoint records the new value", automatic=True))
        else:  # the user's own fact, refused in the words of any other difference: only they can judge it
            # In the words of any other difference (long values cut around where they differ: core.jsondiff).
            changes.append(Change(name, differences(before, after, path=name, limit=1)[0],
                                  "the next checkpoint records the new value", explain=False))
        saved[key] = after


#: The settings of a prepared data loader that decide which samples its batches hold and what a count of batches (the
#: position a resumed script skips to) means, as the descriptor records them (``data_order.order_settings``).
ORDER_SETTINGS = ("dataset_length", "batch_size", "drop_last", "shuffle", "sampler", "batch_sampler",
                  "split_batches", "even_batches", "dispatch_batches", "processes")
#: How a data loader's order setting reads in a message.
_LOADER_LABELS = {"dataset_length": "dataset length", "batch_size": "batch size", "batch_sampler": "batch sampler",
                  "processes": "number of processes it shards over"}
#: What resuming with a changed order setting does (the restore itself is unchanged: ``data_order``).
LOADER_EFFECT = ("the data order is not reproduced: the loader continues from the saved epoch and generators, but its "
                 "batches, and the batches a resumed position (counted in batches) skips, differ from the "
                 "uninterrupted run's")
STATEFUL_EFFECT = ("this cannot be accepted for a stateful data loader (use_stateful_dataloader): its saved iterator "
                   "position would be replayed on the changed loader, which can fail part way through the restore or "
                   "resume at another sample. Resume with the saved setting, or start a new run directory")


def _loader_value(value: Any) -> str:
    return str(value) if isinstance(value, (bool, str)) else _show(value)


def _loader_changes(saved: Any, live: Any, same_world: bool) -> list[Change]:
    """The changed order settings (:data:`ORDER_SETTINGS`) of each data loader, by its index. A setting the
    checkpoint does not record, or that is ``None`` on either side, is not a change; the number of processes is not
    one when the world size changed (that check decides). A shuffle change is named once (not again as a sampler
    change); a ``dispatch_batches`` change covers the loader class it implies."""
    changes: list[Change] = []
    for index, old, new in _entry_pairs(saved, live):
        stateful = bool(old.get("stateful")) and bool(new.get("stateful"))
        named: set[str] = set()
        for key in ORDER_SETTINGS:
            if key not in old:  # recorded before this setting was: unknown, compare as before
                new.pop(key, None)
                continue
            if key not in new or old[key] == new[key]:
                continue
            before, after = old[key], new[key]
            old[key] = after
            if before is None or after is None or (key == "processes" and not same_world) \
                    or (key == "sampler" and "shuffle" in named):
                continue
            if key == "dispatch_batches":
                old["class"] = new.get("class")  # DataLoaderShard <-> DataLoaderDispatcher: this very change
            named.add(key)
            changes.append(Change(
                f"dataloaders[{index}].{key}",
                f"data loader {index}'s {_LOADER_LABELS.get(key, key)} changed from {_loader_value(before)} to "
                f"{_loader_value(after)}",
                STATEFUL_EFFECT if stateful else LOADER_EFFECT, acceptable=not stateful))
    return changes


def named_changes(saved: dict[str, Any], live: dict[str, Any]) -> list[Change]:
    """The differences between two normalised descriptors that this module can name, in descriptor order
    (schedulers, training metadata, then data loaders). Mutates both: ``saved`` is aligned to ``live`` at each named
    difference and names recorded only live are dropped, so the generic comparison reports only what is left."""
    changes = _scheduler_changes(saved.get("schedulers"), live.get("schedulers"))
    _metadata_changes(saved.get("training"), live.get("training"), "", changes)
    changes += _loader_changes(saved.get("dataloaders"), live.get("dataloaders"),
                               saved.get("world_size") == live.get("world_size"))
    return changes


_ACCEPT_NAME = re.compile(
    r"schedulers\[\d+\]\.[A-Za-z_][A-Za-z0-9_]*|dataloaders\[\d+\]\.[A-Za-z_][A-Za-z0-9_]*|training\..+", re.DOTALL)


def check_accept_names(value: Any) -> tuple[str, ...]:
    """Validate ``configure_checkpointing(accept_changes=...)``: a list of names as a refused resume prints them."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise CheckpointConfigurationError(
            f"configure_checkpointing(accept_changes={value!r}) must be a list of change names, as a refused resume "
            'prints them: e.g. accept_changes=["schedulers[0].num_warmup_steps"] or ["training.seed"]')
    names = tuple(value)
    bad = [name for name in names if not isinstance(name, str) or not _ACCEPT_NAME.fullmatch(name)]
    if bad:
        raise CheckpointConfigurationError(
            f"configure_checkpointing(accept_changes=...): {bad!r} are not change names. A name is "
            '"schedulers[N].<setting>" (a learning-rate scheduler\'s value), "dataloaders[N].<setting>" (a data '
            'loader\'s order setting, e.g. "dataloaders[0].batch_size") or "training.<key>" (a metadata key), '
            "exactly as a refused resume prints it; see docs/configuration.md, \"What may change on resume\".")
    return tuple(dict.fromkeys(names))


def accept_hint(names: Iterable[str]) -> str:
    """The sentence of a refusal that says how to accept its named changes."""
    return ("configure_checkpointing(accelerator, accept_changes=" + json.dumps(list(names)) + ")")


def continue_live_schedules(schedulers: list[Any], indices: Iterable[int]) -> None:
    """After a restore that accepted a change to the functions of the ``LambdaLR`` schedulers at ``indices``: set
    each optimizer group's learning rate (and ``get_last_lr()``) to the live functions' value at the restored
    step, ``base_lr * f(last_epoch)`` as ``LambdaLR`` computes it. The optimizer restore brought back the rate the
    saved functions gave that step; without this, the first step after the resume would still use it."""
    import torch

    for index in sorted(set(indices)):
        scheduler = getattr(schedulers[index], "scheduler", schedulers[index])
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            continue
        values = [base * function(scheduler.last_epoch)
                  for function, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
        for group, value in zip(scheduler.optimizer.param_groups, values):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(value))
            else:
                group["lr"] = value
        set_last_lr(scheduler, [group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
                                for group in scheduler.optimizer.param_groups])
