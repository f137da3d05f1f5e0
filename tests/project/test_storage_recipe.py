"""docs/storage.md's "Try it locally" recipe runs as written (issue 35, item 6.5): a loopback moto S3 server, a
bucket, the standard AWS variables, a protected save to ``s3://`` and the command line reading it back.

The one change made to the block: port 5000 becomes a free port (CI runs tests side by side). The server's process
group is ended afterwards whatever happened.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORAGE = ROOT / "docs" / "storage.md"


def _recipe() -> str:
    section = STORAGE.read_text().split("## Try it locally", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "the 'Try it locally' section has one bash block"
    return blocks[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(300)
def test_the_try_it_locally_recipe_saves_to_a_loopback_s3_server_and_lists_it(tmp_path: Path) -> None:
    recipe = _recipe()
    assert "127.0.0.1:5000" in recipe and "AWS_ENDPOINT_URL" in recipe and "s3://my-bucket/run-7" in recipe
    script = tmp_path / "recipe.sh"
    script.write_text(recipe.replace("5000", str(_free_port())))
    nowhere = tmp_path / "no-aws-config"
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HOME=str(tmp_path),
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", AWS_CONFIG_FILE=str(nowhere),
               AWS_SHARED_CREDENTIALS_FILE=str(nowhere), AWS_EC2_METADATA_DISABLED="true")
    shell = subprocess.Popen(["bash", "-e", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = shell.communicate(timeout=240)
    finally:
        try:
            os.killpg(shell.pid, signal.SIGKILL)  # the server, if the recipe stopped before its `kill %1`
        except ProcessLookupError:
            pass
    assert shell.returncode == 0, err[-3000:]
    assert re.search(r"checkpoint_0\s+complete", out) and "newest complete checkpoint: checkpoint_0" in out
    assert "s3://my-bucket/run-7/checkpoint_0: valid" in out
    assert not (tmp_path / "s3:").exists()  # it reached the bucket, not a local directory named s3:
