"""The version policy: evidence about the private pieces decides protection; the table records what ran.

Protection is decided by evidence, not version numbers (:mod:`..compat.evidence`): each protected path (FSDP1, FSDP2,
and the one-process/DDP path of ``protect="all"``) declares the private Accelerate and torch pieces it relies on
(``runtime.accelerate_internals``, ``fsdp.internals``); the installed releases are protected on a path when every one of its
pieces has a value recorded for a release that passed the library's tests (``accelerate_txn/evidence.json``),
whatever their version numbers. Elsewhere automatic dispatch runs native Accelerate after one warning naming the
piece, the release and what changed, and the explicit API refuses, unless the user sets
``ACCELERATE_TXN_ALLOW_UNVALIDATED=1`` and accepts the risk.

The table ``accelerate_txn/validated.json`` stays the record of what ran: the (torch, Accelerate) pairs on which the
distributed matrix subset passed with exactly those releases (``make test-matrix-table`` runs every row; CI runs a
covering set, ``make test-matrix``), also shown in the README (a test keeps the two equal). Its releases, and those of
``.ci/matrix-full-run.md``, are the ones whose evidence is recorded.

Checkpoint compatibility across versions is decided by :func:`checkpoint_compatibility`, not by equality of
the recorded versions (see docs/protocol.md, "Versions").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from packaging.version import Version

from ..compat.evidence import OVERRIDE_ENV as OVERRIDE_ENV  # the gate's override, named here for the front end
from ..compat.evidence import Difference, differences, explain
from ..compat.pieces import Piece
from ..core.environment import flag
from ..fsdp.internals import TORCH_COMMON, TORCH_FSDP1, TORCH_FSDP2
from .accelerate_internals import ACCELERATE_COMMON, ACCELERATE_FSDP1, ACCELERATE_FSDP2

#: ``0`` (or false, off, no) turns automatic dispatch off: ``save_state``/``load_state`` and Trainer run exactly native.
PATCH_ENV = "ACCELERATE_TXN_PATCHES"
DISPATCH = flag(PATCH_ENV, True)
#: ``1`` (or true, yes, on) takes the protected path where the evidence does not protect the installed releases.
OVERRIDE = flag(OVERRIDE_ENV, False)
TABLE_FILE = "validated.json"


@dataclass(frozen=True)
class TestedPair:
    """One row of the table: the exact releases the matrix installs, the Pythons it runs them on, and whether the
    protected FSDP2 path was validated on it too (``"fsdp2": true``; FSDP1 is protected on every row)."""

    __test__ = False  # not a pytest test class, despite the name

    torch: str
    accelerate: str
    python: tuple[str, ...]
    fsdp2: bool = False

    @property
    def series(self) -> tuple[str, str]:
        """The (torch, accelerate) minor series this row validates."""
        return series(self.torch), series(self.accelerate)


def installed_versions() -> dict[str, str]:
    """The real installed versions (recorded in every manifest)."""
    import accelerate
    import torch

    return {"accelerate": accelerate.__version__, "torch": torch.__version__}


def _release(version: str) -> Version:
    # "2.13.0+cpu" and "2.13.0a0+git..." compare by their release numbers.
    return Version(Version(version).base_version)


def series(version: str) -> str:
    """The minor series of a release: "2.13.1+cpu" -> "2.13"."""
    release = _release(version)
    return f"{release.major}.{release.minor}"


def _load_table() -> tuple[TestedPair, ...]:
    raw = json.loads(resources.files("accelerate_txn").joinpath(TABLE_FILE).read_text(encoding="utf-8"))
    return tuple(TestedPair(row["torch"], row["accelerate"], tuple(row["python"]), bool(row.get("fsdp2", False)))
                 for row in raw["pairs"])


TESTED: tuple[TestedPair, ...] = _load_table()
# The validated (torch minor, accelerate minor) series, e.g. ("2.13", "1.10").
VALIDATED: frozenset[tuple[str, str]] = frozenset(pair.series for pair in TESTED)


def automatic_dispatch_requested() -> bool:
    """Whether automatic dispatch is on (:data:`PATCH_ENV` unset, or a switch's "on"); a value that is no switch
    raises ``CheckpointConfigurationError`` naming it (read before any collective: every rank reads it alike)."""
    return DISPATCH.read()


def override_requested() -> bool:
    """Whether the user takes the protected path at their own risk where a piece differs (:data:`OVERRIDE_ENV`)."""
    return OVERRIDE.read()


# --- The evidence gate -------------------------------------------------------------------------------------------

#: The protected paths of the Accelerate front end and the private pieces each relies on.
PATHS: dict[str, tuple[Piece, ...]] = {
    "fsdp1": (*ACCELERATE_COMMON, *ACCELERATE_FSDP1, *TORCH_COMMON, *TORCH_FSDP1),
    "fsdp2": (*ACCELERATE_COMMON, *ACCELERATE_FSDP2, *TORCH_COMMON, *TORCH_FSDP2),
    "common": (*ACCELERATE_COMMON, *TORCH_COMMON),  # one process and DDP (protect="all")
}
PATH_NAMES = {"fsdp1": "FSDP1", "fsdp2": "FSDP2", "common": "one-process and DDP"}


def fsdp_state_dict_type(accelerator: Any) -> tuple[int, str] | None:
    """``(FSDP version, state dict type name)`` of an FSDP ``accelerator`` (``(2, "FULL_STATE_DICT")``), else
    ``None``."""
    if accelerator.distributed_type.name != "FSDP":
        return None
    plugin = accelerator.state.fsdp_plugin
    if plugin is None:
        return None
    kind = getattr(plugin.state_dict_type, "name", None) or str(plugin.state_dict_type).rsplit(".", 1)[-1]
    return getattr(plugin, "fsdp_version", 1), kind


def sharded_fsdp_version(accelerator: Any) -> int | None:
    """The FSDP version (1 or 2) when ``accelerator`` uses FSDP with ``SHARDED_STATE_DICT``, else ``None``."""
    found = fsdp_state_dict_type(accelerator)
    return found[0] if found is not None and found[1] == "SHARDED_STATE_DICT" else None


def full_fsdp_version(accelerator: Any) -> int | None:
    """The FSDP version (1 or 2) when ``accelerator`` uses FSDP with ``FULL_STATE_DICT`` (Accelerate's and the
    Trainer's default), else ``None``."""
    found = fsdp_state_dict_type(accelerator)
    return found[0] if found is not None and found[1] == "FULL_STATE_DICT" else None


def path_of(accelerator: Any) -> str:
    """The protected path an Accelerator's checkpoints take (``runtime.versions.PATHS``): "fsdp2" for FSDP2,
    "fsdp1" for other FSDP setups, "common" for one process and DDP (``protect="all"``)."""
    found = fsdp_state_dict_type(accelerator)
    if found is None:
        return "common" if accelerator.distributed_type.name != "FSDP" else "fsdp1"
    return "fsdp2" if found[0] == 2 else "fsdp1"


def differing(path: str = "fsdp1") -> list[Difference]:
    """The pieces of ``path`` whose installed value no release that passed had (empty: protected by evidence)."""
    return differences(PATHS[path])


def protected(path: str = "fsdp1") -> bool:
    """Whether ``path`` takes the protected path here: the evidence protects the installed releases, or the user
    accepted the risk (:data:`OVERRIDE_ENV`)."""
    return override_requested() or not differing(path)


def unsupported_message(path: str = "fsdp1") -> str:
    """The one warning for a path the evidence does not protect: each differing piece, its release, what changed."""
    return explain(f"Accelerate {PATH_NAMES[path]}", differing(path))


def unprotected() -> dict[str, list[str]]:
    """Each path the evidence does not protect here -> why (one line per differing piece); empty: all protected."""
    return {path: [difference.describe() for difference in found]
            for path in PATHS if (found := differing(path))}


def require_supported_versions(path: str = "fsdp1") -> None:
    """Raise :class:`UnsupportedVersionError` where the evidence does not protect ``path`` (unless the override is
    set): the explicit API applies the same gate as the patched methods."""
    if not protected(path):
        from ..errors import UnsupportedVersionError

        raise UnsupportedVersionError(unsupported_message(path))


def markdown_table() -> str:
    """The README's table of validated pairs, generated from the same file."""
    lines = ["| PyTorch | Accelerate | Protected | Validated with | on Python |", "| --- | --- | --- | --- | --- |"]
    for pair in TESTED:
        torch_series, accelerate_series = pair.series
        lines.append(f"| {torch_series}.x | {accelerate_series}.x | {'FSDP1, FSDP2' if pair.fsdp2 else 'FSDP1'} "
                     f"| torch {pair.torch}, accelerate {pair.accelerate} | {', '.join(pair.python)} |")
    return "\n".join(lines) + "\n"


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
