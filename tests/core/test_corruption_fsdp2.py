"""The corruption suite on FSDP2: every file class of a real 2-rank FSDP2 checkpoint x every kind of damage.

The same matrix as tests/core/test_corruption.py (its cases, its damage, its expectations: each refusal a
:class:`CheckpointIntegrityError`, the same on every rank, raised before anything changed; crafted pickles never
run; unlisted files no loader reads accepted with an exact restore; a manifest-less copy loaded with a warning
after every file was checked), run by one launched process group on Accelerate's FSDP2 (``fsdp_version=2``,
DTensor parameters; ranks: tests/scenarios/corruption_fsdp2.py, which compares each rank's local shards). The tests below
are tests/core/test_corruption.py's own functions (collected here again with this module's ``matrix`` fixture, or called),
so the two suites cannot drift apart. One launch; about 25-30 s on 2 shared CPU cores.

Known failure: the accepted loads after the first hit the FSDP2 gradient-scaler bug that tests/fsdp/test_fsdp2_faults.py
isolates (strict xfail here; remove the marks with the fix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.core.manifest import read_manifest
from accelerate_txn.testing import launch
from tests.core import test_corruption as fsdp1

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: Any) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("corruption_fsdp2")
    return root, launch("tests.scenarios.corruption_fsdp2:corruption_matrix", 2, args=(str(root),), timeout=fsdp1.TIMEOUT)


def test_the_damaged_checkpoint_is_a_protected_fsdp2_checkpoint(matrix: tuple[Path, list]) -> None:
    root, observations = matrix
    for obs in observations:
        assert set(obs["dtensor"]) == {"DTensor"}, obs["dtensor"]
    manifest = read_manifest(root / "good")
    assert manifest is not None  # protected: published with a manifest
    assert [m["fsdp"] for m in manifest["components"][""]["models"]] == [[{"fsdp_version": 2, "mesh": [2]}]]


# tests/core/test_corruption.py's checks of the matrix (parametrized over the same cases), against this module's run.
test_the_checkpoint_holds_every_file_class = fsdp1.test_the_checkpoint_holds_every_file_class
test_damaged_copy_is_refused_on_every_rank_before_anything_changes = (
    fsdp1.test_damaged_copy_is_refused_on_every_rank_before_anything_changes)
test_crafted_pickles_never_run_their_code = fsdp1.test_crafted_pickles_never_run_their_code

# The accepted loads run one after another in one process, so the scaler is initialised by the first: every later
# load exercises the FSDP2 scaler reset (tests/fsdp/test_fsdp2_faults.py).


@pytest.mark.parametrize("case", fsdp1.ACCEPTED)
def test_unlisted_file_no_loader_reads_is_accepted_and_restores_exactly(matrix: tuple[Path, list], case: str) -> None:
    fsdp1.test_unlisted_file_no_loader_reads_is_accepted_and_restores_exactly(matrix, case)


def test_manifest_less_copy_loads_by_default_with_a_warning_after_checking_every_file(matrix: tuple[Path, list]) -> None:
    fsdp1.test_manifest_less_copy_loads_by_default_with_a_warning_after_checking_every_file(matrix)
