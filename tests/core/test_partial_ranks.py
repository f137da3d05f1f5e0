"""A checkpoint call reached by some ranks only: ``save_state`` under ``if accelerator.is_main_process:`` (the
most common FSDP checkpointing mistake), a load on one rank, a save on one rank against a load on the other.

Natively such a call ends in a bare gloo abort (``op.preamble.length <= op.nbytes``) or a hang. With the library
the ranks first meet in the process group's store, with no collective (``core.ranks.arrive``): the ranks that
reached the call raise ``CheckpointArrivalError`` within ``arrival_timeout``, naming who arrived and the usual
cause, and nothing is written. A rank that arrives after the others gave up raises too; a save against a load is
named at once. Dispatch switched off, other backends and one process never touch the store.

Real 2-process gloo runs (FSDP1 and FSDP2), each with a hard timeout; the scenarios are grouped into three
launches. A short arrival timeout is set only where a rank is meant to be missing (that rank is held in a barrier
until the others gave up, so nothing depends on speed); everywhere else it is long.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from accelerate_txn import CheckpointArrivalError, CheckpointRankError, configure_checkpointing, errors
from accelerate_txn.accelerate.config import (
    ARRIVAL_TIMEOUT_ENV,
    DEFAULT_ARRIVAL_TIMEOUT,
    arrival_timeout,
    checkpoint_config,
)
from accelerate_txn.core.ranks import ARRIVAL_PREFIX, arrive
from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.testing import launch

TIMEOUT = 300  # hard limit of one launch
SHORT = 5.0  # arrival timeout where a rank is deliberately missing
LONG = 120.0  # arrival timeout where every rank comes (a loaded machine never fails these)
PATCH_ENV = "ACCELERATE_TXN_PATCHES"


# --------------------------------------------------------------------------------- scenarios (inside the ranks)

def _keys() -> tuple[Any, Any]:
    """The default group's store and the arrival keys' view of it."""
    import torch.distributed as dist

    from accelerate_txn.fsdp.internals import default_store

    store = default_store()
    return store, dist.PrefixStore(ARRIVAL_PREFIX, store)


def _listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def partial_calls(root: str, fsdp_version: int) -> dict[str, Any]:
    """Every partial-call case in order on one FSDP setup; calls are numbered 1.. (see the test)."""
    import torch.distributed as dist

    from accelerate_txn import load_training_checkpoint, save_training_checkpoint
    from tests.scenarios.guarantee_scenarios import _build
    from tests.scenarios.scenarios import _error, _train

    base, rank = Path(root), int(os.environ["RANK"])
    acc, model, opt, sched = _build(fsdp_version, seed=0)
    _train(acc, model, opt, sched, 1, seed=1)
    configure_checkpointing(acc, arrival_timeout=LONG)
    store, keys = _keys()
    obs: dict[str, Any] = {}

    # Dispatch off: native Accelerate, not one store request (the count is the whole store's).
    dist.barrier()
    before = store.num_keys()
    os.environ[PATCH_ENV] = "0"
    try:
        acc.save_state(str(base / "native"))
    finally:
        del os.environ[PATCH_ENV]
    obs["off"] = {"new_keys": store.num_keys() - before, "slot": keys.check([f"rank {rank}"]),
                  "saved": (base / "native").is_dir()}
    dist.barrier()

    # Call 1: a normal protected save arrives exactly once (the patch hands it to the explicit API, which does not
    # arrive again).
    obs["good"] = _error(lambda: acc.save_state(str(base / "good")))
    obs["after_good"] = {"call_1": keys.check(["1/decision"]), "call_2": keys.check(["2/first"])}
    dist.barrier()

    # Call 2: save_state on rank 0 only; rank 1 waits in a barrier until rank 0 gave up, then arrives late.
    configure_checkpointing(acc, arrival_timeout=SHORT)
    listing = _listing(base)
    if rank == 0:
        obs["alone_save"] = _error(lambda: acc.save_state(str(base / "alone")))
    dist.barrier()
    if rank == 1:
        obs["alone_save"] = _error(lambda: acc.save_state(str(base / "alone")))
    dist.barrier()
    obs["alone_save_wrote"] = sorted(set(_listing(base)) - set(listing))

    # Call 3: load_state on rank 0 only, then rank 1 late.
    if rank == 0:
        obs["alone_load"] = _error(lambda: acc.load_state(str(base / "good")))
    dist.barrier()
    if rank == 1:
        obs["alone_load"] = _error(lambda: acc.load_state(str(base / "good")))
    dist.barrier()

    # Call 4: a save on rank 0 against a load on rank 1, named at once (long timeout: a wait would time out with
    # another message, which the test would see).
    configure_checkpointing(acc, arrival_timeout=LONG)
    listing = _listing(base)
    obs["mixed"] = _error(lambda: acc.save_state(str(base / "mixed")) if rank == 0 else acc.load_state(str(base / "good")))
    # Call 5: the explicit API arrives too: save_training_checkpoint against save_state.
    obs["explicit_mixed"] = _error(lambda: save_training_checkpoint(acc, str(base / "mixed")) if rank == 0
                                   else acc.save_state(str(base / "mixed")))
    dist.barrier()
    obs["mixed_wrote"] = sorted(set(_listing(base)) - set(listing))

    # Calls 6 and 7: every rank again, explicit save then patched load: both work after the failures, and call 6's
    # "go" deleted the keys of calls 1-5.
    _train(acc, model, opt, sched, 1, seed=2)
    obs["after_save"] = _error(lambda: save_training_checkpoint(acc, str(base / "after")))
    obs["after_load"] = _error(lambda: acc.load_state(str(base / "after")))
    obs["after_explicit_load"] = _error(lambda: load_training_checkpoint(acc, str(base / "after")))
    dist.barrier()
    obs["calls_with_keys"] = [n for n in range(1, 12)
                              if keys.check([f"{n}/first"]) or keys.check([f"{n}/count"]) or keys.check([f"{n}/decision"])]
    obs["slot"] = keys.get(f"rank {rank}").decode()
    return obs


def store_traffic(root: str) -> dict[str, Any]:
    """A non-FSDP backend (MULTI_CPU) saves natively without store traffic; many arrivals keep the keys bounded."""
    import torch.distributed as dist

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    store, keys = _keys()
    obs: dict[str, Any] = {"backend": accelerator.distributed_type.name}
    dist.barrier()
    before = store.num_keys()
    accelerator.save_state(str(Path(root) / "ddp"))
    obs["ddp_new_keys"] = store.num_keys() - before
    obs["ddp_saved"] = (Path(root) / "ddp").is_dir() and model is not None
    dist.barrier()
    counts = []
    for call in range(1, 61):
        arrive("save_state" if call % 2 else "load_state", LONG, store)
        if call in (10, 60):
            dist.barrier()  # both ranks past this call before the store is counted
            counts.append(store.num_keys())
            dist.barrier()
    obs["key_counts"] = counts
    obs["calls_with_keys"] = [n for n in range(1, 61)
                              if keys.check([f"{n}/first"]) or keys.check([f"{n}/count"]) or keys.check([f"{n}/decision"])]
    return obs


# --------------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def partial(request: Any, tmp_path_factory: Any) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp(f"partial_fsdp{request.param}")
    return root, launch(partial_calls, 2, args=(str(root), request.param), timeout=TIMEOUT)


def _arrival_error(error: dict[str, Any] | None) -> str:
    assert error is not None, "no error raised"
    assert error["type"] == "CheckpointArrivalError", error
    return error["message"]


@pytest.mark.distributed
def test_a_save_on_rank_0_only_raises_an_explained_arrival_error_and_writes_nothing(
        partial: tuple[Path, list[dict[str, Any]]]) -> None:
    root, (zero, one) = partial
    message = _arrival_error(zero["alone_save"])
    assert "save_state() was called on ranks [0] but ranks [1] did not reach it within 5 s." in message
    assert "if accelerator.is_main_process:" in message and "call it on every rank" in message
    assert "Nothing was written or restored." in message
    assert f"arrival_timeout=SECONDS) or {ARRIVAL_TIMEOUT_ENV} (now 5 s)" in message
    assert not (root / "alone").exists()
    assert zero["alone_save_wrote"] == [] and one["alone_save_wrote"] == []  # no checkpoint, no staging, no lock


@pytest.mark.distributed
def test_a_rank_that_arrives_after_the_others_gave_up_raises_instead_of_hanging(
        partial: tuple[Path, list[dict[str, Any]]]) -> None:
    _root, (zero, one) = partial
    message = _arrival_error(one["alone_save"])
    assert ("This rank (1) reached save_state() after ranks [0] had stopped waiting for ranks [1] at save_state() "
            "(they waited 5 s and raised CheckpointArrivalError).") in message
    assert "if accelerator.is_main_process:" in message
    message = _arrival_error(one["alone_load"])
    assert "This rank (1) reached load_state() after ranks [0] had stopped waiting" in message
    assert zero["alone_save"] is not None and zero["alone_load"] is not None  # rank 0 raised before it


@pytest.mark.distributed
def test_a_load_on_rank_0_only_raises_an_explained_arrival_error(partial: tuple[Path, list[dict[str, Any]]]) -> None:
    _root, (zero, _one) = partial
    message = _arrival_error(zero["alone_load"])
    assert "load_state() was called on ranks [0] but ranks [1] did not reach it within 5 s." in message
    assert "if accelerator.is_main_process:" in message


@pytest.mark.distributed
def test_a_save_against_a_load_is_named_at_once_on_both_ranks(partial: tuple[Path, list[dict[str, Any]]]) -> None:
    root, observed = partial
    for obs in observed:
        message = _arrival_error(obs["mixed"])
        assert message.startswith("Rank 0 called save_state() while rank 1 called load_state() at the same point.")
        assert "within" not in message  # decided on arrival, not after the (long) timeout
        message = _arrival_error(obs["explicit_mixed"])
        assert message.startswith(
            "Rank 0 called save_training_checkpoint() while rank 1 called save_state() at the same point.")
        assert obs["mixed_wrote"] == []
    assert not (root / "mixed").exists()


@pytest.mark.distributed
def test_a_call_arrives_once_and_saves_and_loads_work_before_and_after_the_failures(
        partial: tuple[Path, list[dict[str, Any]]]) -> None:
    root, observed = partial
    for obs in observed:
        assert obs["good"] is None
        assert obs["after_good"] == {"call_1": True, "call_2": False}  # the patched save arrived exactly once
        assert obs["after_save"] is None and obs["after_load"] is None and obs["after_explicit_load"] is None
    assert observed[0]["slot"] == "8 load_training_checkpoint" and observed[1]["slot"] == "8 load_training_checkpoint"
    # The "go" of the last call deleted the keys of every earlier call: the failed ones included.
    assert observed[0]["calls_with_keys"] == [8]
    assert (root / "good" / "checkpoint_manifest.json").is_file()
    assert (root / "after" / "checkpoint_manifest.json").is_file()


@pytest.mark.distributed
def test_dispatch_switched_off_writes_nothing_to_the_store(partial: tuple[Path, list[dict[str, Any]]]) -> None:
    _root, observed = partial
    for obs in observed:
        assert obs["off"] == {"new_keys": 0, "slot": False, "saved": True}


@pytest.mark.distributed
def test_other_backends_touch_no_store_and_the_arrival_keys_stay_bounded(tmp_path: Path) -> None:
    observed = launch(store_traffic, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    for obs in observed:
        assert obs["backend"] == "MULTI_CPU" and obs["ddp_saved"]
        assert obs["ddp_new_keys"] == 0
        first, last = obs["key_counts"]
        assert last == first, f"the store grew from {first} to {last} keys over 50 more arrivals"
        assert obs["calls_with_keys"] == [60]


# --------------------------------------------------------------------------------- one process, configuration

def test_one_process_arrives_without_touching_a_store() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    arrive("save_state", 0.0, store=None)  # None: any store access would raise


def test_arrival_timeout_defaults_to_300_and_is_validated(monkeypatch: Any) -> None:
    monkeypatch.delenv(ARRIVAL_TIMEOUT_ENV, raising=False)
    accelerator = Accelerator(cpu=True)
    assert DEFAULT_ARRIVAL_TIMEOUT == 300.0 and checkpoint_config(accelerator).arrival_timeout == 300.0
    configure_checkpointing(accelerator, arrival_timeout=12.5)
    assert checkpoint_config(accelerator).arrival_timeout == 12.5 and arrival_timeout(accelerator) == 12.5
    for bad in (-1, math.nan, math.inf, "soon", True):
        with pytest.raises(CheckpointConfigurationError, match=r"configure_checkpointing\(arrival_timeout=\.\.\.\) is "
                           r".*: the wait for every rank to reach save_state\(\)/load_state\(\) must be a finite"):
            configure_checkpointing(accelerator, arrival_timeout=bad)
    assert checkpoint_config(accelerator).arrival_timeout == 12.5  # a refused value changes nothing
    configure_checkpointing(accelerator, arrival_timeout=0)
    assert checkpoint_config(accelerator).arrival_timeout == 0.0


def test_arrival_timeout_comes_from_the_environment_and_is_read_leniently_before_any_agreement(
        monkeypatch: Any) -> None:
    monkeypatch.setenv(ARRIVAL_TIMEOUT_ENV, " 45 ")
    assert arrival_timeout(Accelerator(cpu=True)) == 45.0
    assert checkpoint_config(Accelerator(cpu=True)).arrival_timeout == 45.0
    monkeypatch.setenv(ARRIVAL_TIMEOUT_ENV, "soon")
    fresh = Accelerator(cpu=True)
    # Before any agreement the invalid value never raises (one rank alone would leave the others waiting): the
    # arrival check uses the default, and the first rank phase reads the configuration and raises everywhere.
    assert arrival_timeout(fresh) == 300.0 and arrival_timeout({"a": fresh}) == 300.0 and arrival_timeout(None) == 300.0
    with pytest.raises(CheckpointConfigurationError,
                       match=rf"The environment variable {ARRIVAL_TIMEOUT_ENV} is 'soon': the wait for every rank"):
        checkpoint_config(fresh)


def test_arrival_error_is_a_rank_error_exported_and_picklable() -> None:
    import pickle

    assert issubclass(CheckpointArrivalError, CheckpointRankError)
    assert "CheckpointArrivalError" in errors.__all__
    error = pickle.loads(pickle.dumps(CheckpointArrivalError("save_state() was called on ranks [0]")))
    assert isinstance(error, CheckpointArrivalError) and str(error) == "save_state() was called on ranks [0]"
