"""Retention never deletes the newest complete checkpoint of a run: not the library's ``prune`` (the save path's
``total_limit``) whatever ``newest`` its caller passes, and not ``accelerate-txn prune``, which decides from what it
lists while holding the directory lock.

Regression (issue "The guarantee under operators, teardown and odd environments", item 1): the CLI decided from a scan
taken before it held the lock, and ``prune`` protected only the ``newest`` it was given. A save publishing
checkpoint_4 between that scan (checkpoint_1..3, keep 1, "newest" checkpoint_3) and the lock made it delete 1, 2 and
4: the newest checkpoint of the run.

Checkpoints are real: manifest-backed ones published with the library's own primitives (``DirectoryLock``,
``StagedDirectory``, ``build_inventory``, ``write_manifest``), and real protected saves of a single-process
Accelerator. The race runs in two real processes, bounded in count and time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import save_training_checkpoint
from accelerate_txn.cli import main
from accelerate_txn.core.manifest import MANIFEST, PROTOCOL, build_inventory, write_manifest
from accelerate_txn.core.select import complete_run_id, numbered_checkpoints, prune
from accelerate_txn.store.posix import POSIX, DirectoryLock, StagedDirectory

REPO = Path(__file__).resolve().parents[2]
RUN = "0123456789abcdef0123456789abcdef"


def publish_checkpoint(root: Path, number: int, run_id: str = RUN, *, log: Path | None = None) -> Path:
    """Publish a small complete checkpoint ``root/checkpoint_<number>`` as a save does: under the directory lock,
    staged in a hidden sibling, inventory and manifest written last, renamed into place. With ``log``, the number is
    appended to it before the lock is released (so, read under the lock, the log's last line is the newest)."""
    with DirectoryLock(root, timeout=120):
        staged = StagedDirectory(root / f"checkpoint_{number}", run_id)
        staging = staged.create()
        (staging / "model.safetensors").write_bytes(os.urandom(64))
        (staging / "random_states_0.pkl").write_bytes(number.to_bytes(8, "little") * 4)
        write_manifest(staging, {"protocol": PROTOCOL, "status": "complete", "run_id": run_id,
                                 "transaction_id": staged.txid, "integrity": "full", "hash": "xxh3_128",
                                 "files": build_inventory(staging, "full")}, store=POSIX)
        published = staged.publish()
        if log is not None:
            with log.open("a") as stream:
                stream.write(f"{number}\n")
    return published


def _numbers(root: Path) -> list[int]:
    return [number for number, _path in numbered_checkpoints(root)]


def _cli(*args: Any) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in args])
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------------------------- the library's prune


def test_prune_keeps_the_newest_it_lists_whatever_newest_the_caller_passes(tmp_path: Path) -> None:
    # The interleaving of the bug, called directly: the caller's "newest" (checkpoint_3) is stale because
    # checkpoint_4 was published since. Before the fix prune deleted 1, 2 and 4.
    for number in range(1, 5):
        publish_checkpoint(tmp_path, number)
    with DirectoryLock(tmp_path):
        deleted = prune(tmp_path, RUN, 1, tmp_path / "checkpoint_3", store=POSIX)
    assert deleted == [tmp_path / "checkpoint_1", tmp_path / "checkpoint_2"]
    assert _numbers(tmp_path) == [3, 4]  # the newest listed and the caller's newest both stay
    assert complete_run_id(tmp_path / "checkpoint_4") == RUN


def test_save_time_retention_never_deletes_a_newer_checkpoint_of_the_run(tmp_path: Path) -> None:
    # Real protected saves: checkpoint_4 is saved, then checkpoint_3 with total_limit 1 (explicit paths). Retention
    # runs with newest=checkpoint_3; before the fix it deleted checkpoint_4, the run's newest complete checkpoint.
    from tests.accelerate.test_save_single import _accelerator

    accelerator = _accelerator()[0]
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_0")
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_4")
    save_training_checkpoint(accelerator, tmp_path / "checkpoint_3", checkpoint_limit=1)
    assert _numbers(tmp_path) == [3, 4]
    assert all((tmp_path / f"checkpoint_{n}" / MANIFEST).is_file() for n in (3, 4))


# --------------------------------------------------------------------------------------------- the CLI's prune


def test_cli_prune_decides_under_the_lock_when_a_save_publishes_just_before_it(tmp_path: Path, monkeypatch: Any) -> None:
    # Deterministic replay of the race: a save publishes checkpoint_4 right before the CLI takes the lock (the
    # hook runs inside the CLI's acquire, before the real one). Deciding from a scan taken earlier, the CLI deleted
    # checkpoint_4; deciding from what it lists under the lock, it keeps checkpoint_4 and deletes 1..3.
    for number in range(1, 4):
        publish_checkpoint(tmp_path, number)
    real_acquire = DirectoryLock.acquire
    interleaved: list[int] = []

    def acquire(self: DirectoryLock) -> None:
        if not interleaved:
            interleaved.append(4)
            publish_checkpoint(tmp_path, 4)  # its own lock: this nested acquire is the real one
        real_acquire(self)

    monkeypatch.setattr(DirectoryLock, "acquire", acquire)
    code, out, _err = _cli("prune", tmp_path, "--keep", "1", "--json")
    assert code == 0 and interleaved == [4]
    report = json.loads(out)
    assert report["kept"] == [str(tmp_path / "checkpoint_4")]
    assert report["deleted"] == [str(tmp_path / f"checkpoint_{n}") for n in (1, 2, 3)]
    assert _numbers(tmp_path) == [4]


def test_cli_prune_checks_for_corrupt_checkpoints_under_the_lock(tmp_path: Path, monkeypatch: Any) -> None:
    # checkpoint_2 is damaged just before the CLI takes the lock. Checked before the lock, the CLI went on and
    # retention deleted a good checkpoint while counting around the damaged one; checked under it, the CLI refuses
    # (exit 1) and deletes nothing.
    for number in range(1, 4):
        publish_checkpoint(tmp_path, number)
    real_acquire = DirectoryLock.acquire

    def acquire(self: DirectoryLock) -> None:
        (tmp_path / "checkpoint_2" / "model.safetensors").write_bytes(b"truncated")
        real_acquire(self)

    monkeypatch.setattr(DirectoryLock, "acquire", acquire)
    code, _out, err = _cli("prune", tmp_path, "--keep", "1")
    assert code == 1 and "checkpoint_2" in err and "fail verification" in err
    assert _numbers(tmp_path) == [1, 2, 3]


def test_cli_prune_lists_only_while_it_holds_the_lock(tmp_path: Path, monkeypatch: Any) -> None:
    import accelerate_txn.cli._commands as commands

    for number in range(1, 4):
        publish_checkpoint(tmp_path, number)
    held: list[bool] = []
    real_acquire, real_release, real_scan = DirectoryLock.acquire, DirectoryLock.release, commands.scan_run_directory
    state = {"locked": False}

    def acquire(self: DirectoryLock) -> None:
        real_acquire(self)
        state["locked"] = True

    def release(self: DirectoryLock) -> None:
        state["locked"] = False
        real_release(self)

    def scan(root: Path, *args: Any) -> Any:  # (root, trainer): whether it is a Trainer output directory
        held.append(state["locked"])
        return real_scan(root, *args)

    monkeypatch.setattr(DirectoryLock, "acquire", acquire)
    monkeypatch.setattr(DirectoryLock, "release", release)
    monkeypatch.setattr(commands, "scan_run_directory", scan)
    assert _cli("prune", tmp_path, "--keep", "2")[0] == 0
    assert held and all(held), held
    assert _numbers(tmp_path) == [2, 3]
    held.clear()
    assert _cli("prune", tmp_path, "--keep", "1", "--dry-run")[0] == 0  # the preview takes no lock
    assert held == [False] and _numbers(tmp_path) == [2, 3]


def test_cli_prune_dry_run_states_the_rule_prune_applies(tmp_path: Path) -> None:
    for number in range(1, 5):
        publish_checkpoint(tmp_path, number)
    code, out, _err = _cli("prune", tmp_path, "--keep", "2", "--dry-run", "--json")
    assert code == 0
    preview = json.loads(out)
    code, out, _err = _cli("prune", tmp_path, "--keep", "2", "--json")
    assert code == 0
    done = json.loads(out)
    assert preview["would_delete"] == done["deleted"] == [str(tmp_path / f"checkpoint_{n}") for n in (1, 2)]
    assert preview["kept"] == done["kept"] == [str(tmp_path / f"checkpoint_{n}") for n in (3, 4)]


# --------------------------------------------------------------------------------------------- a real race

# Publishes checkpoint_0, 1, 2, ... until the stop file appears (at most ``limit``), with a "training step" of CPU
# work between saves; after each publish it writes one byte to the pipe ``signal`` (the pruner waits on it).
_PUBLISHER = """
import hashlib, os, sys
from pathlib import Path
from tests.core.test_guarantee_retention import publish_checkpoint
root, log, stop = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
limit, work, signal = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
count = 0
while count < limit and not stop.exists():
    for _ in range(work):  # a training step between two saves: CPU work outside the lock, as in a real run
        hashlib.sha256(bytes(1 << 20)).digest()
    publish_checkpoint(root, count, log=log)
    count += 1
    try:
        os.write(signal, b"p")
    except BrokenPipeError:  # the pruner is done
        break
print("published", count, flush=True)
"""

# 30 rounds of ``accelerate-txn prune --keep 1`` (the CLI's main, in this process), each after two more publishes;
# after each, what the directory holds, read under the lock.
_PRUNER = """
import contextlib, io, json, os, sys
from pathlib import Path
from accelerate_txn.core.select import numbered_checkpoints
from accelerate_txn.store.posix import DirectoryLock
from accelerate_txn.cli import main

root, log, iterations, attempts, signal = (Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                           int(sys.argv[5]))
rounds = []
for _ in range(iterations):
    waited = 0
    while waited < 2:  # two more publishes since the last round (blocking read: the publisher's pipe)
        got = os.read(signal, 2 - waited)
        if not got:
            sys.exit("the publisher stopped")
        waited += len(got)
    before = max(n for n, _ in numbered_checkpoints(root))  # the newest when this prune starts
    for attempt in range(attempts):  # while a save holds the lock prune fails at once (exit 1): retry
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["prune", str(root), "--keep", "1", "--json"])
        if code == 0 or "Another writer holds the lock" not in err.getvalue():
            break
    report = json.loads(out.getvalue()) if code == 0 else None
    # Under the lock the publisher is stopped, and its log's last line is exactly the newest checkpoint published.
    with DirectoryLock(root, timeout=120):
        newest_published = int(log.read_text().split()[-1])
        present = [n for n, _ in numbered_checkpoints(root)]
    rounds.append({"code": code, "error": err.getvalue()[-2000:], "before": before, "present": present,
                   "newest_published": newest_published,
                   "deleted": [int(Path(p).name.split("_")[1]) for p in report["deleted"]] if report else []})
print(json.dumps(rounds), flush=True)
"""


@pytest.mark.timeout(300)
def test_cli_prune_racing_a_publishing_process_never_deletes_the_newest(tmp_path: Path) -> None:
    root, log, stop = tmp_path / "run", tmp_path / "published.log", tmp_path / "stop"
    root.mkdir()
    readable, writable = os.pipe()
    # stderr to files: the lock's "waiting" log lines must never fill a pipe nobody reads yet.
    with (tmp_path / "publisher.err").open("w") as publisher_err, (tmp_path / "pruner.err").open("w") as pruner_err:
        try:
            publisher = subprocess.Popen(
                [sys.executable, "-c", _PUBLISHER, str(root), str(log), str(stop), "20000", "4", str(writable)],
                cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=publisher_err, pass_fds=(writable,))
            pruner = subprocess.Popen(
                [sys.executable, "-c", _PRUNER, str(root), str(log), "30", "100000", str(readable)],
                cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=pruner_err, pass_fds=(readable,))
        finally:
            os.close(readable)
            os.close(writable)  # only the publisher holds it now: its exit ends the pruner's wait
        try:
            pruned, _ = pruner.communicate(timeout=240)
        finally:
            stop.touch()
            for process in (pruner, publisher):
                if process.poll() is None:
                    try:
                        process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        process.kill()
            rest, _ = publisher.communicate(timeout=60)
    assert publisher.returncode == 0, (tmp_path / "publisher.err").read_text()[-3000:]
    assert pruner.returncode == 0, (tmp_path / "pruner.err").read_text()[-3000:]
    rounds = json.loads(pruned)
    assert len(rounds) == 30
    for r in rounds:
        # The newest checkpoint ever published still exists (retention ran under the lock, so what it listed as
        # newest was the newest published at that moment; anything published later it never saw).
        assert r["newest_published"] in r["present"], r
        # Nothing it deleted was the newest at the time: a newer one it kept is still there.
        assert all(any(n > d for n in r["present"]) for d in r["deleted"]), r
        # The newest when the prune started, or a newer one published meanwhile, is still there.
        assert max(r["present"]) >= r["before"], r
    # Every round pruned: a round whose prune found the lock held retried at once until it got it (the publisher
    # leaves it free during its training step), and no other error occurred.
    assert [r["code"] for r in rounds] == [0] * 30, [r["error"] for r in rounds if r["code"]]
    assert sum(len(r["deleted"]) for r in rounds) > 0
    assert all(complete_run_id(path) == RUN for _n, path in numbered_checkpoints(root))
    assert int(rest.split()[-1]) >= 2
