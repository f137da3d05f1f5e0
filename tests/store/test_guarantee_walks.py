"""Every walk over a tree the library did not create is iterative: a directory nested far deeper than Python's
recursion limit (1,100 levels here; the limit is 1,000) inside a checkpoint or a leftover never raises
``RecursionError``.

Regression (issue "The guarantee under operators, teardown and odd environments", item 2): ``list_tree`` recursed once
per level, ``fsync_tree`` and the save's directory fsync used ``os.walk`` (recursive on Python 3.10/3.11), cleanup and
retention used ``shutil.rmtree`` (recursive before 3.12), and the CLI's size and legacy scans used ``os.walk``. So
automatic ``load_training_checkpoint`` failed on every rank instead of skipping the candidate, ``accelerate-txn
list/latest/verify/prune`` printed tracebacks, and one deep staging leftover made every later save fail.

A checkpoint nested deeper than 64 levels is now refused by ``list_tree`` with an integrity error naming the path,
so selection skips it with its reason. Checkpoints are real protected saves of a single-process Accelerator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from accelerate_txn import CheckpointIntegrityError, load_training_checkpoint, save_training_checkpoint
from accelerate_txn.accelerate.selection import checkpoint_candidates, latest_training_checkpoint
from accelerate_txn.core.manifest import MANIFEST, list_tree, read_manifest, verify_manifest
from accelerate_txn.core.select import complete_run_id
from accelerate_txn.store.posix import fsync_tree, remove_leftovers, retire, retired_leftovers, staging_leftovers
from tests.accelerate.test_save_single import _accelerator

REPO = Path(__file__).resolve().parents[2]
DEEP = 1100  # levels: past the interpreter's recursion limit (1000 on CPython)


def nest(base: Path, levels: int, name: str = "d", *, files: int = 0) -> None:
    """``levels`` directories named ``name``, each inside the previous one, below ``base`` (created relative to an
    open directory, so no path is ever formed); with ``files``, that many 10-byte ``notes.txt``, one every
    ``levels // files`` levels."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(levels):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            step = max(1, levels // files) if files else 0
            if files and level % step == 0 and level // step < files:
                note = os.open("notes.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(note, b"x" * 10)
                os.close(note)
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _remove_deep_trees(tmp_path: Path) -> Iterator[None]:
    """pytest's own cleanup of old temporary directories uses shutil.rmtree, which recurses: remove what a test
    left with ``rm -rf`` (iterative) so no later session trips over it."""
    yield
    for entry in tmp_path.iterdir():
        subprocess.run(["rm", "-rf", str(entry)], check=True, timeout=120)


def _trainer(project_dir: Path | None = None, seed: int = 0) -> tuple[Accelerator, torch.nn.Module]:
    accelerator, model, _optimizer = _accelerator(project_dir, seed)
    return accelerator, model


def _cli(*args: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "accelerate_txn", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr, done.stderr[-3000:]
    return done


@pytest.fixture
def deep_run(tmp_path: Path) -> tuple[Path, Accelerator]:
    """checkpoint_0 complete; checkpoint_1 complete but with a directory nested DEEP levels inside (files at a few
    levels), so it no longer is."""
    root = tmp_path / "run"
    accelerator, _model = _trainer()
    for number in range(2):
        save_training_checkpoint(accelerator, root / f"checkpoint_{number}")
    nest(root / "checkpoint_1", DEEP, files=5)
    return root, accelerator


# --------------------------------------------------------------------------------------------- selection


def test_selection_skips_a_deeply_nested_checkpoint_with_its_reason(deep_run: tuple[Path, Accelerator]) -> None:
    root, accelerator = deep_run
    for owners in (None, accelerator):
        found, reasons = checkpoint_candidates(root, owners)
        assert found == [root / "checkpoint_0"]
        assert len(reasons) == 1 and reasons[0].startswith("checkpoint_1: "), reasons
        assert "nested more than 64 levels" in reasons[0] and str(root / "checkpoint_1" / "d" / "d") in reasons[0]
    assert latest_training_checkpoint(root) == str(root / "checkpoint_0")
    assert latest_training_checkpoint(root, full=True) == str(root / "checkpoint_0")
    with pytest.raises(CheckpointIntegrityError, match=r"nested more than 64 levels deep"):
        verify_manifest(root / "checkpoint_1", read_manifest(root / "checkpoint_1"), full=True, dcp=False)


def test_automatic_restore_skips_a_deeply_nested_checkpoint(tmp_path: Path) -> None:
    saver, model = _trainer(tmp_path)
    save_training_checkpoint(saver)  # checkpoints/checkpoint_0
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    save_training_checkpoint(saver)  # checkpoints/checkpoint_1: the newest
    checkpoints = tmp_path / "checkpoints"
    nest(checkpoints / "checkpoint_1", DEEP)
    resumed, fresh = _trainer(tmp_path, seed=1)
    assert load_training_checkpoint(resumed) == checkpoints / "checkpoint_0"
    assert all(torch.equal(value, expected[name]) for name, value in fresh.state_dict().items())


def test_list_tree_accepts_64_levels_and_refuses_65_naming_the_path(tmp_path: Path) -> None:
    for levels in (64, 65):
        root = tmp_path / f"tree{levels}"
        root.mkdir()
        nest(root, levels, files=2)
        if levels == 64:
            assert len(list_tree(root)) == 2
        else:
            with pytest.raises(CheckpointIntegrityError, match=r"Checkpoint directory .*tree65/d/d/.* is nested more"):
                list_tree(root)


# --------------------------------------------------------------------------------------------- the command line


def test_cli_on_a_deeply_nested_checkpoint_exits_with_documented_codes(deep_run: tuple[Path, Accelerator]) -> None:
    root, _accelerator = deep_run
    listed = _cli("list", root, "--json")
    assert listed.returncode == 0
    entries = {entry["name"]: entry for entry in json.loads(listed.stdout)["checkpoints"]}
    assert entries["checkpoint_1"]["status"] == "corrupt" and "nested more than 64" in entries["checkpoint_1"]["reason"]
    assert entries["checkpoint_0"]["would_load"] and entries["checkpoint_1"]["size_bytes"] > 0
    assert _cli("list", root).returncode == 0
    latest = _cli("latest", root)
    assert latest.returncode == 0 and latest.stdout.strip() == str(root / "checkpoint_0")
    assert "checkpoint_1" in latest.stderr and "nested more than 64" in latest.stderr
    assert _cli("verify", root / "checkpoint_0").returncode == 0
    verify = _cli("verify", root / "checkpoint_1", "--full")
    assert verify.returncode == 1 and "nested more than 64" in verify.stderr
    # A published checkpoint of the run that fails verification: prune refuses (exit 1), deleting nothing.
    for extra in ((), ("--dry-run",)):
        pruned = _cli("prune", root, "--keep", "1", *extra)
        assert pruned.returncode == 1 and "checkpoint_1" in pruned.stderr and "fail verification" in pruned.stderr
    assert sorted(path.name for path in root.iterdir() if not path.name.startswith(".")) == ["checkpoint_0",
                                                                                             "checkpoint_1"]


def test_cli_size_and_legacy_scans_walk_a_deep_manifestless_directory(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "checkpoint_3").mkdir(parents=True)
    nest(root / "checkpoint_3", DEEP, files=3)
    listed = _cli("list", root, "--json")
    assert listed.returncode == 0
    (entry,) = json.loads(listed.stdout)["checkpoints"]
    assert entry["status"] == "corrupt" and entry["size_bytes"] == 30
    verify = _cli("verify", root / "checkpoint_3")
    assert verify.returncode == 1 and "no checkpoint files" in verify.stderr
    latest = _cli("latest", root)
    assert latest.returncode == 1 and "no complete checkpoint" in latest.stderr.lower()


# --------------------------------------------------------------------------------------------- removal and fsync


def test_next_save_removes_deep_staging_and_retired_leftovers(tmp_path: Path) -> None:
    root = tmp_path / "run"
    accelerator, _model = _trainer()
    save_training_checkpoint(accelerator, root / "checkpoint_0")
    save_training_checkpoint(accelerator, root / "checkpoint_1")
    run_id = complete_run_id(root / "checkpoint_0")
    assert run_id is not None
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"k" * 7)
    staging = root / f".checkpoint_5.staging-{run_id}-{'e' * 32}"
    staging.mkdir()
    nest(staging, DEEP, files=4)
    (staging / "link").symlink_to(outside, target_is_directory=True)  # removed itself, never followed
    (staging / "file-link").symlink_to(outside / "keep.bin")
    retired = retire(root / "checkpoint_0", run_id)
    nest(retired, DEEP)
    assert [path for path, _run in staging_leftovers(root)] == [staging] and retired_leftovers(root) == [retired]
    save_training_checkpoint(accelerator, root / "checkpoint_2")  # its cleanup runs under the lock
    assert staging_leftovers(root) == [] and retired_leftovers(root) == []
    assert sorted(path.name for path in root.iterdir() if not path.name.startswith(".")) == ["checkpoint_1",
                                                                                             "checkpoint_2"]
    assert (outside / "keep.bin").read_bytes() == b"k" * 7


def test_remove_leftovers_removes_a_tree_deeper_than_path_max(tmp_path: Path) -> None:
    # 1,500 levels of 3-character names: the deepest path is over 6,000 characters, past PATH_MAX (4096).
    staging = tmp_path / f".checkpoint_1.staging-{'a' * 32}-{'b' * 32}"
    staging.mkdir()
    nest(staging, 1500, name="abc", files=3)
    assert remove_leftovers(tmp_path, None) == [staging]
    assert list(tmp_path.iterdir()) == []


def test_fsync_of_a_deep_staged_tree(tmp_path: Path) -> None:
    from accelerate_txn.store.posix import fsync_directories

    root = tmp_path / "tree"
    root.mkdir()
    nest(root, DEEP, files=4)
    fsync_tree(root)
    fsync_directories(root)
    assert (root / MANIFEST).exists() is False  # untouched: nothing written, nothing removed
    assert len(list(os.scandir(root / "d"))) == 2  # notes.txt and the next level


def test_a_save_whose_hook_writes_a_deep_tree_fails_cleanly_and_leaves_no_staging(tmp_path: Path) -> None:
    # The staged tree is refused before publishing (the published checkpoint would be unselectable), and discarding
    # the staging directory (remove_tree) works at any depth: nothing is left behind.
    from accelerate_txn import CheckpointError

    accelerator, _model = _trainer()
    accelerator.register_save_state_pre_hook(lambda _models, _weights, output_dir: nest(Path(output_dir), DEEP))
    with pytest.raises(CheckpointError, match=r"nested more than 64 levels deep"):
        save_training_checkpoint(accelerator, tmp_path / "run" / "checkpoint_0")
    assert [path.name for path in (tmp_path / "run").iterdir()] == [".accelerate-txn.lock"]


def test_remove_tree_removes_links_themselves_and_never_their_targets(tmp_path: Path) -> None:
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "data.bin").write_bytes(b"d" * 5)
    # A staging leftover that is itself a link to a directory (the name matches; the next save's cleanup runs).
    linked = tmp_path / "run" / f".checkpoint_2.staging-{'a' * 32}-{'c' * 32}"
    linked.parent.mkdir()
    linked.symlink_to(target, target_is_directory=True)
    assert remove_leftovers(linked.parent, None) == [linked]
    assert not linked.is_symlink() and (target / "sub" / "data.bin").read_bytes() == b"d" * 5
    from accelerate_txn.store.posix import remove_tree

    # Links inside a tree: to a directory, to a file, dangling; the tree goes, the targets stay.
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "to-dir").symlink_to(target, target_is_directory=True)
    (tree / "a" / "to-file").symlink_to(target / "sub" / "data.bin")
    (tree / "dangling").symlink_to(tmp_path / "nowhere")
    remove_tree(tree)
    remove_tree(tree)  # already gone: nothing to do
    assert not tree.exists() and (target / "sub" / "data.bin").read_bytes() == b"d" * 5
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    remove_tree(link)  # the link itself
    assert not link.is_symlink() and target.is_dir()
