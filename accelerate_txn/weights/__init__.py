"""Model-weight I/O: bounded, atomic Diffusers/transformers sharded-safetensors export and validated loading.

Guarantees (each is pinned by ``tests/weights/test_weights.py``):

* **Validate everything, then change anything.** Every loader reads the safetensors headers (or, for ``.bin``
  files, the ``weights_only`` payload) of every file first and checks keys, shapes, duplicates and the index
  against the model before a single parameter is touched. Partial checkpoints and adapter (LoRA) files are
  rejected with a message naming what is missing / unexpected (an adapter is exported with
  :func:`export_dcp_to_peft`, for PEFT's own loader).
* **Bounded memory.** Exports consume the state dict shard by shard; loaders read one file at a time; the DCP
  export materialises one shard at a time. Peak extra memory is about one shard, not the model (about two for
  the DCP export with a dtype cast).
* **Atomic export.** An export is written into a hidden staging sibling (``accelerate_txn._staging``) and
  published by a rename. Re-exporting over an earlier export swaps the two directories with one atomic
  ``renameat2(RENAME_EXCHANGE)`` on Linux, so a reader or a crash sees either the complete old export or the
  complete new one, never a directory whose index names missing shards. Readers open every file once, relative
  to one directory descriptor, and read through those descriptors, so a swap during a read cannot mix exports.
* **Nothing read is unpickled as arbitrary objects.** ``.bin`` files go through ``torch.load(weights_only=True)``;
  DCP ``.metadata`` goes through a restricted unpickler (``_dcp._read_dcp_metadata``).

Callers: one process (rank 0 after gathering the full state dict, or an offline job). Nothing here needs a
process group.

Layout (one concern per private module; this package only re-exports):

* ``_common``: file-name constants, the dtype rule and small helpers shared by every module.
* ``_export``: shard planning and writing, :func:`save_diffusers_state_dict`.
* ``_publish``: atomic publish of an export (staging, lock, recovery, ``RENAME_EXCHANGE`` swap).
* ``_layout``: index reading and locating a checkpoint's weight files, :func:`safetensor_checkpoint_files`.
* ``_read``: reading weight files, header scans and validation against a model.
* ``_loaders``: :func:`read_diffusers_state_dict`, :func:`load_model_checkpoint`,
  :func:`copy_diffusers_checkpoint`, :func:`load_diffusers_checkpoint`, :func:`is_complete_diffusers_checkpoint`.
* ``_fingerprint``: :func:`checkpoint_fingerprint`.
* ``_dcp``: :func:`export_dcp_to_diffusers`, :func:`export_dcp_to_transformers` (transformers' file names:
  ``model.safetensors``, or ``model-*-of-*`` shards and ``model.safetensors.index.json``),
  :func:`export_dcp_to_peft` (a LoRA adapter as ``adapter_model.safetensors`` + ``adapter_config.json``) and their DCP
  helpers.
* ``_peft``: a LoRA adapter's configuration and entries in a checkpoint, under PEFT's saved names.
* ``_signature``: ``sign_key=`` of the exports, a ``model.sig`` in OpenSSF model_signing's format (key-based: ECDSA
  P-256/384/521), written into the staged export so that it is published with it.
"""

from ._common import SIGNATURE_NAME as SIGNATURE_NAME  # for the CLI; not in __all__
from ._dcp import config_layout as config_layout  # for the CLI; not in __all__
from ._dcp import export_dcp_to_diffusers, export_dcp_to_peft, export_dcp_to_transformers
from ._export import resolve_shard_size as resolve_shard_size  # for the CLI; not in __all__
from ._export import save_diffusers_state_dict
from ._fingerprint import FingerprintEntry, checkpoint_fingerprint
from ._layout import safetensor_checkpoint_files
from ._loaders import (
    copy_diffusers_checkpoint,
    is_complete_diffusers_checkpoint,
    load_diffusers_checkpoint,
    load_model_checkpoint,
    read_diffusers_state_dict,
)
from ._signature import export_signer as export_signer  # for the CLI; not in __all__

__all__ = [
    "FingerprintEntry",
    "checkpoint_fingerprint",
    "copy_diffusers_checkpoint",
    "export_dcp_to_diffusers",
    "export_dcp_to_peft",
    "export_dcp_to_transformers",
    "is_complete_diffusers_checkpoint",
    "load_diffusers_checkpoint",
    "load_model_checkpoint",
    "read_diffusers_state_dict",
    "safetensor_checkpoint_files",
    "save_diffusers_state_dict",
]
