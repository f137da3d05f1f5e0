"""accelerate-txn: a training checkpoint is either complete and verified, or it does not exist.

Importing this package wraps ``Accelerator.save_state``/``load_state`` (and the transformers ``Trainer``'s
checkpoints) once (reversibly, see :func:`uninstall`). Where the installed releases are protected (the evidence about
the private pieces each path relies on), FSDP1 and FSDP2 saves and loads with ``SHARDED_STATE_DICT`` or
``FULL_STATE_DICT`` (Accelerate's and the Trainer's defaults included) take the protected path; everything else runs
native Accelerate unchanged, and an FSDP save or load that does logs one WARNING per process and reason with the fix
(strict mode, ``configure_checkpointing(require_protection=True)`` or ``ACCELERATE_TXN_REQUIRE_PROTECTION=1``, raises
:class:`CheckpointUnprotectedError` instead; :func:`protection` answers without saving). ``ACCELERATE_TXN_PATCHES=0``
turns automatic dispatch off; :func:`patch_accelerate_fsdp`/:func:`unpatch_accelerate_fsdp` opt one Accelerator in
or out.
"""

from __future__ import annotations

from .accelerate.autopatch import install_on_import
from .errors import (
    CheckpointArrivalError,
    CheckpointAuthenticationError,
    CheckpointConfigurationError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIntegrityError,
    CheckpointLockedError,
    CheckpointRankError,
    CheckpointUnprotectedError,
    NoCheckpointError,
    NonFiniteStateError,
    RestoreFailedError,
    UnsupportedVersionError,
)
from .trainer.autopatch import install_on_import as install_trainer_on_import

__version__ = "0.1.0.dev0"

# The public API is loaded on first use (PEP 562): ``import accelerate_txn`` stays cheap (the standard library's
# ``sys`` and eight modules of the package: this one, ``errors``, ``accelerate``, ``accelerate.autopatch``, ``trainer``,
# ``trainer.autopatch``, and the import hook both share, ``compat`` and ``compat.hooks``;
# benchmarks/bench_import.py measures it, tests/project/test_import_cost.py pins it), and the offline CLI (``verify``,
# ``list``, ``latest``) never imports torch.
_LAZY = {
    "configure_checkpointing": "accelerate.config",
    "check_finite_state": "accelerate.finite",
    "check_finite_training_value": "accelerate.finite",
    "load_training_checkpoint": "accelerate.load",
    "MANIFEST": "core.manifest",
    "PROTOCOL": "core.manifest",
    "install": "accelerate.patch",
    "uninstall": "accelerate.patch",
    "patch_accelerate_fsdp": "accelerate.patch",
    "unpatch_accelerate_fsdp": "accelerate.patch",
    "register_checkpoint_state": "accelerate.rng",
    "agree": "core.ranks",
    "on_main": "core.ranks",
    "save_training_checkpoint": "accelerate.save",
    "latest_training_checkpoint": "accelerate.selection",
    "quarantine_checkpoint": "runtime.quarantine",
    "release_checkpoint": "runtime.quarantine",
    "wait_for_checkpoint": "runtime.async_save",
}

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; type checkers treat the name as True
if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from typing import Any

    from .accelerate.config import configure_checkpointing
    from .accelerate.finite import check_finite_state, check_finite_training_value
    from .accelerate.load import load_training_checkpoint
    from .accelerate.patch import install, patch_accelerate_fsdp, uninstall, unpatch_accelerate_fsdp
    from .accelerate.rng import register_checkpoint_state
    from .accelerate.save import save_training_checkpoint
    from .accelerate.selection import latest_training_checkpoint
    from .core.manifest import MANIFEST, PROTOCOL
    from .core.ranks import agree as agree  # rank helpers: importable, not in __all__
    from .core.ranks import on_main as on_main
    from .runtime.async_save import wait_for_checkpoint
    from .runtime.quarantine import quarantine_checkpoint, release_checkpoint


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def checkpoint_source_identity(path: Any) -> Any:
    """Content identity of a frozen model source, hashed once on rank 0 and shared with every rank.

    All ranks must pass the same path (checked). See :func:`accelerate_txn.weights.checkpoint_fingerprint`.
    """
    import os

    from .core.ranks import agree, on_main
    from .weights import checkpoint_fingerprint

    agree(os.fspath(path), "the checkpoint source path")
    return on_main(lambda: checkpoint_fingerprint(path), f"Fingerprinting {path}")


def protection(owner: Any) -> Any:
    """Whether ``owner``'s checkpoints take the protected path now, and if not why and the one change that would
    protect them: a :class:`~accelerate_txn.runtime.protection.Protection` (truthy when protected; ``.reason``,
    ``.fix``, ``.path``). ``owner`` is an ``Accelerator`` or a transformers ``Trainer``. Local, no collective: call it
    on any rank, at any time (the optimizer's live state counts, so ask after the first step too)."""
    if hasattr(owner, "args") and hasattr(owner, "accelerator") and hasattr(owner, "state"):
        from .trainer.patch import protection as trainer_protection

        return trainer_protection(owner)
    from .accelerate.patch import protection as accelerator_protection

    return accelerator_protection(owner)


# Wrap Accelerator.save_state/load_state now if Accelerate is imported, else the moment it is; the same for the
# transformers Trainer's save and resume (``accelerate_txn.trainer``).
install_on_import()
install_trainer_on_import()

__all__ = [
    "MANIFEST",
    "PROTOCOL",
    "CheckpointArrivalError",
    "CheckpointAuthenticationError",
    "CheckpointConfigurationError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIntegrityError",
    "CheckpointLockedError",
    "CheckpointRankError",
    "CheckpointUnprotectedError",
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
    "protection",
    "quarantine_checkpoint",
    "register_checkpoint_state",
    "release_checkpoint",
    "save_training_checkpoint",
    "unpatch_accelerate_fsdp",
    "uninstall",
    "wait_for_checkpoint",
]
