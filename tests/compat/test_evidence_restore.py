"""What a path does where the evidence does not protect it, in real 2-rank FSDP1 jobs (gloo, CPU): it runs native,
with one warning per process and reason, and restores as native does.

* A release whose ``load_fsdp_model`` body changed (a shadow copy of the installed Accelerate where it loads
  nothing): the FSDP1 restore runs that body wherever the direct read declines the layout (here a
  ``MixedPrecision`` policy), so FSDP1 runs native with one warning naming the piece, writes no manifest, and
  restores exactly what native Accelerate restores with that release (nothing), not "protected" with the model
  silently left as it was. On the installed release the same job is protected and restores exactly, through that
  same body.
* A damaged evidence file (missing, unreadable, not JSON, another structure: a copy of the library first on
  ``PYTHONPATH``): every save and load succeeds natively, after one warning per process naming the file, and
  ``accelerate-txn doctor`` reports every path not protected with the same reason.
(Each piece changed alone, gate and doctor only: tests/compat/test_evidence_shadow.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.runtime.accelerate_internals import ACCELERATE_FSDP1
from accelerate_txn.runtime.versions import OVERRIDE_ENV, PATCH_ENV
from accelerate_txn.testing import launch, run_script
from tests.support.overlay import overlay, shadow_of

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300
LOAD_FSDP_MODEL = next(piece for piece in ACCELERATE_FSDP1 if piece.qualname == "load_fsdp_model")


def _environment(**extra: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in (PATCH_ENV, OVERRIDE_ENV)}
    return {**environment, **extra}


def test_a_changed_load_fsdp_model_turns_the_mixed_precision_fsdp1_restore_native_with_one_warning(
        tmp_path: Path) -> None:
    shadow = shadow_of([LOAD_FSDP_MODEL], tmp_path / "release")["accelerate"]
    for obs in launch("tests.scenarios.evidence_scenarios:mixed_precision_restore", 2,
                      args=(str(tmp_path / "run"), str(shadow)), timeout=TIMEOUT):
        assert obs["accelerate_file"].startswith(str(shadow))  # the changed release ran
        assert obs["protected"] is False and obs["manifest"] is False and obs["direct_loads"] == 0
        # Two saves and a load: one warning, naming the piece; no log record repeats it.
        (warning,) = obs["warnings"]
        assert warning.startswith("accelerate-txn: Accelerate FSDP1 checkpoints run native, NOT protected"), warning
        assert "accelerate.utils.fsdp_utils.load_fsdp_model (its code) differs" in warning
        assert obs["records"] == []
        # The changed release loads nothing: the protected path did not claim a restore it did not make ...
        assert obs["unchanged_by_load"] is True and obs["restored_differences"] != []
        # ... and restored exactly what native Accelerate restores with this release.
        assert obs["native_differences"] == []


def test_the_installed_load_fsdp_model_restores_the_mixed_precision_fsdp1_model_exactly_when_protected(
        tmp_path: Path) -> None:
    for obs in launch("tests.scenarios.evidence_scenarios:mixed_precision_restore", 2, args=(str(tmp_path), None),
                      timeout=TIMEOUT):
        assert obs["protected"] is True and obs["manifest"] is True and obs["warnings"] == []
        assert obs["direct_loads"] == 0  # declined: Accelerate's load_fsdp_model ran
        assert obs["restored_differences"] == [] and obs["native_differences"] == []


DAMAGES = {
    "missing": lambda text: None,
    "unreadable": lambda text: b"\xff\xfe" + text.encode("utf-8")[:100],
    "invalid JSON": lambda text: text[: len(text) // 2],
    "wrong structure": lambda text: json.dumps({**json.loads(text), "pieces": list(json.loads(text)["pieces"])}),
}
REASONS = {"missing": "is missing", "unreadable": "cannot be read (UnicodeDecodeError", "invalid JSON":
           "is not valid JSON", "wrong structure": "has no 'pieces' object"}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_evidence_file_runs_every_path_native_with_one_warning_and_doctor_agrees(
        damage: str, tmp_path: Path) -> None:
    library = overlay("accelerate_txn", tmp_path / "library", {"evidence.json": DAMAGES[damage]})
    environment = _environment(PYTHONPATH=os.pathsep.join([str(library), str(REPO)]))
    reason = f"accelerate-txn's evidence file {library / 'accelerate_txn' / 'evidence.json'} {REASONS[damage]}"
    result = run_script(REPO / "tests" / "scenarios" / "evidence_scenarios.py", [str(tmp_path / "run")], num_processes=2,
                        fsdp_version=1, timeout=TIMEOUT, env=environment)
    assert result.returncode == 0, result.summary() + "\n" + "\n".join(output[-3000:] for output in result.output)
    for output in result.output:
        (line,) = [line for line in output.splitlines() if line.startswith("OBSERVED ")]
        obs: dict[str, Any] = json.loads(line[len("OBSERVED "):])
        assert obs["library"].startswith(str(library)) and obs["distributed_type"] == "FSDP"
        # Saves and the load succeeded natively: no manifest, the model's files, the model restored exactly.
        assert obs["manifest"] is False and obs["model_saved"] is True
        assert obs["changed_by_training"] is True and obs["restored_differences"] == []
        # One warning for the whole process (two saves, a load), naming the file and why; no log record besides.
        (warning,) = obs["warnings"]
        assert warning.startswith(f"accelerate-txn: every checkpoint path runs native, NOT protected: {reason}"), \
            warning
        assert obs["records"] == []
    # The doctor says the same, path by path.
    done = subprocess.run([sys.executable, "-m", "accelerate_txn", "doctor", "--json"], capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=tmp_path, env=environment)
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["protected"] is False
    for name, path in report["paths"].items():
        assert path["status"] == "not protected", (name, path)
        (difference,) = path["differences"]
        assert difference.startswith(reason), difference
