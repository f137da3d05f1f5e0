"""The Trainer front end's version gate: the ``"transformers"`` rows of ``accelerate_txn/validated.json``.

A row names the exact transformers, torch and Accelerate releases ``tests/test_trainer.py`` passed with; it validates
their three minor series together (Trainer's private save and resume points change between transformers minors:
:mod:`.internals`). Outside the rows, Trainer runs native after one warning naming the versions, exactly as the
Accelerate front end does outside its table; ``VIDEOX_ACCELERATE_ALLOW_UNVALIDATED=1`` takes the protected path at
the user's own risk.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

from ..accelerate.versions import OVERRIDE_ENV, TABLE_FILE, installed_versions, override_requested, series


@dataclass(frozen=True)
class TrainerRow:
    """One validated (transformers, torch, accelerate) triple and the Pythons it ran on."""

    transformers: str
    torch: str
    accelerate: str
    python: tuple[str, ...]

    @property
    def series(self) -> tuple[str, str, str]:
        return series(self.transformers), series(self.torch), series(self.accelerate)


def _load_rows() -> tuple[TrainerRow, ...]:
    raw = json.loads(resources.files("accelerate_txn").joinpath(TABLE_FILE).read_text(encoding="utf-8"))
    return tuple(TrainerRow(row["transformers"], row["torch"], row["accelerate"], tuple(row["python"]))
                 for row in raw.get("transformers", ()))


ROWS: tuple[TrainerRow, ...] = _load_rows()
VALIDATED: frozenset[tuple[str, str, str]] = frozenset(row.series for row in ROWS)


def trainer_versions() -> dict[str, str]:
    """The installed transformers, torch and Accelerate releases (recorded in every Trainer manifest)."""
    import transformers

    return {"transformers": transformers.__version__, **installed_versions()}


def transformers_series() -> str:
    return series(trainer_versions()["transformers"])


@functools.lru_cache(maxsize=1)
def installed_validated() -> bool:
    versions = trainer_versions()
    return (series(versions["transformers"]), series(versions["torch"]), series(versions["accelerate"])) in VALIDATED


def versions_ok() -> bool:
    """True when the installed triple is validated or the user accepted the risk."""
    return installed_validated() or override_requested()


def unsupported_message() -> str:
    versions = trainer_versions()
    validated = "; ".join(f"transformers {t}.x with torch {o}.x and accelerate {a}.x" for t, o, a in sorted(VALIDATED))
    return (f"accelerate-txn has not validated its Trainer front end with transformers {versions['transformers']}, "
            f"torch {versions['torch']} and accelerate {versions['accelerate']} (validated: {validated or 'none'}): "
            "Trainer checkpoints are saved and resumed natively, NOT protected. Install a validated combination, or "
            f"set {OVERRIDE_ENV}=1 to use the protected path at your own risk.")
