"""Readable summaries of the training-configuration descriptor a manifest records (``inspect``), and the
differences that would stop a resume (``diff``). Plain dictionaries in, plain dictionaries out.
"""

from __future__ import annotations

import math
from typing import Any

from ..accelerate.layouts import unit_text


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _count(shape: Any) -> int:
    return math.prod(int(n) for n in shape) if isinstance(shape, list) and all(isinstance(n, int) for n in shape) else 0


def _model(model: dict[str, Any]) -> dict[str, Any]:
    parameters = _dict(model.get("parameters"))
    rows = [row for row in parameters.values() if isinstance(row, dict)]
    units = [unit for unit in _list(model.get("fsdp")) if isinstance(unit, dict)]
    return {
        "id": model.get("id"),
        "class": model.get("class"),
        "parameters": sum(_count(row.get("shape")) for row in rows),
        "trainable": sum(_count(row.get("shape")) for row in rows if row.get("requires_grad")),
        "tensors": len(rows),
        "dtypes": sorted({str(row.get("dtype")) for row in rows}),
        "fsdp_units": len(units),
        # FSDP1 units record their sharding strategy (hybrid ones their grid too); FSDP2 its version and mesh.
        "sharding": sorted({unit_text(unit) for unit in units}),
        "config": _dict(model.get("config")),
    }


def _optimizer(optimizer: dict[str, Any]) -> dict[str, Any]:
    groups = [group for group in _list(optimizer.get("groups")) if isinstance(group, list)]
    return {"class": optimizer.get("class"), "groups": [len(group) for group in groups]}


def _scheduler(scheduler: dict[str, Any]) -> dict[str, Any]:
    functions = [_dict(function) for function in _list(scheduler.get("functions"))]
    names = [str(function.get("function") or _dict(function.get("partial")).get("function") or "?")
             for function in functions]
    return {"class": scheduler.get("class"), "optimizer": scheduler.get("optimizer"), "functions": names}


def summarize(descriptor: Any) -> dict[str, Any]:
    """What a person wants to read of one component's descriptor; tolerant of missing or malformed fields."""
    descriptor = _dict(descriptor)
    return {
        "world_size": descriptor.get("world_size"),
        "backend": descriptor.get("backend"),
        "mixed_precision": descriptor.get("mixed_precision"),
        "accumulation_steps": descriptor.get("accumulation_steps"),
        "models": [_model(model) for model in _list(descriptor.get("models")) if isinstance(model, dict)],
        "optimizers": [_optimizer(opt) for opt in _list(descriptor.get("optimizers")) if isinstance(opt, dict)],
        "schedulers": [_scheduler(s) for s in _list(descriptor.get("schedulers")) if isinstance(s, dict)],
        "dataloaders": [_dict(loader) for loader in _list(descriptor.get("dataloaders"))],
        "custom_objects": _list(descriptor.get("custom_objects")),
        "scaler": descriptor.get("scaler"),
        "private_states": {name: {"generators": sorted(_dict(state.get("generators"))),
                                  "progress_keys": _list(state.get("progress_keys"))}
                           for name, state in _dict(descriptor.get("private_states")).items() if isinstance(state, dict)},
        "training": _dict(descriptor.get("training")),
    }


def _front_end(manifest: dict[str, Any]) -> str:
    """Which front end saved a checkpoint: ``trainer`` (transformers.Trainer) or ``accelerate``."""
    from ..trainer.layout import is_trainer_manifest

    return "trainer" if is_trainer_manifest(manifest) else "accelerate"


def _components_text(manifest: dict[str, Any]) -> str:
    """The components of a checkpoint, as a person reads them: a Trainer checkpoint has none (its configuration is
    Trainer's record); an Accelerate one the default component (one Accelerator, at the checkpoint's root) or named
    ones (one Accelerator each, in a subdirectory)."""
    names = sorted(_dict(manifest.get("components")))
    if _front_end(manifest) == "trainer":
        return "a Trainer checkpoint (no named components)" if not names else \
            f"a Trainer checkpoint with components {', '.join(map(repr, names))}"
    if not names:
        return "a checkpoint that records no components"
    if names == [""]:
        return "an Accelerate checkpoint (the default component: one Accelerator)"
    shown = ", ".join("the default component" if name == "" else repr(name) for name in names)
    return f"an Accelerate checkpoint with components {shown}"


def resume_blockers(saved: dict[str, Any], other: dict[str, Any], *, allow_reshard: bool = False
                    ) -> list[dict[str, Any]]:
    """Why a run configured as ``other`` was saved would be refused when resuming ``saved``, per component, in the
    library's own words (the same comparison load_state() runs), every difference (load_state()'s message lists the
    first 8). Empty when it would resume."""
    from ..accelerate.descriptor import compare_descriptor
    from ..errors import CheckpointConfigurationError

    saved_parts, other_parts = _dict(saved.get("components")), _dict(other.get("components"))
    found = []
    if set(saved_parts) != set(other_parts):
        kinds = [_components_text(saved), _components_text(other)]
        fronts = {_front_end(saved), _front_end(other)}
        why = ("a checkpoint is resumed by the front end that saved it: Trainer's train(resume_from_checkpoint=...) "
               "or Accelerate's load_state()" if len(fronts) > 1 else "load_state() needs the same components")
        found.append({"component": None, "message": f"A is {kinds[0]}, B is {kinds[1]}: {why}",
                      "differences": [f"components: {kinds[0]} (saved) vs {kinds[1]} (live)"]})
    for name in sorted(set(saved_parts) & set(other_parts)):
        where = f"component {name!r}" if name else "the checkpoint"
        try:
            compare_descriptor(saved_parts[name], other_parts[name], where=where, warn=False,
                               allow_reshard=allow_reshard, limit=None)
        except CheckpointConfigurationError as exc:
            message = str(exc)
            lines = [line.strip() for line in message.splitlines()[1:] if line.startswith("  ")]
            found.append({"component": name, "message": message, "differences": lines})
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a hand-edited or foreign manifest
            found.append({"component": name, "differences": [],
                          "message": f"{where}: the recorded configurations cannot be compared (malformed: {exc!r})"})
    return found
