"""Evidence, not version numbers, decides protection.

``accelerate_txn/evidence.json`` records, for every piece a front end declares (:class:`.pieces.Piece`), the values it
had in each release that passed the library's tests (``.ci/record_evidence.py`` writes it from those releases'
sources). The installed releases are protected when every piece of a front end has a recorded value, whatever their
version numbers: a release that changed none of them is protected the day it ships, and one that changed a piece
runs native with one warning naming the piece, the release and what changed.

Checked lazily, once per process and front end (the pieces' sources are parsed then: tens of milliseconds, never at
import). :func:`forget` starts over (tests, and a process that replaced a piece on purpose).

A damaged evidence file (missing, unreadable, not JSON, or not the recorder's structure: a broken installation)
protects nothing: every path of every front end then differs by that one reason (:func:`damage`), so each runs
native after the one warning it shares (:func:`warn_once`), and ``accelerate-txn doctor`` says the same.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata, resources

from .pieces import Piece, forget_observed, observe_all, outline

EVIDENCE_FILE = "evidence.json"
#: Set to 1 to take the protected path where the evidence does not protect the installed releases (the user's risk;
#: read by the front ends through ``runtime.versions.override_requested``, which accepts only its documented values).
OVERRIDE_ENV = "ACCELERATE_TXN_ALLOW_UNVALIDATED"


class EvidenceDamaged(Exception):
    """The evidence file cannot be used (:func:`damage` says why)."""


def _malformed(evidence: object) -> str | None:
    """What in ``evidence`` is not the structure ``.ci/record_evidence.py`` writes, or None."""
    if not isinstance(evidence, dict):
        return "is not a JSON object"
    for section, depth in (("releases", 1), ("pieces", 2), ("outlines", 2)):
        table = evidence.get(section)
        if not isinstance(table, dict):
            return f"has no {section!r} object"
        for key, entry in table.items():
            groups = entry.values() if depth == 2 and isinstance(entry, dict) else [entry] if depth == 1 else None
            if groups is None or not all(isinstance(group, list) and all(isinstance(item, str) for item in group)
                                         for group in groups):
                return f"has a malformed {section!r} entry {key!r}"
    return None


@functools.lru_cache(maxsize=1)
def _read() -> tuple[dict | None, str | None]:
    """(the evidence, None), or (None, why the file cannot be used)."""
    location = resources.files("accelerate_txn").joinpath(EVIDENCE_FILE)
    try:
        text = location.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, f"{location} is missing"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{location} cannot be read ({type(exc).__name__}: {exc})"
    try:
        evidence = json.loads(text)
    except ValueError as exc:
        return None, f"{location} is not valid JSON ({exc})"
    problem = _malformed(evidence)
    return (None, f"{location} {problem}") if problem else (evidence, None)


def damage() -> str | None:
    """Why the evidence file cannot be used (missing, unreadable, not JSON, another structure), or None."""
    return _read()[1]


def recorded() -> dict:
    """The evidence file: ``{"releases": {package: [versions]}, "pieces": {key: {value: [versions]}},
    "outlines": {key: {value: [calls]}}}``. Raises :class:`EvidenceDamaged` where it cannot be used."""
    evidence, problem = _read()
    if evidence is None:
        raise EvidenceDamaged(f"accelerate-txn's evidence file {problem}")
    return evidence


def installed_release(package: str) -> str:
    """The release of ``package`` Python imports (its ``__version__`` once imported: the one whose sources are
    read), else the installed distribution's."""
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclass(frozen=True)
class Difference:
    """One piece whose installed value no release that passed had; or, with no ``piece``, the evidence file that
    cannot be used (``found``: why)."""

    piece: Piece | None
    found: str
    release: str
    accepted: dict[str, list[str]] = field(default_factory=dict)
    outline_here: tuple[str, ...] | None = None
    outline_there: tuple[str, ...] | None = None

    def describe(self) -> str:
        """"transformers 5.26.0: transformers.trainer.Trainer._save_checkpoint (its code) differs from every release
        that passed (4.57.6 to 5.24.0): the same calls in another order (...)"."""
        piece = self.piece
        if piece is None:
            return f"accelerate-txn's evidence file {self.found} (a broken installation: reinstall accelerate-txn)"
        releases = sorted({release for group in self.accepted.values() for release in group}, key=_release_key)
        passed = _span(releases) if releases else "none recorded"
        head = f"{self.release}: {piece.name}"
        if self.found.startswith("unreadable: "):
            return f"{head} cannot be checked ({self.found[len('unreadable: '):]}); the releases that passed: {passed}"
        if piece.kind == "signature":
            return (f"{head} has the parameters {self.found}; the releases that passed ({passed}) have "
                    f"{' or '.join(sorted(self.accepted)) or 'none recorded'}")
        if piece.kind == "assigns":
            return f"{head} {self.found} (the releases that passed: {passed})"
        return f"{head} (its code) differs from every release that passed ({passed}){self._changes()}"

    def _changes(self) -> str:
        here, there = self.outline_here, self.outline_there
        if here is None or there is None:
            return ""
        added = [call for call in dict.fromkeys(here) if call not in there]
        removed = [call for call in dict.fromkeys(there) if call not in here]
        if added or removed:
            parts = ([f"calls added: {', '.join(added[:6])}"] if added else []) + \
                    ([f"calls removed: {', '.join(removed[:6])}"] if removed else [])
            return ": " + "; ".join(parts)
        if list(here) != list(there):
            return f": the same calls in another order ({', '.join(dict.fromkeys(here))})"
        return ": other statements, the same calls in the same order"


def _release_key(version: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(version))
    except InvalidVersion:
        return (1, version)


def _span(releases: Sequence[str]) -> str:
    return releases[0] if len(releases) == 1 else f"{releases[0]} to {releases[-1]}, {len(releases)} releases"


@functools.lru_cache(maxsize=16)
def _differences(pieces: tuple[Piece, ...]) -> tuple[Difference, ...]:
    evidence, problem = _read()
    if evidence is None:  # nothing is protected by evidence that cannot be read
        return (Difference(None, str(problem), "accelerate-txn"),)
    values = observe_all(pieces)
    found: list[Difference] = []
    for piece in pieces:
        accepted: dict[str, list[str]] = evidence.get("pieces", {}).get(piece.key, {})
        value = values[piece.key]
        if value in accepted:
            continue
        there = None
        release = installed_release(piece.package)
        outlines = evidence.get("outlines", {}).get(piece.key, {})
        if outlines:  # the outline of this release as it passed (a locally changed copy of it), else the newest's
            reference = next((v for v, group in accepted.items() if release.partition("+")[0] in group), None)
            if reference is None:
                reference = max(accepted, key=lambda v: max((_release_key(r) for r in accepted[v]), default=(0,)),
                                default=None)
            there = tuple(outlines.get(reference, ())) if reference in outlines else None
        here = outline(piece)
        found.append(Difference(piece, value, f"{piece.package} {release}", accepted,
                                tuple(here) if here is not None else None, there))
    return tuple(found)


def differences(pieces: Iterable[Piece]) -> list[Difference]:
    """The pieces whose installed value no release that passed had (empty: the evidence protects this
    combination). Computed once per process for a given set of pieces."""
    return list(_differences(tuple(pieces)))


def forget() -> None:
    """Check again at the next call (after a piece was replaced, or the evidence file changed)."""
    _differences.cache_clear()
    _read.cache_clear()
    forget_observed()


_WARNED: set[str] = set()  # the warnings given in this process (warn_once)


def warn_once(message: str, stacklevel: int = 2) -> None:
    """Warn ``message`` (a ``RuntimeWarning``) unless this process already did: one warning per process and reason,
    whichever path, front end or Accelerator meets it."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def explain(front_end: str, found: Sequence[Difference]) -> str:
    """The one warning for a front end that runs native: each differing piece, the release and what changed; or,
    where the evidence file cannot be used, the same warning for every path of every front end."""
    damaged = next((difference for difference in found if difference.piece is None), None)
    if damaged is not None:
        return (f"accelerate-txn: every checkpoint path runs native, NOT protected: {damaged.describe()}. Run "
                f"`accelerate-txn doctor` for the details; set {OVERRIDE_ENV}=1 to use the protected path at your "
                "own risk.")
    listed = "; ".join(difference.describe() for difference in found)
    return (f"accelerate-txn: {front_end} checkpoints run native, NOT protected: the installed releases differ from "
            f"every release that passed accelerate-txn's tests in a private piece it relies on ({listed}). Run "
            f"`accelerate-txn doctor` for the details; set {OVERRIDE_ENV}=1 to use the protected "
            "path at your own risk.")
