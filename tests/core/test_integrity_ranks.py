"""Who hashes and flushes what: the explicit API's version gate, and the per-rank split of the save's hash-and-fsync
pass and of the restore's re-hash (issue: every rank used to fsync every file of the staged tree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.core.manifest import writer_rank
from accelerate_txn.testing import launch
from tests.support.overlay import accelerate_with_a_renamed_parameter

REPO = Path(__file__).resolve().parents[2]

_GATE = """
    import json, os, sys, tempfile
    import accelerate_txn  # with an Accelerate that changed a private piece (tests/support/overlay.py) first on the path
    from accelerate import Accelerator
    from accelerate_txn.errors import UnsupportedVersionError

    obs = {}
    acc = Accelerator(cpu=True)
    root = tempfile.mkdtemp()
    for name, call in (("save", lambda: accelerate_txn.save_training_checkpoint(acc, os.path.join(root, "a"))),
                       ("load", lambda: accelerate_txn.load_training_checkpoint(acc, root))):
        try:
            call()
            obs[name] = None
        except UnsupportedVersionError as exc:
            obs[name] = str(exc)
    obs["published_without_override"] = os.path.exists(os.path.join(root, "a"))
    os.environ["ACCELERATE_TXN_ALLOW_UNVALIDATED"] = "1"
    path = accelerate_txn.save_training_checkpoint(acc, os.path.join(root, "b"))
    obs["published_with_override"] = (path / accelerate_txn.MANIFEST).is_file()
    print(json.dumps(obs))
"""


def test_explicit_api_applies_the_evidence_gate_of_the_patched_methods(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "ACCELERATE_TXN_ALLOW_UNVALIDATED"}
    environment["PYTHONPATH"] = str(accelerate_with_a_renamed_parameter(tmp_path))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_GATE)], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    obs = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("save", "load"):
        assert obs[name] and "accelerate.utils.fsdp_utils.load_fsdp_optimizer has the parameters" in obs[name]
        assert "ACCELERATE_TXN_ALLOW_UNVALIDATED" in obs[name]
    assert obs["published_without_override"] is False
    assert obs["published_with_override"] is True


@pytest.mark.parametrize("name, world, expected", [
    ("pytorch_model_fsdp_0/__1_0.distcp", 2, 1),
    ("optimizer_0/__0_0.distcp", 2, 0),
    ("pytorch_model_fsdp_0/.metadata", 2, 0),
    ("random_states_1.pkl", 2, 1),
    ("training_state_1.pt", 2, 1),
    ("model/random_states_1.pkl", 2, 1),
    ("scheduler_1.bin", 2, 0),  # an index, not a rank: written by the main process
    ("custom_checkpoint_1.pkl", 2, 0),
    ("random_states_3.pkl", 2, 0),  # a rank that no longer exists: rank 0 takes it
])
def test_writer_rank_attributes_each_file_to_the_process_that_wrote_it(name: str, world: int, expected: int) -> None:
    assert writer_rank(name, world, ("random_states_{rank}.pkl", "training_state_{rank}.pt")) == expected


def test_each_rank_hashes_and_flushes_only_its_own_files_and_together_they_cover_the_tree(tmp_path: Any) -> None:
    results = launch("tests.scenarios.scenarios:own_files", 2, args=(str(tmp_path),), timeout=240)
    mine = [set(obs["mine"]) for obs in results]
    assert not (mine[0] & mine[1])
    assert mine[0] | mine[1] == set(results[0]["tree"])
    assert {name for name in mine[1] if not name.endswith(".distcp")} == {"random_states_1.pkl", "training_state_1.pt"}
    assert any(name.endswith("__1_0.distcp") for name in mine[1])
    assert "pytorch_model_fsdp_0/.metadata" in mine[0] and "scheduler.bin" in mine[0]
    for obs in results:  # the rows a rank contributes are the ones the published manifest records
        assert obs["rows_match_manifest"]
