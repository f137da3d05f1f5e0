"""Workers never outlive the process that started them: ``kill -9`` of a real parent that called
:func:`~accelerate_txn.testing.launch`, or :func:`~accelerate_txn.testing.start_script` on a silent script, and its
ranks end too (the shared lifeline, ``accelerate_txn/testing/_lifeline.py``).

Each case starts a real parent process, waits (polling, bounded by a hang guard) until both ranks have recorded their
pids, ``kill -9``s the parent, then polls those pids until they are gone. Without the lifeline the ranks keep running
(``launch``'s daemon processes end only on a clean exit of their parent; the launcher's workers of a script that
prints nothing never notice) and the bounded wait fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD = 120.0  # seconds: a bound on waiting for the ranks to start or to end, never a timing under test
POLL = 0.05  # the poll interval of those waits

# A long-running rank: it records its pid, then works until something ends it. It prints nothing (a worker that
# prints would also learn of the launcher's end from a broken pipe).
SPIN = '''\
import os
import sys
import time
from pathlib import Path


def spin(folder):
    path = Path(folder) / f"rank{os.environ['RANK']}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    while True:  # "training": until killed
        time.sleep(0.05)


if __name__ == "__main__":
    spin(sys.argv[1])
'''

PARENTS = {
    "launch": "from accelerate_txn.testing import launch; import sys; sys.path.insert(0, {folder!r}); "
              "launch('spin:spin', 2, args=({folder!r},), timeout=3600, env={{'PYTHONPATH': {folder!r}}})",
    "start_script": "from accelerate_txn.testing import run_script; "
                    "run_script({script!r}, [{folder!r}], timeout=3600, cwd={folder!r})",
}


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended: an orphan's reaper may be slow to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            state = stream.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X", "x")


def _poll(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within the hang guard ({HANG_GUARD:.0f} s)")
        time.sleep(POLL)  # a poll interval inside a hang guard, not a synchronisation


@pytest.mark.timeout(300)
@pytest.mark.parametrize("starter", sorted(PARENTS))
def test_ranks_end_when_the_process_that_started_them_is_killed(tmp_path: Path, starter: str) -> None:
    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    code = PARENTS[starter].format(folder=str(tmp_path), script=str(script))
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
        _poll(lambda: all(path.exists() for path in files) or parent.poll() is not None, "the ranks did not start")
        assert parent.poll() is None, parent.communicate()[1].decode()
        pids = [int(path.read_text()) for path in files]
        assert all(_running(pid) for pid in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        _poll(lambda: not any(_running(pid) for pid in pids), f"ranks {pids} outlived their killed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids:  # only if the test failed: leave nothing running
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
