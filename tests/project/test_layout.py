"""The layout is the map of the design: checked from the source, function-level imports included.

* No import cycle between the library's modules.
* Dependencies point one way (``LAYERS``): the transaction core imports no front end and no store
  implementation, the FSDP layer no front end, a store implementation no front end; only the top (the package
  root, ``cli``, ``testing``) may import anything below it.
* No module imports a private (``_``-prefixed) name of another module; a private module may be imported only from
  its own package.
* The package root holds only the public face and subpackages.
* The offline CLI imports no torch.
* The save transaction is written once (``core/transaction.py``): no front end defines a reservation, runs one of its
  steps itself or imports a store implementation (``store.local_store()`` instead); nothing else is defined in both
  front ends but their declared faces (``BOTH_FRONT_ENDS``); the Trainer front end imports nothing of the Accelerate
  one.
* The tests mirror the package: every test file lives in the folder of the room it tests (``tests/<room>/`` names a
  subpackage of ``accelerate_txn``), beside the folders of whole-repository checks, scenario code and support.
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

TESTS = Path(__file__).resolve().parents[1]
#: What may sit directly under tests/: the package marker, the shared fixtures, and the crash sweep
#: (``python -m tests.crash_sweep``). No script run by path belongs here: Python would put tests/ first on its
#: path, where tests/accelerate/ stands in for Accelerate itself (``make test-gpu`` runs tests/scripts/gpu_check.py).
TESTS_ROOT_FILES = {"__init__.py", "conftest.py", "crash_sweep.py"}
#: The folders of tests/ that are no room of the package, and what each holds.
TESTS_OTHER_FOLDERS = {
    "project": "whole-repository checks: layout, README, docs, dependency floors, CI, benchmarks, demo, public API",
    "scenarios": "code that runs inside launched ranks and the harnesses that start them (no test_*.py)",
    "support": "loopback servers and helpers the tests share (no test_*.py)",
    "scripts": "scripts run by path: the launcher's example script, make test-gpu's check (no test_*.py)",
}


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


def misplaced_tests(tests: Path, package: Path) -> list[str]:
    """What in the test tree ``tests`` does not mirror ``package``: a file directly under tests/ other than
    ``TESTS_ROOT_FILES``; a folder that is neither one of ``TESTS_OTHER_FOLDERS`` nor a subpackage of ``package``
    (at any depth: tests/fsdp/ mirrors accelerate_txn/fsdp/); a module of a room that is not a test (helpers belong in
    scenarios/ or support/); a test file outside the rooms and project/ (scenarios/, support/, scripts/ hold none);
    a folder without ``__init__.py`` (the tests import each other as packages; scripts/ is run by path)."""
    found = []

    def entries(folder: Path) -> list[Path]:
        return sorted(entry for entry in folder.iterdir()
                      if not entry.name.startswith(".") and entry.name != "__pycache__")

    for entry in entries(tests):
        if entry.is_file():
            if entry.name not in TESTS_ROOT_FILES:
                found.append(f"tests/{entry.name}: only {sorted(TESTS_ROOT_FILES)} belong directly under tests/; a test "
                             f"goes into the folder of the room it tests")
            continue
        folders = [entry, *sorted(path for path in entry.rglob("*") if path.is_dir() and path.name != "__pycache__")]
        for folder in folders:
            where = folder.relative_to(tests).as_posix()
            files = [path for path in entries(folder) if path.is_file()]
            if entry.name != "scripts" and not (folder / "__init__.py").is_file():
                found.append(f"tests/{where}/: no __init__.py")
            if entry.name in TESTS_OTHER_FOLDERS:
                if entry.name != "project":
                    found += [f"tests/{where}/{path.name}: a test in {entry.name}/, which holds "
                              f"{TESTS_OTHER_FOLDERS[entry.name]}" for path in files if path.name.startswith("test_")]
                continue
            if not (package / folder.relative_to(tests) / "__init__.py").is_file():
                found.append(f"tests/{where}/: names no subpackage of {package.name} (the rooms mirror the package; "
                             f"other folders: {sorted(TESTS_OTHER_FOLDERS)})")
            found += [f"tests/{where}/{path.name}: not a test (test_*.py) in a room; helpers go to scenarios/ or support/"
                      for path in files if path.name != "__init__.py"
                      and not (path.name.startswith("test_") and path.suffix == ".py")]
    return found


def test_every_test_file_lives_in_the_folder_of_the_room_it_tests() -> None:
    assert misplaced_tests(TESTS, PACKAGE) == [], "The tests do not mirror the package:\n" + "\n".join(
        misplaced_tests(TESTS, PACKAGE))


def test_the_tests_mirror_check_can_fail(tmp_path: Path) -> None:
    """Each kind of misplacement in a crafted tree is named, and a well-formed tree passes."""
    package = tmp_path / "pkg"
    for room in ("core", "fsdp"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    tests = tmp_path / "tests"
    for folder in ("core", "project", "scenarios", "scripts"):
        (tests / folder).mkdir(parents=True)
        if folder != "scripts":
            (tests / folder / "__init__.py").write_text("")
    for name in ("__init__.py", "conftest.py", "crash_sweep.py", "core/test_a.py", "project/test_layout.py",
                 "scenarios/a_scenarios.py", "scripts/train.py"):
        (tests / name).write_text("")
    assert misplaced_tests(tests, package) == []

    (tests / "test_flat.py").write_text("")  # a test directly under tests/
    (tests / "weights").mkdir()  # a folder naming no subpackage
    (tests / "weights" / "__init__.py").write_text("")
    (tests / "fsdp").mkdir()  # a room without __init__.py
    (tests / "fsdp" / "test_b.py").write_text("")
    (tests / "core" / "_helper.py").write_text("")  # a helper in a room
    (tests / "scenarios" / "test_c.py").write_text("")  # a test among the scenarios
    (tests / "core" / "deeper").mkdir()  # a folder below a room that the room's subpackage does not have
    (tests / "core" / "deeper" / "__init__.py").write_text("")
    found = misplaced_tests(tests, package)
    expected = ["tests/test_flat.py:", "tests/weights/: names no subpackage of pkg", "tests/fsdp/: no __init__.py",
                "tests/core/_helper.py: not a test", "tests/scenarios/test_c.py: a test in scenarios/",
                "tests/core/deeper/: names no subpackage of pkg"]
    assert [message for message in expected if not any(line.startswith(message) for line in found)] == [], found
    assert len(found) == len(expected), found


def test_the_checks_can_fail() -> None:
    """The graph walk sees a function-level import and resolves relative imports (a guard against a vacuous test)."""
    graph = _graph()
    assert "accelerate_txn.accelerate.patch" in graph["accelerate_txn.accelerate.autopatch"]  # function-level
    assert "accelerate_txn.core.manifest" in graph["accelerate_txn.core.select"]
    assert _part("accelerate_txn.store.base") == "store.base" and _part("accelerate_txn.errors") == "errors"


# --- One transaction, front ends side by side (issue 44) ---------------------------------------------------------------

FRONT_ENDS = ("accelerate", "trainer")
#: The steps of the save transaction (``core/transaction.py`` and the core and store functions it runs): a front end
#: never runs one itself, nor imports one by name.
TRANSACTION_STEPS = frozenset({
    "hash_rows", "complete_rows", "carry_user_files", "find_user_files", "carry_files", "recover_replaced",
    "remove_leftovers", "staging_leftovers", "fsync_directories", "replace_directory", "prune", "StagedDirectory",
    "DirectoryLock",
})
#: Defined in ``core`` only: the transaction and its collective steps.
CORE_ONLY = frozenset({"Transaction", "Reservation", "own_rows", "retain", "prune_outside_a_save"})
#: Top-level names both front ends define, each its own face of something shared (anything else defined in both is
#: a step written twice: move it below them, into ``core`` or ``runtime``).
BOTH_FRONT_ENDS = {
    "install", "uninstall", "installed", "_protected",  # each front end's wrapt patch of its own targets
    "install_on_import", "_install_patch",  # each its own import hook target (``compat.hooks`` is the shared hook)
    "transaction", "_publish",  # each front end's Terms and manifest fields of the one core transaction
    "protection",  # each front end's answer to ``accelerate_txn.protection()`` (``runtime.protection.Protection``)
    "backend", "describe",  # the distributed type, the configuration descriptor: of an Accelerator, of a Trainer
    "_verify",  # the verification of a load (Accelerate's component rules) and of a resume (Trainer's layout)
    "order_record", "_length",  # the data order of prepared loaders, of the Trainer's sampler
}


def _front_end_findings(module: str, path: Path) -> list[str]:
    """What ``module`` (a front end's) does against the one transaction: a reservation class of its own, a core-only
    name defined, a transaction step or a store implementation imported by name."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in CORE_ONLY:
            found.append(f"{module}:{node.lineno}: defines {node.name} (core/transaction.py's)")
        if isinstance(node, ast.ClassDef):
            methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
            if {"open", "publish"} <= methods:
                found.append(f"{module}:{node.lineno}: class {node.name} reserves and publishes itself")
    for target, name, line in _imports(module, path):
        if name in TRANSACTION_STEPS:
            found.append(f"{module}:{line}: imports the transaction step {name} from {target}")
        store = target if name is None else f"{target}.{name}"
        if (store.startswith(f"{NAME}.store.") and store.split(".")[2] != "base"
                and f"{NAME}.store.{store.split('.')[2]}" in MODULES):
            found.append(f"{module}:{line}: imports the store implementation {store} (use store.local_store())")
    return found


def test_the_save_transaction_is_written_once_and_no_front_end_imports_a_store_implementation() -> None:
    offenders = [finding for module, path in MODULES.items() if _part(module) in FRONT_ENDS
                 for finding in _front_end_findings(module, path)]
    assert offenders == [], "The transaction is core/transaction.py's:\n" + "\n".join(offenders)
    defined: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if _part(module) in FRONT_ENDS:
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    defined.setdefault(node.name, set()).add(_part(module))
    twice = sorted(name for name, parts in defined.items() if len(parts) > 1 and name not in BOTH_FRONT_ENDS)
    assert twice == [], f"Defined in both front ends (written twice; move it into core/ or runtime/): {twice}"


def test_the_trainer_front_end_imports_nothing_of_the_accelerate_front_end() -> None:
    offenders = [f"{module}:{line}: imports {target}" for module, path in MODULES.items() if _part(module) == "trainer"
                 for target, _name, line in _imports(module, path) if _part(target) == "accelerate"]
    assert offenders == [], "\n".join(offenders)


def test_the_transaction_checks_can_fail(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from ..store.posix import POSIX\nfrom ..core.carry import carry_user_files\n"
                     "class Reservation:\n    def open(self): ...\n    def publish(self): ...\n", encoding="utf-8")
    findings = _front_end_findings(f"{NAME}.accelerate.probe", probe)
    assert len(findings) == 4, findings  # a store implementation, a step, a core-only name, a class publishing itself
    assert "transaction" in BOTH_FRONT_ENDS and {"Transaction", "own_rows", "retain"} <= CORE_ONLY
