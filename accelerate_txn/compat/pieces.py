"""The private pieces of Accelerate, torch and transformers the library relies on, and what it needs of each.

A :class:`Piece` names one private (or otherwise unstable) thing by where it is defined (``module`` and
``qualname``) and says what the library needs of it (``kind``):

* ``"exists"``: the module defines or imports the name (a function, class, or a binding another function calls);
* ``"signature"``: the function's parameters (names, order, which have defaults, ``*``/``**``), nothing else;
* ``"code"``: the function's code (its signature and body), or a class's (its body: methods, fields,
  attributes), ignoring only what cannot change what it does: comments, docstrings and other bare string
  constants, ``pass``, formatting, and the annotations of parameters, return values and local variables (a call
  never reads them: Python does not evaluate a local variable's annotation, and a parameter's is evaluated once,
  when the function is defined, and never at all under ``from __future__ import annotations``). Everything else
  counts, logging included (a call inside a log message's arguments is behaviour, ``logger.info("%s",
  self.state.pop())``); so do the annotations in a class body (they declare a dataclass's or a named tuple's
  fields, in order) and a bare ``x: int`` in a function (it makes ``x`` local). For the functions and classes
  whose behaviour the library depends on: every private one whose body a protected path runs (called through,
  or wrapped and then called), and those whose effects it relies on (the order of Trainer's writes, what a
  native save puts where);
* ``"assigns"``: the function assigns every attribute in ``attributes`` (``self.x = ...``, ``state.x = ...``,
  ``a.b.x = ...``, or by name: ``setattr(obj, "x", ...)``, ``super().__setattr__("x", ...)``): the private
  attributes of an object the library reads, e.g. ``Accelerator._models`` set in ``Accelerator.__init__``.

:func:`observe` computes the piece's *value* (a short string: a fingerprint, a signature, ``"present"``) from the
source of the running object (resolved through any wrapper), and :func:`observe_source` the same from a source tree
(an unpacked wheel) without importing anything, so the evidence of a release can be recorded from its files. The
two agree by construction: both read the function's definition from its source file.

The fingerprint is computed from a canonical form of the syntax tree that is the same on every Python this library
supports (``ast.dump``'s output is not: 3.13 leaves empty fields out, 3.12 added ``type_params``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("exists", "signature", "code", "assigns")
PRESENT = "present"
#: Syntax-tree fields that carry no behaviour or differ between Pythons for the same source.
IGNORED_FIELDS = frozenset({"type_comment", "type_params", "kind", "ctx"})


@dataclass(frozen=True)
class Piece:
    """One private piece a front end relies on: ``package`` (the distribution: ``torch``, ``accelerate``,
    ``transformers``), the defining ``module`` and ``qualname``, what is needed of it (``kind``), and why."""

    package: str
    module: str
    qualname: str
    kind: str
    why: str
    attributes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown piece kind {self.kind!r} (known: {', '.join(KINDS)})")

    @property
    def key(self) -> str:
        """The piece's key in the evidence file: ``module:qualname#kind``."""
        return f"{self.module}:{self.qualname}#{self.kind}"

    @property
    def name(self) -> str:
        """``module.qualname`` as a user reads it."""
        return f"{self.module}.{self.qualname}"


class Unreadable(Exception):
    """The piece's source cannot be found or read (a missing name, a compiled module, a function built at run
    time): its value is then the reason, which no recorded evidence holds."""


# --- Canonical syntax trees --------------------------------------------------------------------------------------


BLOCKS = ("body", "orelse", "finalbody")


def _is_noise(statement: ast.stmt) -> bool:
    """A statement that does nothing: ``pass``, or a bare string constant (a docstring, a string used as a
    comment). Anything that evaluates something (a call, an f-string, a name) is behaviour."""
    if isinstance(statement, ast.Pass):
        return True
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def _kept(block: list[Any]) -> list[Any]:
    return [statement for statement in block if not _is_noise(statement)]


def _fields(node: ast.AST, in_class: bool = False) -> Iterator[tuple[str, Any]]:
    """The fields of ``node`` that carry behaviour, as they are canonically compared: noise statements left out of
    blocks (an emptied body is one ``pass``); the annotations of parameters and return values left out; outside a
    class body (``in_class``: a statement directly in one) an annotated assignment read as a plain one, and a bare
    annotation (``x: int``, which only makes ``x`` local) as its target alone. In a class body annotations count:
    they declare fields."""
    for field, value in ast.iter_fields(node):
        if field in IGNORED_FIELDS or (field == "annotation" and isinstance(node, ast.arg)):
            continue
        if field == "returns" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.AnnAssign) and not in_class and field in ("annotation", "simple"):
            continue
        if field in BLOCKS and isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            value = _kept(value) or ([ast.Pass()] if field == "body" else [])
        yield field, value


#: The statements of these blocks are at the level of the block's own statement (in a class body if it is).
_SAME_LEVEL = (ast.If, ast.Try, ast.ExceptHandler, ast.With)


def _class_level(node: ast.AST, field: str, in_class: bool) -> bool:
    """Whether the statements of ``node``'s ``field`` are directly in a class body (or in an ``if``/``try``/``with``
    block there: ``if sys.version_info >= ...: x: int``)."""
    if isinstance(node, ast.ClassDef):
        return field == "body"
    return in_class and isinstance(node, _SAME_LEVEL) and field in (*BLOCKS, "handlers")


def _canonical(node: Any, out: list[str], in_class: bool = False) -> None:
    """``node`` as text: its type and behaviour-carrying fields (:func:`_fields`), recursively. ``in_class``: the
    node is a statement directly in a class body."""
    if isinstance(node, ast.AST):
        plain = isinstance(node, ast.AnnAssign) and not in_class
        out.append(("Assign" if plain and node.value is not None else type(node).__name__) + "(")
        for field, value in _fields(node, in_class):
            if value is None or value == []:
                continue
            if plain and node.value is not None and field == "target":
                field, value = "targets", [value]
            out.append(field + "=")
            inner = _class_level(node, field, in_class)
            if isinstance(value, list):
                out.append("[")
                for item in value:
                    _canonical(item, out, inner)
                    out.append(",")
                out.append("]")
            else:
                _canonical(value, out, False)
            out.append(",")
        out.append(")")
    else:
        out.append(repr(node))


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` without the noise statements (depth first, in source order)."""
    yield node
    for _field, value in _fields(node):
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                yield from _walk(child)


def fingerprint(definition: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    """A 16-hex-digit fingerprint of a function's or a class's code, blind to comments, docstrings, ``pass``,
    formatting and the annotations a call never reads (:func:`_fields`), and the same on every Python."""
    out: list[str] = []
    _canonical(definition, out)
    return hashlib.sha256("".join(out).encode()).hexdigest()[:16]


def signature(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The parameters as ``(self, a, b=, *args, c=, **kwargs)``: names, order, defaults, ``/``, ``*``, ``**``."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    parts = [arg.arg + ("=" if index >= first_default else "") for index, arg in enumerate(positional)]
    if arguments.posonlyargs:
        parts.insert(len(arguments.posonlyargs), "/")
    if arguments.vararg is not None:
        parts.append("*" + arguments.vararg.arg)
    elif arguments.kwonlyargs:
        parts.append("*")
    parts += [arg.arg + ("" if default is None else "=")
              for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg is not None:
        parts.append("**" + arguments.kwarg.arg)
    return "(" + ", ".join(parts) + ")"


def calls(function: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    """The names the function (or class) calls, in source order (``save_model``, ``self._save_rng_state``): an
    outline of what it does, to say what changed when its fingerprint differs."""
    return [ast.unparse(node.func) for node in _walk(function) if isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))]


def set_by_call(node: ast.AST) -> str | None:
    """The attribute a call sets by name, or None: ``setattr(obj, "x", v)``, ``super().__setattr__("x", v)``,
    ``object.__setattr__(self, "x", v)`` (how ``torch.nn.Module.__init__`` sets its own)."""
    if not isinstance(node, ast.Call):
        return None
    function = node.func
    if isinstance(function, ast.Name) and function.id == "setattr":
        candidates = node.args[1:2]
    elif isinstance(function, ast.Attribute) and function.attr == "__setattr__":
        candidates = node.args[:2]
    else:
        return None
    return next((arg.value for arg in candidates if isinstance(arg, ast.Constant) and isinstance(arg.value, str)),
                None)


def _assigned(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(function):
        if (name := set_by_call(node)) is not None:
            names.add(name)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute):
                names.add(target.attr)  # ``a.b.x = ...``: x, whatever holds it
            for element in ast.walk(target):
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name):
                    names.add(element.attr)  # ``self.x = ...`` or ``state.x = ...``, in a tuple too
    return names


# --- Finding a definition in a file ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _parsed(path: str, stamp: tuple[int, int]) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def parse_file(path: str | Path) -> ast.Module:
    """The file's syntax tree (parsed once per process while the file is unchanged)."""
    stat = Path(path).stat()
    return _parsed(str(path), (stat.st_mtime_ns, stat.st_size))


def _children(node: ast.AST) -> Iterator[ast.stmt]:
    """The statements directly in a module or class body, looking inside top-level ``if``/``try`` blocks (where
    libraries define version-dependent code)."""
    for statement in getattr(node, "body", []):
        if isinstance(statement, (ast.If, ast.Try)):
            yield from _children(statement)
            for block in ("orelse", "finalbody"):
                yield from getattr(statement, block, [])
            for handler in getattr(statement, "handlers", []):
                yield from _children(handler)
        else:
            yield statement


def find_definition(tree: ast.Module, qualname: str) -> ast.AST:
    """The last definition of ``qualname`` ("Class.method", "function") in ``tree`` (the one that wins at import)."""
    node: ast.AST = tree
    for part in qualname.split("."):
        found = [child for child in _children(node)
                 if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part]
        if not found:
            raise Unreadable(f"{qualname} is not defined in the source")
        node = found[-1]
    return node


def binds(tree: ast.Module, name: str) -> bool:
    """Whether a module's top level defines, assigns or imports ``name``."""
    for statement in _children(tree):
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and statement.name == name:
            return True
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in statement.names):
                return True
        if isinstance(statement, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                     for t in statement.targets):
            return True
    return False


def value_of(piece: Piece, definition: ast.AST) -> str:
    """The piece's value from its definition's syntax tree."""
    if piece.kind == "exists":
        return PRESENT
    if piece.kind == "code" and isinstance(definition, ast.ClassDef):
        return fingerprint(definition)
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Unreadable(f"{piece.name} is not a function")
    if piece.kind == "signature":
        return signature(definition)
    if piece.kind == "code":
        return fingerprint(definition)
    missing = sorted(set(piece.attributes) - _assigned(definition))
    return PRESENT if not missing else "lacks " + ", ".join(missing)


# --- Observing a piece ---------------------------------------------------------------------------------------------


def _resolve(piece: Piece) -> Any:
    try:
        target: Any = importlib.import_module(piece.module)
    except ImportError as exc:
        raise Unreadable(f"{piece.module} cannot be imported ({exc})") from exc
    for part in piece.qualname.split("."):
        target = inspect.getattr_static(target, part, None) if inspect.isclass(target) else getattr(target, part, None)
        if target is None:
            raise Unreadable(f"{piece.name} does not exist")
        if isinstance(target, (staticmethod, classmethod)):
            target = target.__func__
    return inspect.unwrap(target)  # through wrapt's and functools' wrappers (``__wrapped__``): the original


def observe(piece: Piece) -> str:
    """The piece's value in the running interpreter: read from the source of the object its name resolves to now
    (the original under any wrapper; another function put in its place is read as that function)."""
    target = _resolve(piece)
    if piece.kind == "exists":
        return PRESENT
    try:
        path = inspect.getsourcefile(target)
    except TypeError as exc:
        raise Unreadable(f"{piece.name} has no Python source ({exc})") from exc
    qualname = getattr(target, "__qualname__", "")
    if path is None or "<locals>" in qualname:
        raise Unreadable(f"{piece.name} has no source file to read")
    try:
        return value_of(piece, _definition(target, path, qualname))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise Unreadable(f"{piece.name}'s source {path} cannot be read ({exc})") from exc


def _definition(target: Any, path: str, qualname: str) -> ast.AST:
    """The definition of a function from its own lines (``inspect.getsourcelines``: no need to parse its whole
    file), or from its file where those lines do not parse alone; the same node either way."""
    if inspect.isfunction(target):
        try:
            lines, _start = inspect.getsourcelines(target)
            node = ast.parse(textwrap.dedent("".join(lines))).body[0]
        except (OSError, SyntaxError, IndexError):
            node = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == target.__name__:
            return node
    return find_definition(parse_file(path), qualname)


def module_file(root: Path, module: str) -> Path:
    """The source file of ``module`` in a source tree (an unpacked wheel): ``a/b.py`` or ``a/b/__init__.py``."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise Unreadable(f"{module} is not in {root}")


def observe_source(piece: Piece, root: Path) -> str:
    """The piece's value in the source tree ``root`` (nothing imported). For ``exists`` the module must define or
    import the name at its top level (or, for ``Class.attr``, the class must define it)."""
    tree = parse_file(module_file(root, piece.module))
    if piece.kind == "exists" and "." not in piece.qualname:
        if not binds(tree, piece.qualname):
            raise Unreadable(f"{piece.name} does not exist")
        return PRESENT
    return value_of(piece, find_definition(tree, piece.qualname))


_OBSERVED: dict[Piece, str] = {}  # observe_all's values in this process (forget_observed() clears it)


def observe_all(pieces: Iterable[Piece]) -> dict[str, str]:
    """Each piece's key -> its value here, or ``"unreadable: <why>"``; each piece is read once per process (the
    paths share most of their pieces)."""
    values: dict[str, str] = {}
    for piece in pieces:
        if piece not in _OBSERVED:
            try:
                _OBSERVED[piece] = observe(piece)
            except Unreadable as exc:
                _OBSERVED[piece] = f"unreadable: {exc}"
        values[piece.key] = _OBSERVED[piece]
    return values


def forget_observed() -> None:
    """Read every piece again at the next :func:`observe_all` (a piece was replaced on purpose)."""
    _OBSERVED.clear()


def outline(piece: Piece) -> list[str] | None:
    """The calls of a ``code`` piece in the running interpreter (``None`` where it cannot be read)."""
    if piece.kind != "code":
        return None
    try:
        target = _resolve(piece)
        definition = _definition(target, inspect.getsourcefile(target) or "", target.__qualname__)
    except (Unreadable, TypeError, OSError, SyntaxError, AttributeError):
        return None
    return calls(definition) if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None


def outline_source(piece: Piece, root: Path) -> list[str] | None:
    """The calls of a ``code`` piece in a source tree."""
    if piece.kind != "code":
        return None
    definition = find_definition(parse_file(module_file(root, piece.module)), piece.qualname)
    return calls(definition) if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
