"""A changed release of an installed package, for tests of the evidence gate: a directory that shadows the package
(put it first on ``PYTHONPATH``) where every file is the installed one (a symbolic link) except the ones changed.

This is what a new release that changed one private piece looks like to the library: it reads the sources of the
package Python imports. Nothing installed is modified.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


def installed_package(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not an installed package"
    return Path(next(iter(spec.submodule_search_locations)))


def overlay(name: str, into: Path, changes: dict[str, Callable[[str], str | bytes | None]]) -> Path:
    """A shadow of package ``name`` under ``into`` (returned: the directory to put on ``PYTHONPATH``): each file of
    ``changes`` (a path relative to the package, e.g. ``"utils/fsdp_utils.py"``) is a copy transformed by its
    function, which must change it (bytes: written as they are; None: the file is left out); everything else links
    to the installed files."""
    source = installed_package(name)
    target = into / name

    def mirror(directory: Path, copy: Path, changed: dict[str, Callable[[str], str | bytes | None]]) -> None:
        copy.mkdir(parents=True)
        for entry in directory.iterdir():
            if entry.name == "__pycache__":
                continue
            below = {path.split("/", 1)[1]: change for path, change in changed.items()
                     if "/" in path and path.split("/", 1)[0] == entry.name}
            if entry.name in changed:
                text = entry.read_text(encoding="utf-8")
                new = changed[entry.name](text)
                assert new != text, f"the change to {entry} changed nothing"
                if isinstance(new, bytes):
                    (copy / entry.name).write_bytes(new)
                elif new is not None:  # None: the file is left out
                    (copy / entry.name).write_text(new, encoding="utf-8")
            elif below:
                mirror(entry, copy / entry.name, below)
            else:
                (copy / entry.name).symlink_to(entry)

    mirror(source, target, changes)
    return into


# A release of Accelerate that renamed one parameter of ``load_fsdp_optimizer`` (a function the protected path
# replaces): every protected path of the Accelerate front end relies on its signature.
_RENAMED = "def load_fsdp_optimizer(\n    fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0"


def _renamed_parameter(text: str) -> str:
    assert text.count(_RENAMED) == 1, "load_fsdp_optimizer's definition moved: update tests/support/overlay.py"
    return text.replace(_RENAMED, _RENAMED.replace("optimizer_index=0", "index=0"))


def accelerate_with_a_renamed_parameter(into: Path) -> Path:
    """An Accelerate whose ``load_fsdp_optimizer`` calls ``optimizer_index`` ``index`` (``PYTHONPATH`` entry)."""
    return overlay("accelerate", into, {"utils/fsdp_utils.py": _renamed_parameter})


# A release of Accelerate that changed the body of ``save_fsdp_optimizer`` and kept its parameters: the FSDP1 path
# relies on its code (its save writes the optimizer's DCP files), FSDP2 only on its signature (the library replaces
# it), one process and DDP not at all.
_SAVE_OPTIMIZER = re.compile(r"^def save_fsdp_optimizer\([^)]*\):\n", re.MULTILINE)


def _changed_body(text: str) -> str:
    assert len(_SAVE_OPTIMIZER.findall(text)) == 1, "save_fsdp_optimizer's definition moved: update tests/support/overlay.py"
    return _SAVE_OPTIMIZER.sub(lambda match: match.group(0) + "    changed_in_this_release = True\n", text)


def accelerate_with_a_changed_fsdp1_save(into: Path) -> Path:
    """An Accelerate whose ``save_fsdp_optimizer`` has one more statement, the same parameters (``PYTHONPATH``
    entry)."""
    return overlay("accelerate", into, {"utils/fsdp_utils.py": _changed_body})


# A release of Accelerate whose ``save_state`` lets the user choose Accelerate's per-rank ``use_dcp=False`` format
# (``save_fsdp_model``/``save_fsdp_optimizer`` take it; no release up to 1.16 passes it from ``save_state``).
_SAVE_STATE = ("    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, "
               "**save_model_func_kwargs):\n")
_SAVES = ("save_fsdp_model(self.state.fsdp_plugin, self, model, output_dir, i)",
          "save_fsdp_optimizer(self.state.fsdp_plugin, self, opt, self._models[i], output_dir, i)")


def _use_dcp_choice(text: str) -> str:
    assert text.count(_SAVE_STATE) == 1 and all(text.count(call) == 1 for call in _SAVES), \
        "Accelerator.save_state moved: update tests/support/overlay.py"
    text = text.replace(_SAVE_STATE, _SAVE_STATE.replace("safe_serialization: bool = True,",
                                                         "safe_serialization: bool = True, use_dcp: bool = True,"))
    for call in _SAVES:
        text = text.replace(call, call[:-1] + ", use_dcp=use_dcp)")
    return text


def accelerate_with_a_use_dcp_choice(into: Path) -> Path:
    """An Accelerate whose ``save_state(use_dcp=False)`` writes the per-rank format (``PYTHONPATH`` entry)."""
    return overlay("accelerate", into, {"accelerator.py": _use_dcp_choice})


# --- One declared piece changed ------------------------------------------------------------------------------------
# What a release that changed exactly one piece looks like, for every kind: a ``code`` piece whose body does nothing
# (``return None`` first: a generator then yields nothing) or, for a class, one more class attribute; a ``signature``
# piece with one more keyword-only parameter; an ``assigns`` piece that no longer sets its first attribute; an
# ``exists`` piece bound no more (its import dropped). Every other line of the module stays as it is.

#: The kinds of a piece of the same function whose value a change of each kind also changes (a signature is part of
#: the code; a binding dropped takes every reading of it along).
AFFECTS: dict[str, frozenset[str]] = {
    "code": frozenset({"code"}),
    "signature": frozenset({"signature", "code"}),
    "assigns": frozenset({"assigns", "code"}),
    "exists": frozenset({"exists", "signature", "code", "assigns"}),
}


def module_path(module: str) -> str:
    """``module``'s file relative to its top-level package directory (``utils/fsdp_utils.py``), as installed."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    package = installed_package(module.split(".")[0])
    return Path(spec.origin).relative_to(package).as_posix()


def _splice(text: str, node: ast.AST, replacement: list[str]) -> str:
    """``text`` with the lines of ``node`` (from its first line to its last) replaced by ``replacement`` (indented
    as the node was)."""
    lines = text.splitlines(keepends=True)
    indent = " " * node.col_offset  # type: ignore[attr-defined]
    new = [indent + line + "\n" for line in replacement]
    return "".join(lines[: node.lineno - 1] + new + lines[node.end_lineno:])  # type: ignore[attr-defined]


def _insert_before(text: str, statement: ast.stmt, line: str) -> str:
    lines = text.splitlines(keepends=True)
    assert lines[statement.lineno - 1][: statement.col_offset].strip() == "", "a body on its definition's line"
    return "".join([*lines[: statement.lineno - 1], " " * statement.col_offset + line + "\n",
                    *lines[statement.lineno - 1:]])


def _binding(tree: ast.Module, name: str) -> ast.Import | ast.ImportFrom | None:
    from accelerate_txn.compat.pieces import _children  # the same walk the evidence reads top-level bindings with

    found = [statement for statement in _children(tree) if isinstance(statement, (ast.Import, ast.ImportFrom))
             and any((alias.asname or alias.name.split(".")[0]) == name for alias in statement.names)]
    return found[-1] if found else None


def change_piece(text: str, qualname: str, kind: str, attributes: tuple[str, ...] = ()) -> str:
    """The source ``text`` of a module with one piece changed (see above)."""
    from accelerate_txn.compat.pieces import find_definition

    tree = ast.parse(text)
    if kind == "exists" and "." not in qualname and (statement := _binding(tree, qualname)) is not None:
        kept = copy.deepcopy(statement)
        kept.names = [alias for alias in kept.names if (alias.asname or alias.name.split(".")[0]) != qualname]
        return _splice(text, statement, ast.unparse(kept).splitlines() if kept.names else ["pass"])
    definition = find_definition(tree, qualname)
    if kind == "code" and isinstance(definition, ast.ClassDef):
        return _insert_before(text, definition.body[0], "changed_in_this_release = True")
    assert isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)), (qualname, kind)
    if kind == "code":
        return _insert_before(text, definition.body[0], "return None")
    if kind == "signature":
        header = copy.deepcopy(definition)
        header.decorator_list = []
        header.args.kwonlyargs.append(ast.arg("changed_in_this_release"))
        header.args.kw_defaults.append(ast.Constant(None))
        first = definition.body[0]
        lines = text.splitlines(keepends=True)
        # The new header, then the body exactly as it was (from its first statement's line).
        signature = ast.unparse(header).splitlines()[0]
        return "".join([*lines[: definition.lineno - 1], " " * definition.col_offset + signature + "\n",
                        *lines[first.lineno - 1:]])
    assert kind == "assigns", kind
    from accelerate_txn.compat.pieces import set_by_call  # ``super().__setattr__("x", ...)``: torch's Module

    attribute = attributes[0]
    targets = [node for node in ast.walk(definition) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               and any(isinstance(element, ast.Attribute) and element.attr == attribute
                       for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                       for element in ast.walk(target))]
    targets += [node for node in ast.walk(definition) if isinstance(node, ast.Expr) and set_by_call(node.value) == attribute]
    assert targets, f"{qualname} assigns no {attribute}"
    for node in sorted(targets, key=lambda node: node.lineno, reverse=True):
        text = _splice(text, node, ["pass"])
    return text


def shadow_of(pieces: list[Any], into: Path) -> dict[str, Path]:
    """A shadow of each package of ``pieces`` under ``into`` (one piece per module file: each changed alone in its
    file), as ``{package: directory to put first on sys.path}``."""
    changes: dict[str, dict[str, Callable[[str], str]]] = {}
    for piece in pieces:
        path = module_path(piece.module)
        assert path not in changes.get(piece.package, {}), f"two pieces of {piece.module} in one shadow"
        changes.setdefault(piece.package, {})[path] = \
            lambda text, piece=piece: change_piece(text, piece.qualname, piece.kind, piece.attributes)
    return {package: overlay(package, into / package, files) for package, files in changes.items()}
