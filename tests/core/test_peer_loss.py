"""A rank that goes away mid-save or mid-restore (SIGTERM, a signal handler's exception, SIGKILL): the other rank
raises the library's error naming it, never gloo's raw ``RuntimeError`` ("Connection reset by peer"), and no
complete checkpoint appears; the next job selects the newest complete checkpoint, restores it and saves.

Real 2-rank FSDP1 and FSDP2 jobs on CPU (gloo), real signals sent by rank 1 to itself at a deterministic instant
(tests/scenarios/peer_loss_scenarios.py): inside native ``save_state`` (a save pre-hook, before its DCP collectives), between
the native save and the flush (``save:after-native-save``), inside the flush (``save:during-flush``), in the
background write of an asynchronous save, mid-restore (``load:during-restore``), and just before the save (the other
rank waits for it at the arrival check: named at once, not after ``arrival_timeout``). Each chain runs its faults in
one run directory, each job restarting from the previous fault (a restart that must select, restore and publish),
then a final restart: ``faults + 1`` launches per chain.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios.crash_harness import LAUNCH_TIMEOUT, SURVIVOR_TIMEOUT, JobResult, run_to_completion, run_until_crash_point

ENTRY = "tests.scenarios.peer_loss_scenarios"

# (name, spec of the fault): rank 1 gets ``signal`` at ``instant``; ``handler`` "default" keeps the signal's default
# action (SIGTERM ends the process at once), "raise" raises an exception there (as torch elastic's handler does).
CHAINS: dict[int, list[tuple[str, dict[str, Any]]]] = {
    1: [
        ("sigterm-inside-native-save", {"instant": "hook", "signal": "SIGTERM", "handler": "default"}),
        ("handler-raises-after-native-save", {"instant": "save:after-native-save", "signal": "SIGTERM",
                                              "handler": "raise"}),
        ("sigterm-mid-restore", {"instant": "load:during-restore", "signal": "SIGTERM", "handler": "default"}),
    ],
    2: [
        ("sigterm-during-flush", {"instant": "save:during-flush", "signal": "SIGTERM", "handler": "default"}),
        ("sigterm-in-async-background-write", {"instant": "save:during-flush", "signal": "SIGTERM",
                                               "handler": "default", "async": True}),
        ("sigkill-before-the-save", {"instant": "before-save", "signal": "SIGKILL", "handler": "default"}),
    ],
}
CASES = [(version, name) for version, links in CHAINS.items() for name, _ in links]

pytestmark = [pytest.mark.distributed,
              pytest.mark.timeout(int(sum(len(links) + 1 for links in CHAINS.values())
                                      * (LAUNCH_TIMEOUT + SURVIVOR_TIMEOUT)) + 60)]


def _chain(version: int, directory: Path) -> dict[str, Any]:
    """Run chain ``version``: ``{name: (fault job, restart job)}``; a job that hung or failed ends the chain and
    becomes the outcome of every fault not yet restarted."""
    root = directory / "run"
    outcomes: dict[str, Any] = {}
    previous: str | None = None
    try:
        for index, (name, fault) in enumerate(CHAINS[version]):
            spec = {"root": str(root), "version": version, "resume": index > 0, **fault}
            job = run_until_crash_point(spec, directory, f"v{version}-{index}", whole_job=False, entry=ENTRY)
            if previous is not None:
                outcomes[previous] = (outcomes[previous][0], job)
            outcomes[name] = (job, None)
            previous = name
        final = run_to_completion({"root": str(root), "version": version, "resume": True}, directory,
                                  f"v{version}-final", entry=ENTRY)
        outcomes[previous] = (outcomes[previous][0], final)  # type: ignore[index]
    except AssertionError as exc:
        for name, _ in CHAINS[version]:
            if name not in outcomes or outcomes[name][1] is None:
                outcomes[name] = exc
    return outcomes


@pytest.fixture(scope="module")
def chains(tmp_path_factory: Any) -> dict[int, dict[str, Any]]:
    return {version: _chain(version, tmp_path_factory.mktemp(f"peer_loss_fsdp{version}")) for version in CHAINS}


@pytest.mark.parametrize(("version", "name"), CASES)
def test_a_rank_that_goes_away_mid_checkpoint_is_named_on_the_other_rank_and_the_next_job_resumes(
        chains: dict[int, dict[str, Any]], version: int, name: str) -> None:
    outcome = chains[version][name]
    if isinstance(outcome, BaseException):
        pytest.fail(f"the FSDP{version} chain stopped before {name} was checked: {outcome}")
    job: JobResult = outcome[0]
    fault = dict(CHAINS[version])[name]
    index = [n for n, _ in CHAINS[version]].index(name)
    # Rank 1 got the signal where it was armed: ended by it (default action), or raised the handler's exception.
    if fault["handler"] == "default":
        assert job.returncodes[1] == -getattr(signal, fault["signal"]), job.describe()
    else:
        assert job.obs[1]["fault"]["type"] == "SignalRaised", job.describe()
    # Rank 0 ended on its own (no hang), with the library's error naming rank 1 as the rank that went away.
    assert job.returncodes[0] == 0, job.describe()
    error = job.obs[0]["fault"]
    assert error["library"] and error["type"] == "CheckpointRankError", error
    assert error["failures"] == [1], error
    assert "rank(s) [1] went away" in error["message"], error["message"]
    assert "restart the whole job" in error["message"], error["message"]
    # Nothing new was published; the only complete checkpoints are the earlier saves; rank 0 left no staging behind.
    report = job.obs[0]["report"]
    assert report["complete"] == list(range(index + 1)), report
    assert job.obs[0]["manifests"] == [f"checkpoint_{n}" for n in range(index + 1)], job.obs[0]
    assert report["leftovers"] == [], report
    # The next job selects the newest complete checkpoint (the fault job's first save), restores it, and publishes.
    restart: JobResult = outcome[1]
    for rank in (0, 1):
        obs = restart.obs[rank]
        assert obs["resume"]["type"] is None, restart.describe()
        assert obs["selected"] == index, obs
        assert obs["save"]["type"] is None, obs
        assert obs["save"]["value"].endswith(f"checkpoint_{index + 1}"), obs
