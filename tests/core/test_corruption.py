"""The corruption suite (issue 7): every file class of a real 2-rank FSDP1 checkpoint x every kind of damage,
under the default integrity mode.

One launched process group saves once and tries ``load_state`` on many damaged copies (tests/scenarios/corruption_scenarios
.py); each refusal must be a :class:`CheckpointIntegrityError`, the same on every rank, raised before anything
changed: parameters, optimizer state, scheduler, gradient scaler, global RNG (torch, Python, NumPy), the registered
custom object, the registered private state and ``Accelerator.step`` are compared before and after on each rank.
The damaged copies stay on disk for the CLI checks. A second group checks automatic selection, legacy and staging
directories, and a flipped byte in a payload over 16 MiB.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.cli import main as cli
from accelerate_txn.core.manifest import read_manifest, verify_manifest
from accelerate_txn.testing import launch
from tests.scenarios import corruption_scenarios as scenarios

pytestmark = pytest.mark.distributed
TIMEOUT = 420
CASES = [name for name, _ in scenarios._cases()]
CRAFTED = [name for name in CASES if name.startswith("crafted-")]
# Damaged with the manifest rewritten to match the damaged bytes: only reading the files can tell.
MATCHING = CRAFTED + [name for name in CASES if name.startswith("matching-") or name == "metadata_names_outside"]
REFUSED = [name for name in CASES if name not in MATCHING]
ACCEPTED = list(scenarios.EXTRA_IGNORED)
COMPONENTS = ["parameters", "optimizer", "scheduler", "scaler", "rng", "custom object", "private state", "step"]

# What each refusal says (the first check that sees the damage).
_EXPECTED = {
    "truncate": r"has \d+ bytes; the manifest recorded \d+",
    "flip": r"does not match its xxh3_128|Unreadable DCP metadata|describes other tensors",
    "delete": r"is missing",
    "symlink": r"symbolic link",
}
_EXPECTED_MANIFEST = {
    "truncate": r"Unreadable checkpoint manifest",
    "flip": r"Unreadable checkpoint manifest",
    "delete": r"no completion manifest and allow_legacy=False",
    "symlink": r"checkpoint_manifest\.json.*symbolic link",
}


def _expected(case: str) -> str:
    if case.startswith("extra_") or case.startswith("manifest_omits_"):
        return r"is not in the inventory of .*, but a loader would read it"
    if case == "metadata_names_outside":
        return r"points outside its checkpoint directory"
    if case.startswith("matching-truncated-"):
        return r"Unreadable checkpoint file .*" + re.escape(case.removeprefix("matching-truncated-"))
    if case == "model_dir-symlink":
        return r"pytorch_model_fsdp_0 is a symbolic link"
    if case.startswith("crafted-"):
        return r"Unreadable (checkpoint file|DCP metadata) .*(weights_only=True|is not allowed in DCP metadata)"
    prefix, kind = case.rsplit("-", 1)
    return (_EXPECTED_MANIFEST if prefix == "manifest" else _EXPECTED)[kind]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: Any) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("corruption")
    return root, launch("tests.scenarios.corruption_scenarios:corruption_matrix", 2, args=(str(root),), timeout=TIMEOUT)


def test_the_checkpoint_holds_every_file_class(matrix: tuple[Path, list]) -> None:
    _, observations = matrix
    listing = set(observations[0]["listing"])
    assert set(scenarios.FILES.values()) <= listing, sorted(set(scenarios.FILES.values()) - listing)
    assert observations[0]["components"] == COMPONENTS


@pytest.mark.parametrize("case", REFUSED + MATCHING)
def test_damaged_copy_is_refused_on_every_rank_before_anything_changes(matrix: tuple[Path, list], case: str) -> None:
    _, observations = matrix
    results = [obs["cases"][case] for obs in observations]
    for rank, result in enumerate(results):
        # Every compared component differed from the saved state before the load: a mutation would show.
        assert result["same_as_saved"] == [], f"rank {rank}: precondition: {result['same_as_saved']} already equal"
        error = result["error"]
        assert error is not None, f"rank {rank}: the damaged copy {case} was loaded"
        assert error["type"] == "CheckpointIntegrityError", error
        assert re.search(_expected(case), error["message"]), error["message"]
        assert "weights_only=False" not in error["message"]  # never pass on torch's advice to unpickle fully
        assert result["changed"] == [], f"rank {rank}: {result['changed']} changed before the refusal"
        assert result["marked_failed"] is False  # refused in the preflight, not part-way through a restore
    assert results[0]["error"] == results[1]["error"]  # the same error on every rank


def test_crafted_pickles_never_run_their_code(matrix: tuple[Path, list]) -> None:
    root, observations = matrix
    markers = root / "markers"
    assert all(obs["markers"] == [] for obs in observations)
    assert not markers.exists() or not list(markers.iterdir())
    # Control: the crafted files are live exploits (a plain unpickling runs them), so the check above can fail.
    for relative in scenarios.CRAFTED_FILES:
        path = root / "cases" / f"crafted-{relative.replace('/', '_')}" / relative
        if path.name == ".metadata":
            with path.open("rb") as stream:
                pickle.load(stream)  # what DCP's own reader does
        else:
            torch.load(path, weights_only=False)  # what native Accelerate does for custom objects
        marker = markers / relative.replace("/", "_")
        assert marker.is_dir(), f"the crafted {relative} did not run its code"
        marker.rmdir()  # leave no marker behind for the other checks


@pytest.mark.parametrize("case", ACCEPTED)
def test_unlisted_file_no_loader_reads_is_accepted_and_restores_exactly(matrix: tuple[Path, list], case: str) -> None:
    root, observations = matrix
    for obs in observations:
        result = obs["cases"][case]
        assert result["error"] is None, result["error"]
        assert result["restored_differences"] == []
        assert result["changed"] == COMPONENTS  # the load restores every compared component
    directory = root / "cases" / case
    report = verify_manifest(directory, read_manifest(directory), full=True)
    assert report["extra"] == [scenarios.EXTRA_IGNORED[case]]


def test_manifest_less_copy_loads_by_default_with_a_warning_after_checking_every_file(matrix: tuple[Path, list]) -> None:
    _, observations = matrix
    assert observations[0]["legacy_default"]["warned"]  # rank 0 warns
    for obs in observations:
        assert obs["legacy_default"]["error"] is None
        assert obs["legacy_default"]["restored_differences"] == []


def _verify(capsys: Any, *argv: str) -> int:
    status = cli(["verify", *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return status


@pytest.mark.parametrize("case", REFUSED + ACCEPTED)
def test_verify_full_exit_code(matrix: tuple[Path, list], capsys: Any, case: str) -> None:
    root, _ = matrix
    expected = 0 if case in ACCEPTED else 1
    assert _verify(capsys, str(root / "cases" / case), "--full") == expected


@pytest.mark.parametrize("case", [c for c in MATCHING if c.endswith(".metadata") or c == "metadata_names_outside"])
def test_verify_dcp_refuses_crafted_dcp_metadata(matrix: tuple[Path, list], capsys: Any, case: str) -> None:
    root, _ = matrix
    assert _verify(capsys, str(root / "cases" / case), "--full", "--dcp") == 1
    assert not (root / "markers").exists() or not list((root / "markers").iterdir())


def test_verify_command_line_in_a_subprocess(matrix: tuple[Path, list]) -> None:
    root, _ = matrix
    for case, expected in (("model_payload_1-flip", 1), ("model_dir-symlink", 1), ("extra_notes", 0)):
        done = subprocess.run([sys.executable, "-m", "accelerate_txn", "verify", str(root / "cases" / case), "--full"],
                              capture_output=True, text=True, timeout=120, cwd=os.getcwd())
        assert done.returncode == expected, (case, done.stdout, done.stderr)
        assert "Traceback" not in done.stdout + done.stderr


@pytest.fixture(scope="module")
def selection(tmp_path_factory: Any) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("selection")
    return root, launch("tests.scenarios.corruption_scenarios:selection", 2, args=(str(root),), timeout=TIMEOUT)


def _refused_unchanged(observations: list, key: str, pattern: str) -> None:
    for obs in observations:
        error = obs[key]["error"]
        assert error is not None and error["type"] == "CheckpointIntegrityError", error
        assert re.search(pattern, error["message"]), error["message"]
        assert obs[key]["changed"] == []
    assert observations[0][key]["error"] == observations[1][key]["error"]


def test_automatic_selection_skips_a_corrupt_newest_checkpoint_and_restores_the_older_exactly(
        selection: tuple[Path, list]) -> None:
    _, observations = selection
    _refused_unchanged(observations, "explicit_corrupt", r"__1_0\.distcp does not match its xxh3_128")
    for obs in observations:
        assert obs["automatic"]["error"] is None, obs["automatic"]["error"]
        assert obs["automatic"]["restored_differences"] == []  # checkpoint_1, exactly
        assert obs["automatic"]["iteration"] == 3  # the next save goes past the skipped checkpoint_2, never onto it
    assert observations[0]["automatic"]["skipped"]  # rank 0 says why checkpoint_2 was skipped


def test_staging_directory_is_never_loadable(selection: tuple[Path, list]) -> None:
    _, observations = selection
    assert any(".checkpoint_3.staging-" in name for name in observations[0]["run1"])
    for key in ("staging_with_manifest", "staging_without_manifest"):
        _refused_unchanged(observations, key, r"is a staging \(or retired\) directory")
    # Automatic selection ignored the (higher-numbered) staging directories: see the test above (checkpoint_1).


def test_newer_legacy_directories_are_never_preferred_over_a_complete_checkpoint(selection: tuple[Path, list]) -> None:
    _, observations = selection
    _refused_unchanged(observations, "legacy_explicit_half_written", r"scheduler\.bin")
    for obs in observations:
        result = obs["legacy_automatic"]
        assert result["error"] is None, result["error"]
        assert result["restored_differences"] == []  # checkpoint_1 (complete), not checkpoint_3 (legacy, newer)
        assert result["iteration"] == 4  # the next save goes past the legacy checkpoint_2 and checkpoint_3
    assert not observations[0]["legacy_automatic"]["legacy_warning"]


def test_flipped_byte_in_a_payload_over_16_mib_is_refused_by_default(selection: tuple[Path, list], capsys: Any) -> None:
    root, observations = selection
    assert all(obs["wide_shard_bytes"] > 16 * 1024 * 1024 for obs in observations)
    _refused_unchanged(observations, "wide_explicit", r"__1_0\.distcp does not match its xxh3_128")
    for obs in observations:
        assert obs["wide_automatic"]["error"] is None, obs["wide_automatic"]["error"]
        assert obs["wide_automatic"]["restored_differences"] == []  # the older checkpoint_0, exactly
    assert any("does not match its xxh3_128" in m for m in observations[0]["wide_automatic"]["skipped"])
    assert _verify(capsys, str(root / "run3" / "checkpoints" / "checkpoint_1"), "--full") == 1


def test_cli_latest_names_the_checkpoint_load_state_resumes_from(selection: tuple[Path, list], capsys: Any) -> None:
    # load_state() skipped run3's checkpoint_1 (a flipped byte in a payload over 16 MiB) and restored checkpoint_0;
    # `accelerate-txn latest` promises to print the checkpoint load_state() would resume from.
    root, observations = selection
    assert observations[0]["wide_automatic"]["restored_differences"] == []
    status = cli(["latest", str(root / "run3" / "checkpoints")])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert status == 0
    assert captured.out.strip() == str(root / "run3" / "checkpoints" / "checkpoint_0"), captured.out
