"""The validated version table, the version policy and its override.

The table is ``accelerate_txn/validated.json`` (the package root): the one list of (torch, Accelerate) pairs on
which the distributed matrix subset passed with exactly those releases (``make test-matrix-table`` runs every row;
CI runs a covering set of them, ``make test-matrix``), also shown in the README (a test keeps the two equal). A
tested pair validates its *minor series*: torch 2.13.0 with Accelerate 1.10.1 in the table
means any torch 2.13.x with any Accelerate 1.10.x, since patch releases do not change the private internals
this library relies on. Outside the table, automatic dispatch runs native Accelerate after one warning and the
explicit API refuses, unless the user sets ``VIDEOX_ACCELERATE_ALLOW_UNVALIDATED=1`` and accepts the risk.

Checkpoint compatibility across versions is decided by :func:`checkpoint_compatibility`, not by equality of
the recorded versions (see docs/protocol.md, "Versions").
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from dataclasses import dataclass
from importlib import resources

from packaging.version import Version

OVERRIDE_ENV = "VIDEOX_ACCELERATE_ALLOW_UNVALIDATED"
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


def is_validated_pair(torch_version: str, accelerate_version: str) -> bool:
    """True when the two releases' minor series were tested together (any patch release of a tested pair)."""
    return (series(torch_version), series(accelerate_version)) in VALIDATED


def is_validated(package: str, version: str) -> bool:
    """True when ``version``'s minor series of ``package`` ("torch" or "accelerate") is part of some validated
    pair. Protection needs the installed *pair* validated: see :func:`is_validated_pair`."""
    index = ("torch", "accelerate").index(package)
    return series(version) in {pair[index] for pair in VALIDATED}


def unvalidated() -> list[str]:
    """The installed releases that make the pair unvalidated ("accelerate 1.16.0"); both when each is validated
    with something else but not with the other; empty when the installed pair is validated."""
    installed = installed_versions()
    if is_validated_pair(installed["torch"], installed["accelerate"]):
        return []
    unknown = [f"{name} {version}" for name, version in installed.items() if not is_validated(name, version)]
    return unknown or [f"{name} {version}" for name, version in installed.items()]


def override_requested() -> bool:
    return os.environ.get(OVERRIDE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def _installed_validated() -> bool:
    return not unvalidated()


def versions_ok() -> bool:
    """True when the installed pair is validated or the user accepted the risk."""
    return _installed_validated() or override_requested()


def _adjacent(earlier: str, later: str) -> bool:
    """Whether minor series ``later`` directly follows ``earlier`` ("2.8", "2.9")."""
    a, b = Version(earlier), Version(later)
    return a.major == b.major and b.minor == a.minor + 1


def _span(minors: list[str]) -> str:
    """"1.7, 1.8, 1.9" -> "1.7 to 1.9"; a gap in the minors lists them instead."""
    numbers = sorted(minors, key=Version)
    if len(numbers) > 2 and all(_adjacent(a, b) for a, b in itertools.pairwise(numbers)):
        return f"{numbers[0]} to {numbers[-1]}"
    return ", ".join(numbers)


def describe_table() -> str:
    """The validated pairs in one line, by minor series, neighbouring torch series with the same Accelerate series
    together: "torch 2.8 to 2.12 with accelerate 1.15; torch 2.13 with accelerate 1.7 to 1.15; ..."."""
    by_torch: dict[str, list[str]] = {}
    for torch_series, accelerate_series in sorted(VALIDATED, key=lambda pair: Version(pair[0])):
        by_torch.setdefault(torch_series, []).append(accelerate_series)
    runs: list[tuple[list[str], list[str]]] = []  # (torch series, their common Accelerate series)
    for torch_series, minors in by_torch.items():
        if runs and sorted(runs[-1][1]) == sorted(minors) and _adjacent(runs[-1][0][-1], torch_series):
            runs[-1][0].append(torch_series)
        else:
            runs.append(([torch_series], minors))
    pairs = "; ".join(f"torch {_span(torch_series)} with accelerate {_span(minors)}" for torch_series, minors in runs)
    return f"{pairs} (any patch release)"


def unsupported_message() -> str:
    return (
        f"accelerate-txn has not been validated with {' and '.join(unvalidated())} (validated: {describe_table()}). "
        f"Install a validated pair, or set {OVERRIDE_ENV}=1 to use the protected path at your own risk."
    )


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


def require_supported_versions() -> None:
    """Raise :class:`UnsupportedVersionError` outside the validated table (unless the override is set): the
    explicit API applies the same gate as the patched methods."""
    if not versions_ok():
        from ..errors import UnsupportedVersionError

        raise UnsupportedVersionError(unsupported_message())


# --- FSDP2 -------------------------------------------------------------------------------------------------------

#: (torch minor series, Accelerate minor series) on which the protected FSDP2 path was validated: the rows of the
#: table marked ``"fsdp2": true`` (each passed the FSDP2 tests as well as the matrix subset, with that pair installed).
FSDP2_VALIDATED: frozenset[tuple[str, str]] = frozenset(pair.series for pair in TESTED if pair.fsdp2)


def fsdp2_validated() -> bool:
    """Whether the installed torch and Accelerate belong to a series the FSDP2 path was validated on."""
    versions = installed_versions()
    return (series(versions["torch"]), series(versions["accelerate"])) in FSDP2_VALIDATED


def fsdp2_validated_message() -> str:
    versions = installed_versions()
    validated = ", ".join(f"torch {t}.x with Accelerate {a}.x" for t, a in sorted(FSDP2_VALIDATED))
    return (f"the protected FSDP2 path is validated on {validated}; installed: torch {versions['torch']}, "
            f"Accelerate {versions['accelerate']}")
