"""The Trainer front end's gate: evidence about the private pieces it relies on decides, not version numbers.

The Trainer is protected where every private transformers piece it relies on (``trainer.internals.trainer_pieces``)
and every Accelerate and torch piece of the FSDP path it uses (``runtime.versions.PATHS``) has a value recorded
for a release that passed the Trainer tests (``accelerate_txn/evidence.json``), each through the same mechanism
(``compat.evidence``): a transformers release that changed none of them is protected the day it ships, whatever
the torch and Accelerate releases beside it, as long as their own pieces match. Elsewhere Trainer runs native after
one warning naming the piece, the release and what changed; ``ACCELERATE_TXN_ALLOW_UNVALIDATED=1`` takes the
protected path at the user's own risk. The ``"transformers"`` rows of ``accelerate_txn/validated.json`` record the
(transformers, torch, Accelerate) releases the Trainer tests ran on: the record whose evidence is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..compat.evidence import Difference, differences, explain
from ..compat.pieces import Piece
from ..runtime.versions import DISPATCH as DISPATCH  # the one switch
from ..runtime.versions import PATH_NAMES, PATHS, TABLE_FILE, installed_versions, override_requested, path_of, series
from ..runtime.versions import automatic_dispatch_requested as automatic_dispatch_requested
from .internals import TRAINER_FSDP_PIECES, trainer_pieces


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


def path_of_trainer(trainer: Any) -> str:
    """The Accelerate front end's path whose pieces a Trainer's checkpoints rely on (``fsdp1``, ``fsdp2``, or
    ``common`` for one process and DDP)."""
    accelerator = getattr(trainer, "accelerator", None)
    return "common" if accelerator is None else path_of(accelerator)


def pieces(trainer_class: type | None = None, path: str = "fsdp1") -> tuple[Piece, ...]:
    """The pieces a Trainer's checkpoints on ``path`` rely on: transformers', the Accelerate functions Trainer calls
    on FSDP (:data:`.internals.TRAINER_FSDP_PIECES`), and the Accelerate/torch ones of ``path``."""
    fsdp = TRAINER_FSDP_PIECES if path != "common" else ()
    found: dict[str, Piece] = {}  # by key: a piece two declarations need (each with its why) is checked once
    for piece in (*trainer_pieces(trainer_class), *fsdp, *PATHS[path]):
        found.setdefault(piece.key, piece)
    return tuple(found.values())


def differing(trainer_class: type | None = None, path: str = "fsdp1") -> list[Difference]:
    """The pieces (:func:`pieces`) whose installed value no release that passed had; empty: the evidence protects
    the Trainer here."""
    return differences(pieces(trainer_class, path))


def protected(trainer_class: type | None = None, path: str = "fsdp1") -> bool:
    """Whether the Trainer takes the protected path: the evidence protects the installed releases, or the user
    accepted the risk."""
    return override_requested() or not differing(trainer_class, path)


def unsupported_message(trainer_class: type | None = None, path: str = "fsdp1") -> str:
    return explain(f"transformers Trainer ({PATH_NAMES[path]})", differing(trainer_class, path))
