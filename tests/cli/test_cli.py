"""The ``accelerate-txn`` command line on real checkpoints (real single-process protected saves).

Most runs call :func:`accelerate_txn.cli.main` in-process; a few run ``python -m accelerate_txn`` as a real
subprocess (exit status, no traceback, what it imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import accelerate_txn
from accelerate_txn import MANIFEST, configure_checkpointing, register_checkpoint_state, save_training_checkpoint
from accelerate_txn.store.posix import POSIX, DirectoryLock

REPO = Path(__file__).resolve().parents[2]
RUN_A = "a" * 32  # run ids of hand-made leftovers
LARGE = 2100  # Linear(LARGE, LARGE): 17.6 MB of float32 weights, over the 16 MiB a quick verification hashes


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)  # the whole of stdout: --json prints nothing else


def _subprocess(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "accelerate_txn", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)


def save(path: Path, *, lr: float = 0.01, step: int = 12, width: int = 3) -> Path:
    """One real protected checkpoint of a new one-process run (see :func:`accelerator`)."""
    trainer = accelerator(lr=lr, width=width)
    trainer.step = step
    return Path(save_training_checkpoint(trainer, path))


def accelerator(*, lr: float = 0.01, width: int = 3) -> Accelerator:
    """A one-process run: Sequential(Linear(width, 2), ReLU, Linear(2, 2)) with AdamW in two groups (a 17.6 MB
    Linear(LARGE, LARGE) first layer with SGD for ``width=LARGE``), LambdaLR, training metadata and a registered
    progress state."""
    accelerator = Accelerator(cpu=True)
    hidden = LARGE if width == LARGE else 2
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    optimizer = (torch.optim.SGD(model.parameters(), lr=lr) if width == LARGE else
                 torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    configure_checkpointing(accelerator, metadata={"batch_size": 8, "lr": lr})
    register_checkpoint_state(accelerator, {"data": torch.Generator()}, {"step": 0})
    return accelerator


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint_0..2 complete (one run); pristine: tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("run")
    trainer = accelerator()
    for number in range(3):
        trainer.step = 4 * number
        save_training_checkpoint(trainer, root / f"checkpoint_{number}")
    return root


@pytest.fixture
def messy_run(run_dir: Path, tmp_path: Path) -> Path:
    """The run plus every kind of damage and leftover ``list`` must tell apart."""
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run_dir, root)
    shutil.copytree(root / "checkpoint_1", root / "checkpoint_3")  # a published copy, then truncated
    payload = root / "checkpoint_3" / "optimizer.bin"
    payload.write_bytes(payload.read_bytes()[:100])
    (root / "checkpoint_4").mkdir()  # native Accelerate layout, no manifest
    (root / "checkpoint_4" / "model.safetensors").write_bytes(b"x" * 10)
    (root / "checkpoint_5").mkdir()  # empty
    staging = root / f".checkpoint_6.staging-{RUN_A}-{'b' * 32}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"y" * 7)
    (root / f".checkpoint_9.deleting-{RUN_A}-{'c' * 32}").mkdir()  # retention interrupted mid-delete
    return root


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


# --------------------------------------------------------------------------------------------- global options


def test_version_and_help_are_plain(cli: Any) -> None:
    result = cli("--version")
    assert result.code == 0 and result.out.strip() == f"accelerate-txn {accelerate_txn.__version__}"
    for command in ([], ["list"], ["verify"], ["inspect"], ["diff"], ["prune"], ["latest"], ["export"], ["doctor"]):
        result = cli(*command, "--help")
        assert result.code == 0, command
        assert "``" not in result.out and ":func:" not in result.out and "Imported only" not in result.out
    assert all(name in cli("--help").out for name in ("list", "verify", "inspect", "diff", "prune", "latest", "export",
                                                     "doctor"))


def test_python_dash_m_runs_the_cli_and_user_errors_print_no_traceback(tmp_path: Path) -> None:
    missing = _subprocess("verify", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    empty = _subprocess("latest", str(tmp_path))
    assert empty.returncode == 1 and "no checkpoints" in empty.stderr and "Traceback" not in empty.stderr
    unknown = _subprocess("frobnicate")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    version = _subprocess("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"accelerate-txn {accelerate_txn.__version__}"


def test_verify_list_and_latest_do_not_import_torch(run_dir: Path) -> None:
    probe = ("import sys\nfrom accelerate_txn.cli import main\n"
             "codes = [main(['verify', sys.argv[1]]), main(['list', sys.argv[2]]), main(['latest', sys.argv[2]])]\n"
             "print('torch' in sys.modules, codes)")
    result = _subprocess(str(run_dir / "checkpoint_2"), str(run_dir), code=probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False [0, 0, 0]"


# --------------------------------------------------------------------------------------------- list


def test_list_shows_every_checkpoint_newest_first_and_the_one_load_state_would_pick(cli: Any, messy_run: Path) -> None:
    data = cli("list", messy_run, "--json").json()
    rows = {row["name"]: row for row in data["checkpoints"]}
    assert [row["name"] for row in data["checkpoints"]] == [
        f".checkpoint_9.deleting-{RUN_A}-{'c' * 32}", f".checkpoint_6.staging-{RUN_A}-{'b' * 32}", "checkpoint_5",
        "checkpoint_4", "checkpoint_3",
        "checkpoint_2", "checkpoint_1", "checkpoint_0"]
    assert data["would_load"] == str(messy_run / "checkpoint_2")
    assert [name for name, row in rows.items() if row["would_load"]] == ["checkpoint_2"]
    assert {name: row["status"] for name, row in rows.items()} == {
        f".checkpoint_9.deleting-{RUN_A}-{'c' * 32}": "retired leftover",
        f".checkpoint_6.staging-{RUN_A}-{'b' * 32}": "staging leftover", "checkpoint_5": "corrupt",
        "checkpoint_4": "legacy", "checkpoint_3": "corrupt", "checkpoint_2": "complete", "checkpoint_1": "complete",
        "checkpoint_0": "complete"}
    assert "optimizer.bin has 100 bytes" in rows["checkpoint_3"]["reason"]
    assert "no completion manifest" in rows["checkpoint_5"]["reason"]
    assert "allow_legacy" in rows["checkpoint_4"]["reason"]
    assert rows[f".checkpoint_6.staging-{RUN_A}-{'b' * 32}"]["run_id"] == RUN_A
    complete = rows["checkpoint_2"]
    manifest = _manifest(messy_run / "checkpoint_2")
    assert complete["run_id"] == manifest["run_id"] and complete["reason"] is None
    assert complete["components"] == [{"component": "", "directory": ".", "accelerator_step": 8,
                                        "optimizer_steps": [None]}]  # AdamW that never stepped: no count
    assert complete["checkpoint_number"] == 2
    assert complete["integrity"] == manifest["integrity"]
    on_disk = sum(p.stat().st_size for p in (messy_run / "checkpoint_2").rglob("*") if p.is_file())
    assert complete["size_bytes"] == on_disk and complete["age_seconds"] >= 0

    text = cli("list", messy_run)
    assert text.code == 0
    lines = text.out.splitlines()
    picked = [line for line in lines if line.lstrip().startswith("→")]
    assert len(picked) == 1 and "checkpoint_2" in picked[0] and "complete" in picked[0]
    assert any("checkpoint_4" in line and "legacy" in line for line in lines)
    assert any(".checkpoint_9.deleting-…" in line and "retired leftover" in line for line in lines)
    assert any(line.strip().startswith("checkpoint_3: Checkpoint file") for line in lines)
    assert "load_state() would resume from checkpoint_2" in text.out
    assert "Skipping checkpoint" not in text.err  # the reasons are in the listing, not repeated as warnings


def test_list_refuses_what_is_not_a_run_directory(cli: Any, run_dir: Path, tmp_path: Path) -> None:
    missing = cli("list", tmp_path / "nope")
    assert missing.code == 2 and "does not exist" in missing.err
    checkpoint = cli("list", run_dir / "checkpoint_1")
    assert checkpoint.code == 2 and "is a checkpoint, not a run directory" in checkpoint.err and "verify" in checkpoint.err
    assert cli("list", run_dir / "checkpoint_1" / MANIFEST).code == 2
    # Nothing there: exit 1 ("none found", as latest), the message on stderr, --json still prints the empty listing.
    empty = cli("list", tmp_path)
    assert empty.code == 1 and f"{tmp_path}: no checkpoints" in empty.err and empty.out == ""
    empty_json = cli("list", tmp_path, "--json")
    assert empty_json.code == 1 and "no checkpoints" in empty_json.err
    assert empty_json.json() == {"directory": str(tmp_path), "trainer": False, "would_load": None, "checkpoints": []}


# --------------------------------------------------------------------------------------------- verify


def test_verify_reports_what_it_checked_and_the_real_accelerator_step(cli: Any, run_dir: Path) -> None:
    path = run_dir / "checkpoint_2"
    manifest = _manifest(path)
    text = cli("verify", path)
    assert text.code == 0 and f"{path}: valid (run {manifest['run_id']}" in text.out
    assert f"{len(manifest['files'])} files present with their recorded sizes" in text.out
    assert "not checked:" in text.out and "load_state() compares it" in text.out
    # No payload over 16 MiB: --full adds nothing here, and both reports say so and why (they printed the same).
    assert ("--full would add nothing here: it re-hashes the large payloads (.distcp, .safetensors, .bin over 16 MiB) "
            "that a quick verification checks by size only, and it has none") in text.out
    full = cli("verify", path, "--full")
    assert full.code == 0 and "--full added nothing here" in full.out and "it has none, so every file" in full.out
    data = cli("verify", path, "--full", "--json").json()
    assert data["full_effect"].startswith("--full added nothing here")
    assert data["valid"] is True and data["error"] is None and data["run_id"] == manifest["run_id"]
    assert data["components"] == [{"component": "", "directory": ".", "accelerator_step": 8,
                                   "optimizer_steps": [None]}]  # not {"": 0}
    checked = data["checked"]
    assert checked["files"] == len(manifest["files"]) and checked["full"] is True
    assert checked["hashed"] + checked["size_only"] == checked["files"]
    assert checked["hashed"] == sum(1 for row in manifest["files"].values() if {"xxh3_128", "sha256"} & set(row))


def test_verify_quick_does_not_claim_to_have_hashed_a_large_payload_and_full_does(cli: Any, tmp_path: Path) -> None:
    path = save(tmp_path / "checkpoint_0", width=LARGE)
    weights = path / "model.safetensors"
    assert weights.stat().st_size > 16 * 1024 * 1024
    data = cli("verify", path, "--json").json()
    assert data["valid"] and data["checked"]["size_only"] == 1
    assert any("large payload" in note and "--full" in note for note in data["not_checked"])
    assert data["full_effect"] is None  # the note above says what --full would re-hash
    intact = cli("verify", path, "--full")
    assert intact.code == 0 and "--full re-hashed 1 large payload (over 16 MiB)" in intact.out
    with weights.open("r+b") as stream:  # same size, one byte changed in the middle of the tensor data
        stream.seek(weights.stat().st_size // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))
    quick = cli("verify", path)
    assert quick.code == 0 and "size only (--full re-hashes it)" in quick.out  # honest about what it did not see
    full = cli("verify", path, "--full")
    assert full.code == 1 and "model.safetensors does not match its" in full.err


def test_verify_rejects_damage_with_exit_1(cli: Any, messy_run: Path) -> None:
    truncated = cli("verify", messy_run / "checkpoint_3")
    assert truncated.code == 1 and "optimizer.bin has 100 bytes" in truncated.err and truncated.out == ""
    data = cli("verify", messy_run / "checkpoint_3", "--json").json()
    assert data["valid"] is False and "optimizer.bin has 100 bytes" in data["error"] and data["checked"] is None
    legacy = cli("verify", messy_run / "checkpoint_4")
    assert legacy.code == 1 and "legacy" in legacy.err and "allow_legacy" in legacy.err
    empty = cli("verify", messy_run / "checkpoint_5")
    assert empty.code == 1 and "not a complete checkpoint" in empty.err
    staging = cli("verify", next(messy_run.glob(".checkpoint_6.staging-*")), "--json")
    assert staging.code == 1 and "staging" in staging.json()["error"]
    extra = messy_run / "checkpoint_2" / "optimizer_1.bin"  # a file a loader would read, not in the inventory
    extra.write_bytes(b"z")
    assert cli("verify", messy_run / "checkpoint_2").code == 1
    extra.unlink()
    (messy_run / "checkpoint_2" / MANIFEST).write_text("{}")
    assert cli("verify", messy_run / "checkpoint_2").code == 1
    (messy_run / "checkpoint_2" / MANIFEST).write_text("{not json")
    garbled = cli("verify", messy_run / "checkpoint_2", "--json")
    assert garbled.code == 1 and "Unreadable checkpoint manifest" in garbled.json()["error"]


def test_verify_usage_errors_exit_2_with_a_hint(cli: Any, run_dir: Path, tmp_path: Path) -> None:
    missing = cli("verify", tmp_path / "does" / "not" / "exist", "--json")
    assert missing.code == 2 and "does not exist" in missing.err and missing.out == ""
    run = cli("verify", run_dir)
    assert run.code == 2 and "is a run directory" in run.err
    assert f"accelerate-txn list {run_dir}" in run.err and f"accelerate-txn latest {run_dir}" in run.err
    manifest_file = cli("verify", run_dir / "checkpoint_0" / MANIFEST)
    hint = f"pass its directory: accelerate-txn verify {run_dir / 'checkpoint_0'}"
    assert manifest_file.code == 2 and hint in manifest_file.err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("hello")
    other = cli("verify", tmp_path / "notes")
    assert other.code == 2 and "not a checkpoint directory" in other.err


# --------------------------------------------------------------------------------------------- inspect, diff


def test_inspect_shows_the_training_configuration(cli: Any, run_dir: Path) -> None:
    path = run_dir / "checkpoint_1"
    text = cli("inspect", path)
    assert text.code == 0
    assert "world size 1, backend NO, mixed precision no, gradient accumulation 1" in text.out
    assert "torch.nn.modules.container.Sequential, 14 parameters in 4 tensors, float32" in text.out  # 3*2+2 + 2*2+2
    assert "optimizer 0: torch.optim.adamw.AdamW, 2 groups (2 + 2 parameter tensors)" in text.out
    assert "scheduler: torch.optim.lr_scheduler.LambdaLR on optimizer 0" in text.out
    assert "registered state training_state_{rank}.pt: generators data; progress step" in text.out
    assert "training metadata: batch_size=8, lr=0.01" in text.out
    assert "torch " in text.out and "accelerate " in text.out and "Accelerator step 4" in text.out
    data = cli("inspect", path, "--json").json()
    component = data["components"][""]
    assert component["models"][0]["parameters"] == 14 and component["models"][0]["trainable"] == 14
    assert component["optimizers"] == [{"class": "torch.optim.adamw.AdamW", "groups": [2, 2]}]
    assert component["training"] == {"batch_size": 8, "lr": 0.01}
    assert data["steps"] == [{"component": "", "directory": ".", "accelerator_step": 4, "optimizer_steps": [None]}]
    assert cli("inspect", run_dir).code == 2


def test_diff_explains_why_b_would_not_resume_a(cli: Any, run_dir: Path, tmp_path: Path) -> None:
    same = cli("diff", run_dir / "checkpoint_0", run_dir / "checkpoint_2")
    assert same.code == 0 and "would resume" in same.out
    other = save(tmp_path / "other" / "checkpoint_0", lr=0.02)
    text = cli("diff", run_dir / "checkpoint_0", other)
    assert text.code == 1
    assert "training.lr: 0.01 (saved) vs 0.02 (live)" in text.out and "different training runs" in text.out
    data = cli("diff", run_dir / "checkpoint_0", other, "--json").json()
    assert data["would_resume"] is False and data["same_run"] is False
    assert data["blockers"][0]["differences"] == ["training.lr: 0.01 (saved) vs 0.02 (live)"]
    assert "saved for a different training configuration" in data["blockers"][0]["message"]
    assert cli("diff", run_dir / "checkpoint_0", tmp_path / "nope").code == 2


def test_inspect_and_diff_report_a_malformed_manifest_without_traceback(cli: Any, run_dir: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "checkpoint_0"
    shutil.copytree(run_dir / "checkpoint_0", broken)
    manifest = _manifest(broken)
    manifest["components"][""]["schedulers"] = "not a list"
    manifest["components"][""]["models"] = {"not": "a list"}
    (broken / MANIFEST).write_text(json.dumps(manifest))
    assert cli("inspect", broken).code == 0  # what is readable is shown
    result = cli("diff", run_dir / "checkpoint_0", broken, "--json")
    assert result.code == 1 and "cannot be compared (malformed" in result.json()["blockers"][0]["message"]


# --------------------------------------------------------------------------------------------- prune


def test_prune_dry_run_names_exactly_what_prune_deletes(cli: Any, messy_run: Path) -> None:
    import shutil

    shutil.rmtree(messy_run / "checkpoint_3")  # published but corrupt: prune refuses while it is there
    dry = cli("prune", messy_run, "--keep", "2", "--dry-run", "--json").json()
    assert [Path(p).name for p in dry["would_delete"]] == ["checkpoint_0"] and dry["dry_run"] is True
    assert dry["deleted"] == []  # a dry run deletes nothing, and says so
    assert (messy_run / "checkpoint_0").is_dir()
    real = cli("prune", messy_run, "--keep", "2", "--json").json()
    assert real["deleted"] == dry["would_delete"] and real["kept"] == dry["kept"] and real["would_delete"] == []
    assert sorted(p.name for p in messy_run.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_1", "checkpoint_2", "checkpoint_4", "checkpoint_5"]  # legacy and broken ones are left alone
    assert list(messy_run.glob(".checkpoint_6.staging-*"))
    text = cli("prune", messy_run, "--keep", "1")
    assert text.code == 0 and "deleted: checkpoint_1" in text.out
    assert cli("prune", messy_run, "--keep", "0").code == 2


def test_prune_refuses_when_a_corrupt_checkpoint_of_the_run_would_count(cli: Any, messy_run: Path) -> None:
    result = cli("prune", messy_run, "--keep", "1")
    assert result.code == 1 and "checkpoint_3 of run" in result.err
    assert "is published but its contents fail verification" in result.err
    assert "count it as a checkpoint to keep" in result.err
    assert all((messy_run / f"checkpoint_{n}").is_dir() for n in range(4))


def test_prune_waits_for_no_writer_and_deletes_nothing_while_one_holds_the_lock(cli: Any, run_dir: Path,
                                                                                 tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run_dir, root)
    lock = DirectoryLock(root)  # another open file description: the same exclusion as another process
    lock.acquire()
    try:
        result = cli("prune", root, "--keep", "1")
    finally:
        lock.release()
    assert result.code == 1 and "lock" in result.err
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_prune_needs_run_id_when_several_runs_share_the_directory(cli: Any, run_dir: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run_dir, root)
    stranger = save(tmp_path / "elsewhere" / "checkpoint_7")
    shutil.copytree(stranger, root / "checkpoint_7")
    ambiguous = cli("prune", root, "--keep", "1")
    assert ambiguous.code == 2 and "--run-id" in ambiguous.err
    assert cli("prune", root, "--keep", "1", "--run-id", "f" * 32).code == 2
    ours = _manifest(root / "checkpoint_0")["run_id"]
    result = cli("prune", root, "--keep", "1", "--run-id", ours, "--json").json()
    assert [Path(p).name for p in result["deleted"]] == ["checkpoint_0", "checkpoint_1"]
    assert (root / "checkpoint_7").is_dir() and (root / "checkpoint_2").is_dir()


# --------------------------------------------------------------------------------------------- latest


def test_latest_prints_the_newest_complete_checkpoint_and_says_why_others_were_skipped(cli: Any,
                                                                                         messy_run: Path) -> None:
    result = cli("latest", messy_run)
    assert result.code == 0 and result.out.strip() == str(messy_run / "checkpoint_2")
    assert "Skipping checkpoint" in result.err and "checkpoint_3" in result.err
    data = cli("latest", messy_run, "--json").json()
    assert data == {"directory": str(messy_run), "latest": str(messy_run / "checkpoint_2"), "error": None,
                    "legacy": False, "trainer": False}


def test_latest_exit_codes(cli: Any, tmp_path: Path) -> None:
    missing = cli("latest", tmp_path / "nope")
    assert missing.code == 2 and "does not exist" in missing.err
    empty = cli("latest", tmp_path, "--json")
    assert empty.code == 1 and empty.json()["latest"] is None and "no checkpoints" in empty.err
    (tmp_path / "checkpoint_1").mkdir()
    broken = cli("latest", tmp_path)
    assert broken.code == 1 and "No complete checkpoint" in broken.err
    assert "checkpoint_1: it has no completion manifest" in broken.err


# --------------------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp")
    weights = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4)}
    dcp.save({"model": weights}, storage_writer=dcp.FileSystemWriter(str(root / "dcp")), no_dist=True)
    (root / "config.json").write_text(json.dumps({"_class_name": "Tiny", "width": 3}))
    return root, weights


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "BF16", "torch.bfloat16"])
def test_export_accepts_dtype_names(cli: Any, tmp_path: Path, dcp_source: tuple[Path, Any], name: str) -> None:
    from safetensors.torch import load_file

    root, weights = dcp_source
    result = cli("export", root / "dcp", root / "config.json", tmp_path / "out", "--max-shard-size", "64",
                 "--dtype", name, "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert data["dtype"] == "bfloat16" and data["max_shard_size"] == 64
    loaded: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "out").glob("*.safetensors"):
        loaded.update(load_file(shard))
    assert set(loaded) == set(weights)
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], weights[k].bfloat16()) for k in weights)


def test_export_refuses_a_bad_dtype_or_size_as_a_usage_error(cli: Any, tmp_path: Path, dcp_source: tuple[Path, Any]) -> None:
    root, _ = dcp_source
    for option, value, words in (("--dtype", "bf17", "not a floating dtype"), ("--dtype", "int8", "bf16, bfloat16"),
                                 ("--max-shard-size", "5XB", "not a positive size")):
        result = cli("export", root / "dcp", root / "config.json", tmp_path / "out", option, value)
        assert result.code == 2 and words in result.err, (option, value, result.err)
        assert not (tmp_path / "out").exists()


def test_export_shard_size_default_is_the_api_default_and_units_are_explicit(cli: Any, tmp_path: Path,
                                                                             dcp_source: tuple[Path, Any]) -> None:
    from accelerate_txn.weights._common import DEFAULT_MAX_SHARD_SIZE

    root, _ = dcp_source
    default = cli("export", root / "dcp", root / "config.json", tmp_path / "a", "--json").json()
    assert default["max_shard_size"] == DEFAULT_MAX_SHARD_SIZE == 5 * 1024**3  # was 5 * 10**9 before
    decimal = cli("export", root / "dcp", root / "config.json", tmp_path / "b", "--max-shard-size", "5GB", "--json")
    assert decimal.json()["max_shard_size"] == 5_000_000_000
    binary = cli("export", root / "dcp", root / "config.json", tmp_path / "c", "--max-shard-size", "5GiB", "--json")
    assert binary.json()["max_shard_size"] == 5 * 1024**3


def test_export_of_a_missing_checkpoint_is_a_usage_error_without_traceback(tmp_path: Path) -> None:
    result = _subprocess("export", str(tmp_path / "nope"), str(tmp_path), str(tmp_path / "out"), "--dtype", "bf16")
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_inspect_summary_names_fsdp2_layouts_by_mesh_and_fsdp1_by_strategy_and_grid() -> None:
    from accelerate_txn.cli._describe import summarize

    fsdp2 = summarize({"models": [{"parameters": {}, "fsdp": [{"fsdp_version": 2, "mesh": [2]}]}]})["models"][0]
    fsdp1 = summarize({"models": [{"parameters": {}, "fsdp": [{"sharding": "FULL_SHARD"}]}]})["models"][0]
    assert fsdp2["sharding"] == ["FSDP2 mesh [2]"] and fsdp1["sharding"] == ["FULL_SHARD"]
    hsdp = summarize({"models": [{"parameters": {}, "fsdp": [{"fsdp_version": 2, "mesh": [2, 4],
                                                              "mesh_dims": ["dp_replicate", "dp_shard_cp"]}]}]})
    assert hsdp["models"][0]["sharding"] == ["FSDP2 mesh dp_replicate=2 x dp_shard_cp=4"]
    hybrid = summarize({"models": [{"parameters": {}, "fsdp": [
        {"sharding": "HYBRID_SHARD", "hybrid": {"replicate": 2, "shard": 4}}]}]})["models"][0]
    assert hybrid["sharding"] == ["HYBRID_SHARD (2 replicas x 4 ranks)"]


def test_verify_full_shows_a_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    import os
    import pty
    import subprocess
    import sys

    from accelerate_txn.core.manifest import PROTOCOL, build_inventory, write_manifest

    root = tmp_path / "checkpoint_0"
    (root / "pytorch_model_fsdp_0").mkdir(parents=True)
    with (root / "pytorch_model_fsdp_0" / "__0_0.distcp").open("wb") as stream:
        stream.truncate(300 * 2**20)  # sparse: hashing reads zeros fast
    write_manifest(root, {"protocol": PROTOCOL, "status": "complete", "run_id": "a" * 32, "transaction_id": "b" * 32,
                          "integrity": "full", "components": {}, "files": build_inventory(root, "full")}, store=POSIX)
    command = [sys.executable, "-m", "accelerate_txn", "verify", "--full", str(root)]
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=follower, timeout=120)
        os.close(follower)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO once the terminal's other end is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0 and b"valid" in done.stdout
    assert b"re-hashing" in seen  # the bar, drawn on the terminal (stderr)
    piped = subprocess.run(command, capture_output=True, timeout=120)
    assert piped.returncode == 0 and b"re-hashing" not in piped.stderr + piped.stdout  # no bar into a pipe
