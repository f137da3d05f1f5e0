"""accelerate-txn: a training checkpoint is either complete and verified, or it does not exist.

Importing this package wraps ``Accelerator.save_state``/``load_state`` once (reversibly, see :func:`uninstall`).
On a validated Accelerate/PyTorch pair, FSDP1 ``SHARDED_STATE_DICT`` saves and loads take the protected
path; everything else runs native Accelerate unchanged. ``VIDEOX_ACCELERATE_PATCHES=0`` turns automatic
dispatch off; :func:`patch_accelerate_fsdp`/:func:`unpatch_accelerate_fsdp` opt one Accelerator in or out.
"""

from __future__ import annotations

from typing import Any

from ._config import configure_checkpointing
from ._finite import check_finite_state, check_finite_training_value
from ._load import load_training_checkpoint
from ._manifest import MANIFEST, PROTOCOL
from ._patch import install, patch_accelerate_fsdp, uninstall, unpatch_accelerate_fsdp
from ._ranks import agree, on_main
from ._rng import register_checkpoint_state
from ._save import save_training_checkpoint
from ._select import latest_training_checkpoint
from .errors import (
    CheckpointConfigurationError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIntegrityError,
    CheckpointLockedError,
    CheckpointRankError,
    NoCheckpointError,
    NonFiniteStateError,
    RestoreFailedError,
    UnsupportedVersionError,
)

__version__ = "0.1.0.dev0"


def checkpoint_source_identity(path: Any) -> Any:
    """Content identity of a frozen model source, hashed once on rank 0 and shared with every rank.

    All ranks must pass the same path (checked). See :func:`accelerate_txn.weights.checkpoint_fingerprint`.
    """
    import os

    from .weights import checkpoint_fingerprint

    agree(os.fspath(path), "the checkpoint source path")
    return on_main(lambda: checkpoint_fingerprint(path), f"Fingerprinting {path}")


install()

__all__ = [
    "MANIFEST",
    "PROTOCOL",
    "CheckpointConfigurationError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIntegrityError",
    "CheckpointLockedError",
    "CheckpointRankError",
    "NoCheckpointError",
    "NonFiniteStateError",
    "RestoreFailedError",
    "UnsupportedVersionError",
    "__version__",
    "check_finite_state",
    "check_finite_training_value",
    "checkpoint_source_identity",
    "configure_checkpointing",
    "install",
    "latest_training_checkpoint",
    "load_training_checkpoint",
    "patch_accelerate_fsdp",
    "register_checkpoint_state",
    "save_training_checkpoint",
    "unpatch_accelerate_fsdp",
    "uninstall",
]
