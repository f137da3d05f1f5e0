"""A protected save onto an object-store FUSE mount (a crafted mount table says gcsfuse) is refused on every rank
alike, with the fix, before anything is written; the job goes on saving elsewhere. Real 2-process gloo runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accelerate_txn.testing import launch
from tests.support.s3_server import BUCKET, Server

pytestmark = pytest.mark.distributed
TIMEOUT = 300


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_a_save_onto_gcsfuse_is_refused_on_every_rank_and_writes_nothing(tmp_path: Path, fsdp_version: int,
                                                                        s3_server: Server) -> None:
    root = Path(os.path.realpath(tmp_path))
    mounted = root / "gcs"
    mounted.mkdir()
    table = root / "mountinfo"
    table.write_text("27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                     f"45 27 0:40 / {mounted} rw,nosuid,nodev,relatime shared:7 - fuse.gcsfuse my-bucket "
                     "rw,user_id=0,group_id=0\n")
    url = f"s3://{BUCKET}/mount-{fsdp_version}/checkpoint_0"
    observed = launch("tests.scenarios.mount_scenarios:save_onto_a_mount", 2,
                      args=(str(root), fsdp_version, str(table), url), timeout=TIMEOUT)
    # Each names its destination, and the directory it would be published in (where the lock and staging go).
    cases = {"save_state": ("run/checkpoint_0", "run"), "async": ("run/checkpoint_1", "run"),
             "automatic": ("project/checkpoints/checkpoint_0", "project/checkpoints"), "url": ("cache", "cache")}
    for case, (destination, parent) in cases.items():
        errors = [obs[case] for obs in observed]
        assert errors[0] == errors[1], (case, errors)  # the same exception and message on both ranks
        error = errors[0]
        assert error is not None and error["type"] == "CheckpointConfigurationError", (case, error)
        assert error["failures"] == [0], (case, error)  # decided by the publishing rank
        message = error["message"]
        assert str(mounted / destination) in message, (case, message)
        assert f"Cannot publish checkpoints in {mounted / parent}" in message, (case, message)
        assert f"it is on {mounted}, a gcsfuse mount of Google Cloud Storage (file system fuse.gcsfuse, source " \
               "my-bucket)" in message, (case, message)
        assert 'save_state("gs://BUCKET/PREFIX/checkpoint_N")' in message, (case, message)
    for obs in observed:
        assert obs["listing"] == []  # nothing written under the mount: no directory, no lock file, no staging
        assert obs["iteration"] == 0  # the automatic name was not consumed
        assert obs["local"] is None and obs["local_published"]
    assert not any(p.name.startswith(".") for p in root.iterdir())
