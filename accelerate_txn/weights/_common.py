"""Names, constants and small helpers shared by every module of :mod:`accelerate_txn.weights`."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..errors import CheckpointConfigurationError

PathLike = str | os.PathLike[str]

CONFIG_NAME = "config.json"
SAFETENSORS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SAFETENSORS_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
BIN_INDEX_NAME = "diffusion_pytorch_model.bin.index.json"
BIN_WEIGHTS_NAME = "diffusion_pytorch_model.bin"
#: The names ``transformers`` ``from_pretrained`` loads: one file, or shards with their index.
TRANSFORMERS_WEIGHTS_NAME = "model.safetensors"
TRANSFORMERS_INDEX_NAME = "model.safetensors.index.json"
#: The names PEFT's ``save_pretrained`` writes and ``PeftModel.from_pretrained`` loads (one file, never sharded).
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
#: Export layouts: file names of Diffusers (``diffusion_pytorch_model*``), of transformers (``model*``) or of a PEFT
#: adapter (``adapter_model.safetensors``).
DIFFUSERS, TRANSFORMERS, PEFT = "diffusers", "transformers", "peft"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
DCP_MODEL_PREFIX = "model."
#: The model directory Accelerate's FSDP ``SHARDED_STATE_DICT`` save writes inside a checkpoint.
ACCELERATE_FSDP_MODEL_DIR = "pytorch_model_fsdp_0"

_EXAMPLES = 5  # how many keys an error message lists before "and N more"
#: The files of an export besides its ``diffusion_pytorch_model*`` weights (kept by re-exports, fingerprinted).
EXPORT_FILES = (CONFIG_NAME, SAFETENSORS_INDEX_NAME, BIN_INDEX_NAME, TRANSFORMERS_INDEX_NAME, ADAPTER_CONFIG_NAME)
#: How every weight file of an export (any layout) starts: what a re-export may replace.
EXPORT_WEIGHT_PREFIXES = ("diffusion_pytorch_model", "model-", TRANSFORMERS_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
#: The signature an export signed with ``sign_key`` carries (:mod:`._signature`): OpenSSF model_signing's default
#: name. A re-export may replace it; it is not fingerprinted (a signature is no content of the model).
SIGNATURE_NAME = "model.sig"


def examples(keys: list[str]) -> str:
    shown = ", ".join(keys[:_EXAMPLES])
    return f"{shown}, and {len(keys) - _EXAMPLES} more" if len(keys) > _EXAMPLES else shown


def strip(key: str, prefix: str | None) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}


def check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointConfigurationError(
            f"dtype={dtype!r} is not a floating torch.dtype: pass e.g. torch.bfloat16, or None to keep each tensor's "
            "dtype (integer and boolean tensors are never cast)."
        )


def output_dtype(dtype: torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    """The dtype a tensor is exported in: ``dtype`` for floating tensors when given, else unchanged."""
    return dtype if dtype is not None and stored.is_floating_point else stored
