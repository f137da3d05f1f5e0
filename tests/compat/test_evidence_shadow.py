"""Every declared piece is checked where it matters: changed alone, in a shadow copy of its release, it turns the
paths that rely on it native with one warning, and ``accelerate-txn doctor`` says so.

For each piece of ``runtime.accelerate_internals``, ``fsdp.internals`` and ``trainer.internals`` that the installed releases
have (every path's, the Trainer's, both end-of-training methods, and what rotates checkpoints in this release), a copy
of the installed package whose files are the installed ones except the piece's module, where the piece is changed as a
release could change it (``tests/support/overlay.py``: a ``code`` piece's body made a no-op, or a class given one more
attribute; a ``signature`` piece given one more parameter; an ``assigns`` piece no longer setting its first attribute;
an ``exists`` binding dropped), is put first on ``PYTHONPATH`` of a fresh interpreter. There:

* the evidence of each path (Accelerate FSDP1, FSDP2, one process and DDP; the Trainer on the same three) names
  exactly the changed pieces the path relies on, and no other;
* the front ends' gates (``accelerate.patch``'s dispatch decision on a real Accelerator set to each path; the
  Trainer patch's ``native_reason``) refuse the protected path on each path that relies on one of them, with one
  RuntimeWarning per path naming it (each gate asked twice), and raise no warning on the others;
* ``accelerate-txn doctor --json`` exits 1 and reports exactly those paths not protected, each naming the pieces.

Pieces of different modules are changed together in one interpreter (each alone in its file), so that the 90-odd
pieces take as many interpreters as one module has pieces (17, ``transformers.trainer``).
``torch.distributed.tensor._api.DTensor`` (an ``exists`` piece: a class torch's own modules import by that name, so
a copy without it does not import) is removed from its module in the interpreter instead, before anything reads it.
(A real 2-rank FSDP1 job under a changed release: tests/compat/test_evidence_restore.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.compat.pieces import Piece, Unreadable, observe
from accelerate_txn.fsdp.internals import TORCH_COMMON, TORCH_FSDP1, TORCH_FSDP2
from accelerate_txn.runtime.accelerate_internals import ACCELERATE_COMMON, ACCELERATE_FSDP1, ACCELERATE_FSDP2
from accelerate_txn.runtime.versions import OVERRIDE_ENV, PATCH_ENV, PATHS
from accelerate_txn.trainer.internals import ALTERNATIVES, TRAINER_FSDP_PIECES, TRAINER_PIECES
from tests.support.overlay import AFFECTS, module_path, shadow_of

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300
EVERY_PIECE: tuple[Piece, ...] = tuple({piece.key: piece for piece in (  # each key once
    *ACCELERATE_COMMON, *ACCELERATE_FSDP1, *ACCELERATE_FSDP2, *TORCH_COMMON, *TORCH_FSDP1, *TORCH_FSDP2,
    *TRAINER_PIECES, *TRAINER_FSDP_PIECES, *(piece for group in ALTERNATIVES for piece in group))}.values())


def _here(piece: Piece) -> bool:
    try:
        observe(piece)
    except Unreadable:
        return False
    return True


#: The declared pieces the installed releases have: all of them but the alternatives of another release (4.57's
#: ``Trainer._rotate_checkpoints`` under transformers 5.x, or 5.x's ``rotate_checkpoints`` under 4.57).
DECLARED: tuple[Piece, ...] = tuple(piece for piece in EVERY_PIECE if _here(piece))
#: Pieces removed from their module in the interpreter rather than in a copy (see the module docstring).
REMOVED_AT_RUN_TIME = frozenset({("torch.distributed.tensor._api", "DTensor")})
DOCTOR_NAMES = {"fsdp1": "fsdp1", "fsdp2": "fsdp2", "common": "ddp"}

# The checks, in an interpreter whose PYTHONPATH starts with the shadows. argv[1]: [[[module, name], ...] to remove
# first, [the changed modules]]. Prints {"differing": {path: [keys]}, "gates": {path: {"protected": [..], "warnings": [..]}},
# "doctor": {"code": int, "report": {...}}, "warnings": [every "NOT protected" warning of the process]}.
CHECKS = r"""
import contextlib, importlib, io, json, sys, types, warnings
removed, changed = json.loads(sys.argv[1])
for module, name in removed:
    delattr(importlib.import_module(module), name)
files = {module: importlib.import_module(module).__file__ for module in changed}
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    import transformers.trainer
    import accelerate_txn
    from accelerate_txn.accelerate import patch as accelerate_patch
    from accelerate_txn.runtime import versions
    from accelerate_txn.cli import main
    from accelerate_txn.trainer import patch as trainer_patch
    from accelerate_txn.trainer import versions as trainer_versions

    Trainer = transformers.trainer.Trainer
    obs = {"differing": {}, "gates": {}, "files": files}
    for path in versions.PATHS:
        obs["differing"][path] = [d.piece.key for d in versions.differing(path)]
        obs["differing"]["trainer-" + path] = [d.piece.key for d in trainer_versions.differing(Trainer, path)]

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    trainer = Trainer.__new__(Trainer)
    trainer.accelerator, trainer.args = accelerator, types.SimpleNamespace(push_to_hub=False)

    def gate(decide):
        before = len(caught)
        decisions = [decide(), decide()]
        said = [str(w.message) for w in caught[before:] if "NOT protected" in str(w.message)]
        return {"decisions": decisions, "warnings": said}

    def reason():
        try:
            return trainer_patch.native_reason(trainer)
        except Exception as exc:  # a setup this bare Trainer cannot answer for: not the evidence's refusal
            return f"error {type(exc).__name__}"

    for path, version in (("fsdp1", 1), ("fsdp2", 2), ("common", None)):
        if version is None:
            accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.NO
            accelerator.state.fsdp_plugin = None
            accelerate_txn.configure_checkpointing(accelerator, protect="all")
        else:
            accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
            plugin.fsdp_version = version
            accelerator.state.fsdp_plugin = plugin
        accelerator.state.device = torch.device("cpu")
        obs["gates"][path] = gate(lambda: accelerate_patch._protected(accelerator))
        obs["gates"]["trainer-" + path] = gate(reason)
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = main(["doctor", "--json"])
    obs["doctor"] = {"code": code, "report": json.loads(captured.getvalue())}
obs["warnings"] = [str(w.message) for w in caught if "NOT protected" in str(w.message)]
print("OBSERVED " + json.dumps(obs))
"""


def _batches(pieces: tuple[Piece, ...]) -> list[list[Piece]]:
    """The pieces in groups where no two share a module (each changed alone in its file)."""
    batches: list[list[Piece]] = []
    for piece in pieces:
        batch = next((b for b in batches if all(other.module != piece.module for other in b)), None)
        if batch is None:
            batches.append(batch := [])
        batch.append(piece)
    return batches


BATCHES = _batches(DECLARED)


def _affected(changed: list[Piece]) -> set[str]:
    """The keys of the declared pieces whose value the changes alter: each changed piece, and the other readings
    of the same function (its code reads its signature; a binding dropped takes every reading along)."""
    return {piece.key for piece in DECLARED for change in changed
            if (piece.module, piece.qualname) == (change.module, change.qualname) and piece.kind in AFFECTS[change.kind]}


def _path_pieces() -> dict[str, tuple[Piece, ...]]:
    """Each path's pieces, as the front ends declare them for the installed releases."""
    import transformers.trainer

    from accelerate_txn.trainer.versions import pieces

    found: dict[str, tuple[Piece, ...]] = dict(PATHS)
    for path in PATHS:
        found["trainer-" + path] = pieces(transformers.trainer.Trainer, path)
    return found


def _run(batch: list[Piece], into: Path) -> dict[str, Any]:
    in_copies = [piece for piece in batch if (piece.module, piece.qualname) not in REMOVED_AT_RUN_TIME]
    removed = [[piece.module, piece.qualname] for piece in batch if (piece.module, piece.qualname) in REMOVED_AT_RUN_TIME]
    shadows = shadow_of(in_copies, into)
    environment = {key: value for key, value in os.environ.items() if key not in (PATCH_ENV, OVERRIDE_ENV)}
    environment["PYTHONPATH"] = os.pathsep.join([*map(str, shadows.values()), str(REPO)])
    changed = sorted({piece.module for piece in in_copies})
    done = subprocess.run([sys.executable, "-c", CHECKS, json.dumps([removed, changed])], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=REPO, env=environment)
    line = next((line for line in done.stdout.splitlines() if line.startswith("OBSERVED ")), None)
    assert done.returncode == 0 and line is not None, done.stderr[-4000:]
    return json.loads(line[len("OBSERVED "):])


def test_only_the_alternatives_of_other_releases_are_left_out() -> None:
    left_out = [piece for piece in EVERY_PIECE if piece not in DECLARED]
    alternatives = {piece for group in ALTERNATIVES for piece in group}
    assert all(piece in alternatives for piece in left_out), left_out
    # Of each group, the one the Trainer front end checks on the installed release is here (changed below).
    from accelerate_txn.trainer.internals import trainer_pieces

    own = set(trainer_pieces())
    for group in ALTERNATIVES:
        (checked,) = [piece for piece in group if piece in own]
        assert checked in DECLARED, checked


def test_every_declared_piece_is_in_one_batch_alone_in_its_module() -> None:
    assert sorted(piece.key for batch in BATCHES for piece in batch) == sorted(piece.key for piece in DECLARED)
    for batch in BATCHES:
        assert len({module_path(piece.module) for piece in batch}) == len(batch)


@pytest.mark.parametrize("batch", BATCHES, ids=[f"batch{index}" for index in range(len(BATCHES))])
def test_a_changed_piece_turns_every_path_relying_on_it_native_with_one_warning_and_doctor_says_so(
        batch: list[Piece], tmp_path: Path) -> None:
    obs = _run(batch, tmp_path)
    assert all(file.startswith(str(tmp_path)) for file in obs["files"].values()), obs["files"]  # the copies ran
    affected = _affected(batch)
    paths = _path_pieces()
    expected = {path: sorted(affected & {piece.key for piece in pieces}) for path, pieces in paths.items()}
    # The evidence of each path names exactly the changed pieces it relies on.
    assert {path: sorted(keys) for path, keys in obs["differing"].items()} == expected
    names = {piece.key: piece.name for piece in DECLARED}
    for path, keys in expected.items():
        gate = obs["gates"][path]
        if keys:
            # Refused, with one warning naming each changed piece; asked again, nothing more.
            (warning,) = gate["warnings"]
            assert "NOT protected" in warning and all(names[key] in warning for key in keys), (path, warning)
            if path.startswith("trainer-"):
                assert gate["decisions"] == [warning, warning]
            else:
                assert gate["decisions"] == [False, False]
        else:
            assert gate["warnings"] == [], (path, gate)
            if path.startswith("trainer-"):
                assert all(decision is None or not decision.startswith("accelerate-txn:")
                           for decision in gate["decisions"]), (path, gate)
    # One warning per process and reason: one per refused path, never the same twice.
    assert len(obs["warnings"]) == len(set(obs["warnings"])) == sum(1 for keys in expected.values() if keys)
    # The doctor agrees, path by path.
    report = obs["doctor"]["report"]
    assert obs["doctor"]["code"] == (1 if any(expected.values()) else 0)
    for path, keys in expected.items():
        name = "trainer-" + DOCTOR_NAMES[path.split("-", 1)[1]] if path.startswith("trainer-") else DOCTOR_NAMES[path]
        entry = report["paths"][name]
        assert entry["status"] == ("not protected" if keys else "protected"), (name, entry)
        assert all(any(names[key] in line for line in entry["differences"]) for key in keys), (name, entry)
