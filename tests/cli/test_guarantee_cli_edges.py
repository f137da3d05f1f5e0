"""The command line (and selection) at its edges: a symbolic link named ``checkpoint_N``, and a terminal or pipe that
cannot encode anything but ASCII.

Regressions (issue "The guarantee under operators, teardown and odd environments", item 3):

* ``accelerate-txn list`` read a symlinked ``checkpoint_N`` through the link (its run id, steps and size were the
  target's), ``prune`` took it for a published-but-corrupt checkpoint of the run and refused, and a link to a file or
  a dangling link was not listed at all. A link is now listed as what it is (``corrupt``: "a symbolic link ..."),
  never verified through, counted, selected or deleted through; selection skips it with that reason.
* With an ASCII stdout (``PYTHONIOENCODING=ascii``, e.g. with ``LC_ALL=C``) ``list`` crashed with
  ``UnicodeEncodeError`` on its arrow. Every command now works there, writes only ASCII, and falls back to "->" and
  "..." for its symbols.

Every CLI run here is a real subprocess (``python -m accelerate_txn``) with a hard timeout; checkpoints are real
protected saves of a single-process Accelerator.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from accelerate import Accelerator

from accelerate_txn import load_training_checkpoint, save_training_checkpoint
from accelerate_txn.accelerate.selection import checkpoint_candidates, latest_training_checkpoint
from accelerate_txn.core.select import complete_run_id, prune
from accelerate_txn.store.posix import POSIX, DirectoryLock, retire
from tests.accelerate.test_save_single import _accelerator

REPO = Path(__file__).resolve().parents[2]
RUN_A = "a" * 32


def _trainer(project_dir: Path | None = None, seed: int = 0) -> Accelerator:
    return _accelerator(project_dir, seed)[0]


def _cli(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """``python -m accelerate_txn ARGS`` (bytes out: what the process really wrote)."""
    done = subprocess.run([sys.executable, "-m", "accelerate_txn", *map(str, args)], capture_output=True, timeout=120,
                          cwd=REPO, env=env)
    assert b"Traceback" not in done.stderr and b"UnicodeEncodeError" not in done.stderr, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint_0 and checkpoint_1 of one run (complete), never changed: tests copy it."""
    root = tmp_path_factory.mktemp("pristine") / "run"
    accelerator = _trainer()
    for number in range(2):
        save_training_checkpoint(accelerator, root / f"checkpoint_{number}")
    return root


# --------------------------------------------------------------------------------------------- symbolic links


@pytest.fixture
def linked_run(pristine: Path, tmp_path: Path) -> Path:
    """The run plus links named checkpoint_N: to a checkpoint of the run inside it (5), to a complete copy outside
    it (6), dangling (7), and to a file (8). Every link is newer than every real checkpoint."""
    root = tmp_path / "run"
    shutil.copytree(pristine, root, symlinks=True)
    shutil.copytree(pristine / "checkpoint_1", tmp_path / "elsewhere")
    (tmp_path / "a-file").write_text("not a checkpoint")
    (root / "checkpoint_5").symlink_to("checkpoint_1", target_is_directory=True)
    (root / "checkpoint_6").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "checkpoint_7").symlink_to(tmp_path / "nowhere")
    (root / "checkpoint_8").symlink_to(tmp_path / "a-file")
    return root


LINKS = ("checkpoint_5", "checkpoint_6", "checkpoint_7", "checkpoint_8")


def test_list_shows_a_symlinked_checkpoint_as_a_link_and_reads_nothing_through_it(linked_run: Path) -> None:
    done = _cli("list", linked_run, "--json")
    assert done.returncode == 0
    report = json.loads(done.stdout)
    entries = {entry["name"]: entry for entry in report["checkpoints"]}
    assert report["would_load"] == str(linked_run / "checkpoint_1")
    for name in LINKS:
        entry = entries[name]
        assert entry["status"] == "corrupt" and entry["reason"].startswith("a symbolic link"), entry
        assert entry["run_id"] is None and entry["components"] is None and entry["integrity"] is None, entry
        assert entry["size_bytes"] == 0 and not entry["would_load"], entry
    table = _cli("list", linked_run)
    assert table.returncode == 0 and b"checkpoint_6: a symbolic link" in table.stdout


def test_latest_verify_and_selection_skip_symlinked_checkpoints_with_a_reason(linked_run: Path) -> None:
    latest = _cli("latest", linked_run)
    assert latest.returncode == 0 and latest.stdout.decode().strip() == str(linked_run / "checkpoint_1")
    for name in ("checkpoint_5", "checkpoint_6"):
        assert f"Skipping checkpoint {linked_run / name}: it is a symbolic link".encode() in latest.stderr
    for name in ("checkpoint_5", "checkpoint_6"):
        verify = _cli("verify", linked_run / name, "--full")
        assert verify.returncode == 1 and b"symbolic link" in verify.stderr
    found, reasons = checkpoint_candidates(linked_run)
    assert found == [linked_run / "checkpoint_1", linked_run / "checkpoint_0"]
    assert sorted(reason.split(":")[0] for reason in reasons) == list(LINKS)
    assert all("symbolic link" in reason for reason in reasons)
    assert latest_training_checkpoint(linked_run, full=True) == str(linked_run / "checkpoint_1")


def test_prune_never_counts_or_deletes_through_a_symlinked_checkpoint(linked_run: Path, tmp_path: Path) -> None:
    done = _cli("prune", linked_run, "--keep", "1", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["deleted"] == [str(linked_run / "checkpoint_0")]
    assert report["kept"] == [str(linked_run / "checkpoint_1")]
    assert all((linked_run / name).is_symlink() for name in LINKS)
    assert complete_run_id(linked_run / "checkpoint_1") is not None and complete_run_id(tmp_path / "elsewhere")
    # The library's retention, given a link as "newest", deletes nothing through it either.
    with DirectoryLock(linked_run):
        assert prune(linked_run, complete_run_id(linked_run / "checkpoint_1"), 1, linked_run / "checkpoint_6", store=POSIX) == []
    assert (tmp_path / "elsewhere").is_dir() and (linked_run / "checkpoint_1").is_dir()


def test_automatic_restore_and_saving_ignore_a_symlinked_checkpoint(tmp_path: Path) -> None:
    saver = _trainer(tmp_path)
    save_training_checkpoint(saver)  # checkpoints/checkpoint_0
    checkpoints = tmp_path / "checkpoints"
    other = tmp_path / "other-run"
    save_training_checkpoint(_trainer(seed=3), other)  # another run's complete checkpoint
    (checkpoints / "checkpoint_1").symlink_to(other, target_is_directory=True)
    resumed = _trainer(tmp_path, seed=1)
    assert load_training_checkpoint(resumed) == checkpoints / "checkpoint_0"
    # The link is not a checkpoint of another run in this directory: the next save is not refused because of it.
    published = save_training_checkpoint(resumed)
    assert published.parent == checkpoints and published.name == "checkpoint_2"
    assert (checkpoints / "checkpoint_1").is_symlink() and complete_run_id(other) is not None


# --------------------------------------------------------------------------------------------- ASCII-only streams


def _env(**values: str) -> dict[str, str]:
    base = {key: value for key, value in os.environ.items()
            if not key.startswith("LC_") and key not in ("LANG", "LANGUAGE", "PYTHONIOENCODING", "PYTHONUTF8")}
    return {**base, **values}


ASCII = {"LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
C_LOCALE = {"LC_ALL": "C"}


@pytest.fixture
def messy(pristine: Path, tmp_path: Path) -> Path:
    """Complete checkpoints, a staging leftover and a retired leftover, in a directory with a non-ASCII name."""
    root = tmp_path / "läufe"
    shutil.copytree(pristine, root)
    staging = root / f".checkpoint_3.staging-{RUN_A}-{'b' * 32}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"y" * 7)
    shutil.copytree(root / "checkpoint_0", root / "checkpoint_9")
    retire(root / "checkpoint_9", RUN_A)
    return root


def _commands(root: Path) -> list[tuple[list[Any], int]]:
    """Every command, with its documented exit status on ``root`` (the last one deletes)."""
    staging = next(root.glob(".checkpoint_3.staging-*"))
    first, second = root / "checkpoint_0", root / "checkpoint_1"
    helps = [([command, "--help"], 0) for command in ("list", "verify", "inspect", "diff", "prune", "latest", "export")]
    return [(["--help"], 0), (["--version"], 0), *helps,
            (["list", root], 0), (["list", root, "--json"], 0),
            (["verify", second], 0), (["verify", second, "--full", "--json"], 0), (["verify", staging], 1),
            (["verify", root], 2),
            (["inspect", second], 0), (["inspect", second, "--json"], 0),
            (["diff", first, second], 0), (["diff", first, second, "--json"], 0),
            (["latest", root], 0), (["latest", root, "--json"], 0),
            (["prune", root, "--keep", "1", "--dry-run"], 0), (["prune", root, "--keep", "1"], 0)]


@pytest.mark.parametrize("variables", [ASCII, C_LOCALE], ids=["ascii-stdio", "c-locale"])
def test_every_command_works_on_an_ascii_or_c_locale_stream(messy: Path, variables: dict[str, str]) -> None:
    env = _env(**variables)
    for args, expected in _commands(messy):
        done = _cli(*args, env=env)
        assert done.returncode == expected, (args, done.returncode, done.stderr[-2000:])
        if variables is ASCII:  # the stream asked for ASCII, and gets only ASCII
            done.stdout.decode("ascii")
            done.stderr.decode("ascii")
    assert sorted(path.name for path in messy.iterdir() if not path.name.startswith(".")) == ["checkpoint_1"]


def test_list_on_an_ascii_stream_uses_ascii_symbols_and_escapes_other_characters(messy: Path) -> None:
    text = _cli("list", messy, env=_env(**ASCII)).stdout.decode("ascii")
    (selected,) = [line for line in text.splitlines() if "checkpoint_1 " in line and "complete" in line]
    assert selected.lstrip().startswith("->"), text
    assert ".checkpoint_3.staging-..." in text and ".checkpoint_9.deleting-..." in text
    assert "l\\xe4ufe" in text  # the directory's name, escaped rather than a crash
    unicode = _cli("list", messy, env=_env(**C_LOCALE)).stdout.decode("utf-8")  # UTF-8 mode: the real symbols
    assert "\u2192" in unicode and ".checkpoint_3.staging-\u2026" in unicode and "läufe" in unicode
