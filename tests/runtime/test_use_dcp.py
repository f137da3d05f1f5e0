"""Accelerate's per-rank ``use_dcp=False`` format (issue 33, item 4).

No Accelerate release up to 1.16 lets a user choose it through ``save_state``/``load_state`` or the Trainer: only
direct calls of ``save_fsdp_model``/``save_fsdp_optimizer`` take it, which write no checkpoint transaction (the
library wraps neither). A release whose ``save_state`` does let the user choose it changed ``Accelerator.save_state``'s
code, which the FSDP paths rely on: the evidence gate runs them native with the warning naming that piece, and the
library's own routed FSDP2 calls pass a ``use_dcp=False`` through to native Accelerate
(``accelerate_txn/accelerate/patch.py``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.overlay import accelerate_with_a_use_dcp_choice

REPO = Path(__file__).resolve().parents[2]


def test_no_installed_release_lets_save_state_or_load_state_choose_the_per_rank_format() -> None:
    from accelerate import Accelerator
    from accelerate.utils import fsdp_utils

    assert "use_dcp" not in inspect.signature(Accelerator.save_state).parameters
    assert "use_dcp" not in inspect.signature(Accelerator.load_state).parameters
    assert "use_dcp" in inspect.signature(fsdp_utils.save_fsdp_model).parameters  # the direct call takes it


@pytest.mark.timeout(300)
def test_a_release_whose_save_state_chooses_use_dcp_runs_fsdp_native_with_the_warning(tmp_path: Path) -> None:
    shadow = accelerate_with_a_use_dcp_choice(tmp_path)
    code = """
import json, inspect
from accelerate import Accelerator
from accelerate_txn.runtime import versions
print(json.dumps({"parameter": "use_dcp" in inspect.signature(Accelerator.save_state).parameters,
                  "protected": {path: versions.protected(path) for path in ("fsdp1", "fsdp2", "common")},
                  "message": versions.unsupported_message("fsdp2")}))
"""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("ACCELERATE_TXN_PATCHES", "ACCELERATE_TXN_ALLOW_UNVALIDATED")}
    environment["PYTHONPATH"] = os.pathsep.join([str(shadow), str(REPO)])
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True,
                               text=True, timeout=240, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    seen = json.loads(completed.stdout.strip().splitlines()[-1])
    assert seen["parameter"]
    assert seen["protected"] == {"fsdp1": False, "fsdp2": False, "common": False}
    assert "Accelerator.save_state" in seen["message"]
