"""A synchronous protected FSDP1 save builds its sharded state dicts from views of the local shards: real
2-process gloo FSDP1, real DCP files, both loaders."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelerate_txn.testing import launch

# A hang guard per launch, not a time budget (as tests/runtime/test_async_save.py's); pytest's timeout is a backstop.
TIMEOUT = 720.0
pytestmark = pytest.mark.timeout(int(TIMEOUT) + 60)


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_sync_save_runs_no_fsdp_collective_copies_nothing_and_restores_exactly_with_both_loaders(
        tmp_path: Path, use_orig_params: bool) -> None:
    for obs in launch("tests.scenarios.sync_capture_scenarios:sync_capture", 2, args=(str(tmp_path), use_orig_params),
                      timeout=TIMEOUT):
        assert obs["sync_type"] == "PosixPath"  # synchronous: published when save_state returned
        # The capture path: no FSDP gather in the caller (native Accelerate's save of the same state ran them),
        # and no copy larger than a 0-dim step tensor (the boxes are views of the live shards).
        assert obs["sync_collectives"] == [], obs["sync_collectives"]
        assert obs["native_collectives"] > 0
        assert obs["copies"] > 0 and obs["largest_copy"] <= 1, obs
        # The DCP entries (keys, global shapes, dtypes) of native Accelerate's own save.
        assert obs["dcp_differences"] == [] and obs["dcp_entries"] > 0
        # Written before save_state returned: training right after changed the state, not the files.
        assert obs["training_moved"] and obs["files_unchanged"]
        assert obs["protected_differences"] == [] and obs["next_step_differences"] == []
        # Native load_state restores it exactly, or (Accelerate 1.7-1.12) fails as on its own native files.
        assert obs["native_differences"] == [] or (
            obs["native_differences"] is None and obs["native_error"] == obs["native_reference_error"]), obs
        # Declined on one rank: every rank built natively (FSDP's gathers ran) and the save is exact.
        assert obs["declined_collectives"] > 0 and obs["declined_differences"] == []
