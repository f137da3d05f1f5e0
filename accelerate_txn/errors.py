"""The library's exception hierarchy.

Every exception subclasses a built-in (so ``except ValueError`` in user code keeps working), takes a single
message argument and is therefore picklable: errors travel between ranks. Messages say what is wrong, where,
and what to do.

When a phase fails on some ranks, every rank raises the same exception: the common class of the failing ranks'
errors when they agree, :class:`CheckpointRankError` otherwise. ``failures`` maps each failing rank to its
message (it is empty for an error raised on one process only).
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every error raised by accelerate-txn."""

    failures: dict[int, str]

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.failures = {}


class CheckpointRankError(CheckpointError):
    """Ranks failed with different errors (or with errors that are not the library's own)."""


class CheckpointArrivalError(CheckpointRankError):
    """Only some ranks reached a collective checkpoint call (``save_state``/``load_state`` under FSDP), or ranks
    reached different ones; raised on the ranks that did, before any collective, and nothing was written or
    restored."""


class CheckpointIntegrityError(CheckpointError, ValueError):
    """A checkpoint on disk is incomplete, truncated, altered or not a checkpoint at all."""


class CheckpointAuthenticationError(CheckpointIntegrityError):
    """Verification keys are configured and a checkpoint's manifest carries no authenticator, an authenticator that
    does not match its content, or one made with a key that is not configured: it may be forged. An integrity error
    too, so automatic selection skips such a candidate as it skips a damaged one."""


class CheckpointConfigurationError(CheckpointError, ValueError):
    """The live training configuration does not match the checkpoint, or the library is misconfigured."""


class CheckpointUnprotectedError(CheckpointConfigurationError):
    """Protection is required (``ACCELERATE_TXN_REQUIRE_PROTECTION=1`` or ``configure_checkpointing(acc,
    require_protection=True)``) and this save or load would run native, unprotected: raised before anything is
    written or read, the same on every rank."""


class CheckpointLockedError(CheckpointError):
    """Another live writer holds the lock on the checkpoint directory."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The destination already exists (or belongs to another run)."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete checkpoint could be found where one was requested."""


class RestoreFailedError(CheckpointError):
    """A restore failed part-way: training state is inconsistent until a successful reload."""


class UnsupportedVersionError(CheckpointError):
    """The installed Accelerate/PyTorch pair is outside the validated table."""


class NonFiniteStateError(CheckpointError, ValueError):
    """A tensor about to be saved or just restored contains NaN or Inf."""


__all__ = [
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
]
