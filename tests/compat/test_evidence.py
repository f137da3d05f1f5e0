"""Evidence, not version numbers, decides protection (accelerate_txn/compat, accelerate_txn/evidence.json).

* A piece's value is blind to what cannot change behaviour (comments, docstrings, ``pass``, formatting, the
  annotations a call never reads) and sees what can (statements swapped, a constant changed, a parameter renamed,
  logging, a class's fields and their order).
* The value read from the running interpreter equals the value read from the release's files (how the evidence is
  recorded), for every declared piece; a function put in a piece's place is read as itself; the library's own
  wrappers are seen through.
* The evidence holds every release that passed: each release of the validated table and of the Trainer rows, one
  value per piece; the installed releases are protected on every path.
* ``.ci/record_evidence.py check`` reads a release's wheel without installing it and names a changed piece.
(The front ends' gates on a changed release: tests/runtime/test_versions_and_patch.py, tests/fsdp/test_fsdp2.py,
tests/trainer/test_trainer.py.)
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from accelerate_txn.compat.evidence import differences, forget, recorded
from accelerate_txn.compat.pieces import (
    PRESENT,
    Piece,
    Unreadable,
    calls,
    find_definition,
    fingerprint,
    observe,
    observe_source,
    signature,
    value_of,
)
from accelerate_txn.fsdp.internals import TORCH_COMMON, TORCH_FSDP1, TORCH_FSDP2
from accelerate_txn.runtime.accelerate_internals import ACCELERATE_COMMON, ACCELERATE_FSDP1, ACCELERATE_FSDP2
from accelerate_txn.runtime.versions import PATHS, TESTED, protected, unprotected

REPO = Path(__file__).resolve().parents[2]
ALL_ACCELERATE_AND_TORCH = tuple(dict.fromkeys(
    (*ACCELERATE_COMMON, *ACCELERATE_FSDP1, *ACCELERATE_FSDP2, *TORCH_COMMON, *TORCH_FSDP1, *TORCH_FSDP2)))


def _function(source: str) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


BASE = '''
def save(self, output_dir, index=0):
    state = self.state_dict()
    write(state, output_dir)
    flush(output_dir)
    return 1
'''


@pytest.mark.parametrize("same", [
    # comments, blank lines, line breaks and quotes
    '''
    def save(self, output_dir, index=0):  # a comment
        state = self.state_dict()

        write(state,
              output_dir)
        flush(output_dir)  # another
        return 1
    ''',
    # a docstring, a bare string, pass, the annotations of parameters, the return value and a local variable
    '''
    def save(self, output_dir: str, index: int = 0) -> int:
        """Saves."""
        state: dict = self.state_dict()
        "the state is written, then flushed"
        write(state, output_dir)
        pass
        flush(output_dir)
        return 1
    ''',
])
def test_a_fingerprint_ignores_comments_docstrings_annotations_and_formatting_only(same: str) -> None:
    assert fingerprint(_function(same)) == fingerprint(_function(BASE))


@pytest.mark.parametrize("changed", [
    BASE.replace("    write(state, output_dir)\n    flush(output_dir)\n",
                 "    flush(output_dir)\n    write(state, output_dir)\n"),
    BASE.replace("return 1", "return 2"),
    BASE.replace("flush(output_dir)", "sync(output_dir)"),
    BASE.replace("index=0", "position=0"),
    BASE.replace("    return 1\n", "    cleanup(output_dir)\n    return 1\n"),
    # logging is behaviour: a call inside a log message's arguments, a log line, a warning, a print, a verbose branch
    BASE.replace("    return 1\n", '    logger.info("saved %s", self.state.pop())\n    return 1\n'),
    BASE.replace("    return 1\n", '    logger.info("saved")\n    return 1\n'),
    BASE.replace("    return 1\n", '    warnings.warn("careful")\n    return 1\n'),
    BASE.replace("    return 1\n", '    print("done")\n    return 1\n'),
    BASE.replace("    return 1\n", '    if index:\n        logging.getLogger(__name__).debug("x")\n    return 1\n'),
    # an f-string evaluates its fields; a bare annotation makes a name local
    BASE.replace("    return 1\n", '    f"{self.flush()}"\n    return 1\n'),
    BASE.replace("    return 1\n", "    flush: int\n    return 1\n"),
])
def test_a_fingerprint_sees_every_change_of_behaviour(changed: str) -> None:
    assert changed != BASE
    assert fingerprint(_function(changed)) != fingerprint(_function(BASE))


def _class(source: str) -> ast.ClassDef:
    node = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(node, ast.ClassDef)
    return node


def test_a_class_fingerprint_sees_its_fields_and_their_order_and_ignores_its_docstring() -> None:
    record = '''
    @dataclass
    class Info:
        relative_path: str
        offset: int
        length: int
        transform: list | None = None
    '''
    assert fingerprint(_class(record)) == fingerprint(_class(record.replace(
        "class Info:\n", 'class Info:\n        """Where an item lives."""\n')))
    for changed in (record.replace("offset: int\n        length: int", "length: int\n        offset: int"),
                    record.replace("length: int", "length: float"),
                    record.replace("transform: list | None = None", "transform: list | None = ()"),
                    record.replace("@dataclass", "@dataclass(frozen=True)")):
        assert fingerprint(_class(changed)) != fingerprint(_class(record)), changed


def test_assigns_sees_every_way_a_function_sets_an_attribute() -> None:
    piece = Piece("torch", "m", "C.__init__", "assigns", "a test", ("a", "b", "c", "d", "e", "f"))
    setter = _function('''
    def __init__(self, state):
        self.a = 1
        state.config.b = True
        setattr(self, "c", {})
        super().__setattr__("d", [])
        object.__setattr__(self, "e", None)
        self.x, state.f = 1, 2
    ''')
    assert value_of(piece, setter) == PRESENT
    reader = _function('''
    def __init__(self, state):
        read(self.a, state.config.b, getattr(self, "c"))
        self.d.append(state.e, state.f)
    ''')
    assert value_of(piece, reader) == "lacks a, b, c, d, e, f"  # reading an attribute is not setting it


def test_a_signature_is_names_order_defaults_and_markers() -> None:
    assert signature(_function("def f(a, /, b, c=1, *args, d, e=2, **kwargs): pass")) == \
        "(a, /, b, c=, *args, d, e=, **kwargs)"
    assert signature(_function("def f(self, *, key=None): pass")) == "(self, *, key=)"
    assert calls(_function(BASE)) == ["self.state_dict", "write", "flush"]


def test_the_last_definition_wins_and_definitions_under_if_and_try_are_found() -> None:
    tree = ast.parse(textwrap.dedent('''
        if FLAG:
            def f(a): pass
        else:
            def f(a, b): pass
        try:
            class C:
                def m(self, x): pass
        except ImportError:
            C = None
    '''))
    assert signature(find_definition(tree, "f")) == "(a, b)"  # type: ignore[arg-type]
    assert signature(find_definition(tree, "C.m")) == "(self, x)"  # type: ignore[arg-type]
    with pytest.raises(Unreadable, match=r"C\.n is not defined"):
        find_definition(tree, "C.n")


def _site_packages(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def _declared() -> list[Piece]:
    pieces = list(ALL_ACCELERATE_AND_TORCH)
    if importlib.util.find_spec("transformers") is not None:
        from accelerate_txn.trainer.internals import TRAINER_FSDP_PIECES, trainer_pieces

        pieces += [*trainer_pieces(), *TRAINER_FSDP_PIECES]
    return list(dict.fromkeys(pieces))


def test_the_running_value_of_every_piece_equals_the_value_read_from_its_release_files() -> None:
    # How the evidence is recorded (from a wheel's files) and how it is checked (from the running objects) agree.
    import accelerate_txn  # noqa: F401  (the library's own wrappers are installed: they must be seen through)

    for piece in _declared():
        running = observe(piece)
        assert running == observe_source(piece, _site_packages(piece.package)), piece.key
        assert not running.startswith(("unreadable", "lacks")), (piece.key, running)


def test_a_function_put_in_a_pieces_place_is_read_as_itself() -> None:
    from accelerate.utils import fsdp_utils

    piece = next(p for p in ACCELERATE_COMMON if p.qualname == "load_fsdp_optimizer" and p.kind == "signature")
    original = fsdp_utils.load_fsdp_optimizer
    before = observe(piece)
    try:
        fsdp_utils.load_fsdp_optimizer = _renamed  # another function under the name
        assert observe(piece) == "(fsdp_plugin, accelerator, optimizer, model, input_dir, index=)"
        forget()
        (difference,) = differences([piece])
        assert difference.describe().startswith(
            f"accelerate {difference.release.split()[1]}: accelerate.utils.fsdp_utils.load_fsdp_optimizer has the "
            "parameters (fsdp_plugin, accelerator, optimizer, model, input_dir, index=); the releases that passed")
    finally:
        fsdp_utils.load_fsdp_optimizer = original
        forget()
    assert observe(piece) == before and differences([piece]) == []


def _renamed(fsdp_plugin, accelerator, optimizer, model, input_dir, index=0):  # type: ignore[no-untyped-def]
    return None


def test_a_missing_piece_is_unreadable_and_never_protected() -> None:
    ghost = Piece("accelerate", "accelerate.accelerator", "Accelerator._no_such_method", "code", "a test")
    with pytest.raises(Unreadable, match="does not exist"):
        observe(ghost)
    (difference,) = differences([ghost])
    assert "cannot be checked (accelerate.accelerator.Accelerator._no_such_method does not exist)" in \
        difference.describe()
    assert observe(Piece("accelerate", "accelerate.accelerator", "load_fsdp_model", "exists", "x")) == PRESENT


def test_the_evidence_holds_one_value_per_piece_for_every_release_that_passed() -> None:
    evidence = recorded()
    wanted = {"torch": {pair.torch for pair in TESTED}, "accelerate": {pair.accelerate for pair in TESTED}}
    from accelerate_txn.trainer.versions import ROWS

    wanted["transformers"] = {row.transformers for row in ROWS}
    for package, releases in wanted.items():
        assert releases <= set(evidence["releases"][package]), package
    from accelerate_txn.trainer.internals import ALTERNATIVES, TRAINER_FSDP_PIECES, TRAINER_PIECES

    for piece in dict.fromkeys((*ALL_ACCELERATE_AND_TORCH, *TRAINER_PIECES, *TRAINER_FSDP_PIECES)):
        holders = evidence["pieces"][piece.key]
        for release in evidence["releases"][piece.package]:
            assert sum(release in group for group in holders.values()) == 1, (piece.key, release)
    # Each Trainer release has exactly one of each group of alternatives recorded (its end-of-training method, what
    # rotates its checkpoints): its own.
    for alternatives in ALTERNATIVES:
        recorded_values = [evidence["pieces"].get(piece.key, {}) for piece in alternatives]
        for release in evidence["releases"]["transformers"]:
            assert sum(release in group for values in recorded_values for group in values.values()) == 1, \
                ([piece.key for piece in alternatives], release)
    # A value that says a piece is missing or lacks an attribute is never evidence of a release that passed.
    for key, values in evidence["pieces"].items():
        assert not any(value.startswith(("unreadable", "lacks")) for value in values), (key, list(values))
    # The full rectangle of .ci/matrix-full-run.md passed: every torch and Accelerate release of it is recorded.
    record = (REPO / ".ci" / "matrix-full-run.md").read_text(encoding="utf-8")
    header = next(line for line in record.splitlines() if line.startswith("| torch \\ Accelerate |"))
    accelerates = {cell.strip() for cell in header.split("|")[2:-1]}
    torches = {line.split("|")[1].strip() for line in record.splitlines() if line.startswith("| 2.")}
    assert accelerates <= set(evidence["releases"]["accelerate"])
    assert torches <= set(evidence["releases"]["torch"])
    assert "passed (table) | passed" in record and "FAILED" not in record


def test_the_installed_releases_are_protected_on_every_path() -> None:
    assert unprotected() == {}
    assert all(protected(path) for path in PATHS)
    if importlib.util.find_spec("transformers") is not None:
        from accelerate_txn.trainer.versions import differing

        assert all(differing(None, path) == [] for path in PATHS)


def _wheel(tmp_path: Path, name: str, change: str | None = None) -> Path:
    """A wheel of the installed Accelerate's source files, as a new release would ship them (``change``: a line
    of ``utils/fsdp_utils.py`` replaced, ``old=>new``)."""
    root = _site_packages("accelerate")
    wheel = tmp_path / name
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted((root / "accelerate").rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            relative = path.relative_to(root).as_posix()
            if change and relative == "accelerate/utils/fsdp_utils.py":
                old, new = change.split("=>")
                assert text.count(old) == 1
                text = text.replace(old, new)
            archive.writestr(relative, text)
    return wheel


def test_the_recorder_reads_a_wheel_without_installing_it_and_names_a_changed_piece(tmp_path: Path) -> None:
    same = _wheel(tmp_path, "accelerate-1.99.0-py3-none-any.whl")
    changed = _wheel(tmp_path, "accelerate-1.99.1-py3-none-any.whl",
                     "def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0"
                     "=>def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=1")
    before = (REPO / "accelerate_txn" / "evidence.json").read_bytes()
    done = subprocess.run([sys.executable, str(REPO / ".ci" / "record_evidence.py"), "check", str(same), str(changed)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines() == [
        "accelerate 1.99.0: protected",
        "accelerate 1.99.1: differs: accelerate.utils.fsdp_utils:save_fsdp_model#code",
    ]
    assert (REPO / "accelerate_txn" / "evidence.json").read_bytes() == before  # check records nothing


def test_the_evidence_file_is_what_the_recorder_writes() -> None:
    evidence = json.loads((REPO / "accelerate_txn" / "evidence.json").read_text(encoding="utf-8"))
    assert set(evidence) == {"about", "releases", "pieces", "outlines"}
    assert list(evidence["pieces"]) == sorted(evidence["pieces"])  # the recorder's order: diffs stay readable
    for key, values in evidence["outlines"].items():
        assert key.endswith("#code") and set(values) <= set(evidence["pieces"][key])
