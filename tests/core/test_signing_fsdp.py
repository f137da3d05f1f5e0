"""Authenticated checkpoints on real 2-rank jobs (tests/scenarios/signing_scenarios.py; issue 37): a checkpoint forged
consistently without the key (a payload and its manifest row rewritten) is refused on every rank before anything is
restored, while the genuine signed one restores exactly: FSDP1 and FSDP2 locally (one launch each), FSDP1 on
``s3://`` (the loopback S3 server; one launch) with ``accelerate-txn verify --key`` refusing the forgery too, and a
transformers Trainer saving under ``ACCELERATE_TXN_SIGNING_KEY_FILE`` (one launch)."""

from __future__ import annotations

import json
import secrets
import uuid
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import MANIFEST
from accelerate_txn.core.signing import load_key
from accelerate_txn.testing import launch
from tests.scenarios.signing_scenarios import FORGED_EPOCH
from tests.support.s3_server import BUCKET, Server

pytestmark = pytest.mark.distributed
TIMEOUT = 420


def _key(directory: Path) -> Path:
    key = directory / "signing.hex"
    key.write_text(secrets.token_hex(32) + "\n")
    return key


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def job(request: Any, tmp_path_factory: Any) -> tuple[Path, str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp(f"signing_fsdp{request.param}")
    key = _key(root)
    observations = launch("tests.scenarios.signing_scenarios:signed_restore", 2, args=(str(root), str(key), request.param),
                          timeout=TIMEOUT)
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


# -- s3:// ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def remote(s3_server: Server, tmp_path_factory: Any) -> tuple[str, Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("signing_s3")
    key = _key(root)
    parent = f"s3://{BUCKET}/signed-{uuid.uuid4().hex[:8]}"
    observations = launch("tests.scenarios.signing_scenarios:signed_remote", 2, args=(parent, str(root / "cache"), str(key)),
                          timeout=TIMEOUT)
    return parent, key, observations


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_forgery_in_the_bucket_is_refused_on_every_rank_and_the_genuine_one_restores(remote: Any) -> None:
    parent, key, observations = remote
    key_id = load_key(key).key_id
    messages = {obs["refused"]["message"] for obs in observations}
    assert len(messages) == 1, messages
    for obs in observations:
        assert obs["refused"]["type"] == "CheckpointAuthenticationError", obs["refused"]
        assert f"{parent}/checkpoint_2/{MANIFEST}: its authenticator does not match its content under key {key_id}" \
            in obs["refused"]["message"], obs["refused"]["message"]
        assert obs["changed"] == []
        assert obs["downloaded"] == []  # refused from the bucket's manifest: nothing of it in the cache
        assert obs["genuine"] is None and obs["genuine_differences"] == []
        assert obs["unkeyed"] is None and obs["unkeyed_epoch"] == FORGED_EPOCH  # consistent: XXH3 cannot tell


@pytest.mark.timeout(TIMEOUT + 60)
def test_cli_verify_with_the_key_refuses_the_forgery_in_the_bucket(remote: Any,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate_txn.cli import main

    parent, key, _ = remote
    key_id = load_key(key).key_id
    assert main(["verify", f"{parent}/checkpoint_1", "--key", str(key)]) == 0
    assert f"the manifest's authenticator, made with key {key_id}" in capsys.readouterr().out
    assert main(["verify", f"{parent}/checkpoint_2", "--key", str(key)]) == 1
    err = capsys.readouterr().err
    assert f"{parent}/checkpoint_2/{MANIFEST}: its authenticator does not match its content under key {key_id}" in err
    assert "Traceback" not in err
    assert main(["verify", f"{parent}/checkpoint_2"]) == 0  # no key: the forgery is consistent, as documented


# -- transformers Trainer ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(tmp_path_factory: Any) -> tuple[Path, Path, list[dict[str, Any]]]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("signing_trainer")
    key = _key(root)
    observations = launch("tests.scenarios.signing_scenarios:signed_trainer", 2, args=(str(root / "out"), str(key)),
                          timeout=TIMEOUT)
    return root / "out", key, observations


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_trainer_save_is_signed_and_a_forged_checkpoint_is_refused_before_anything_loads(trainer: Any) -> None:
    out, key, observations = trainer
    key_id = load_key(key).key_id
    for obs in observations:
        for name, authenticator in obs["authenticators"].items():
            assert authenticator and authenticator.get("key_id") == key_id, (name, authenticator)
    errors = {obs["refused"] for obs in observations}
    assert len(errors) == 1, errors  # the same error on every rank
    (error,) = errors
    assert error.startswith("CheckpointAuthenticationError: "), error
    assert f"{out / 'checkpoint-4' / MANIFEST}: its authenticator does not match its content under key {key_id}" \
        in error, error
    assert all(obs["untouched"] for obs in observations)


@pytest.mark.timeout(TIMEOUT + 60)
def test_resume_from_checkpoint_true_skips_the_forgery_for_the_genuine_older_one(trainer: Any) -> None:
    out, _, observations = trainer
    for obs in observations:
        assert obs["resumed_at"] == 2 and obs["resumed_to"] == 3
    assert json.loads((out / "checkpoint-3" / MANIFEST).read_text()).get("authenticator")
