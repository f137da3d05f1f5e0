"""Issue 34 item 5: a data loader whose order or position changed between save and resume (``resume_changes``).

What decides a prepared loader's batches and what a position counted in batches means (dataset length, batch size,
``drop_last``, shuffle and sampler, batch sampler, ``split_batches`` / ``even_batches`` / ``dispatch_batches``, the
processes it shards over) is recorded in the descriptor; a change is refused before anything is restored, naming the
loader, the setting and both values, unless accepted by name (a stateful loader's: never). Unit tests compare
descriptors ``describe()`` builds from real Accelerators (and loaders Accelerate's own ``prepare_data_loader`` shards
over two processes); one real 2-rank FSDP1 run saves mid-epoch and resumes with another batch size and another
dataset length (tests/scenarios/loader_change_scenarios.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DataLoaderConfiguration

from accelerate_txn import configure_checkpointing
from accelerate_txn.accelerate.config import checkpoint_config
from accelerate_txn.accelerate.data_order import order_settings
from accelerate_txn.accelerate.descriptor import check_resume, describe
from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.testing import launch

TIMEOUT = 300  # a hang guard for the launch (about 40 s on 2 loaded cores)
pytestmark = pytest.mark.timeout(TIMEOUT + 120)
WHERE = "run/checkpoint_3"


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(64))


def _loader(samples: int = 64, batch: int = 4, iterable: bool = False, **options: Any) -> torch.utils.data.DataLoader:
    data = _Stream() if iterable else torch.utils.data.TensorDataset(torch.arange(samples))
    if not iterable:
        options.setdefault("shuffle", True)
    return torch.utils.data.DataLoader(data, batch_size=batch, **options)


def _descriptor(samples: int = 64, batch: int = 4, *, config: dict[str, Any] | None = None,
                **options: Any) -> dict[str, Any]:
    """``describe()`` of a real one-process Accelerator with a model and one prepared loader, as a manifest records
    it (a JSON round trip)."""
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**(config or {})))
    accelerator.prepare(torch.nn.Linear(2, 2), _loader(samples, batch, **options))
    return json.loads(json.dumps(describe(accelerator)))


def _refusal(saved: dict[str, Any], live: dict[str, Any], **options: Any) -> str:
    with pytest.raises(CheckpointConfigurationError) as info:
        check_resume(saved, live, where=WHERE, **options)
    return str(info.value)


def _sharded(**options: Any) -> dict[str, Any]:
    """The order settings of a loader Accelerate shards for rank 0 of 2 processes (its own ``prepare_data_loader``)."""
    prepare = {key: options.pop(key) for key in ("split_batches", "even_batches") if key in options}
    loader = prepare_data_loader(_loader(**options), num_processes=2, process_index=0, **prepare)
    return order_settings(loader, 2)


def _with_settings(descriptor: dict[str, Any], settings: dict[str, Any], world: int = 2) -> dict[str, Any]:
    result = json.loads(json.dumps(descriptor))
    result["dataloaders"][0].update(settings)
    result["world_size"] = world
    return result


def _one_process(descriptor: dict[str, Any]) -> dict[str, Any]:
    """The order settings ``describe()`` recorded for a one-process Accelerator's loader."""
    return {key: value for key, value in descriptor["dataloaders"][0].items()
            if key not in ("class", "dataset", "workers", "stateful")}


def test_describe_records_what_decides_each_loaders_order_and_position() -> None:
    (entry,) = _descriptor(64, 4)["dataloaders"]
    assert {key: entry[key] for key in ("dataset_length", "batch_size", "drop_last", "shuffle", "sampler",
                                        "batch_sampler", "dispatch_batches", "processes")} == {
        "dataset_length": 64, "batch_size": 4, "drop_last": False, "shuffle": True,
        "sampler": "torch.utils.data.sampler.RandomSampler", "batch_sampler": "torch.utils.data.sampler.BatchSampler",
        "dispatch_batches": False, "processes": 1}
    # One process: Accelerate does not shard, so its split_batches / even_batches do not apply.
    assert entry["split_batches"] is None and entry["even_batches"] is None
    (stream,) = _descriptor(iterable=True, config={"dispatch_batches": False})["dataloaders"]
    assert (stream["dataset_length"], stream["batch_size"], stream["shuffle"], stream["sampler"]) == (None, 4, None, None)
    # Two processes: the batch size the user gave (not Accelerate's per-process split), and the sharding settings.
    assert _sharded(split_batches=True, even_batches=False)["batch_size"] == 4
    assert {key: _sharded()[key] for key in ("split_batches", "even_batches", "processes")} == {
        "split_batches": False, "even_batches": True, "processes": 2}
    iterable = _sharded(iterable=True, split_batches=True)
    assert (iterable["batch_size"], iterable["split_batches"], iterable["processes"]) == (4, True, 2)
    # Several processes reading a dataset Accelerate does not shard (each rank's own shard, whose length may differ
    # between ranks): its length is unknown, so ranks holding shards of other lengths still agree on the descriptor.
    own = order_settings(_loader(), 2)
    assert (own["dataset_length"], own["batch_size"], own["processes"]) == (None, 4, 2)


CHANGES = {
    "batch size": (dict(batch=8), "batch_size", "data loader 0's batch size changed from 4 to 8"),
    "dataset length": (dict(samples=80), "dataset_length", "data loader 0's dataset length changed from 64 to 80"),
    "drop_last": (dict(drop_last=True), "drop_last", "data loader 0's drop_last changed from False to True"),
    "shuffle": (dict(shuffle=False), "shuffle", "data loader 0's shuffle changed from True to False"),
    "sampler": (dict(config={"use_seedable_sampler": True}), "sampler",
                "data loader 0's sampler changed from torch.utils.data.sampler.RandomSampler to "
                "accelerate.data_loader.SeedableRandomSampler"),
    "dispatch_batches": (dict(config={"dispatch_batches": True}), "dispatch_batches",
                         "data loader 0's dispatch_batches changed from False to True"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_order_setting_is_refused_naming_the_loader_the_setting_both_values_and_the_way_through(
        change: str) -> None:
    options, key, line = CHANGES[change]
    message = _refusal(_descriptor(), _descriptor(**{"samples": 64, "batch": 4, **options}))
    assert f"{WHERE} was saved for a different training configuration:\n  {line}: if accepted, the data order is " \
           "not reproduced" in message
    assert f'configure_checkpointing(accelerator, accept_changes=["dataloaders[0].{key}"])' in message
    assert message.count("data loader 0's") == 1  # one change named once (shuffle is not also a sampler change)


def test_an_iterable_datasets_batch_size_change_is_refused() -> None:
    saved = _descriptor(iterable=True, config={"dispatch_batches": False})
    message = _refusal(saved, _descriptor(batch=8, iterable=True, config={"dispatch_batches": False}))
    assert "data loader 0's batch size changed from 4 to 8" in message


@pytest.mark.parametrize(("saved", "live", "line"), [
    ({}, {"split_batches": True}, "data loader 0's split_batches changed from False to True"),
    ({}, {"even_batches": False}, "data loader 0's even_batches changed from True to False"),
    ({"split_batches": True}, {"split_batches": True, "batch": 8}, "data loader 0's batch size changed from 4 to 8"),
])
def test_a_changed_sharding_setting_is_refused(saved: dict[str, Any], live: dict[str, Any], line: str) -> None:
    base = _descriptor()
    message = _refusal(_with_settings(base, _sharded(**saved)), _with_settings(base, _sharded(**live)))
    assert f"  {line}: if accepted, the data order is not reproduced" in message


def test_an_accepted_loader_change_resumes_with_a_line_saying_the_order_is_not_reproduced() -> None:
    result = check_resume(_descriptor(64, 4), _descriptor(80, 8), where=WHERE,
                          accept_changes=["dataloaders[0].batch_size", "dataloaders[0].dataset_length"])
    assert [change.accepted_line() for change in result.accepted] == [
        f"data loader 0's {text}: the data order is not reproduced: the loader continues from the saved epoch and "
        "generators, but its batches, and the batches a resumed position (counted in batches) skips, differ from the "
        "uninterrupted run's" for text in ("dataset length changed from 64 to 80", "batch size changed from 4 to 8")]
    # One name accepts one change: the other is still refused.
    message = _refusal(_descriptor(64, 4), _descriptor(80, 8), accept_changes=["dataloaders[0].batch_size"])
    assert "dataset length changed from 64 to 80" in message and "batch size changed" not in message


def test_a_stateful_loaders_order_change_is_refused_even_when_named() -> None:
    # Its saved iterator position would be replayed on the changed loader (a shorter epoch: StopIteration mid-restore).
    saved = _descriptor(64, 4, config={"use_stateful_dataloader": True})
    live = _descriptor(8, 4, config={"use_stateful_dataloader": True})
    message = _refusal(saved, live, accept_changes=["dataloaders[0].dataset_length"])
    assert ("data loader 0's dataset length changed from 64 to 8: this cannot be accepted for a stateful data loader "
            "(use_stateful_dataloader)") in message
    assert "accept_changes=" not in message


def test_a_checkpoint_recorded_before_order_settings_loads_as_before() -> None:
    saved, live = _descriptor(64, 4), _descriptor(80, 8)
    assert live["dataloaders"][0]["batch_size"] == 8  # the live run records them...
    for key in ("dataset_length", "batch_size", "drop_last", "shuffle", "sampler", "batch_sampler", "split_batches",
                "even_batches", "dispatch_batches", "processes"):
        del saved["dataloaders"][0][key]
    result = check_resume(saved, live, where=WHERE)  # ...the checkpoint does not: unknown, not a change
    assert result.accepted == []


def test_a_world_size_change_is_left_to_the_world_size_check_and_elastic_resume() -> None:
    base = _descriptor()
    saved, live = _with_settings(base, _sharded()), _with_settings(base, _one_process(base), world=1)
    assert saved["dataloaders"][0]["processes"] == 2 and live["dataloaders"][0]["processes"] == 1
    message = _refusal(saved, live)
    assert "saved on 2 ranks and this run has 1" in message and "dataloaders[0]" not in message
    assert check_resume(saved, live, where=WHERE, allow_reshard=True).accepted == []
    # Another batch size is still refused in an elastic resume.
    resized = _with_settings(base, {**_one_process(base), "batch_size": 8}, world=1)
    assert "data loader 0's batch size changed from 4 to 8" in _refusal(saved, resized, allow_reshard=True)


def test_data_loader_change_names_are_accepted_by_configure_checkpointing() -> None:
    accelerator = Accelerator(cpu=True)
    configure_checkpointing(accelerator, accept_changes=["dataloaders[0].batch_size", "dataloaders[1].drop_last"])
    assert checkpoint_config(accelerator).accept_changes == ("dataloaders[0].batch_size", "dataloaders[1].drop_last")
    with pytest.raises(CheckpointConfigurationError, match=r"\['dataloaders\.batch_size'\] are not change names"):
        configure_checkpointing(accelerator, accept_changes=["dataloaders.batch_size"])


@pytest.mark.distributed
def test_a_mid_epoch_resume_with_another_batch_size_or_dataset_length_is_refused_on_every_rank(tmp_path: Any) -> None:
    results = launch("tests.scenarios.loader_change_scenarios:resume_with_other_loaders", 2, args=(str(tmp_path),),
                     timeout=TIMEOUT)
    for rank, obs in enumerate(results):
        for name, line in (("batch", "data loader 0's batch size changed from 4 to 8"),
                           ("length", "data loader 0's dataset length changed from 64 to 80")):
            assert obs[name] is not None, f"rank {rank}: the {name} change resumed silently"
            assert obs[name]["type"] == "CheckpointConfigurationError"
            assert f"{line}: if accepted, the data order is not reproduced" in obs[name]["message"]
            assert obs[f"{name}_changed_nothing"], f"rank {rank}: the refused {name} resume changed state"
        assert obs["batch"]["message"] == results[0]["batch"]["message"]
        assert obs["length"]["message"] == results[0]["length"]["message"]
        assert obs["accepted"] is None and obs["same"] is None and obs["same_lines"] == []
        # Accepted by the printed name: it resumes, with one line on rank 0 saying the order is not reproduced.
        if rank == 0:
            (line,) = obs["accepted_lines"]
            assert line.startswith(f"Resumed {obs['path']} with changes: data loader 0's dataset length changed from "
                                   "64 to 80: the data order is not reproduced")
        else:
            assert obs["accepted_lines"] == []
