"""Saving where something already exists: what native Accelerate overwrites, the library replaces atomically.

Native ``save_state(output_dir)`` writes into an existing directory (a script resumed from ``checkpoint-35`` saves
``checkpoint-40`` again). Importing the library must not turn that into an error: the new checkpoint is published
in its place atomically (``renameat2(RENAME_EXCHANGE)``, or two renames recovered by the next writer), the old one
is deleted only after that, with one warning. What is not a checkpoint is never replaced: through the patch such a
save runs native with a warning; the explicit API refuses it. ``overwrite="refuse"`` keeps the strict refusal.

Kills: a real ``kill -9`` of rank 0 at each instant of a replacement (before the swap, between the fallback's two
renames, after the swap), each followed by a restart that restores exactly what the checkpoint must hold and
whose next save leaves no leftover.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import accelerate_txn
from accelerate_txn import MANIFEST, save_training_checkpoint
from accelerate_txn.core.faults import REPLACE_POINTS
from accelerate_txn.core.select import is_transient, replace_refusal
from accelerate_txn.errors import CheckpointConfigurationError, CheckpointExistsError
from accelerate_txn.store import posix
from accelerate_txn.store.posix import DirectoryLock, recover_replaced, replace_directory
from accelerate_txn.testing import launch
from tests.scenarios.crash_harness import (
    KILLED,
    LAUNCH_TIMEOUT,
    SURVIVOR_TIMEOUT,
    WORLD,
    run_to_completion,
    run_until_crash_point,
)
from tests.scenarios.overwrite_scenarios import USER_FILES
from tests.support.single import stepped_accelerator

# --------------------------------------------------------------------------------------------- the store


def _tree(path: Path, **files: str) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _contents(path: Path) -> dict[str, str]:
    return {entry.name: entry.read_text() for entry in sorted(path.iterdir())}


def test_replace_directory_swaps_in_the_new_tree_and_deletes_the_old(tmp_path: Path) -> None:
    final = _tree(tmp_path / "checkpoint-2", old="1")
    staging = _tree(tmp_path / ".checkpoint-2.staging-ab-cd", new="2")
    replace_directory(staging, final, "cd")
    assert _contents(final) == {"new": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # the old tree is gone, nothing aside


def test_replace_directory_fallback_renames_the_old_tree_aside_first(tmp_path: Path, monkeypatch: Any) -> None:
    # As on a filesystem without renameat2(RENAME_EXCHANGE): the only way to reach the fallback here.
    monkeypatch.setattr(posix, "exchange", lambda _first, _second: False)
    final = _tree(tmp_path / "checkpoint-2", old="1")
    staging = _tree(tmp_path / ".checkpoint-2.staging-ab-cd", new="2")
    seen: dict[str, Any] = {}

    def between() -> None:  # the instant a kill would leave: old aside, final missing, new still staged
        seen["final"] = final.exists()
        seen["aside"] = _contents(tmp_path / ".checkpoint-2.replaced-cd")

    replace_directory(staging, final, "cd", between=between)
    assert seen == {"final": False, "aside": {"old": "1"}}
    assert _contents(final) == {"new": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_recover_replaced_puts_a_missing_checkpoint_back_and_drops_finished_ones(tmp_path: Path) -> None:
    _tree(tmp_path / ".checkpoint-2.replaced-aa", old="1")  # checkpoint-2 missing: a killed replacement
    _tree(tmp_path / "checkpoint-3", new="3")
    _tree(tmp_path / ".checkpoint-3.replaced-bb", old="3")  # checkpoint-3 present: the replacement committed
    with DirectoryLock(tmp_path):
        restored = recover_replaced(tmp_path)
    assert restored == [tmp_path / "checkpoint-2"]
    assert _contents(tmp_path / "checkpoint-2") == {"old": "1"}
    assert _contents(tmp_path / "checkpoint-3") == {"new": "3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".accelerate-txn.lock", "checkpoint-2", "checkpoint-3"]


def test_a_set_aside_tree_is_never_loadable() -> None:
    assert is_transient(Path("/x/.checkpoint-2.replaced-0123abcd"))


def test_replace_refusal_allows_checkpoints_and_refuses_everything_else(tmp_path: Path, monkeypatch: Any) -> None:
    ours = _tree(tmp_path / "ours", **{MANIFEST: "{}"})
    native = _tree(tmp_path / "native", **{"random_states_0.pkl": "x"})
    (tmp_path / "fsdp").mkdir()
    (tmp_path / "fsdp" / "pytorch_model_fsdp_0").mkdir()
    (tmp_path / "empty").mkdir()
    for path in (ours, native, tmp_path / "fsdp", tmp_path / "empty"):
        assert replace_refusal(path) is None, path
    notes = _tree(tmp_path / "notes", **{"a.txt": "1", "b.txt": "2", "c.txt": "3", "d.txt": "4"})
    assert replace_refusal(notes) == "it holds a.txt, b.txt, c.txt and 1 more and none of the files a save_state() writes"
    run = _tree(tmp_path / "run")
    (run / "checkpoint-1").mkdir()
    assert "run directory" in str(replace_refusal(run))
    staged = _tree(tmp_path / "staged")
    (staged / ".checkpoint-1.staging-aa-bb").mkdir()
    assert "run directory" in str(replace_refusal(staged))
    (tmp_path / "file").write_text("x")
    assert replace_refusal(tmp_path / "file") == "it is not a directory"
    (tmp_path / "link").symlink_to(ours)
    assert replace_refusal(tmp_path / "link") == "it is a symbolic link"
    monkeypatch.chdir(native)
    assert replace_refusal(native, {"the working directory": Path.cwd()}) == "it is the working directory"
    assert replace_refusal(tmp_path, {"the working directory": Path.cwd()}).startswith("it contains the working directory")


# --------------------------------------------------------------------------------------------- one process, explicit API


def _accelerator(seed: int = 0, **project: Any) -> tuple[Accelerator, Any, Any]:
    return stepped_accelerator(seed, **project)


def _step(accelerator: Accelerator, model: Any, optimizer: Any) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _transaction(path: Path) -> str:
    import json

    return json.loads((path / MANIFEST).read_text())["transaction_id"]


def test_a_checkpoint_of_this_run_is_replaced_atomically_with_one_warning(tmp_path: Path, caplog: Any) -> None:
    accelerator, model, optimizer = _accelerator()
    target = tmp_path / "checkpoint-2"
    save_training_checkpoint(accelerator, target)
    first = _transaction(target)
    _step(accelerator, model, optimizer)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        save_training_checkpoint(accelerator, target)
    replacing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Replacing")]
    assert replacing == [f"Replacing {target} (a checkpoint of this run): the new checkpoint is published atomically "
                         "in its place, and the old one is deleted only after that"]
    assert _transaction(target) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".accelerate-txn.lock", "checkpoint-2"]
    fresh, model2, _ = _accelerator(seed=5)
    accelerate_txn.load_training_checkpoint(fresh, target)
    assert all(torch.equal(expected[name], p) for name, p in model2.named_parameters())


def test_an_asynchronous_save_replaces_in_the_background_the_same_way(tmp_path: Path, caplog: Any) -> None:
    accelerator, model, optimizer = _accelerator()
    accelerate_txn.configure_checkpointing(accelerator, async_save=True)
    target = tmp_path / "checkpoint-1"
    save_training_checkpoint(accelerator, target)
    accelerate_txn.wait_for_checkpoint(accelerator)
    first = _transaction(target)
    _step(accelerator, model, optimizer)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        save_training_checkpoint(accelerator, target)
        accelerate_txn.wait_for_checkpoint(accelerator)
    assert any(r.getMessage().startswith(f"Replacing {target} (a checkpoint of this run)") for r in caplog.records)
    assert _transaction(target) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".accelerate-txn.lock", "checkpoint-1"]
    fresh, model2, _ = _accelerator(seed=5)
    accelerate_txn.load_training_checkpoint(fresh, target)
    assert all(torch.equal(expected[name], p) for name, p in model2.named_parameters())


@pytest.mark.parametrize("kind", ["native", "empty", "unreadable manifest"])
def test_a_native_checkpoint_or_an_empty_directory_is_replaced(tmp_path: Path, caplog: Any, kind: str) -> None:
    target = tmp_path / "checkpoint-1"
    target.mkdir()
    if kind == "native":
        (target / "random_states_0.pkl").write_bytes(b"native")
        (target / "unet_ema").mkdir()  # what a save hook wrote beside it: part of the old checkpoint
    elif kind == "unreadable manifest":
        (target / MANIFEST).write_text("{not json")
    accelerator, _, _ = _accelerator()
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        save_training_checkpoint(accelerator, target)
    words = {"native": "a checkpoint without a manifest (native Accelerate)", "empty": "an empty directory",
             "unreadable manifest": "a directory whose manifest is not readable"}[kind]
    assert any(f"Replacing {target} ({words})" in r.getMessage() for r in caplog.records)
    assert (target / MANIFEST).is_file() and not (target / "unet_ema").exists()
    accelerate_txn.load_training_checkpoint(_accelerator(seed=1)[0], target)  # a complete checkpoint


@pytest.mark.parametrize("kind", ["notes", "file", "link", "run directory", "working directory", "project directory"])
def test_what_is_not_a_checkpoint_is_never_replaced(tmp_path: Path, monkeypatch: Any, kind: str) -> None:
    target = tmp_path / "target"
    project: dict[str, Any] = {}
    if kind == "notes":
        _tree(target, **{"notes.txt": "mine"})
    elif kind == "file":
        target.write_text("mine")
    elif kind == "link":
        _tree(tmp_path / "real", **{"random_states_0.pkl": "x"})
        target.symlink_to(tmp_path / "real")
    elif kind == "run directory":
        _tree(target)
        _tree(target / "checkpoint-1", **{"random_states_0.pkl": "x"})
    elif kind == "working directory":
        _tree(target, **{"random_states_0.pkl": "x"})
        monkeypatch.chdir(target)
    else:
        _tree(target, **{"random_states_0.pkl": "x"})
        project = {"project_dir": str(target)}
    accelerator, _, _ = _accelerator(**project)
    before = set(os.listdir(tmp_path))
    inside = sorted(os.listdir(target)) if target.is_dir() else target.read_text()
    with pytest.raises(CheckpointExistsError, match=rf"Refusing to replace {target}: it "):
        save_training_checkpoint(accelerator, target)
    assert set(os.listdir(tmp_path)) - before <= {".accelerate-txn.lock"}  # nothing staged, nothing set aside
    assert (sorted(os.listdir(target)) if target.is_dir() else target.read_text()) == inside


def test_replacing_a_native_checkpoint_carries_the_users_own_files_outside_the_inventory(
        tmp_path: Path, caplog: Any, capsys: Any) -> None:
    # Regression (issue 34 item 4): the replace deleted files the user had added to a native checkpoint, which native
    # Accelerate (writing into the directory) keeps; the warning did not name them.
    from accelerate_txn.cli import main
    from accelerate_txn.core.manifest import read_manifest, verify_manifest

    accelerator, model, optimizer = _accelerator()
    target = tmp_path / "checkpoint-3"
    accelerator.save_state(str(target))  # one process, no protect="all": native Accelerate, no manifest
    assert not (target / MANIFEST).exists() and (target / "random_states_0.pkl").is_file()
    (target / "eval_samples").mkdir()
    (target / "eval_samples" / "sample_0.txt").write_text("old sample 0")  # the new save writes it again: it wins
    (target / "eval_samples" / "predictions.pt").write_bytes(b"old payload")  # stale beside the new save's files
    (target / "eval_samples" / "sample_1.txt").write_text("sample 1")
    (target / "NOTES.md").write_text("my notes")
    (target / "custom_checkpoint_4.pkl").write_bytes(b"stale")  # native layout: the old checkpoint's, never carried
    (target / "pytorch_model_fsdp_0").mkdir()
    (target / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"stale shard")  # native layout too

    def hook(_models: Any, _weights: Any, output_dir: str) -> None:  # a save hook writing eval samples of its own
        (Path(output_dir) / "eval_samples").mkdir()
        (Path(output_dir) / "eval_samples" / "sample_0.txt").write_text("new sample 0")

    accelerator.register_save_state_pre_hook(hook)
    _step(accelerator, model, optimizer)
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        save_training_checkpoint(accelerator, target)
    replacing = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Replacing")]
    assert replacing == [
        f"Replacing {target} (a checkpoint without a manifest (native Accelerate)): the new checkpoint is published "
        "atomically in its place, and the old one is deleted only after that; 4 files in it are not part of the "
        "checkpoint (NOTES.md, eval_samples/predictions.pt, eval_samples/sample_0.txt, eval_samples/sample_1.txt): "
        "they are carried into the new one at the same paths, outside its inventory (its manifest lists them as "
        "user_files), unless the new save writes the same path itself"]
    assert (target / "NOTES.md").read_text() == "my notes"
    assert (target / "eval_samples" / "sample_1.txt").read_text() == "sample 1"
    assert (target / "eval_samples" / "sample_0.txt").read_text() == "new sample 0"  # the new save's own file wins
    assert not (target / "eval_samples" / "predictions.pt").exists()
    assert not (target / "custom_checkpoint_4.pkl").exists() and not (target / "pytorch_model_fsdp_0").exists()
    manifest = read_manifest(target)
    assert manifest["user_files"] == {"NOTES.md": {"size": 8}, "eval_samples/sample_1.txt": {"size": 8}}
    assert "eval_samples/sample_0.txt" in manifest["files"] and "NOTES.md" not in manifest["files"]
    report = verify_manifest(target, manifest, full=True, dcp=False)
    assert report["user_files"] == ["NOTES.md", "eval_samples/sample_1.txt"] and report["extra"] == []
    # Not checkpoint content: edited or deleted later, the checkpoint still verifies and loads.
    (target / "NOTES.md").write_text("my notes, edited")
    (target / "eval_samples" / "sample_1.txt").unlink()
    verify_manifest(target, manifest, full=True, dcp=False)
    accelerate_txn.load_training_checkpoint(_accelerator(seed=3)[0], target)
    assert main(["inspect", str(target)]) == 0
    shown = capsys.readouterr().out
    assert "2 user files carried from the checkpoint this one replaced" in shown
    assert "  NOTES.md (" in shown and "  eval_samples/sample_1.txt (" in shown
    # Replaced again (now a protected checkpoint): what is outside its inventory is carried again.
    (target / "eval_samples" / "sample_1.txt").write_text("sample 1 again")
    save_training_checkpoint(accelerator, target)
    assert sorted(read_manifest(target)["user_files"]) == ["NOTES.md", "eval_samples/sample_1.txt"]
    assert (target / "NOTES.md").read_text() == "my notes, edited"


def test_a_user_file_that_cannot_be_carried_keeps_the_checkpoint_from_being_replaced(tmp_path: Path) -> None:
    accelerator, _, _ = _accelerator()
    target = tmp_path / "checkpoint-1"
    save_training_checkpoint(accelerator, target)
    (target / "data").symlink_to(tmp_path)  # a checkpoint holds no symbolic link: carrying it is impossible
    before = _transaction(target)
    with pytest.raises(CheckpointExistsError, match=rf"Refusing to replace {target}: it holds data beside the "
                       r"checkpoint: not a regular file \(a symbolic link, or nested too deep\)"):
        save_training_checkpoint(accelerator, target)
    assert _transaction(target) == before and (target / "data").is_symlink()


def test_a_user_files_entry_never_admits_a_file_a_checkpoint_loader_reads(tmp_path: Path) -> None:
    from accelerate_txn.core.manifest import read_manifest, verify_manifest
    from accelerate_txn.errors import CheckpointIntegrityError

    accelerator, _, _ = _accelerator()
    target = tmp_path / "checkpoint-1"
    save_training_checkpoint(accelerator, target)
    manifest = read_manifest(target)
    (target / "custom_checkpoint_0.pkl").write_bytes(b"planted")  # where load_state looks
    manifest["user_files"] = {"custom_checkpoint_0.pkl": {"size": 7}}
    with pytest.raises(CheckpointIntegrityError, match=r"custom_checkpoint_0\.pkl is not in the inventory"):
        verify_manifest(target, manifest, full=False, dcp=False)
    (target / "custom_checkpoint_0.pkl").unlink()
    manifest["user_files"] = {"random_states_0.pkl": {"size": 1}}  # an inventory file claimed as the user's
    with pytest.raises(CheckpointIntegrityError, match=r"malformed user_files entry for .random_states_0\.pkl."):
        verify_manifest(target, manifest, full=False, dcp=False)


def test_list_shows_a_set_aside_checkpoint_and_inspect_refuses_it(tmp_path: Path, capsys: Any) -> None:
    import json

    from accelerate_txn.cli import main

    accelerator, _, _ = _accelerator()
    for number in (1, 2):
        save_training_checkpoint(accelerator, tmp_path / f"checkpoint-{number}")
    os.rename(tmp_path / "checkpoint-2", tmp_path / ".checkpoint-2.replaced-00ff")  # a kill between the two renames
    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[".checkpoint-2.replaced-00ff"]["status"] == "replaced leftover"
    assert "checkpoint-2 is missing (the next save puts it back)" in rows[".checkpoint-2.replaced-00ff"]["reason"]
    assert rows["checkpoint-1"]["would_load"]
    assert main(["inspect", str(tmp_path / ".checkpoint-2.replaced-00ff")]) != 0
    assert "never a loadable checkpoint" in capsys.readouterr().err
    save_training_checkpoint(accelerator, tmp_path / "checkpoint-3")  # the next save puts checkpoint-2 back
    assert sorted(p.name for p in tmp_path.iterdir()) == [".accelerate-txn.lock", "checkpoint-1", "checkpoint-2",
                                                          "checkpoint-3"]
    accelerate_txn.load_training_checkpoint(_accelerator(seed=2)[0], tmp_path / "checkpoint-2")


def test_overwrite_refuse_keeps_the_strict_refusal(tmp_path: Path) -> None:
    accelerator, _, _ = _accelerator()
    save_training_checkpoint(accelerator, tmp_path / "checkpoint-1")
    before = _transaction(tmp_path / "checkpoint-1")
    accelerate_txn.configure_checkpointing(accelerator, overwrite="refuse")
    with pytest.raises(CheckpointExistsError, match=r"Refusing to overwrite .*checkpoint-1: it already exists.*"
                                                    r"overwrite='replace'"):
        save_training_checkpoint(accelerator, tmp_path / "checkpoint-1")
    assert _transaction(tmp_path / "checkpoint-1") == before
    other, _, _ = _accelerator(seed=3)  # a new run in the same directory
    accelerate_txn.configure_checkpointing(other, overwrite="refuse")
    with pytest.raises(CheckpointExistsError, match=r"holds checkpoints of another training run"):
        save_training_checkpoint(other, tmp_path / "checkpoint-2")
    assert not (tmp_path / "checkpoint-2").exists()
    with pytest.raises(CheckpointConfigurationError, match=r"overwrite='sometimes'.*use 'replace'"):
        accelerate_txn.configure_checkpointing(accelerator, overwrite="sometimes")


def test_automatic_naming_refuses_an_existing_directory_as_native_does(tmp_path: Path) -> None:
    accelerator, _, _ = _accelerator(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    (tmp_path / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    with pytest.raises(CheckpointExistsError, match=r"checkpoint_0: it already exists.*iteration past it"):
        save_training_checkpoint(accelerator)
    assert list((tmp_path / "checkpoints" / "checkpoint_0").iterdir()) == []


def test_saving_beside_another_runs_checkpoints_warns_once_and_retention_keeps_them(tmp_path: Path,
                                                                                   caplog: Any) -> None:
    first, _, _ = _accelerator()
    save_training_checkpoint(first, tmp_path / "checkpoint-1")
    second, _, _ = _accelerator(seed=3)  # a new run: it never loaded from this directory
    with caplog.at_level(logging.WARNING, logger="accelerate_txn"):
        for number in (2, 3, 4):
            save_training_checkpoint(second, tmp_path / f"checkpoint-{number}", checkpoint_limit=2)
    beside = [r.getMessage() for r in caplog.records if "also holds checkpoints of another training run" in r.getMessage()]
    assert len(beside) == 1 and "retention (total_limit) prunes only this run's checkpoints" in beside[0]
    # Retention pruned the second run's oldest, never the first run's checkpoint.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "checkpoint-1", "checkpoint-3", "checkpoint-4"]


# --------------------------------------------------------------------------------------------- 2 ranks, through the patch

pytestmark = pytest.mark.timeout(int(7 * (LAUNCH_TIMEOUT + SURVIVOR_TIMEOUT)) + 60)


@pytest.mark.distributed
def test_resumed_run_replaces_a_newer_checkpoint_and_a_foreign_directory_runs_native(tmp_path: Path) -> None:
    results = launch("tests.scenarios.overwrite_scenarios:replace_and_fall_back", 2, args=(str(tmp_path),), timeout=600)
    for rank, obs in enumerate(results):
        # Native would overwrite checkpoint-2: the library replaces it, exactly, with no leftover and no warning
        # on the warnings channel (the replacement is logged).
        assert obs["replace_error"] is None, obs["replace_error"]
        assert obs["replace_warnings"] == []
        assert obs["replaced_transaction_changed"]
        assert obs["listing_after_replace"] == [".accelerate-txn.lock", "checkpoint-1", "checkpoint-2"]
        assert obs["replaced_differences"] == [], obs["replaced_differences"]
        # A directory of someone's files: native writes into it (one warning per save), the files stay.
        assert obs["foreign_error"] is None, obs["foreign_error"]
        assert len(obs["foreign_warnings"]) == 1 and "runs native Accelerate, UNPROTECTED" in obs["foreign_warnings"][0]
        assert "is not a checkpoint directory (it holds README.txt" in obs["foreign_warnings"][0]
        assert obs["foreign_notes_kept"]
        assert MANIFEST not in obs["foreign_listing"] and "random_states_0.pkl" in obs["foreign_listing"]
        assert not [name for name in obs["foreign_listing_parent"] if is_transient(Path(name))]
        # The strict opt-in: refused on every rank, the checkpoint untouched.
        assert obs["refused"]["type"] == "CheckpointExistsError", obs["refused"]
        assert "Refusing to overwrite" in obs["refused"]["message"]
        assert obs["refused_untouched"]
        assert obs["listing_after_refusal"] == obs["listing_after_replace"], rank
        # Issue 34 item 4: a native checkpoint with the user's files in it, saved again through the library: the
        # files are carried into the new checkpoint, outside its inventory, and the warning names them.
        assert obs["native_manifest"] is False and obs["carry_error"] is None, obs["carry_error"]
        assert obs["carried"] == USER_FILES, obs["carried"]
        assert obs["carried_listed"] == {name: {"size": len(text)} for name, text in USER_FILES.items()}
        assert obs["carried_in_inventory"] == []
    warning = results[0]["carry_warnings"]
    assert len(warning) == 1 and ("2 files in it are not part of the checkpoint (NOTES.md, eval_samples/sample_0.txt): "
                                  "they are carried into the new one at the same paths") in warning[0], warning


# Each job restarts from the previous kill (loads what checkpoint-1 must hold, saves a new checkpoint, which also
# puts back a checkpoint whose replacement was killed between the two renames), then replaces checkpoint-1 and is
# killed there. (kill point, two-rename fallback, what checkpoint-1 holds after the kill, loads first)
KILLS = (
    ("save:replace-before-swap", False, "old"),
    ("save:replace-after-swap", False, "new"),
    ("save:replace-before-swap", True, "old"),
    ("save:replace-old-aside", True, "old"),
    ("save:replace-after-swap", True, "new"),
)


def _user_files(root: Path) -> dict[str, Any]:
    """What the complete checkpoint-1 holds right after a kill (the old tree set aside between the fallback's two
    renames, which the next writer puts back): the user's files and the transaction its manifest names them in."""
    aside = sorted(root.glob(".checkpoint-1.replaced-*"))
    where = root / "checkpoint-1" if (root / "checkpoint-1").is_dir() else aside[-1]
    manifest = json.loads((where / MANIFEST).read_text())
    return {"contents": {name: (where / name).read_text() for name in USER_FILES if (where / name).is_file()},
            "listed": sorted(manifest.get("user_files", {})), "transaction": manifest["transaction_id"]}


@pytest.fixture(scope="module")
def kill_chain(tmp_path_factory: Any) -> list[dict[str, Any]]:
    """Run the chain once: every kill, each followed by the restart that checks it."""
    directory = tmp_path_factory.mktemp("replace_kills")
    root = directory / "run"
    outcomes: list[dict[str, Any]] = []
    holds = "c1-0"  # the label of the state checkpoint-1 holds
    actions: list[list[str]] = [["save", "checkpoint-0", "c0"], ["save", "checkpoint-1", "c1-0"]]
    for index, (point, fallback, after) in enumerate(KILLS):
        label = f"c1-{index + 1}"
        spec = {"root": str(root), "seed": index, "no_exchange": fallback, "kill": f"{point}@0",
                "actions": [*actions, ["save", "checkpoint-1", label]]}
        kill = run_until_crash_point(spec, directory, f"kill{index}", whole_job=False,
                                     entry="tests.scenarios.overwrite_scenarios")
        listing = sorted(p.name for p in root.iterdir())
        outcomes.append({"point": point, "fallback": fallback, "kill": kill, "listing": listing,
                         "expected": label if after == "new" else holds, "user_files": _user_files(root)})
        holds = outcomes[-1]["expected"]
        # The next job restarts: its first save (a new name) takes the lock and cleans up; then checkpoint-1 loads.
        actions = [["load", "checkpoint-0", "c0"], ["save", f"checkpoint-{10 + index}", f"c{10 + index}"],
                   ["load", "checkpoint-1", holds]]
    final = run_to_completion({"root": str(root), "seed": 99, "actions": actions}, directory, "final",
                              entry="tests.scenarios.overwrite_scenarios")
    for index, outcome in enumerate(outcomes):
        outcome["restart"] = outcomes[index + 1]["kill"] if index + 1 < len(outcomes) else final
    return outcomes


def test_every_replace_crash_point_is_killed() -> None:
    assert sorted({point for point, _fallback, _after in KILLS}) == sorted(REPLACE_POINTS)


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(KILLS)), ids=[f"{p}{'-fallback' if f else ''}" for p, f, _ in KILLS])
def test_kill_9_while_replacing_then_restart_restores_exactly_and_leaves_nothing(
        kill_chain: list[dict[str, Any]], index: int) -> None:
    outcome = kill_chain[index]
    kill = outcome["kill"]
    # Rank 0 died by SIGKILL at the point; rank 1 failed on its own (no hang).
    assert kill.first_dead == 0 and kill.returncodes[0] == KILLED, kill.describe()
    assert not kill.survivors_killed and kill.survivors_exited.get(1, 0) != 0, kill.describe()
    listing = outcome["listing"]
    if outcome["point"] == "save:replace-old-aside":
        # Between the two renames: the complete old checkpoint is aside, under a name nothing loads.
        assert "checkpoint-1" not in listing and any(n.startswith(".checkpoint-1.replaced-") for n in listing), listing
    else:
        assert "checkpoint-1" in listing, listing
    # Issue 34 item 4: whichever checkpoint-1 the kill left complete (the old one, or the new one that replaced it)
    # holds the user's files added beside it before the save; the new one lists them in its manifest.
    assert outcome["user_files"]["contents"] == USER_FILES, outcome["user_files"]
    if outcome["point"] == "save:replace-after-swap":
        assert outcome["user_files"]["listed"] == sorted(USER_FILES), outcome["user_files"]
    # The restart: checkpoint-0 and the checkpoint-1 it must hold (the old one unless the swap happened) restore
    # exactly on every rank; after its save, no staging, set-aside or retired directory is left.
    restart = outcome["restart"]
    for rank in range(WORLD):
        obs = restart.obs[rank]
        assert obs.get("loads", {}).get("checkpoint-1") == [], (outcome["expected"], restart.describe())
        assert obs["loads"]["checkpoint-0"] == []
    after = restart.obs[0]["listings"][f"checkpoint-{10 + index}"]
    assert not [name for name in after if is_transient(Path(name))], after
    assert "checkpoint-1" in after
