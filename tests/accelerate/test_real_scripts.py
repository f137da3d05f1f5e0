"""A training script written the way public examples are, unchanged but for ``import accelerate_txn``, run as a real
2-process FSDP job on CPU by the launcher (``accelerate_txn.testing.run_script``): kill -9 mid-save and resume with
the script's own ``--resume_from_checkpoint latest``, and it ends bitwise equal to the uninterrupted run, having seen
the same batches; its own rotation, ``skip_first_batches`` or ``continue``, FSDP1 and FSDP2.

The script (tests/scripts/train_example.py) keeps its own ``checkpoint-N`` directories (every 2 steps, 5 steps an
epoch, 3 epochs: checkpoint-10 falls on an epoch's last batch, the others mid-epoch), rotates on the main process
before each save, resumes ``latest`` by the highest number, and draws noise from the global RNG every step. It logs
each step's sample indices and writes each rank's final parameters.

Also: a save on the main process only (the Diffusers examples' FSDP mistake) gets the explained error; a run resumed
from an older checkpoint saves over the newer ones (native overwrites them) and still ends exactly; a longer run
resumes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.testing import ScriptResult, run_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "scripts" / "train_example.py"
EPOCHS, STEPS_PER_EPOCH = 3, 5  # 40 samples, batches of 4 per rank, 2 ranks
TIMEOUT = 600.0  # a hang guard per job (a job takes about 15 s on 2 loaded cores)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(3600)]


def _run(directory: Path, fsdp: int, *args: str, env: dict[str, str] | None = None, **options: Any) -> ScriptResult:
    return run_script(SCRIPT, ["--output_dir", "out", "--log_dir", "logs", "--num_epochs", str(EPOCHS),
                               "--checkpointing_steps", "2", "--checkpoints_total_limit", "3", *args],
                      num_processes=2, fsdp_version=fsdp, timeout=TIMEOUT, cwd=directory,
                      env={"PYTHONPATH": str(REPO), **(env or {})}, **options)


def _steps(directory: Path, rank: int) -> dict[int, list[int]]:
    """Step -> the sample indices of that step's batch (the last time the step ran)."""
    lines = (directory / "logs" / f"rank{rank}.jsonl").read_text().splitlines()
    return {record["step"]: record["indices"] for record in map(json.loads, lines)}


def _final(directory: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(directory / "out" / f"final_rank{rank}.pt", weights_only=True)


def _published(directory: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (directory / "out").iterdir() if p.name.startswith("checkpoint"))


def _resumed_from(result: ScriptResult) -> int | None:
    for line in result.output[0].splitlines():
        if "Resuming from checkpoint checkpoint-" in line:
            return int(line.rsplit("-", 1)[1])
    return None


def _differences(expected: Path, got: Path) -> list[str]:
    """What differs between two runs: final parameters (bitwise, every rank) and each step's batch."""
    found = []
    for rank in range(2):
        reference, final = _final(expected, rank), _final(got, rank)
        found += [f"rank {rank}: parameter {name}" for name in reference if not torch.equal(reference[name], final[name])]
        reference_steps, steps = _steps(expected, rank), _steps(got, rank)
        found += [f"rank {rank}: step {step} trained on {steps[step]}, the uninterrupted run on {indices}"
                  for step, indices in reference_steps.items() if steps.get(step) != indices]
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: Any) -> dict[int, Path]:
    """The uninterrupted run, FSDP1 and FSDP2."""
    runs = {}
    for fsdp in (1, 2):
        directory = tmp_path_factory.mktemp(f"uninterrupted_fsdp{fsdp}")
        _run(directory, fsdp).check()
        assert sorted(_steps(directory, 0)) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
        runs[fsdp] = directory
    return runs


# (FSDP version, how the job dies, how the resumed epoch skips, the checkpoint the resume must take)
KILLS = [
    # Every rank kills itself while hashing and flushing checkpoint-6 (mid-epoch): never published.
    pytest.param(1, {"env": {"ACCELERATE_TXN_KILL_AT": "save:during-flush#3"}}, "skip_first_batches", 4,
                 id="fsdp1-whole-job-mid-save"),
    # Rank 0 dies between the manifest and the rename of checkpoint-10 (an epoch's last batch); rank 1 fails alone.
    pytest.param(1, {"env": {"ACCELERATE_TXN_KILL_AT": "save:after-manifest@0#5"}}, "continue", 8,
                 id="fsdp1-rank0-epoch-boundary"),
    # Just after checkpoint-8 is renamed into place, before the run continues: it is the one resumed.
    pytest.param(2, {"env": {"ACCELERATE_TXN_KILL_AT": "save:after-rename#4"}}, "skip_first_batches", 8,
                 id="fsdp2-whole-job-after-publish"),
    # The launcher kills the whole job the moment checkpoint-4 appears, wherever each rank is then.
    pytest.param(2, {"kill_on_path": "out/checkpoint-4"}, "continue", None, id="fsdp2-killed-from-outside"),
    # Accelerate's FSDP1 default, FULL_STATE_DICT (rank 0 writes the whole model and optimizer): every rank killed while
    # hashing and flushing checkpoint-6.
    pytest.param(1, {"env": {"ACCELERATE_TXN_KILL_AT": "save:during-flush#3"}, "state_dict_type": "FULL_STATE_DICT"},
                 "skip_first_batches", 4, id="fsdp1-full-state-dict-mid-save"),
    # FSDP2 with FULL_STATE_DICT: rank 0 dies between the manifest and the rename of checkpoint-10.
    pytest.param(2, {"env": {"ACCELERATE_TXN_KILL_AT": "save:after-manifest@0#5"}, "state_dict_type": "FULL_STATE_DICT"},
                 "continue", 8, id="fsdp2-full-state-dict-rank0-after-manifest"),
]


@pytest.mark.parametrize(("fsdp", "kill", "skip_style", "resume_at"), KILLS)
def test_killed_mid_save_resumes_latest_and_ends_bitwise_equal(tmp_path: Path, reference: dict[int, Path], fsdp: int,
                                                               kill: dict[str, Any], skip_style: str,
                                                               resume_at: int | None) -> None:
    killed = _run(tmp_path, fsdp, "--skip_style", skip_style, **kill)
    assert killed.returncode != 0 and killed.timed_out is False, killed.describe()
    published = _published(tmp_path)
    # Whatever the script's own `latest` finds is complete (the killed save left only a hidden staging directory).
    assert all((tmp_path / "out" / f"checkpoint-{n}" / "checkpoint_manifest.json").is_file() for n in published)
    if resume_at is not None:
        assert max(published) == resume_at, published
    same = {key: value for key, value in kill.items() if key == "state_dict_type"}  # the resumed job's settings
    resumed = _run(tmp_path, fsdp, "--skip_style", skip_style, "--resume_from_checkpoint", "latest", **same).check()
    assert _resumed_from(resumed) == max(published), resumed.describe()
    assert _differences(reference[fsdp], tmp_path) == []
    assert not [p.name for p in (tmp_path / "out").iterdir() if ".staging-" in p.name]  # cleaned by the next save


def test_resuming_an_older_checkpoint_saves_over_the_newer_ones_and_ends_exactly(
        tmp_path: Path, reference: dict[int, Path]) -> None:
    # Natively the resumed run overwrites checkpoint-12 and checkpoint-14; with the library they are replaced
    # atomically (no CheckpointExistsError), and the run ends as the uninterrupted one.
    _run(tmp_path, 1).check()
    assert _published(tmp_path) == [10, 12, 14]
    before = {n: json.loads((tmp_path / "out" / f"checkpoint-{n}" / "checkpoint_manifest.json").read_text())
              ["transaction_id"] for n in (12, 14)}
    resumed = _run(tmp_path, 1, "--resume_from_checkpoint", "checkpoint-10").check()
    assert _resumed_from(resumed) == 10
    assert _published(tmp_path) == [12, 14]  # the script's own rotation removed checkpoint-10 before saving 12
    for n in (12, 14):
        after = json.loads((tmp_path / "out" / f"checkpoint-{n}" / "checkpoint_manifest.json").read_text())
        assert after["transaction_id"] != before[n]
    assert _differences(reference[1], tmp_path) == []


def test_a_save_on_the_main_process_only_gets_the_explained_error(tmp_path: Path) -> None:
    result = _run(tmp_path, 1, "--save_on_main_process_only",
                  env={"ACCELERATE_TXN_ARRIVAL_TIMEOUT": "20"}, grace=120)
    assert result.returncode != 0, result.describe()
    rank0 = result.output[0]
    assert "CheckpointArrivalError: save_state() was called on ranks [0] but ranks [1] did not reach it within 20 s" \
        in rank0, result.describe()
    assert "if accelerator.is_main_process:" in rank0
    assert not (tmp_path / "out" / "checkpoint-2").exists()
    assert not [p.name for p in (tmp_path / "out").iterdir() if ".staging-" in p.name]


def test_a_longer_run_resumes_with_one_line_saying_what_changed(tmp_path: Path) -> None:
    _run(tmp_path, 1, "--num_epochs", "2").check()
    assert max(_published(tmp_path)) == 10
    resumed = _run(tmp_path, 1, "--num_epochs", "4", "--resume_from_checkpoint", "latest").check()
    assert _resumed_from(resumed) == 10
    text = "\n".join(resumed.output)
    # Counted in scheduler steps, as the script builds its schedule: 10 batches an epoch before sharding, times 2
    # processes (the prepared scheduler steps once per process).
    assert "the learning-rate schedule's total length changed from 40 to 80 steps" in text, resumed.describe()
    assert sorted(_steps(tmp_path, 0)) == list(range(1, 21))
    assert os.path.isfile(tmp_path / "out" / "final_rank0.pt")
