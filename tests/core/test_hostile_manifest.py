"""Hostile inputs (issue 7): manifests with entries outside the checkpoint, deep nesting, huge size, symbolic links
and malformed rows; pickles that would run code. Single process: a real protected save of a plain (non-FSDP)
Accelerator, then the manifest reader, verification, selection, the restore and the command line on altered copies.
Every refusal is a CheckpointIntegrityError (never RecursionError, MemoryError, ...), nothing runs code, and
nothing changes before a refusal.
"""

from __future__ import annotations

import copy
import errno
import fractions
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from accelerate_txn import (
    CheckpointIntegrityError,
    load_training_checkpoint,
    register_checkpoint_state,
    save_training_checkpoint,
)
from accelerate_txn.accelerate.config import checkpoint_config
from accelerate_txn.accelerate.selection import checkpoint_candidates, latest_training_checkpoint
from accelerate_txn.cli import main as cli
from accelerate_txn.core.manifest import MANIFEST, hash_file, read_manifest, verify_manifest
from tests.scenarios.corruption_scenarios import Counter, Exploit, warmup

DEEP = 200_000


class _Tagged(Counter):
    """A custom object whose state holds a type ``weights_only`` refuses (needs the trust opt-in)."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": fractions.Fraction(self.count, 3)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ratio = state["ratio"]


def _run(seed: int, project_dir: Path | None = None, custom: type[Counter] = Counter) -> dict[str, Any]:
    """A plain single-process Accelerator with a scheduler, a custom object and a registered private state."""
    project = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True) if project_dir else None
    accelerator = Accelerator(cpu=True, project_config=project)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = custom(seed)
    accelerator.register_for_checkpointing(counter)
    noise = torch.Generator().manual_seed(seed)
    progress = {"batches": seed}
    register_checkpoint_state(accelerator, {"noise": noise}, progress)
    for _ in range(seed % 3 + 1):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {"acc": accelerator, "model": model, "opt": optimizer, "sched": scheduler, "counter": counter,
            "noise": noise, "progress": progress}


def _state(run: dict[str, Any]) -> dict[str, Any]:
    raw = getattr(run["opt"], "optimizer", run["opt"])
    return copy.deepcopy({
        "parameters": [p.detach().clone() for p in run["model"].parameters()],
        "optimizer": [dict(s) for s in raw.state.values()],
        "scheduler": run["sched"].state_dict(),
        "custom": run["counter"].state_dict(),
        "private": (run["noise"].get_state(), dict(run["progress"])),
        "rng": torch.get_rng_state(),
    })


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> Path:
    """A complete protected checkpoint (model, optimizer, scheduler, custom object, RNG, private state)."""
    path = tmp_path_factory.mktemp("saved") / "checkpoint_0"
    save_training_checkpoint(_run(0)["acc"], path)
    return path


def _copy(saved: Path, target: Path) -> Path:
    shutil.copytree(saved, target)
    return target


def _manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / MANIFEST).read_text())


def _write(directory: Path, manifest: Any) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest))


def _cli(capsys: Any, *argv: str) -> tuple[int, str]:
    status = cli(list(argv))
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text
    return status, text


def _refused(directory: Path, pattern: str) -> None:
    with pytest.raises(CheckpointIntegrityError, match=pattern):
        verify_manifest(directory, read_manifest(directory), full=True)


# --- entries outside the checkpoint -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside.bin", "a/../../outside.bin", "./../outside.bin", "/etc/hostname",
                                  "sub\\..\\..\\outside.bin", "scheduler.bin\x00.txt", ""])
def test_entry_pointing_outside_the_checkpoint_is_refused(saved: Path, tmp_path: Path, capsys: Any, name: str) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    manifest = _manifest(directory)
    size, digest = hash_file(outside)
    manifest["files"][name] = {"size": size, "xxh3_128": digest}
    _write(directory, manifest)
    _refused(directory, r"points outside its checkpoint directory")
    assert _cli(capsys, "verify", str(directory), "--full")[0] == 1


# --- deep nesting --------------------------------------------------------------------------------------------------

def _deep_manifests(saved: Path) -> dict[str, str]:
    valid = (saved / MANIFEST).read_text().rstrip()
    return {
        "array": "[" * DEEP + "]" * DEEP,
        "object": '{"a":' * DEEP + "1" + "}" * DEEP,
        "inside a valid manifest": valid[:-1] + ', "pad": ' + "[" * DEEP + "]" * DEEP + "}",
    }


@pytest.mark.parametrize("kind", ["array", "object", "inside a valid manifest"])
def test_manifest_nested_200000_levels_is_an_integrity_error(saved: Path, tmp_path: Path, kind: str) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    (directory / MANIFEST).write_text(_deep_manifests(saved)[kind])
    with pytest.raises(CheckpointIntegrityError, match=r"nested too deeply|nested deeper than|not a JSON object"):
        read_manifest(directory)


def test_manifest_depth_limit_is_32(saved: Path, tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    manifest = _manifest(directory)
    for levels, refused in ((30, False), (31, False), (32, True)):  # the top-level object is level 1
        pad: Any = 0
        for _ in range(levels):
            pad = [pad]
        _write(directory, {**manifest, "pad": pad})
        if refused:
            with pytest.raises(CheckpointIntegrityError, match=r"nested deeper than 32"):
                read_manifest(directory)
        else:
            assert read_manifest(directory)["pad"] == pad


def test_deeply_nested_sibling_never_blocks_selection_saving_or_the_cli(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "run"
    run = _run(0)
    save_training_checkpoint(run["acc"], root / "checkpoint_0")
    deep = _copy(root / "checkpoint_0", root / "checkpoint_1")
    (deep / MANIFEST).write_text("[" * DEEP + "]" * DEEP)
    assert latest_training_checkpoint(root) == str(root / "checkpoint_0")
    found, reasons = checkpoint_candidates(root, run["acc"])
    assert found == [root / "checkpoint_0"]
    assert len(reasons) == 1 and reasons[0].startswith("checkpoint_1: ")
    assert _cli(capsys, "verify", str(deep))[0] == 1
    assert _cli(capsys, "verify", str(deep), "--full")[0] == 1
    status, text = _cli(capsys, "list", str(root))
    assert status == 0 and "checkpoint_1" in text
    status, text = _cli(capsys, "latest", str(root))
    assert status == 0 and str(root / "checkpoint_0") in text
    # The next save into the same directory is not blocked by the corrupt sibling.
    assert save_training_checkpoint(run["acc"], root / "checkpoint_2") == root / "checkpoint_2"
    assert latest_training_checkpoint(root) == str(root / "checkpoint_2")


def test_deeply_nested_sibling_is_skipped_by_automatic_restore_and_the_next_automatic_save_works(
        tmp_path: Path) -> None:
    saver = _run(0, tmp_path)
    save_training_checkpoint(saver["acc"])
    expected = _state(saver)
    checkpoints = tmp_path / "checkpoints"
    deep = _copy(checkpoints / "checkpoint_0", checkpoints / "checkpoint_1")
    (deep / MANIFEST).write_text("[" * DEEP + "]" * DEEP)
    resumed = _run(1, tmp_path)
    assert load_training_checkpoint(resumed["acc"]) == checkpoints / "checkpoint_0"
    assert _equal(_state(resumed), expected)
    # The next automatic save must not be blocked by the corrupt checkpoint_1 (it takes the next free number).
    published = save_training_checkpoint(resumed["acc"])
    assert published.parent == checkpoints and published.name != "checkpoint_1"


# --- huge manifests ------------------------------------------------------------------------------------------------

_MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    from accelerate_txn.core.manifest import read_manifest
    from accelerate_txn.errors import CheckpointIntegrityError
    from accelerate_txn.cli import main
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read_manifest(sys.argv[1])
        outcome = "read"
    except CheckpointIntegrityError as exc:
        outcome = "refused: " + str(exc)
    status = main(["verify", sys.argv[1], "--full"])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"outcome": outcome, "status": status, "growth_kib": after - before}))
""")


def test_huge_manifest_is_refused_without_being_read(saved: Path, tmp_path: Path) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    path = directory / MANIFEST
    path.write_text("{")
    os.truncate(path, 100 * 1000 * 1000)  # sparse: 100 MB that cost no disk
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(directory)], capture_output=True, text=True,
                          timeout=120, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("refused: ") and "over the 67108864 byte limit" in result["outcome"]
    assert result["status"] == 1
    assert result["growth_kib"] < 50 * 1024, result  # reading it whole would take over 100 MB
    assert "Traceback" not in done.stderr


def test_huge_sibling_is_skipped_by_selection(saved: Path, tmp_path: Path) -> None:
    _copy(saved, tmp_path / "checkpoint_0")
    huge = _copy(saved, tmp_path / "checkpoint_1")
    (huge / MANIFEST).write_text("{")
    os.truncate(huge / MANIFEST, 100 * 1000 * 1000)
    assert latest_training_checkpoint(tmp_path) == str(tmp_path / "checkpoint_0")


# --- symbolic links ------------------------------------------------------------------------------------------------

def test_manifest_that_is_a_symbolic_link_is_refused(saved: Path, tmp_path: Path, capsys: Any) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    outside = tmp_path / "manifest-copy.json"
    shutil.copy2(directory / MANIFEST, outside)
    (directory / MANIFEST).unlink()
    (directory / MANIFEST).symlink_to(outside)
    with pytest.raises(CheckpointIntegrityError, match=r"symbolic link"):
        read_manifest(directory)
    assert _cli(capsys, "verify", str(directory), "--full")[0] == 1
    assert checkpoint_candidates(tmp_path)[0] == []


def test_checkpoint_directory_that_is_a_symbolic_link_is_refused(saved: Path, tmp_path: Path) -> None:
    link = tmp_path / "checkpoint_0"
    link.symlink_to(saved, target_is_directory=True)
    with pytest.raises(CheckpointIntegrityError, match=r"symbolic link"):
        verify_manifest(link, read_manifest(link), full=True)


# --- special files ---------------------------------------------------------------------------------------------------

_FIFO_PROBE = textwrap.dedent("""
    import json, os, sys

    # Everything the steps use is imported before the first step: no step's outcome depends on import time.
    import torch  # noqa: F401
    import torch.distributed.checkpoint.metadata  # noqa: F401  (read_dcp_metadata imports it on first use)
    from accelerate_txn.core.manifest import read_dcp_metadata, read_manifest, verify_manifest
    from accelerate_txn.core.select import checkpoint_candidates
    from accelerate_txn.cli import main

    events = os.fdopen(int(sys.argv[1]), "w", buffering=1)  # the test's own pipe: stdout carries the CLI's output

    def report(*event):
        events.write(json.dumps(event) + "\\n")

    def step(name, function):
        report("start", name)  # the test knows which step is running should one never return
        try:
            value = function()
            result = value if isinstance(value, (int, str)) else "returned"
        except Exception as exc:
            result = type(exc).__name__
        report("done", name, result)

    run, fifo_manifest, fifo_file, dcp = sys.argv[2:6]
    step("read_manifest", lambda: read_manifest(fifo_manifest))
    step("verify listed file", lambda: verify_manifest(fifo_file, read_manifest(fifo_file), full=True))
    step("selection", lambda: [p.name for p in checkpoint_candidates(run)[0]] == ["checkpoint_0"] and "ok")
    step("cli verify", lambda: main(["verify", fifo_manifest, "--full"]))
    step("cli latest", lambda: main(["latest", run]))
    step("read_dcp_metadata", lambda: read_dcp_metadata(dcp))
    report("finished")
    sys.stdin.readline()  # alive until the test has checked that no descriptor of a named pipe is still open
""")

# Only a hang guard: the probe takes seconds even on a loaded machine, and a reader blocked on a named pipe waits
# forever, so no limit decides the outcome; when it expires the test reports which step is stuck, and where.
_FIFO_HANG_GUARD_S = 300.0


def _fifos_with_a_reader(fifos: list[Path]) -> list[str]:
    """The named pipes some process holds open for reading, including one blocked in open(): an open for writing
    with O_NONBLOCK fails with ENXIO exactly when no reader has the pipe open, and never waits."""
    held = []
    for fifo in fifos:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
        else:
            os.close(fd)  # a reader blocked in open() returns now and reads end-of-file
            held.append(str(fifo))
    return held


def test_the_named_pipe_check_sees_a_reader_blocked_in_open(tmp_path: Path) -> None:
    # What the test below relies on: a reader blocked in open() on a named pipe is seen (and released) by
    # _fifos_with_a_reader. The reader can only return once a writer appeared, so polling for it races nothing.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert _fifos_with_a_reader([fifo]) == []
    reader = subprocess.Popen([sys.executable, "-c", "import sys; assert open(sys.argv[1], 'rb').read() == b''",
                               str(fifo)])
    try:
        seen: list[str] = []
        deadline = time.monotonic() + _FIFO_HANG_GUARD_S  # a hang guard only: the reader waits forever until seen
        while not seen:
            assert reader.poll() is None, "the reader returned although no writer ever opened the pipe"
            assert time.monotonic() < deadline, "the blocked reader was never seen"
            seen = _fifos_with_a_reader([fifo])
            time.sleep(0.01)  # polling interval, not synchronisation
        assert seen == [str(fifo)]
        assert reader.wait(timeout=_FIFO_HANG_GUARD_S) == 0  # released by the check: it read end-of-file
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()


def test_named_pipes_in_a_checkpoint_never_block_a_reader(saved: Path, tmp_path: Path) -> None:
    # A FIFO blocks open() for reading until a writer appears: in place of the manifest (or of a DCP .metadata in a
    # manifest-less directory) a reader that opens it without O_NONBLOCK hangs, and with it every rank. Nothing
    # here ever opens these pipes for writing while the probe runs, so a step that returns proves its reader did
    # not block: the proof involves no clock. Once every step returned, no process may hold a pipe open either.
    run = tmp_path / "run"
    _copy(saved, run / "checkpoint_0")
    fifo_manifest = _copy(saved, run / "checkpoint_1")
    (fifo_manifest / MANIFEST).unlink()
    os.mkfifo(fifo_manifest / MANIFEST)
    fifo_file = _copy(saved, tmp_path / "fifo_file")
    (fifo_file / "scheduler.bin").unlink()
    os.mkfifo(fifo_file / "scheduler.bin")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    os.mkfifo(dcp / ".metadata")
    fifos = [fifo_manifest / MANIFEST, fifo_file / "scheduler.bin", dcp / ".metadata"]
    read_end, write_end = os.pipe()
    with (tmp_path / "probe.out").open("w") as out, (tmp_path / "probe.err").open("w") as err:
        probe = subprocess.Popen(
            [sys.executable, "-c", _FIFO_PROBE, str(write_end), str(run), str(fifo_manifest), str(fifo_file), str(dcp)],
            stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, pass_fds=(write_end,), cwd=os.getcwd())
    os.close(write_end)
    stuck: list[list[str]] = []

    def hang_guard() -> None:  # runs only if the probe is still running after _FIFO_HANG_GUARD_S
        stuck.append(_fifos_with_a_reader(fifos))  # first: a step it unblocks is killed before it can report
        probe.kill()

    guard = threading.Timer(_FIFO_HANG_GUARD_S, hang_guard)
    guard.start()
    events: list[list[Any]] = []
    held_after_the_steps: list[str] | None = None
    try:
        with os.fdopen(read_end) as stream:
            for line in stream:  # ends when the probe exits (or the guard killed it)
                events.append(json.loads(line))
                if events[-1] == ["finished"]:
                    held_after_the_steps = _fifos_with_a_reader(fifos)  # the probe is alive, every step returned
                    assert probe.stdin is not None
                    probe.stdin.write("exit\n")
                    probe.stdin.close()
        returncode = probe.wait()
    finally:
        guard.cancel()
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    stderr = (tmp_path / "probe.err").read_text()
    started = [event[1] for event in events if event[0] == "start"]
    finished = {event[1]: event[2] for event in events if event[0] == "done"}
    unfinished = [name for name in started if name not in finished]
    assert not stuck and not unfinished, (
        f"the probe was still running after {_FIFO_HANG_GUARD_S:.0f} s, in step {unfinished}; named pipes held open "
        f"for reading: {stuck[0] if stuck else '?'}\n{stderr[-3000:]}")
    assert returncode == 0 and events[-1] == ["finished"], f"rc={returncode} events={events}\n{stderr[-3000:]}"
    assert finished == {
        "read_manifest": "CheckpointIntegrityError",
        "verify listed file": "CheckpointIntegrityError",
        "selection": "ok",
        "cli verify": 1,
        "cli latest": 0,
        "read_dcp_metadata": "CheckpointIntegrityError",
    }
    assert held_after_the_steps == [], f"named pipes still open for reading after every step: {held_after_the_steps}"


# --- malformed manifests -------------------------------------------------------------------------------------------

def _first_file(manifest: dict[str, Any]) -> str:
    return sorted(manifest["files"])[0]


_MALFORMED = {
    "top level list": lambda m: [m],
    "top level string": lambda m: "checkpoint",
    "files is a list": lambda m: {**m, "files": list(m["files"])},
    "files is empty": lambda m: {**m, "files": {}},
    "files missing": lambda m: {k: v for k, v in m.items() if k != "files"},
    "row is a string": lambda m: _row(m, "abc"),
    "row is a list": lambda m: _row(m, [1, 2]),
    "row is null": lambda m: _row(m, None),
    "negative size": lambda m: _row(m, {**_first(m), "size": -1}),
    "boolean size": lambda m: _row(m, {**_first(m), "size": True}),
    "string size": lambda m: _row(m, {**_first(m), "size": str(_first(m)["size"])}),
    "float size": lambda m: _row(m, {**_first(m), "size": _first(m)["size"] + 0.5}),
    "missing size": lambda m: _row(m, {k: v for k, v in _first(m).items() if k != "size"}),
    "huge size": lambda m: _row(m, {**_first(m), "size": 10 ** 30}),
    "hash not hex": lambda m: _row(m, {**_first(m), "xxh3_128": "not-a-hash-at-all-not-a-hash-xx"}),
    "hash empty": lambda m: _row(m, {**_first(m), "xxh3_128": ""}),
    "hash is a number": lambda m: _row(m, {**_first(m), "xxh3_128": 12345}),
    "hash upper case": lambda m: _row(m, {**_first(m), "xxh3_128": _first(m)["xxh3_128"].upper()}),
    "hash too short": lambda m: _row(m, {**_first(m), "xxh3_128": "0" * 15}),
    "hash wrong": lambda m: _row(m, {**_first(m), "xxh3_128": "0" * 32}),
    "protocol unknown": lambda m: {**m, "protocol": 99},
    "status not complete": lambda m: {**m, "status": "staging"},
    "run id with a path": lambda m: {**m, "run_id": "../other"},
    "run id missing": lambda m: {k: v for k, v in m.items() if k != "run_id"},
}


def _first(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["files"][_first_file(manifest)]


def _row(manifest: dict[str, Any], row: Any) -> dict[str, Any]:
    return {**manifest, "files": {**manifest["files"], _first_file(manifest): row}}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_malformed_manifest_is_an_integrity_error(saved: Path, tmp_path: Path, capsys: Any, case: str) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    _write(directory, _MALFORMED[case](_manifest(directory)))
    with pytest.raises(CheckpointIntegrityError):
        verify_manifest(directory, read_manifest(directory), full=True)
    assert _cli(capsys, "verify", str(directory), "--full")[0] == 1
    assert checkpoint_candidates(tmp_path)[0] == []


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b'{"size": ' + b"1" * 5000 + b"}", b'{"files": NaN}', b""])
def test_unparsable_manifest_is_an_integrity_error(saved: Path, tmp_path: Path, content: bytes) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    (directory / MANIFEST).write_bytes(content)
    with pytest.raises(CheckpointIntegrityError):
        verify_manifest(directory, read_manifest(directory), full=True)


def test_cli_list_and_latest_on_a_run_of_hostile_checkpoints(saved: Path, tmp_path: Path, capsys: Any) -> None:
    for number, content in enumerate([b"[" * DEEP, b"\xff", b"[]", b'{"files": {"../x": {"size": 1}}}']):
        directory = _copy(saved, tmp_path / f"checkpoint_{number}")
        (directory / MANIFEST).write_bytes(content)
    status, text = _cli(capsys, "list", str(tmp_path))
    assert status == 0 and all(f"checkpoint_{n}" in text for n in range(4))
    assert _cli(capsys, "latest", str(tmp_path))[0] == 1  # no complete checkpoint
    assert _cli(capsys, "list", str(tmp_path / "checkpoint_0"))[0] in (1, 2)  # a checkpoint, not a run directory
    assert _cli(capsys, "verify", str(tmp_path / "checkpoint_0"))[0] == 1


# --- pickles that would run code ------------------------------------------------------------------------------------

class _Exec:
    """Unpickling this runs ``exec`` of a statement that creates the marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (f"import os; os.mkdir({self.marker!r})",)


def _craft(path: Path, marker: Path, how: str) -> None:
    payload = (_Exec if "exec" in how else Exploit)(str(marker))
    if how.startswith("raw"):
        path.write_bytes(pickle.dumps({"state": payload}, protocol=2))  # a plain pickle, not a torch archive
    else:
        torch.save({"state": payload, "count": 1}, path)


def _match_manifest(directory: Path, name: str) -> None:
    manifest = _manifest(directory)
    row = manifest["files"][name]
    algorithm = next(key for key in ("xxh3_128", "sha256") if key in row)
    size, digest = hash_file(directory / name, algorithm)
    manifest["files"][name] = {**row, "size": size, algorithm: digest}
    _write(directory, manifest)


@pytest.mark.parametrize("name, how", [
    ("custom_checkpoint_0.pkl", "torch"), ("custom_checkpoint_0.pkl", "raw"), ("custom_checkpoint_0.pkl", "torch exec"),
    ("scheduler.bin", "torch"), ("scheduler.bin", "raw exec"), ("random_states_0.pkl", "torch"),
    ("training_state_0.pt", "torch"), ("optimizer.bin", "torch"),
])
def test_crafted_pickle_with_a_matching_manifest_is_refused_and_runs_nothing(
        saved: Path, tmp_path: Path, name: str, how: str) -> None:
    directory = _copy(saved, tmp_path / "checkpoint_0")
    marker = tmp_path / "marker"
    _craft(directory / name, marker, how)
    _match_manifest(directory, name)
    verify_manifest(directory, read_manifest(directory), full=True)  # the manifest proves the crafted bytes
    live = _run(5)
    before = _state(live)
    with pytest.raises(CheckpointIntegrityError, match=rf"Unreadable checkpoint file .*{name}") as caught:
        load_training_checkpoint(live["acc"], directory)
    assert "weights_only=False" not in str(caught.value)
    assert not marker.exists(), "a pickle in the checkpoint ran code"
    assert _equal(_state(live), before), "state changed before the refusal"
    # Control: the file is a live exploit for a plain unpickler (what weights_only=False does).
    if how.startswith("raw"):
        pickle.loads((directory / name).read_bytes())
    else:
        torch.load(directory / name, weights_only=False)
    assert marker.exists()


def test_custom_object_needing_full_unpickling_loads_only_with_the_trust_opt_in(tmp_path: Path) -> None:
    saver = _run(0, custom=_Tagged)
    path = save_training_checkpoint(saver["acc"], tmp_path / "checkpoint_0")
    expected = _state(saver)
    live = _run(4, custom=_Tagged)
    before = _state(live)
    with pytest.raises(CheckpointIntegrityError, match=r"custom_checkpoint_0\.pkl"):
        load_training_checkpoint(live["acc"], path)
    assert _equal(_state(live), before)
    # configure_checkpointing() has no trust_custom_objects parameter yet: set the configuration directly.
    checkpoint_config(live["acc"]).trust_custom_objects = True
    load_training_checkpoint(live["acc"], path)
    assert _equal(_state(live), expected)
    assert live["counter"].ratio == fractions.Fraction(0, 3)
