"""The validated version table and its override.

"Validated" means CI runs the whole distributed suite on that pair. Everything else runs native Accelerate
(automatic dispatch) or is refused (explicit opt-in), unless the user sets ``VIDEOX_ACCELERATE_ALLOW_UNVALIDATED=1``
and accepts the risk.

Checkpoint compatibility across versions is decided by :func:`checkpoint_compatibility`, not by equality of
the recorded versions (see docs/protocol.md, "Versions").
"""

from __future__ import annotations

import functools
import os

from packaging.version import Version

# Each entry: (package, inclusive lower bound, exclusive upper bound). Keep in step with .ci/run.
VALIDATED: dict[str, tuple[tuple[str, str], ...]] = {
    "accelerate": (("1.7.0", "1.7.1"), ("1.10.1", "1.10.2"), ("1.13.0", "1.13.1"), ("1.15.0", "1.15.1")),
    "torch": (("2.13.0", "2.13.1"),),
}
OVERRIDE_ENV = "VIDEOX_ACCELERATE_ALLOW_UNVALIDATED"


def installed_versions() -> dict[str, str]:
    """The real installed versions (recorded in every manifest)."""
    import accelerate
    import torch

    return {"accelerate": accelerate.__version__, "torch": torch.__version__}


def _release(version: str) -> Version:
    # "2.13.0+cpu" and "2.13.0a0+git..." compare by their release numbers.
    return Version(Version(version).base_version)


def is_validated(package: str, version: str) -> bool:
    release = _release(version)
    return any(Version(low) <= release < Version(high) for low, high in VALIDATED[package])


def unvalidated() -> list[str]:
    """Human-readable list of installed packages outside the table (empty when validated)."""
    return [f"{name} {version}" for name, version in installed_versions().items() if not is_validated(name, version)]


def override_requested() -> bool:
    return os.environ.get(OVERRIDE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def _installed_validated() -> bool:
    return not unvalidated()


def versions_ok() -> bool:
    """True when the installed pair is validated or the user accepted the risk."""
    return _installed_validated() or override_requested()


def _describe_range(low: str, high: str) -> str:
    first, limit = Version(low), Version(high)
    if limit.release == (*first.release[:2], first.micro + 1):
        return low  # exactly one release
    return f">={low},<{high}"


def describe_table() -> str:
    return "; ".join(f"{name} " + ", ".join(_describe_range(low, high) for low, high in ranges)
                     for name, ranges in VALIDATED.items())


def unsupported_message() -> str:
    return (
        f"accelerate-txn has not been validated with {', '.join(unvalidated())} (validated: {describe_table()}). "
        f"Install a validated pair, or set {OVERRIDE_ENV}=1 to use the protected path at your own risk."
    )


def checkpoint_compatibility(saved: dict[str, str]) -> str | None:
    """Why a checkpoint written under ``saved`` versions cannot be read here, or ``None`` if it can.

    Policy: the on-disk protocol number decides the format; library versions only matter where a reader
    cannot read a newer writer's files. DCP promises backward but not forward compatibility, so a checkpoint
    written by a newer torch (major.minor) than the one running is refused; anything else is accepted.
    """
    here = installed_versions()
    try:
        written = _release(saved["torch"])
    except (KeyError, TypeError, ValueError):
        return "the manifest does not record the torch version that wrote it"
    running = _release(here["torch"])
    if (written.major, written.minor) > (running.major, running.minor):
        return (
            f"it was written by torch {saved['torch']}, newer than the running torch {here['torch']} "
            "(torch.distributed.checkpoint is not forward compatible): upgrade torch to load it"
        )
    return None
