"""``protect="all"`` (``configure_checkpointing`` or ``ACCELERATE_TXN_PROTECT=all``): one process and DDP
``save_state``/``load_state`` take the protected path too. The default stays: FSDP sharded protected, the rest native.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import accelerate_txn
from accelerate_txn import MANIFEST
from accelerate_txn.accelerate.config import PROTECT_ENV
from accelerate_txn.errors import CheckpointConfigurationError, CheckpointIntegrityError
from accelerate_txn.testing import launch
from tests.support.single import stepped_accelerator

REPO = Path(__file__).resolve().parents[2]


def _accelerator(seed: int = 0) -> tuple[Accelerator, Any, Any]:
    return stepped_accelerator(seed)


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _no_protect_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROTECT_ENV, raising=False)


def test_one_process_runs_native_by_default(tmp_path: Path) -> None:
    accelerator, _, _ = _accelerator()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert not (tmp_path / "checkpoint-1" / MANIFEST).exists()
    assert (tmp_path / "checkpoint-1" / "model.safetensors").is_file()


def test_protect_all_publishes_verifies_and_restores_one_process(tmp_path: Path) -> None:
    accelerator, model, _ = _accelerator()
    accelerate_txn.configure_checkpointing(accelerator, protect="all")
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert (tmp_path / "checkpoint-1" / MANIFEST).is_file()
    saved = _weights(model)
    # A corrupt copy is refused before anything is restored.
    fresh, model2, _ = _accelerator(seed=5)
    accelerate_txn.configure_checkpointing(fresh, protect="all")
    before = _weights(model2)
    bad = tmp_path / "checkpoint-2"
    import shutil

    shutil.copytree(tmp_path / "checkpoint-1", bad)
    payload = bad / "model.safetensors"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors"):
        fresh.load_state(str(bad))
    assert all(torch.equal(before[name], p) for name, p in model2.named_parameters())
    fresh.load_state(str(tmp_path / "checkpoint-1"))
    assert all(torch.equal(saved[name], p) for name, p in model2.named_parameters())


def test_the_environment_turns_it_on_and_configure_checkpointing_wins(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTECT_ENV, " ALL ")
    accelerator, _, _ = _accelerator()
    accelerator.save_state(str(tmp_path / "protected"))
    assert (tmp_path / "protected" / MANIFEST).is_file()
    accelerate_txn.configure_checkpointing(accelerator, protect="fsdp")
    accelerator.save_state(str(tmp_path / "native"))
    assert not (tmp_path / "native" / MANIFEST).exists()


def test_dispatch_off_stays_exactly_native_with_protect_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTECT_ENV, "all")
    monkeypatch.setenv("ACCELERATE_TXN_PATCHES", "0")
    accelerator, _, _ = _accelerator()
    accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert not (tmp_path / "checkpoint-1" / MANIFEST).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no lock file, no staging


def test_invalid_values_are_refused_naming_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, _, _ = _accelerator()
    with pytest.raises(CheckpointConfigurationError, match=r"protect='everything'.*use 'fsdp'"):
        accelerate_txn.configure_checkpointing(accelerator, protect="everything")
    monkeypatch.setenv(PROTECT_ENV, "yes")
    with pytest.raises(CheckpointConfigurationError, match=rf"{PROTECT_ENV} is 'yes': use 'fsdp' or 'all'"):
        accelerator.save_state(str(tmp_path / "checkpoint-1"))
    assert not (tmp_path / "checkpoint-1").exists()


_KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch
    from accelerate import Accelerator
    import accelerate_txn
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for number in (1, 2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if number == 2:
            os.environ["ACCELERATE_TXN_KILL_AT"] = sys.argv[2]
        accelerator.save_state(os.path.join(sys.argv[1], f"checkpoint-{number}"))
""")


@pytest.mark.parametrize("point", ["save:during-flush", "save:after-manifest"])
def test_a_one_process_save_killed_mid_save_is_never_published(tmp_path: Path, point: str) -> None:
    env = {**os.environ, PROTECT_ENV: "all", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path), point], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["checkpoint-1"]
    assert [p.name for p in tmp_path.iterdir() if ".checkpoint-2.staging-" in p.name]  # the unpublished save
    assert accelerate_txn.latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_ddp_on_two_ranks_is_protected_with_protect_all(tmp_path: Path) -> None:
    results = launch("tests.scenarios.scenarios:multi_cpu_protect_all", 2, args=(str(tmp_path),), timeout=600,
                     env={PROTECT_ENV: "all"})
    for obs in results:
        assert obs["backend"] == "MULTI_CPU"
        assert obs["manifest"] and obs["differences"] == []
        assert obs["corrupt"]["type"] == "CheckpointIntegrityError", obs["corrupt"]
        assert obs["corrupt_unchanged"]
