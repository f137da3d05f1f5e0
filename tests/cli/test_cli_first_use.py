"""The command line as a new user meets it (issue "First hour of a new user", items 1, 2, 6, 7 and 9).

Regressions:

* A project directory (``runs/exp1`` instead of ``runs/exp1/checkpoints``) was "no checkpoints" (``list``, exit 0),
  exit 1 (``latest``) or "a legacy checkpoint" (``verify``/``inspect``/``diff``): now a usage error (exit 2) naming
  the directory to pass, and so is a directory of runs.
* For a manifest-less (native) checkpoint the CLI said a resume raises ``NoCheckpointError`` while ``load_state()``
  resumed from it: both now answer from ``core.select`` (``legacy_resume``, ``latest_checkpoint``), and a real load
  checks the CLI's statement.
* ``diff`` stopped after 8 differences and cut a long value before the part that differed.
* The manifest recorded only ``accelerator.step`` (0 in an ordinary loop): it now records the optimizer steps taken and
  the checkpoint number, shown by ``list``, ``inspect`` and the save/resume log lines.
* ``prune --dry-run --json`` listed what would go under ``"deleted"``; ``list`` had no colour for ``corrupt``; the
  "Published checkpoint" line was logged by every rank.

Checkpoints are real protected saves (one process, or FSDP1 on two gloo ranks through ``accelerate_txn.testing.launch``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from accelerate_txn import (
    MANIFEST,
    NoCheckpointError,
    configure_checkpointing,
    load_training_checkpoint,
    save_training_checkpoint,
)
from accelerate_txn.core.select import ALLOW_LEGACY_DEFAULT, legacy_resume
from accelerate_txn.store.posix import POSIX
from accelerate_txn.testing import launch

REPO = Path(__file__).resolve().parents[2]


def _trainer(project_dir: Path | None = None, *, steps: int = 3, metadata: dict[str, Any] | None = None,
             seed: int = 0) -> Accelerator:
    """A one-process run that took ``steps`` real Adam steps (automatic naming under ``project_dir``)."""
    project = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True) if project_dir else None
    accelerator = Accelerator(cpu=True, project_config=project)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(steps):
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if metadata is not None:
        configure_checkpointing(accelerator, metadata=metadata)
    return accelerator


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``runs/exp1``: an Accelerate project directory, checkpoints/checkpoint_0 and _1 saved by a real loop (3 Adam
    steps, then 2 more); ``runs/exp2`` a second one. Never changed: tests copy it."""
    runs = tmp_path_factory.mktemp("runs")
    for name in ("exp1", "exp2"):
        trainer = _trainer(runs / name)
        save_training_checkpoint(trainer)
        if name == "exp1":
            model, optimizer = trainer._models[0], trainer._optimizers[0]
            for _ in range(2):
                trainer.backward(model(torch.randn(2, 4)).sum())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            save_training_checkpoint(trainer)
    return runs


# --------------------------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("command", ["list", "latest", "prune", "verify", "inspect", "diff"])
def test_a_project_directory_is_a_usage_error_naming_its_checkpoints_directory(cli: Any, project: Path,
                                                                              command: str) -> None:
    exp1 = project / "exp1"
    args = {"prune": [exp1, "--keep", "1"], "diff": [exp1, exp1 / "checkpoints" / "checkpoint_0"]}.get(command, [exp1])
    result = cli(command, *args)
    assert result.code == 2, (command, result.code, result.out, result.err)
    assert f"checkpoints are in {exp1 / 'checkpoints'}" in result.err
    suggested = command if command in ("list", "latest", "prune") else "list"  # a checkpoint command: see the run
    assert f"accelerate-txn {suggested} {exp1 / 'checkpoints'}" in result.err
    assert "legacy" not in result.err and result.out == ""
    assert sorted(p.name for p in (exp1 / "checkpoints").glob("checkpoint_*")) == ["checkpoint_0", "checkpoint_1"]


def test_a_directory_of_runs_is_a_usage_error_listing_the_run_directories(cli: Any, project: Path,
                                                                          tmp_path: Path) -> None:
    for command in ("list", "latest", "verify"):
        result = cli(command, project)
        assert result.code == 2 and "2 directories below it hold checkpoints" in result.err, (command, result.err)
        assert str(project / "exp1" / "checkpoints") in result.err and str(project / "exp2" / "checkpoints") in result.err
    flat = tmp_path / "flat"  # run directories directly below: runs/a/checkpoint_0
    shutil.copytree(project / "exp1" / "checkpoints", flat / "a")
    result = cli("list", flat, "--json")
    assert result.code == 2 and result.out == ""
    assert f"1 directory below it holds checkpoints: {flat / 'a'}" in result.err
    assert f"accelerate-txn list {flat / 'a'}" in result.err


def test_a_real_run_directory_and_checkpoint_behave_as_before(cli: Any, project: Path, tmp_path: Path) -> None:
    run = project / "exp1" / "checkpoints"
    listed = cli("list", run, "--json")
    assert listed.code == 0 and listed.json()["would_load"] == str(run / "checkpoint_1")
    latest = cli("latest", run)
    assert latest.code == 0 and latest.out.strip() == str(run / "checkpoint_1") and latest.err == ""
    assert cli("verify", run / "checkpoint_0").code == 0
    assert cli("inspect", run / "checkpoint_0").code == 0
    assert cli("diff", run / "checkpoint_0", run / "checkpoint_1").code == 0
    assert cli("prune", run, "--keep", "1", "--dry-run").code == 0
    verify = cli("verify", run)  # a run directory given to verify: the hint it always had
    assert verify.code == 2 and "is a run directory" in verify.err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("list", empty).code == 1 and "no checkpoints" in cli("list", empty).err
    assert cli("latest", empty).code == 1


# --------------------------------------------------------------------------------------------- item 2


def test_the_cli_says_what_load_state_does_with_a_native_checkpoint_and_a_real_load_does_it(cli: Any,
                                                                                           tmp_path: Path) -> None:
    native = _trainer(tmp_path / "exp")
    native.save_state()  # a one-process CPU Accelerator: native Accelerate, no manifest
    run = tmp_path / "exp" / "checkpoints"
    assert (run / "checkpoint_0").is_dir() and not (run / "checkpoint_0" / MANIFEST).exists()
    statement = legacy_resume(ALLOW_LEGACY_DEFAULT)

    listed = cli("list", run)
    assert listed.code == 0 and "legacy" in listed.out
    assert "load_state() would resume from checkpoint_0, which has no completion manifest (see above)" in listed.out
    assert f"  checkpoint_0: no completion manifest: a native Accelerate checkpoint or an unfinished native save; " \
           f"{statement}" in listed.out
    assert "NoCheckpointError" not in listed.out
    latest = cli("latest", run, "--json")
    assert latest.code == 0 and latest.json()["latest"] == str(run / "checkpoint_0") and latest.json()["legacy"]
    assert statement in latest.err and "start a new run directory" not in latest.err
    verify = cli("verify", run / "checkpoint_0")
    assert verify.code == 1 and statement in verify.err

    # What the library really does, with the default configuration: resumes from it, with a RuntimeWarning.
    from accelerate_txn.accelerate.config import checkpoint_config

    resumed = _trainer(tmp_path / "exp", steps=0, seed=1)
    assert checkpoint_config(resumed).allow_legacy is ALLOW_LEGACY_DEFAULT is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_training_checkpoint(resumed) == run / "checkpoint_0"
    assert any(issubclass(w.category, RuntimeWarning) and "no completion manifest" in str(w.message) for w in caught)
    assert torch.equal(resumed._models[0].weight, native._models[0].weight)
    # And with allow_legacy=False it refuses, as the statement for that policy says.
    refusing = _trainer(tmp_path / "exp", steps=0, seed=2)
    configure_checkpointing(refusing, allow_legacy=False)
    with pytest.raises(NoCheckpointError) as refused:
        load_training_checkpoint(refusing)
    assert legacy_resume(False) in str(refused.value)
    assert "refuses it" in legacy_resume(False) and "resumes from it" in statement

    # A native run of several checkpoints: the explanation once per listing, not once per checkpoint (it was 3 lines
    # per checkpoint); each JSON row still carries it whole.
    many = tmp_path / "many"
    for number in range(3):
        shutil.copytree(run / "checkpoint_0", many / f"checkpoint_{number}")
    listed = cli("list", many)
    assert listed.code == 0 and listed.out.count(statement) == 1, listed.out
    assert "  checkpoint_2, checkpoint_1, checkpoint_0: no completion manifest: a native Accelerate checkpoint" \
           in listed.out
    assert "load_state() would resume from checkpoint_2, which has no completion manifest (see above)" in listed.out
    rows = cli("list", many, "--json").json()["checkpoints"]
    assert [row["status"] for row in rows] == ["legacy"] * 3 and all(statement in row["reason"] for row in rows)


def test_a_native_checkpoint_is_never_preferred_over_a_complete_one(cli: Any, project: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(project / "exp1" / "checkpoints", run)
    shutil.copytree(run / "checkpoint_1", run / "checkpoint_5")
    (run / "checkpoint_5" / MANIFEST).unlink()  # a newer manifest-less directory with checkpoint files
    data = cli("list", run, "--json").json()
    assert data["would_load"] == str(run / "checkpoint_1")
    assert {row["name"]: row["status"] for row in data["checkpoints"]}["checkpoint_5"] == "legacy"
    assert cli("latest", run).out.strip() == str(run / "checkpoint_1")
    resumed = _trainer(tmp_path, steps=0)
    resumed.project_configuration.project_dir = str(tmp_path)
    shutil.move(str(run), str(tmp_path / "checkpoints"))
    assert load_training_checkpoint(resumed) == tmp_path / "checkpoints" / "checkpoint_1"


# --------------------------------------------------------------------------------------------- item 6


def test_diff_shows_every_difference_or_says_how_many_more_and_cuts_around_the_difference(cli: Any,
                                                                                         tmp_path: Path) -> None:
    long = "a" * 300
    first = save_training_checkpoint(_trainer(metadata={**{f"k{i:02d}": i for i in range(30)}, "note": long + "X"}),
                                     tmp_path / "a" / "checkpoint_0")
    second = save_training_checkpoint(_trainer(metadata={**{f"k{i:02d}": -i for i in range(1, 31)}, "note": long + "Y"}),
                                      tmp_path / "b" / "checkpoint_0")
    data = cli("diff", first, second, "--json").json()
    lines = data["blockers"][0]["differences"]
    assert len(lines) == 32 == data["differences_total"]  # k00 .. k30 and note; nothing silently dropped
    (note,) = [line for line in lines if line.startswith("training.note:")]
    assert "X\"" in note and "Y\"" in note and note.count("...") == 2  # cut before, never past, the difference
    text = cli("diff", first, second)
    assert text.code == 1
    shown = [line for line in text.out.splitlines() if line.startswith("  training.")]
    assert len(shown) == 20 and "  ... and 12 more (use --all)" in text.out
    everything = cli("diff", first, second, "--all")
    assert len([line for line in everything.out.splitlines() if line.startswith("  training.")]) == 32
    assert "more (use --all)" not in everything.out


# --------------------------------------------------------------------------------------------- item 7


def test_the_manifest_records_optimizer_steps_and_checkpoint_number_and_the_cli_shows_them(cli: Any,
                                                                                           project: Path) -> None:
    run = project / "exp1" / "checkpoints"
    for number, steps in ((0, 3), (1, 5)):
        manifest = json.loads((run / f"checkpoint_{number}" / MANIFEST).read_text())
        assert manifest["progress"] == {"checkpoint": number, "optimizer_steps": {"": [steps]}}
        assert manifest["steps"] == {"": 0}  # accelerator.step: 0 outside accelerator.accumulate()
    data = cli("list", run, "--json").json()
    rows = {row["name"]: row for row in data["checkpoints"]}
    assert rows["checkpoint_1"]["components"][0]["optimizer_steps"] == [5]
    assert rows["checkpoint_1"]["checkpoint_number"] == 1
    table = cli("list", run).out
    (line,) = [line for line in table.splitlines() if "checkpoint_1 " in line]
    assert line.split()[3:5] == ["5", "0"]  # arrow, name, status, then step and acc.step
    inspect = cli("inspect", run / "checkpoint_1")
    assert "checkpoint 1, optimizer step 5, Accelerator step 0" in inspect.out
    assert cli("inspect", run / "checkpoint_1", "--json").json()["checkpoint_number"] == 1
    assert "checkpoint 0, optimizer step 3, Accelerator step 0" in cli("verify", run / "checkpoint_0").out


def test_a_manifest_without_progress_still_verifies_lists_and_loads(cli: Any, project: Path, tmp_path: Path) -> None:
    from accelerate_txn.core.manifest import write_manifest

    run = tmp_path / "checkpoints"
    shutil.copytree(project / "exp1" / "checkpoints", run)
    for path in run.glob("checkpoint_*"):  # as an older accelerate-txn wrote them
        manifest = json.loads((path / MANIFEST).read_text())
        del manifest["progress"]
        write_manifest(path, manifest, store=POSIX)
    assert cli("verify", run / "checkpoint_1", "--full").code == 0
    data = cli("list", run, "--json").json()
    assert data["would_load"] == str(run / "checkpoint_1")
    assert data["checkpoints"][0]["components"][0]["optimizer_steps"] is None
    assert "checkpoint -, optimizer step -, Accelerator step 0" in cli("inspect", run / "checkpoint_1").out
    assert load_training_checkpoint(_trainer(tmp_path, steps=0)) == run / "checkpoint_1"


def test_save_and_resume_log_lines_name_the_checkpoint_and_optimizer_step(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(tmp_path, steps=4)
    with caplog.at_level(logging.INFO, logger="accelerate_txn"):
        save_training_checkpoint(trainer)
        load_training_checkpoint(_trainer(tmp_path, steps=0, seed=3))
    messages = [record.getMessage() for record in caplog.records]
    published = [m for m in messages if m.startswith("Published checkpoint")]
    assert published == [f"Published checkpoint {tmp_path / 'checkpoints' / 'checkpoint_0'} (checkpoint 0, "
                         "optimizer step 4, Accelerator step 0)"]
    assert f"Resumed from checkpoint {tmp_path / 'checkpoints' / 'checkpoint_0'} (checkpoint 0, optimizer step 4, " \
           "Accelerator step 0)" in messages


def fsdp_save_and_resume(root: str) -> dict[str, Any]:
    """In each of 2 ranks: 3 real AdamW steps on FSDP1, a patched save_state(), a resume into a fresh run; what the
    logs and the restored optimizer say."""
    import accelerate_txn  # noqa: F401  (installs the patch)
    from tests.scenarios.scenarios import _build, _train

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("accelerate_txn")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    acc, model, optimizer, scheduler = _build(0, project_dir=root, automatic_checkpoint_naming=True)
    _train(acc, model, optimizer, scheduler, 3, seed=0)
    acc.save_state()
    acc2 = _build(1, project_dir=root, automatic_checkpoint_naming=True)[0]
    acc2.load_state()
    from accelerate_txn.accelerate.save import optimizer_steps

    return {"rank": acc.process_index, "published": [m for m in records if m.startswith("Published checkpoint")],
            "resumed": [m for m in records if m.startswith("Resumed from")], "restored_steps": optimizer_steps(acc2)}


@pytest.mark.distributed
def test_fsdp_save_logs_published_once_per_save_and_records_the_optimizer_step(cli: Any, tmp_path: Path) -> None:
    ranks = launch(fsdp_save_and_resume, 2, args=(str(tmp_path),), timeout=300)
    assert sum(len(rank["published"]) for rank in ranks) == 1 and ranks[0]["published"]  # rank 0 only
    assert "(checkpoint 0, optimizer step 3, Accelerator step 0)" in ranks[0]["published"][0]
    assert len(ranks[0]["resumed"]) == 1 and "(checkpoint 0, optimizer step 3, " in ranks[0]["resumed"][0]
    assert [rank["restored_steps"] for rank in ranks] == [[3], [3]]
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint_0" / MANIFEST).read_text())
    assert manifest["progress"] == {"checkpoint": 0, "optimizer_steps": {"": [3]}}


# --------------------------------------------------------------------------------------------- item 9


def test_list_colours_corrupt_red_on_a_terminal(project: Path, tmp_path: Path) -> None:
    import pty

    run = tmp_path / "run"
    shutil.copytree(project / "exp1" / "checkpoints", run)
    payload = run / "checkpoint_1" / "optimizer.bin"
    payload.write_bytes(payload.read_bytes()[:10])
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "accelerate_txn", "list", str(run)], stdout=follower,
                              stderr=subprocess.PIPE, timeout=120, cwd=REPO,
                              env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "200"})
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0, done.stderr
    assert b"\x1b[1;31mcorrupt" in seen and b"\x1b[32mcomplete" in seen  # bold red, green
    piped = subprocess.run([sys.executable, "-m", "accelerate_txn", "list", str(run)], capture_output=True,
                           timeout=120, cwd=REPO)
    assert b"corrupt" in piped.stdout and b"\x1b[" not in piped.stdout  # no colour into a pipe


def test_only_diff_export_and_verify_dcp_import_torch(project: Path) -> None:
    """docs/cli.md, "Speed": list, verify, latest, inspect and prune import no torch; diff does."""
    run = project / "exp1" / "checkpoints"
    probe = ("import sys\nfrom accelerate_txn.cli import main\n"
             "codes = [main(['inspect', sys.argv[1]]), main(['prune', sys.argv[2], '--keep', '1', '--dry-run'])]\n"
             "print('torch' in sys.modules, codes)\n"
             "codes.append(main(['diff', sys.argv[1], sys.argv[1]]))\n"
             "print('torch' in sys.modules, codes)")
    done = subprocess.run([sys.executable, "-c", probe, str(run / "checkpoint_0"), str(run)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    probes = [line for line in done.stdout.splitlines() if line.startswith(("True ", "False "))]
    assert probes == ["False [0, 0]", "True [0, 0, 0]"]


def test_messages_use_proper_singular_and_plural(cli: Any, project: Path) -> None:
    checkpoint = project / "exp1" / "checkpoints" / "checkpoint_0"
    text = cli("verify", checkpoint).out
    assert "(s)" not in text and "(ies)" not in text
    files = len(json.loads((checkpoint / MANIFEST).read_text())["files"])
    assert f"{files} files present with their recorded sizes" in text
