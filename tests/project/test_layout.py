"""The layout is the map of the design: checked from the source, function-level imports included.

* No import cycle between the library's modules.
* Dependencies point one way (``LAYERS``): the transaction core imports no front end and no store
  implementation, the FSDP layer no front end, a store implementation no front end; only the top (the package
  root, ``cli``, ``testing``) may import anything below it.
* No module imports a private (``_``-prefixed) name of another module; a private module may be imported only from
  its own package.
* The package root holds only the public face and subpackages.
* The offline CLI imports no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import accelerate_txn

PACKAGE = Path(accelerate_txn.__file__).parent
NAME = "accelerate_txn"

# What each part of the package may import (besides itself). A part is a subpackage, or a module of the root.
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "store.base": {"errors"},
    "store": {"errors"},  # every store implementation: the interface and the errors, no front end, no core
    "core": {"errors", "store.base"},  # the transaction: no front end, no FSDP, no store implementation
    # The evidence gate's mechanism (which private pieces changed): the standard library only; each front end and the
    # FSDP layer declare their own pieces with it.
    "compat": set(),
    "fsdp": {"errors", "core", "compat"},  # FSDP layouts and restores: no front end
    # What both front ends run on: Accelerate's internals, the version gate, the asynchronous engine.
    "runtime": {"errors", "store", "core", "fsdp", "compat"},
    "accelerate": {"errors", "store", "core", "fsdp", "compat", "runtime"},  # the Accelerate front end
    "weights": {"errors", "store", "core"},
    # The Trainer front end, beside the Accelerate one: never importing it.
    "trainer": {"errors", "store", "core", "fsdp", "compat", "runtime"},
    "cli": {"errors", "store", "core", "fsdp", "accelerate", "weights", "trainer", "compat", "runtime", "__init__"},
    "testing": {"errors"},
    "__init__": {"errors", "store", "core", "fsdp", "accelerate", "weights", "trainer", "runtime"},
    "__main__": {"cli"},
}
ROOT_FILES = {"__init__.py", "__main__.py", "errors.py", "validated.json", "evidence.json"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of the library, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.split(".")[0] == NAME]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != NAME:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:  # ``from package import module``
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def _part(module: str) -> str:
    """The layer a module belongs to: ``store.base`` is its own; otherwise the subpackage, or the root module."""
    rest = module.split(".")[1:]
    if not rest:
        return "__init__"
    if rest[:2] == ["store", "base"]:
        return "store.base"
    return rest[0]


def _graph() -> dict[str, set[str]]:
    return {module: {target for target, _name, _line in _imports(module, path) if target in MODULES}
            for module, path in MODULES.items()}


def test_the_package_root_holds_only_the_public_face_and_subpackages() -> None:
    extra = sorted(entry.name for entry in PACKAGE.iterdir()
                   if not entry.name.startswith(".") and entry.name != "__pycache__"
                   and not (entry.is_dir() and (entry / "__init__.py").is_file()) and entry.name not in ROOT_FILES)
    assert extra == [], f"Only the public face and subpackages belong in {PACKAGE}; found {extra}"
    assert {"core", "store", "fsdp", "accelerate", "weights", "trainer", "cli", "testing"} <= {
        entry.name for entry in PACKAGE.iterdir() if (entry / "__init__.py").is_file()}


def test_no_import_cycle_function_level_imports_included() -> None:
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
                continue
            if state.get(child) == 1:
                cycles.append([*path[path.index(child):], child])
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    assert cycles == [], "Import cycles (function-level imports count):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_dependencies_point_one_way() -> None:
    offenders = []
    for module, path in MODULES.items():
        part = _part(module)
        allowed = LAYERS[part] | {part}
        if "store" in allowed:  # whoever may import a store implementation may import the interface
            allowed |= {"store.base"}
        for target, _name, line in _imports(module, path):
            if target not in MODULES:
                continue
            other = _part(target)
            if other in allowed:
                continue
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} ({part}) imports {target} ({other})")
    assert offenders == [], ("Imports against the dependency direction (tests/project/test_layout.py LAYERS):\n"
                             + "\n".join(offenders))


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for target, name, line in _imports(module, path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if name is not None and name.startswith("_") and not name.startswith("__"):
                offenders.append(f"{where}: {module} imports the private name {name} of {target}")
            private_module = next((part for part in target.split(".")[1:] if part.startswith("_")
                                   and not part.startswith("__")), None)
            if private_module is not None and target.rpartition(".")[0] != package:
                offenders.append(f"{where}: {module} imports {target}, a private module of another package")
    assert offenders == [], "Private names taken across modules:\n" + "\n".join(offenders)


def test_the_offline_cli_imports_no_torch(tmp_path: Path) -> None:
    script = ("import sys\n"
              "from accelerate_txn.cli import main\n"
              "codes = []\n"
              f"for args in (['list', {str(tmp_path)!r}], ['latest', {str(tmp_path)!r}], ['--help']):\n"
              "    try:\n"
              "        main(args)\n"
              "    except SystemExit as exc:\n"
              "        codes.append(exc.code)\n"
              "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
              "print('clean', codes)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "clean" in result.stdout, result.stdout + result.stderr


def test_the_checks_can_fail() -> None:
    """The graph walk sees a function-level import and resolves relative imports (a guard against a vacuous test)."""
    graph = _graph()
    assert "accelerate_txn.accelerate.patch" in graph["accelerate_txn.accelerate.autopatch"]  # function-level
    assert "accelerate_txn.core.manifest" in graph["accelerate_txn.core.select"]
    assert _part("accelerate_txn.store.base") == "store.base" and _part("accelerate_txn.errors") == "errors"
