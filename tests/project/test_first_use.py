"""Rough edges a first user hit (issue 11), each pinned: the test harness, export file modes, the benchmark
runner against its documentation, the demo's output."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.testing import fsdp_accelerator, launch

REPO = Path(__file__).resolve().parents[2]


def _harness_with_project_config(project_dir: str) -> dict[str, Any]:
    """Runs in a fresh process (fsdp_accelerator forces Accelerate's process-wide state onto FSDP)."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=3)
    accelerator = fsdp_accelerator(project_config=config)
    return {"same": accelerator.project_configuration is config, "dir": accelerator.project_dir,
            "limit": accelerator.project_configuration.total_limit,
            "fsdp": accelerator.distributed_type.name}


@pytest.mark.distributed
def test_fsdp_accelerator_accepts_project_config(tmp_path: Path) -> None:
    # Regression: project_config=... raised "got multiple values for keyword argument 'project_config'".
    (result,) = launch(_harness_with_project_config, 1, args=(str(tmp_path),), timeout=240)  # hang guard
    assert result == {"same": True, "dir": str(tmp_path), "limit": 3, "fsdp": "FSDP"}


def test_fsdp_accelerator_refuses_what_it_cannot_run_before_touching_accelerate() -> None:
    from accelerate.utils import ProjectConfiguration

    # FULL_STATE_DICT runs (FSDP1's full gather with the harness's CPU fix); FSDP2 has no LOCAL_STATE_DICT.
    with pytest.raises(CheckpointConfigurationError, match=r"LOCAL_STATE_DICT does not exist on FSDP2"):
        fsdp_accelerator(state_dict_type="LOCAL_STATE_DICT", fsdp_version=2)
    with pytest.raises(CheckpointConfigurationError, match=r"use one of SHARDED_STATE_DICT, FULL_STATE_DICT"):
        fsdp_accelerator(state_dict_type="HALF_STATE_DICT")
    with pytest.raises(CheckpointConfigurationError, match=r"project_config or project_dir, total_limit, not both"):
        fsdp_accelerator(project_config=ProjectConfiguration(), project_dir="x", total_limit=2)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_exported_safetensors_files_respect_the_umask(tmp_path: Path, umask: int) -> None:
    # Regression: safetensors creates files 0600, so exports were unreadable by the group whatever the umask.
    import torch.distributed.checkpoint as dcp

    from accelerate_txn.weights import export_dcp_to_diffusers

    dcp.save({"model": {"w": torch.randn(8, 4), "b": torch.randn(8)}},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "Tiny"}))
    previous = os.umask(umask)
    try:
        out = export_dcp_to_diffusers(tmp_path / "dcp", tmp_path / "config.json", tmp_path / "out", 128)
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in Path(out).iterdir()}
    assert len([name for name in modes if name.endswith(".safetensors")]) == 2
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_run_all_runs_exactly_the_commands_docs_benchmarks_records() -> None:
    # Regression: run_all.py ran --sizes 50 --repeats 5, docs/benchmarks.md records --sizes 50 200 --repeats 3
    # with and without MALLOC_MMAP_THRESHOLD_.
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--dry-run"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    ran = [line.removeprefix("== ").replace(sys.executable, ".venv/bin/python") for line in result.stdout.splitlines()]
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    recorded = []
    for block in doc.split("**Command**")[1:]:
        body = block.split("```", 2)[1].split("\n", 1)[1]
        recorded += [line.split("#", 1)[0].strip() for line in body.splitlines() if line.split("#", 1)[0].strip()]
    assert ran == recorded and len(ran) >= 2
    for script in ("bench_checkpoint.py", "bench_weights.py"):
        assert any(f"benchmarks/{script}" in line for line in ran)


def _demo_module() -> Any:
    spec = importlib.util.spec_from_file_location("accelerate_txn_demo", REPO / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_demo_prints_both_runs_losses_in_a_narrow_table(tmp_path: Path) -> None:
    # Regression: the demo printed only the reference run's losses, and its listing was about 130 columns wide.
    demo = _demo_module()
    reference = {step: 1.0 / step for step in range(1, demo.STEPS + 1)}
    resumed = {step: value for step, value in reference.items() if step > 9} | {12: 0.5}
    lines = demo.loss_table(reference, resumed, 9)
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["10", "11", "12"]
    assert rows[0][1:] == [f"{reference[10]:.6f}", f"{resumed[10]:.6f}"]
    assert rows[2][1:] == [f"{reference[12]:.6f}", "0.500000", "DIFFERENT"]
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint_2").mkdir(parents=True)
    (checkpoints / f".checkpoint_3.staging-{'a' * 32}-{'b' * 32}").mkdir()
    listing = demo.describe_listing(checkpoints)
    assert any(".checkpoint_3.staging-aaaaaaaa…/" in line and "staging leftover" in line for line in listing)
    assert max(len(line) for line in lines + listing) <= 80
