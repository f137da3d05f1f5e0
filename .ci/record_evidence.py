"""Record (or check) the evidence of releases from their wheels: accelerate_txn/evidence.json.

    python .ci/record_evidence.py record WHEEL...   add each wheel's piece values (a release that PASSED the tests)
    python .ci/record_evidence.py check WHEEL...    say, for each wheel, whether the evidence protects it, and why not
    python .ci/record_evidence.py rerecord WHEEL... record every release of the file again, from nothing, from
                                                    its wheels (exactly those: after a piece or the fingerprint changed)

A wheel is read without installing or importing it: the source files of the pieces' modules are taken from the zip.
Record only releases the tests passed on (the rows of validated.json; `.ci/matrix-full-run.md`; the Trainer rows):
the evidence file is the library's claim that these values were tested. The package of a wheel is read from its
name (torch, accelerate, transformers).
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accelerate_txn.compat.pieces import Piece, Unreadable, observe_source, outline_source  # noqa: E402
from accelerate_txn.fsdp.internals import TORCH_COMMON, TORCH_FSDP1, TORCH_FSDP2  # noqa: E402
from accelerate_txn.runtime.accelerate_internals import ACCELERATE_COMMON, ACCELERATE_FSDP1, ACCELERATE_FSDP2  # noqa: E402
from accelerate_txn.trainer.internals import ALTERNATIVES, TRAINER_FSDP_PIECES, TRAINER_PIECES  # noqa: E402

EVIDENCE = ROOT / "accelerate_txn" / "evidence.json"
PIECES: tuple[Piece, ...] = tuple(dict.fromkeys(
    (*ACCELERATE_COMMON, *ACCELERATE_FSDP1, *ACCELERATE_FSDP2, *TORCH_COMMON, *TORCH_FSDP1, *TORCH_FSDP2,
     *TRAINER_PIECES, *TRAINER_FSDP_PIECES, *(piece for group in ALTERNATIVES for piece in group))))
ABOUT = [
    "The evidence that decides protection (accelerate_txn/compat/evidence.py): for each private piece a front end",
    "relies on (declared in runtime/accelerate_internals.py, fsdp/internals.py, trainer/internals.py), the values it had in",
    "each release that passed the library's tests, with those releases. Written by .ci/record_evidence.py from the",
    "releases' wheels; never by hand. 'outlines': the calls of each code value, to say what changed.",
]


def _package(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return name.lower(), version.split("+")[0]  # "2.13.0+cpu": the release


def _unpacked(wheel: Path, pieces: list[Piece], into: Path) -> Path:
    modules = {piece.module for piece in pieces}
    wanted = set()
    for module in modules:
        base = module.replace(".", "/")
        wanted |= {f"{base}.py", f"{base}/__init__.py"}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name in wanted:
                archive.extract(name, into)
    return into


def _values(wheel: Path) -> tuple[str, str, dict[str, str], dict[str, list[str]]]:
    package, version = _package(wheel)
    pieces = [piece for piece in PIECES if piece.package == package]
    values: dict[str, str] = {}
    outlines: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as directory:
        root = _unpacked(wheel, pieces, Path(directory))
        for piece in pieces:
            try:
                values[piece.key] = observe_source(piece, root)
            except Unreadable as exc:
                values[piece.key] = f"unreadable: {exc}"
                continue
            calls = outline_source(piece, root)
            if calls is not None:
                outlines[piece.key] = calls
    # Of each group of alternatives (the end-of-training method: _finalize_training, else _inner_training_loop; what
    # rotates checkpoints: Trainer._rotate_checkpoints, else trainer_utils.rotate_checkpoints), the first the release
    # has is its piece (trainer.internals.trainer_pieces), and the others are not.
    for group in ALTERNATIVES:
        keys = [piece.key for piece in group if piece.package == package]
        own = next((key for key in keys if not values.get(key, "unreadable").startswith("unreadable")), None)
        for key in keys:
            if key != own:
                values.pop(key, None)
                outlines.pop(key, None)
    return package, version, values, outlines


def _load() -> dict:
    if EVIDENCE.exists():
        return json.loads(EVIDENCE.read_text(encoding="utf-8"))
    return {"about": ABOUT, "releases": {}, "pieces": {}, "outlines": {}}


def record(wheels: list[Path], evidence: dict | None = None) -> None:
    evidence = _load() if evidence is None else evidence
    evidence["about"] = ABOUT
    for wheel in wheels:
        package, version, values, outlines = _values(wheel)
        bad = {key: value for key, value in values.items() if value.startswith("unreadable")}
        if bad:
            raise SystemExit(f"{wheel.name}: cannot record unreadable pieces: {bad}")
        releases = evidence["releases"].setdefault(package, [])
        if version not in releases:
            releases.append(version)
        for key, value in values.items():
            holders = evidence["pieces"].setdefault(key, {}).setdefault(value, [])
            if version not in holders:
                holders.append(version)
            if key in outlines:
                evidence["outlines"].setdefault(key, {})[value] = outlines[key]
        print(f"recorded {package} {version}: {len(values)} pieces")
    from packaging.version import Version

    for releases in evidence["releases"].values():
        releases.sort(key=Version)
    for holders in evidence["pieces"].values():
        for releases in holders.values():
            releases.sort(key=Version)
    evidence["pieces"] = dict(sorted(evidence["pieces"].items()))
    evidence["outlines"] = dict(sorted(evidence["outlines"].items()))
    partial = EVIDENCE.with_name(EVIDENCE.name + ".partial")
    partial.write_text(json.dumps(evidence, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    partial.replace(EVIDENCE)  # readers see the old file or the new one, never half of one


def rerecord(wheels: list[Path]) -> None:
    """Record the releases the evidence file lists again, from nothing: each piece's value in each of them as the
    declarations and the fingerprint read it now. The wheels must be exactly those releases (no release is added
    or dropped here: the file's releases are the ones that passed the tests)."""
    listed = {(package, version) for package, versions in _load()["releases"].items() for version in versions}
    given = {_package(wheel) for wheel in wheels}
    if given != listed:
        missing = ", ".join(f"{p} {v}" for p, v in sorted(listed - given)) or "none"
        extra = ", ".join(f"{p} {v}" for p, v in sorted(given - listed)) or "none"
        raise SystemExit(f"rerecord needs the wheels of exactly the recorded releases: missing {missing}; "
                         f"not recorded {extra}")
    record(wheels, {"about": ABOUT, "releases": {}, "pieces": {}, "outlines": {}})


def check(wheels: list[Path]) -> None:
    evidence = _load()
    for wheel in wheels:
        package, version, values, _outlines = _values(wheel)
        differing = [key for key, value in values.items() if value not in evidence["pieces"].get(key, {})]
        print(f"{package} {version}: {'protected' if not differing else 'differs: ' + ', '.join(differing)}")


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"record": record, "check": check, "rerecord": rerecord}[command]([Path(path) for path in paths])
