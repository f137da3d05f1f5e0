"""Which config ``export`` ships beside the weights: the one given (``--config``, or CONFIG), else the one the
checkpoint carries; without either, a usage error that says what to pass.

Given, it is a config file, a directory holding one (a model directory as ``from_pretrained`` reads it), or a model id
such as ``meta-llama/Llama-3.2-1B`` found in the local Hugging Face cache (never downloaded: the command line works
offline). Carried: a checkpoint holds ``config.json`` only when its saver wrote the full model (a Trainer without FSDP,
or under FSDP with ``FULL_STATE_DICT``), and ``adapter_config.json`` when it is a protected Trainer save of a PEFT
model. An Accelerate ``save_state()`` checkpoint and a Trainer checkpoint saved under FSDP with ``SHARDED_STATE_DICT``
(``pytorch_model_fsdp_0/``) hold no model config. File work only: no torch.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click

from ._remote import ADAPTER_CONFIG, CONFIG, is_url

#: What a Hugging Face model id looks like (``name`` or ``org/name``), as opposed to a path: one ``/`` at most, no
#: leading ``.`` or ``/``.
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?\Z")


def config_name(layout: str, directory: Path) -> str:
    """Which config file ``directory`` offers for ``layout``: a PEFT adapter's for ``peft`` (and for ``auto`` when it
    has one), else the model's ``config.json``."""
    if layout == "peft" or (layout == "auto" and (directory / ADAPTER_CONFIG).is_file()):
        return ADAPTER_CONFIG
    return CONFIG


def _from_hub_cache(model_id: str, layout: str) -> Path | None:
    """The config of ``model_id`` in the local Hugging Face cache (``HF_HUB_CACHE``), as ``from_pretrained`` finds it
    offline; ``None`` when it is not cached. Never downloads."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # Accelerate depends on huggingface_hub; without it, there is no cache to look in
        return None
    names = [ADAPTER_CONFIG] if layout == "peft" else [ADAPTER_CONFIG, CONFIG] if layout == "auto" else [CONFIG]
    for name in names:
        try:
            found = try_to_load_from_cache(model_id, name)
        except ValueError:  # not a valid repository id after all
            return None
        if isinstance(found, str):
            return Path(found)
    return None


def given_config(value: str | Path, layout: str, option: str) -> Path:
    """The config file ``value`` names (``option``: how it was given, for messages): a file, a directory holding one,
    or a model id in the local Hugging Face cache; a usage error naming what to pass otherwise."""
    path = Path(value)
    if path.is_dir():
        found = path / config_name(layout, path)
        if not found.is_file():
            raise click.UsageError(
                f"{option} {value}: the directory holds no {found.name}: pass the model's config.json (the adapter's "
                f"adapter_config.json for --format peft), or the directory holding it (the model directory "
                "from_pretrained loaded)")
        return found
    if path.is_file():
        return path
    if _MODEL_ID.fullmatch(str(value)):
        cached = _from_hub_cache(str(value), layout)
        if cached is not None:
            return cached
        raise click.UsageError(
            f"{option} {value}: no such file or directory, and no model {str(value)!r} with a "
            f"{ADAPTER_CONFIG if layout == 'peft' else CONFIG} in the local Hugging Face cache (HF_HUB_CACHE; nothing "
            f"is downloaded): pass a local config.json or model directory, or fetch the config first with "
            f"'hf download {value} {ADAPTER_CONFIG if layout == 'peft' else CONFIG}'")
    raise click.UsageError(f"{option} {value}: no such file or directory: pass the model's config.json or its directory")


def carried_config(checkpoint: Path | str, source: Path, output: Path | str, layout: str) -> Path:
    """The config the checkpoint carries (``source``: the local checkpoint, or its downloaded copy); a usage error
    saying why there is none and what to pass."""
    name = config_name(layout, source)
    carried = source / name
    if carried.is_file():
        return carried
    command = f"accelerate-txn export {shlex.quote(str(checkpoint))} {shlex.quote(str(output))}"
    if name == ADAPTER_CONFIG:
        why = (f"only a protected Trainer save of a PEFT model carries the adapter's {ADAPTER_CONFIG}. Pass it with "
               f"--config: '{command} --config ADAPTER_DIR', ADAPTER_DIR holding the {ADAPTER_CONFIG} that "
               "model.peft_config['default'].save_pretrained(ADAPTER_DIR) writes")
    else:
        why = ("an Accelerate save_state() checkpoint holds no model config, nor does a Trainer checkpoint saved under "
               "FSDP with SHARDED_STATE_DICT (its model is the sharded state in pytorch_model_fsdp_0/: Trainer writes "
               f"{CONFIG} only when it saves the full model). Pass the model's config with --config: '{command} --config "
               "MODEL', MODEL the model directory the training loaded (from_pretrained's, holding config.json), a model "
               "id in the local Hugging Face cache (e.g. meta-llama/Llama-3.2-1B), or a config.json written by "
               "model.config.save_pretrained(DIR) (transformers) or model.save_config(DIR) (Diffusers)")
    parent = None if is_url(checkpoint) else Path(checkpoint).parent / name
    nearby = (f"; {parent} is there: --config {shlex.quote(str(parent.parent))} if it is this model's"
              if parent is not None and parent.is_file() else "")
    raise click.UsageError(f"{checkpoint} carries no {name}: {why}{nearby}")
