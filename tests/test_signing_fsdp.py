"""Authenticated checkpoints on a real 2-rank FSDP1 job (one launch; tests/_signing_scenarios.py): a checkpoint
forged consistently without the key is refused on every rank before anything is restored, while the genuine signed
one restores exactly."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.core.signing import load_key
from accelerate_txn.testing import launch
from tests._signing_scenarios import FORGED_EPOCH

pytestmark = pytest.mark.distributed
TIMEOUT = 420


@pytest.fixture(scope="module")
def job(tmp_path_factory: Any) -> tuple[Path, str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("signing")
    key = root / "signing.hex"
    key.write_text(secrets.token_hex(32) + "\n")
    observations = launch("tests._signing_scenarios:signed_restore", 2, args=(str(root), str(key)), timeout=TIMEOUT)
    return root, load_key(key).key_id, observations


@pytest.mark.timeout(TIMEOUT + 60)
def test_forged_checkpoint_is_refused_on_every_rank_before_anything_changes(job: Any) -> None:
    root, key_id, observations = job
    forged = root / "run" / "checkpoint_1"
    messages = {obs["refused"]["message"] for obs in observations}
    assert len(messages) == 1, messages  # the same error on every rank
    for obs in observations:
        assert obs["refused"]["type"] == "CheckpointAuthenticationError"
        assert f"{forged}/checkpoint_manifest.json: its authenticator does not match its content under key {key_id}" \
            in obs["refused"]["message"]
        assert obs["changed"] == [] and obs["same_as_saved"] == []
        assert obs["latest"] == str(root / "run" / "checkpoint_0")  # selection skips the forgery


@pytest.mark.timeout(TIMEOUT + 60)
def test_genuine_signed_checkpoint_restores_and_the_forgery_is_consistent(job: Any) -> None:
    _, _, observations = job
    for obs in observations:
        assert obs["genuine"] is None and obs["genuine_differences"] == []
        # Without a key the forged payload passes every XXH3 check and is restored: only the authenticator tells.
        assert obs["unkeyed"] is None and obs["unkeyed_epoch"] == FORGED_EPOCH
