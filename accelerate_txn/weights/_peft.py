"""A LoRA adapter inside a sharded training checkpoint: its configuration, and which model entries are the adapter's
under the names PEFT's ``save_pretrained`` writes (``adapter_model.safetensors``).

A checkpoint of a PEFT model holds the adapter in one of two ways (``accelerate_txn.trainer.adapters``):

* **adapter only** (Trainer under FSDP2, or any Accelerate ``adapter_only`` save): the entries are what
  ``peft.get_peft_model_state_dict`` returned, already under PEFT's saved names
  (``base_model.model.<module>.lora_A.weight``): taken as they are;
* **whole model** (Trainer under FSDP1 with this library, a full ``save_state``): the live ``state_dict`` names,
  base weights beside the adapter's (``<module>.base_layer.weight``, ``<module>.lora_A.default.weight``): the entries
  of one adapter are picked by name and renamed as PEFT's ``_remove_adapter_name_from_state_dict_key`` does (the
  adapter-name component dropped; DoRA's ``lora_magnitude_vector.<adapter>.weight`` saved as
  ``lora_magnitude_vector``).

PEFT itself picks an adapter's entries structurally, from the live model; offline there is no model, so only LoRA's
own parameters (``LORA_PARAMETERS``) are recognised by name. Everything else is refused, never guessed: another PEFT
method, a LoRA with ``bias`` other than ``"none"`` (its biases are base-layer entries), and whole-model entries that
carry the adapter's name but are no LoRA parameter (``modules_to_save``, trainable tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from ._common import ADAPTER_CONFIG_NAME, examples

#: The tensors of a LoRA layer, by attribute name (peft ``LoraLayer.adapter_layer_names``).
LORA_PARAMETERS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
#: Every name ``peft.get_peft_model_state_dict`` returns for a (non prompt-learning) PEFT model starts so.
PEFT_PREFIX = "base_model.model."
LEAVES = ("weight", "bias")


def read_adapter_config(source: Any, adapter_name: str) -> tuple[dict[str, Any], Callable[[Path], None]]:
    """The adapter configuration (parsed) and how to write it as ``adapter_config.json`` into an export.

    ``source``: a path to ``adapter_config.json`` or to a directory holding one, a PEFT config (``LoraConfig``: an
    object with ``to_dict`` and ``save_pretrained``), or a PEFT model (its ``peft_config[adapter_name]``).
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        path = path / ADAPTER_CONFIG_NAME if path.is_dir() else path
        try:
            text = path.read_text(encoding="utf-8")
            parsed = json.loads(text)
        except (OSError, ValueError) as exc:
            raise CheckpointConfigurationError(
                f"Cannot use {path} as the adapter's {ADAPTER_CONFIG_NAME} ({exc}): pass the file PEFT's "
                "save_pretrained wrote (or its directory), or the PEFT config itself."
            ) from None
        if not isinstance(parsed, dict):
            raise CheckpointConfigurationError(f"{path} holds no JSON object: it is no PEFT {ADAPTER_CONFIG_NAME}.")

        def copy(directory: Path) -> None:
            (directory / ADAPTER_CONFIG_NAME).write_text(text, encoding="utf-8")

        return parsed, copy
    configs = getattr(source, "peft_config", None)
    if isinstance(configs, Mapping):
        if adapter_name not in configs:
            raise CheckpointConfigurationError(
                f"The PEFT model has no adapter {adapter_name!r} (it has {sorted(configs)}): pass adapter_name."
            )
        source = configs[adapter_name]
    if not (callable(getattr(source, "to_dict", None)) and callable(getattr(source, "save_pretrained", None))):
        raise CheckpointConfigurationError(
            f"{type(source).__name__} is no adapter configuration: pass a path to {ADAPTER_CONFIG_NAME}, a PEFT config "
            "(e.g. LoraConfig) or the PEFT model."
        )
    config = source
    parsed = {key: getattr(value, "value", value) for key, value in config.to_dict().items()}
    return parsed, lambda directory: config.save_pretrained(str(directory))


def check_adapter_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse a configuration whose adapter cannot be told apart from the model by name (module docstring)."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise CheckpointConfigurationError(
            f"Cannot export the adapter of {where} as a PEFT adapter: its configuration's peft_type is {kind!r}; only "
            "LoRA adapters (peft_type 'LORA') are exported. Load the checkpoint into the PEFT model and call its "
            "save_pretrained() instead."
        )
    if config.get("bias", "none") != "none":
        raise CheckpointConfigurationError(
            f"Cannot export the adapter of {where}: its LoRA trains biases (bias={config.get('bias')!r}), which are "
            "base-layer entries no name tells apart. Load the checkpoint into the PEFT model and call its "
            "save_pretrained() instead."
        )


def peft_entries(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that only a PEFT model has: LoRA parameters and the base layers LoRA wraps."""
    return sorted(name for name in names if (LORA_PARAMETERS | {"base_layer"}) & set(name.split(".")))


def _adapter_component(parts: list[str]) -> int | None:
    """Index of the adapter-name component of a live LoRA name (``...lora_A.<adapter>.weight``), else ``None``."""
    for index in range(1, len(parts)):
        if parts[index - 1] in LORA_PARAMETERS and parts[index] not in LEAVES:
            return index
    return None


def saved_name(name: str, adapter_name: str) -> str | None:
    """PEFT's saved name of a live entry of adapter ``adapter_name``, or ``None`` when it is no entry of it."""
    parts = name.split(".")
    index = _adapter_component(parts)
    if index is None or parts[index] != adapter_name:
        return None
    kept = parts[:index] + parts[index + 1:]
    if kept[index - 1] == "lora_magnitude_vector" and kept[index:] == ["weight"]:
        kept = kept[:index]  # DoRA: PEFT saves the magnitude vector without ".weight"
    return ".".join(kept)


def adapter_entries(names: Iterable[str], adapter_name: str, where: str) -> dict[str, str]:
    """``saved name -> stored name`` of the adapter's entries among a checkpoint's model entries ``names`` (prefix
    removed); refuses what is no LoRA adapter of ``adapter_name``."""
    names = sorted(names)
    found = {parts[index] for parts in (name.split(".") for name in names)
             if (index := _adapter_component(parts)) is not None}
    whole = bool(found) or any("base_layer" in name.split(".") for name in names)
    if not whole:  # adapter only: already PEFT's saved names
        foreign = [name for name in names if not name.startswith(PEFT_PREFIX)]
        if foreign or not any(LORA_PARAMETERS & set(name.split(".")) for name in names):
            raise CheckpointIntegrityError(
                f"{where} holds no LoRA adapter: {examples(foreign or names)} are not PEFT names "
                f"({PEFT_PREFIX}<module>.lora_A.weight, ...). Export it with --format transformers or diffusers, or "
                "pass the checkpoint of the PEFT model."
            )
        return {name: name for name in names}
    if adapter_name not in found:
        holds = f"the adapter(s) {sorted(found)}" if found else "no LoRA entry (lora_A/lora_B)"
        raise CheckpointConfigurationError(
            f"{where} holds {holds}, not the adapter {adapter_name!r}: pass the adapter's name "
            "(adapter_name=..., --adapter-name)."
        )
    entries = {saved: name for name in names if (saved := saved_name(name, adapter_name)) is not None}
    unnamed = [name for name in names if adapter_name in name.split(".")[1:] and saved_name(name, adapter_name) is None]
    if unnamed:
        raise CheckpointConfigurationError(
            f"Cannot export the adapter {adapter_name!r} of {where}: {len(unnamed)} of its entries are no LoRA "
            f"parameter ({examples(unnamed)}: modules_to_save or trainable tokens), whose saved names PEFT decides "
            "from the live model. Load the checkpoint into the PEFT model and call its save_pretrained() instead."
        )
    return entries
