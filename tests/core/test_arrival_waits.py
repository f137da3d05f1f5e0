"""The arrival wait of a checkpoint call made on some ranks only says what it waits for, and ends early on conclusive
evidence only (``core.ranks.arrive``, ``accelerate.arrival``).

One real 2-process FSDP2 run on gloo with ``arrival_timeout=600``, longer than the launch's hard limit, so each early
end below is proven by the run finishing at all (no step is timed):

* rank 0 saves into ``checkpoint-2`` while rank 1 has skipped it and saves into ``checkpoint-4``: both raise the
  explained ``CheckpointArrivalError`` at once;
* rank 0 saves into ``checkpoint-6`` alone: after a few seconds it logs one WARNING naming the missing rank, the
  directory, the timeout and the setting; rank 1, once it has seen that line, destroys its process group (as
  ``accelerator.end_training()`` does) and stays alive; rank 0's wait then ends with ``CheckpointArrivalError``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn import configure_checkpointing
from accelerate_txn.accelerate.config import ARRIVAL_TIMEOUT_ENV
from accelerate_txn.testing import launch

TIMEOUT = 240  # the launch's hard limit (a hang guard), well under the arrival timeout
ARRIVAL = 600.0  # the arrival timeout: waiting it out would fail the launch
POLL = 0.05


class _Noticed(logging.Handler):
    """Keeps the library's WARNING records and marks ``flag`` (a file) once one is logged."""

    def __init__(self, flag: Path) -> None:
        super().__init__(logging.WARNING)
        self.flag = flag
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.flag.touch()


def _await_file(path: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(POLL)  # a poll interval inside a hang guard, not a synchronisation


def skipped_saves(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.scenarios.guarantee_scenarios import _build
    from tests.scenarios.scenarios import _error, _train

    base, rank = Path(root), int(os.environ["RANK"])
    acc, model, opt, sched = _build(2, seed=0)
    _train(acc, model, opt, sched, 1, seed=1)
    configure_checkpointing(acc, arrival_timeout=ARRIVAL)
    obs: dict[str, Any] = {}

    # Rank 1 skipped checkpoint-2 and is already at checkpoint-4.
    obs["later_save"] = _error(lambda: acc.save_state(str(base / ("checkpoint-2" if rank == 0 else "checkpoint-4"))))
    dist.barrier()

    # Rank 0 alone at checkpoint-6; rank 1 leaves its process group once rank 0 said whom it waits for.
    noticed, done = base / "noticed", base / "rank0_done"
    if rank == 0:
        handler = _Noticed(noticed)
        logging.getLogger("accelerate_txn").addHandler(handler)
        try:
            obs["alone"] = _error(lambda: acc.save_state(str(base / "checkpoint-6")))
        finally:
            logging.getLogger("accelerate_txn").removeHandler(handler)
        obs["warnings"] = handler.messages
        done.touch()
    else:
        _await_file(noticed)
        dist.destroy_process_group()
        _await_file(done)  # alive throughout: the early end cannot come from seeing this process end
    obs["published"] = sorted(path.name for path in base.iterdir() if path.name.startswith("checkpoint"))
    return obs


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_skipped_save_is_explained_early_and_the_wait_says_what_it_waits_for(tmp_path: Path) -> None:
    ranks = launch(skipped_saves, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    for obs in ranks:
        error = obs["later_save"]
        assert error is not None and error["type"] == "CheckpointArrivalError", error
        assert ("Rank 0 called save_state() for '" + str(tmp_path / "checkpoint-2") + "' while rank 1 called it for '"
                + str(tmp_path / "checkpoint-4") + "' at the same point") in error["message"], error["message"]
        assert "within" not in error["message"]  # decided at once, not after the timeout
    alone = ranks[0]
    assert alone["alone"] is not None and alone["alone"]["type"] == "CheckpointArrivalError", alone["alone"]
    assert ("save_state() could not start: rank(s) [1] left without reaching it (rank 1: it destroyed its "
            "process group") in alone["alone"]["message"], alone["alone"]["message"]
    assert "this call was made on some ranks only" in alone["alone"]["message"]
    assert "if accelerator.is_main_process:" in alone["alone"]["message"]
    [notice] = [text for text in alone["warnings"] if "has waited" in text]
    assert "rank 0 has waited" in notice and f"at save_state() into {tmp_path / 'checkpoint-6'} for rank(s) [1]" \
        in notice, notice
    assert f"up to {ARRIVAL:g} s" in notice
    assert f"arrival_timeout=SECONDS) or {ARRIVAL_TIMEOUT_ENV}=SECONDS" in notice
    assert alone["published"] == []  # nothing written by either refused save


def leaving_notice(store_key: str) -> bool:
    """Rank 1 destroys its default process group; rank 0 returns whether the leaving notice reached the store."""
    from datetime import timedelta

    import accelerate  # noqa: F401  accelerate_txn wraps Accelerate (and destroy_process_group) when it is imported
    import torch.distributed as dist

    import accelerate_txn  # noqa: F401  whatever ACCELERATE_TXN_PATCHES says
    from accelerate_txn.core.ranks import ARRIVAL_PREFIX, LEFT_KEY
    from accelerate_txn.fsdp.internals import default_store

    dist.init_process_group("gloo")
    raw = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=120))
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        raw.set(store_key, "destroyed")  # after the destroy, through a client of its own
        return False
    raw.wait([store_key])
    return dist.PrefixStore(ARRIVAL_PREFIX, default_store()).check([LEFT_KEY])


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("patches", ["1", "0"])
def test_destroying_the_process_group_leaves_a_notice_only_where_the_protected_path_can_run(patches: str) -> None:
    """With ``ACCELERATE_TXN_PATCHES=0`` (and nothing opted in) ``destroy_process_group`` is exactly native:
    nothing is written to the store; otherwise it leaves the notice a waiting rank ends its wait on."""
    noticed, _ = launch(leaving_notice, 2, args=(f"destroyed-{patches}",), timeout=TIMEOUT,
                        env={"ACCELERATE_TXN_PATCHES": patches})
    assert noticed is (patches == "1")
