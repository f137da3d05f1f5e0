"""The protocol at scale: its fixed cost on real ranks, and a model of its growth to thousands of ranks.

(a) Real ranks (W = 2, 4, 8; gloo, CPU; Accelerate FSDP with a tiny model): native ``save_state``/``load_state``
(instance opted out) and the protected ones in alternating pairs, as ``bench_checkpoint.py`` does; the fixed cost is
the median over pairs of protected minus native, with the median of pair ratios. One more untimed pair counts, on
every rank, the ``torch.distributed`` calls each save and load makes and the bytes this rank puts into them.

(b) A model of W = 64 ... 4,096 ranks in one process. The ranks' exchanges run as W threads over a simulated process
group (:class:`SimulatedProcessGroup`): the library's own ``run_phase``, ``agree``, ``on_main`` and ``gather_rows``
(``accelerate_txn.core.ranks``) execute on every simulated rank, with the collective semantics of torch.distributed,
and each rank's calls and payload bytes are counted (what a collective carries, not how the backend routes it).
Rank 0's work and one other rank's work then run alone, timed and traced (``tracemalloc``), on a synthetic W-rank
checkpoint on disk shaped as Accelerate's FSDP sharded save (two DCP directories with W payloads each and a real
``.metadata`` of W chunks per tensor, W RNG files): the row merge, ``complete_rows``, the publish proof, the manifest
written by ``write_manifest``; on load, reading the manifest and rank 0's ``check_structure`` and
``check_dcp_inventory``, each rank's selection and re-hash of its own files.

(c) The offline CLI on the same synthetic checkpoints: ``accelerate-txn verify`` (quick and ``--full``) and
``inspect``, each a fresh interpreter.

    .venv/bin/python benchmarks/bench_scale.py --ranks 2 4 8 --repeats 5 --model 64 256 1024 4096 \
        --json benchmarks/results/scale.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

# --- (a) real ranks --------------------------------------------------------------------------------------------

_COUNTED = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
            "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
            "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "barrier", "send", "recv")


def _payload_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes this rank contributes to one call: its input tensor, or its pickled objects."""
    values = list(args) + list(kwargs.values())
    if name in ("all_gather_object", "gather_object"):
        return len(pickle.dumps(values[1] if len(values) > 1 else None))
    if name in ("broadcast_object_list", "scatter_object_list"):
        return len(pickle.dumps(values[0]))
    if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        values = values[1:2]  # the input, not the output list
    for value in values:
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
    return 0


@contextlib.contextmanager
def counting_collectives() -> Iterator[Counter[str]]:
    """Count this process's ``torch.distributed.<collective>(...)`` calls (``"<name>"``) and the bytes it puts into
    them (``"<name> bytes"``) while active. Nested calls inside torch (the two broadcasts of a
    ``broadcast_object_list``) are not counted separately: one API call is one count."""
    import torch.distributed as dist

    counts: Counter[str] = Counter()
    saved = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

    def wrap(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            counts[f"{name} bytes"] += _payload_bytes(name, args, kwargs)
            return function(*args, **kwargs)
        return counted

    for name, function in saved.items():
        setattr(dist, name, wrap(name, function))
    try:
        yield counts
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)


@contextlib.contextmanager
def timing_exchanges() -> Iterator[list[tuple[str, float, float]]]:
    """Record, while active, each exchange of the library's rank phases (``core.ranks.collective``): its phase,
    when it began and how long it took (its wait for the slowest rank included), as perf_counter seconds."""
    from accelerate_txn.core import ranks

    events: list[tuple[str, float, float]] = []
    original = ranks.collective

    @contextlib.contextmanager
    def timed(context: str, group: Any = None, earlier: BaseException | None = None) -> Iterator[None]:
        start = time.perf_counter()
        with original(context, group, earlier):
            yield
        events.append((context, start, time.perf_counter() - start))

    ranks.collective = timed  # type: ignore[assignment]
    try:
        yield events
    finally:
        ranks.collective = original  # type: ignore[assignment]


def _breakdown(events: list[tuple[str, float, float]], start: float, end: float) -> dict[str, Any]:
    """One protected call's time: in the library's exchanges, and the local work before the hashing exchange (the
    hash and fsync of this rank's files: the time since the exchange before it)."""
    hashing = next((i for i, (context, _, _) in enumerate(events) if context.startswith("Hashing and flushing")),
                   None)
    local_hash = None
    if hashing:
        previous = events[hashing - 1]
        local_hash = events[hashing][1] - (previous[1] + previous[2])
    return {"total_s": end - start, "exchanges": len(events), "in_exchanges_s": sum(e[2] for e in events),
            "hash_and_fsync_s": local_hash,
            "timeline": [(context[:70], round(at - start, 4), round(took, 4)) for context, at, took in events]}


def worker(root: str, million: float, repeats: int, fsdp_version: int = 1) -> dict[str, Any]:
    import accelerate_txn
    from accelerate_txn.testing import fsdp_accelerator

    accelerator = fsdp_accelerator(fsdp_version=fsdp_version)
    torch.manual_seed(0)
    width = 2048  # as bench_checkpoint.py: --million 4 is one Linear(2048, 2048)
    layers = max(1, round(million * 1e6 / (width * width + width)))
    raw_model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if fsdp_version == 1:
        model = accelerator.prepare(raw_model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        model, optimizer = accelerator.prepare(raw_model, torch.optim.AdamW(raw_model.parameters(), lr=1e-4))
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parameters = sum(p.numel() for p in raw_model.parameters()) if fsdp_version == 2 else \
        sum(p.numel() for p in model.parameters()) * accelerator.num_processes
    times: dict[str, list[float]] = {key: [] for key in ("save_native", "save_protected", "load_native",
                                                          "load_protected")}
    counts: dict[str, dict[str, int]] = {}
    breakdown: dict[str, Any] = {}

    def one(mode: str, name: str, counted: bool = False) -> None:
        if mode == "native":
            accelerate_txn.unpatch_accelerate_fsdp(accelerator)
        else:
            accelerate_txn.patch_accelerate_fsdp(accelerator)
        path = os.path.join(root, name)
        for phase, call in (("save", accelerator.save_state), ("load", accelerator.load_state)):
            accelerator.wait_for_everyone()
            with counting_collectives() if counted else contextlib.nullcontext(Counter()) as seen, \
                    timing_exchanges() if counted else contextlib.nullcontext([]) as events:
                start = time.perf_counter()
                call(path)
                elapsed = time.perf_counter() - start
            accelerator.wait_for_everyone()
            if counted:
                counts[f"{phase}_{mode}"] = dict(seen)
                if mode == "protected":
                    breakdown[phase] = _breakdown(events, start, start + elapsed)
            else:
                times[f"{phase}_{mode}"].append(elapsed)
        if accelerator.process_index == 0:
            shutil.rmtree(path)

    one("native", "warm_native")  # first calls pay imports and allocator growth: not measured
    one("protected", "warm_protected")
    for repeat in range(repeats):
        for mode in (("native", "protected") if repeat % 2 == 0 else ("protected", "native")):
            one(mode, f"{mode}_{repeat}")
    one("native", "counted_native", counted=True)
    one("protected", "counted_protected", counted=True)
    extra = {phase: statistics.median(p - n for p, n in zip(times[f"{phase}_protected"], times[f"{phase}_native"]))
             for phase in ("save", "load")}
    ratios = {phase: statistics.median(p / n for p, n in zip(times[f"{phase}_protected"], times[f"{phase}_native"]))
              for phase in ("save", "load")}
    return {"world": accelerator.num_processes, "parameters": parameters, "fsdp_version": fsdp_version,
            "times": {key: statistics.median(values) for key, values in times.items()}, "extra": extra,
            "ratios": ratios, "collectives": counts, "breakdown": breakdown}


def real_runs(worlds: list[int], million: float, repeats: int, fsdp_version: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO))  # the ranks import benchmarks.bench_scale
    from accelerate_txn.testing import launch

    found = []
    for world in worlds:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
            ranks = launch("benchmarks.bench_scale:worker", world, args=(root, million, repeats, fsdp_version),
                           timeout=600 + 120 * world * repeats)
        found.append({"world": world, "rank0": ranks[0], "ranks": ranks})
        print(f"W={world}: save +{ranks[0]['extra']['save'] * 1000:.0f} ms ({ranks[0]['ratios']['save']:.2f}x), "
              f"load +{ranks[0]['extra']['load'] * 1000:.0f} ms ({ranks[0]['ratios']['load']:.2f}x)", flush=True)
    return found


# --- (b) the model: W ranks as threads over a simulated process group -------------------------------------------

class SimulatedProcessGroup:
    """The part of the ``torch.distributed`` module API that ``accelerate_txn.core.ranks`` calls, for ``world`` ranks
    that are threads of this process (each thread sets its rank with :meth:`run`). Each collective has its torch
    semantics (every rank calls it; all-reduce MAX/SUM, all-gather, gather to a root, broadcast of objects) and
    counts, per rank, the calls and the payload bytes it sends and receives: what the collective carries to and from
    that rank, not how a backend routes it (a ring or a tree moves the same payloads in more, smaller messages)."""

    class ReduceOp:
        MAX = "max"
        SUM = "sum"

    def __init__(self, world: int) -> None:
        self.world = world
        self.group = SimpleNamespace(WORLD=SimpleNamespace())  # no get_group_store: no store-based evidence
        self.calls: list[Counter[str]] = [Counter() for _ in range(world)]
        self.sent = [0] * world
        self.received = [0] * world
        self._local = threading.local()
        self._slots: list[Any] = [None] * world
        self._combine: Callable[[list[Any]], Any] = list
        self._result: Any = None
        self._arrived = threading.Barrier(world, action=self._reduce)
        self._read = threading.Barrier(world)

    # -- the module API
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group: Any = None) -> int:
        return self._local.rank

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_backend(self, group: Any = None) -> str:
        return "gloo"

    def get_global_rank(self, group: Any, rank: int) -> int:
        return rank

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(range(self.world))

    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> None:
        stack = (lambda slots: torch.stack(slots).amax(0)) if op == self.ReduceOp.MAX else \
            (lambda slots: torch.stack(slots).sum(0))
        tensor.copy_(self._round("all_reduce", tensor.clone(), stack, tensor.nbytes, tensor.nbytes))

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
        for target, value in zip(tensors, self._round("all_gather", tensor.clone(), list, tensor.nbytes,
                                                       tensor.nbytes * self.world)):
            target.copy_(value)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
               group: Any = None) -> None:
        me = self._local.rank
        received = tensor.nbytes * (self.world - 1) if me == dst else 0
        everyone = self._round("gather", tensor.clone(), list, 0 if me == dst else tensor.nbytes, received)
        if me == dst:
            for target, value in zip(gather_list or [], everyone):
                target.copy_(value)

    def broadcast_object_list(self, objects: list[Any], src: int = 0, group: Any = None) -> None:
        me = self._local.rank
        data = pickle.dumps(objects) if me == src else b""
        payload = self._round("broadcast_object_list", data, lambda slots: slots[src],
                              len(data), 0, received_of_result=True)
        if me != src:
            objects[:] = pickle.loads(payload)

    def all_gather_object(self, objects: list[Any], obj: Any, group: Any = None) -> None:
        data = pickle.dumps(obj)
        everyone = self._round("all_gather_object", data, list, len(data), 0, received_of_result=True)
        objects[:] = [pickle.loads(item) for item in everyone]

    # -- machinery
    def _reduce(self) -> None:  # run by one thread once every rank arrived
        self._result = self._combine(self._slots)

    def _round(self, name: str, contribution: Any, combine: Callable[[list[Any]], Any], sent: int, received: int,
               received_of_result: bool = False) -> Any:
        me = self._local.rank
        self._slots[me] = contribution
        self._combine = combine  # every rank of a collective passes the same combination
        self._arrived.wait()
        result = self._result
        self._read.wait()  # nobody overwrites a slot before every rank read the result
        if received_of_result:
            received = sum(len(item) for item in result) if isinstance(result, list) else \
                (len(result) if me != 0 else 0)
        self.calls[me][name] += 1
        self.sent[me] += sent
        self.received[me] += received
        return result

    def run(self, function: Callable[[int], Any]) -> list[Any]:
        """``function(rank)`` on every simulated rank (one thread each); each rank's result, in rank order."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def body(me: int) -> None:
            self._local.rank = me
            try:
                results[me] = function(me)
            except BaseException as exc:  # reported after every thread ended
                errors.append(exc)
                self._arrived.abort()
                self._read.abort()

        previous = threading.stack_size(256 * 1024)
        try:
            threads = [threading.Thread(target=body, args=(me,), daemon=True) for me in range(self.world)]
        finally:
            threading.stack_size(previous)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


@contextlib.contextmanager
def simulated(world: int) -> Iterator[SimulatedProcessGroup]:
    """``accelerate_txn.core.ranks`` talking to a :class:`SimulatedProcessGroup` of ``world`` ranks while active."""
    from accelerate_txn.core import ranks

    fake = SimulatedProcessGroup(world)
    saved = ranks.dist
    ranks.dist = fake  # type: ignore[assignment]
    try:
        yield fake
    finally:
        ranks.dist = saved


# The exchanges of one protected save and one protected load, in the kinds and numbers the real runs count at W = 2,
# 4 and 8 (``collectives`` in the results, protected minus native): each run_phase is one fixed-size all-reduce (12
# bytes), each on_main a run_phase and a broadcast of its value, each agree one all-reduce of 64 bytes, each any_rank
# one of 4 bytes, gather_rows an all-reduce of 8 bytes and a gather. Rank 0's publish and the other ranks' hashing run
# in them as placeholders; their real cost is measured apart (``rank0_s`` and ``other_s``).
SAVE_PHASES = 10  # plain run_phase calls (settings, releases, path, preflight, lock, native save, loader states,
#                   required files, hashing and flushing, ...)
SAVE_AGREE = 4  # the dispatch's, the path and policies, the training configuration, the run id
SAVE_ANY = 1
SAVE_ON_MAIN = 3  # the run id, the reservation, the publish
LOAD_PHASES = 19  # plain run_phase calls (participants, releases, manifest, descriptors, checks, restore, RNG, ...)
LOAD_AGREE = 3  # the dispatch's, the checkpoint to load, the training configuration
LOAD_ANY = 2
LOAD_ON_MAIN = 2  # the candidates, the run id


def _descriptor(world: int) -> dict[str, Any]:
    """A component descriptor shaped as the library's for a one-Linear FSDP model with AdamW."""
    parameters = {"0.bias": {"dtype": "torch.float32", "requires_grad": True, "shape": [2048]},
                  "0.weight": {"dtype": "torch.float32", "requires_grad": True, "shape": [2048, 2048]}}
    return {"accumulation_steps": 1, "backend": "FSDP", "custom_objects": [], "dataloaders": [],
            "mixed_precision": "no", "private_states": {}, "scaler": None, "schedulers": [], "training": {},
            "models": [{"class": "torch.nn.modules.container.Sequential", "config": {}, "id": "model",
                        "fsdp": [{"cpu_offload": False, "original_params": True, "sharding": "FULL_SHARD"}] * 2,
                        "parameters": parameters}],
            "optimizers": [{"class": "torch.optim.adamw.AdamW", "groups": [["0.weight", "0.bias"]],
                            "execution": [{"capturable": False, "differentiable": False, "fused": None}]}],
            "world_size": world}


def exchange_save(world: int, rows_of: Callable[[int], dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Run a save's exchanges on ``world`` simulated ranks; per-rank calls and bytes, and what rank 0 gathered."""
    from accelerate_txn.core.ranks import agree, any_rank, gather_rows, on_main, run_phase

    descriptor = {"": _descriptor(world)}
    values = [{"enabled": True, "path": "fsdp1"}, {"path": "/checkpoints/checkpoint_7", "limit": 3, "policies": {}},
              descriptor, []][:SAVE_AGREE]

    def save(me: int) -> int:
        for _ in range(SAVE_PHASES - 1):
            run_phase(lambda: None, "A fixed-size phase")
        for value in values:
            agree(value, "a value every rank holds")
        for _ in range(SAVE_ANY):
            any_rank(False)
        for _ in range(SAVE_ON_MAIN - 1):
            on_main(lambda: "0" * 32, "Choosing the run id")
        rows = run_phase(lambda: rows_of(me), "Hashing and flushing the staged checkpoint")
        merged = gather_rows(rows, world)
        return on_main(lambda: len(merged), "Publishing")

    return _counted(world, save)


def exchange_load(world: int, manifest_digest: str) -> dict[str, Any]:
    """Run a load's exchanges on ``world`` simulated ranks; per-rank calls and bytes."""
    from accelerate_txn.core.ranks import agree, any_rank, on_main, run_phase

    values = [{"enabled": True, "path": "fsdp1"}, {"path": "/checkpoints/checkpoint_7", "manifest": manifest_digest},
              {"": _descriptor(world)}][:LOAD_AGREE]

    def load(me: int) -> int:
        for _ in range(LOAD_ON_MAIN):
            on_main(lambda: ["/checkpoints/checkpoint_7"], "Selecting the checkpoint")
        for _ in range(LOAD_PHASES):
            run_phase(lambda: None, "A fixed-size phase")
        for value in values:
            agree(value, "a value every rank holds")
        for _ in range(LOAD_ANY):
            any_rank(False)
        return 0

    return _counted(world, load)


def _counted(world: int, function: Callable[[int], Any]) -> dict[str, Any]:
    with simulated(world) as group:
        start = time.perf_counter()
        results = group.run(function)
        elapsed = time.perf_counter() - start
    others = range(1, world)
    return {"result": results[0], "simulation_s": elapsed,
            "messages_rank0": sum(group.calls[0].values()),
            "messages_other": max(sum(group.calls[r].values()) for r in others),
            "calls_rank0": dict(group.calls[0]),
            "sent_rank0": group.sent[0], "received_rank0": group.received[0],
            "sent_other_max": max(group.sent[r] for r in others),
            "received_other_max": max(group.received[r] for r in others)}


# --- the synthetic W-rank checkpoint -------------------------------------------------------------------------------

TENSORS = 2  # per DCP directory: one Linear's weight and bias (the optimizer directory: exp_avg and exp_avg_sq)
RNG_BYTES = 14_497  # Accelerate's random_states_R.pkl on CPU
PAYLOAD_BYTES = 4_096  # each rank's DCP payload (a small model: the content's size does not change the protocol)


def synthetic_checkpoint(root: Path, world: int) -> dict[int, list[str]]:
    """A W-rank checkpoint's staged tree in ``root``, shaped as Accelerate's FSDP sharded save: per DCP directory a
    ``.metadata`` with W chunks per tensor and W payloads ``__R_0.distcp``; W ``random_states_R.pkl``. Returns each
    rank's files as ``core.manifest.writer_rank`` assigns them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from accelerate_txn.core.manifest import writer_rank

    root.mkdir(parents=True)
    block = os.urandom(max(PAYLOAD_BYTES, RNG_BYTES))
    for folder, keys in (("pytorch_model_fsdp_0", ("model.0.weight", "model.0.bias")),
                         ("optimizer_0", ("optimizer.state.0.weight.exp_avg", "optimizer.state.0.weight.exp_avg_sq"))):
        directory = root / folder
        directory.mkdir()
        state: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        per_chunk = PAYLOAD_BYTES // TENSORS
        for key in keys[:TENSORS]:
            rows = 4
            chunks = [ChunkStorageMetadata(offsets=torch.Size([r * rows, 0]), sizes=torch.Size([rows, 8]))
                      for r in range(world)]
            state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                               size=torch.Size([rows * world, 8]), chunks=chunks)
            index = keys.index(key)
            for r in range(world):
                storage[MetadataIndex(key, [r * rows, 0])] = _StorageInfo(f"__{r}_0.distcp", index * per_chunk,
                                                                          per_chunk)
        with (directory / ".metadata").open("wb") as stream:
            pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage,
                                 planner_data={key: tuple(key.split(".", 1)) for key in keys}), stream)
        for r in range(world):
            (directory / f"__{r}_0.distcp").write_bytes(block[:PAYLOAD_BYTES])
    for r in range(world):
        (root / f"random_states_{r}.pkl").write_bytes(block[:RNG_BYTES])
    owners: dict[int, list[str]] = {r: [] for r in range(world)}
    for name in sorted(_names(root)):
        owners[writer_rank(name, world, TEMPLATES)].append(name)
    return owners


TEMPLATES = ("dataloader_states_{rank}.pt", "random_states_{rank}.pkl")


def _names(root: Path) -> list[str]:
    from accelerate_txn.core.manifest import list_tree

    return list(list_tree(root))


def _traced(function: Callable[[], Any]) -> tuple[Any, float, int]:
    """``function()``'s value, wall time and peak traced allocation (``tracemalloc``; the timing is taken apart)."""
    start = time.perf_counter()
    function()
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    try:
        value = function()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return value, elapsed, peak


def model_point(world: int, root: Path, cli: bool = True) -> dict[str, Any]:
    """Every modelled quantity at ``world`` ranks (a synthetic checkpoint is built under ``root``)."""
    from accelerate_txn.accelerate.elastic import POLICY
    from accelerate_txn.core.manifest import (
        HASH,
        MANIFEST,
        PROTOCOL,
        check_dcp_inventory,
        check_hashes,
        check_rank_coverage,
        check_structure,
        complete_rows,
        hash_rows,
        hashed_names,
        list_tree,
        metadata_cache,
        read_manifest,
        write_manifest,
        writer_rank,
    )
    from accelerate_txn.core.ranks import digest, merge_row_payloads, row_payload
    from accelerate_txn.store.posix import POSIX

    staging = root / f"checkpoint_{world}"
    owners = synthetic_checkpoint(staging, world)
    rows = hash_rows(staging, [name for names in owners.values() for name in names], algorithm=HASH,
                     integrity="full")
    rows_by_rank = {r: {name: rows[name] for name in names} for r, names in owners.items()}
    last = world - 1

    # One rank other than 0 during a save: list the staged tree, select, hash and fsync its own files.
    def own_rows(me: int = last) -> dict[str, Any]:
        mine = list_tree(staging, keep=lambda name: writer_rank(name, world, TEMPLATES) == me)  # as save._own_rows
        return hash_rows(staging, list(mine), algorithm=HASH, integrity="full", flush=True)

    _, save_other_s, save_other_peak = _traced(own_rows)
    payloads = [row_payload(r, rows_by_rank[r]) for r in range(1, world)]
    longest = max(len(p) for p in payloads)
    padded = [p.ljust(longest, b" ") for p in payloads]
    descriptors = {"": _descriptor(world)}

    # Rank 0 during a save: merge the gathered rows, complete and prove them, assemble and write the manifest.
    def publish() -> int:
        with metadata_cache():  # as the save's _finish: each .metadata parsed once
            return publish_cached()

    def publish_cached() -> int:
        merged = merge_row_payloads(rows_by_rank[0], padded, world)
        complete_rows(staging, merged, integrity="full")
        check_rank_coverage(staging, merged, descriptors, list(TEMPLATES))
        check_dcp_inventory(staging, {"files": merged})
        manifest = {"protocol": PROTOCOL, "status": "complete", "run_id": "a" * 32, "transaction_id": "b" * 32,
                    "components": descriptors, "steps": {"": 7}, "progress": {"checkpoint": 7,
                                                                               "optimizer_steps": {"": [7]}},
                    "versions": {"accelerate": "1.15.0", "torch": torch.__version__}, "integrity": "full",
                    "hash": HASH, "files": dict(sorted(merged.items())),
                    "rank_state": {"policy": POLICY, "files": list(TEMPLATES)}}
        write_manifest(staging, manifest, store=POSIX)
        return len(merged)

    _, save_rank0_s, save_rank0_peak = _traced(publish)
    manifest_bytes = (staging / MANIFEST).stat().st_size
    manifest = read_manifest(staging)
    assert manifest is not None

    # Load, every rank: read the manifest, digest it (agreement), select and re-hash its own files.
    def load_own(me: int) -> int:
        found = read_manifest(staging)
        digest(found)
        names = [name for name in hashed_names(found, full=True) if writer_rank(name, world, TEMPLATES) == me]
        return check_hashes(staging, found, names)

    _, load_other_s, load_other_peak = _traced(lambda: load_own(last))

    # Load, rank 0: the manifest checks (structure, rank coverage, DCP inventory) and its own files.
    def load_rank0() -> int:
        check_structure(staging, manifest)
        check_dcp_inventory(staging, manifest)
        return load_own(0)

    _, load_rank0_s, load_rank0_peak = _traced(load_rank0)
    save = exchange_save(world, lambda me: rows_by_rank[me])
    assert save["result"] == len(rows), (save["result"], len(rows))
    load = exchange_load(world, digest(manifest).hex())
    point = {"world": world, "files": len(rows), "files_per_rank": len(rows_by_rank[last]),
             "manifest_bytes": manifest_bytes, "row_payload_bytes": longest,
             "save": {**{k: v for k, v in save.items() if k != "result"},
                      "rank0_s": save_rank0_s, "rank0_peak_bytes": save_rank0_peak,
                      "other_s": save_other_s, "other_peak_bytes": save_other_peak},
             "load": {**load, "rank0_s": load_rank0_s, "rank0_peak_bytes": load_rank0_peak,
                      "other_s": load_other_s, "other_peak_bytes": load_other_peak}}
    if cli:
        point["cli"] = {name: _cli_seconds(command, staging) for name, command in
                        (("verify", ["verify"]), ("verify_full", ["verify", "--full"]), ("inspect", ["inspect"]))}
    return point


def _cli_seconds(command: list[str], checkpoint: Path) -> float:
    """Wall time of ``accelerate-txn COMMAND CHECKPOINT`` in a fresh interpreter (best of two: the first warms)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "accelerate_txn", *command, str(checkpoint)], check=True,
                       stdout=subprocess.DEVNULL, env=env)
        timings.append(time.perf_counter() - start)
    return min(timings)


def model(worlds: list[int], cli: bool = True) -> list[dict[str, Any]]:
    points = []
    for world in worlds:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
            point = model_point(world, Path(root), cli=cli)
        points.append(point)
        print(f"W={world}: manifest {point['manifest_bytes'] / 1024:.0f} KiB, rank 0 receives "
              f"{point['save']['received_rank0'] / 1024:.0f} KiB per save, save rank 0 "
              f"{point['save']['rank0_s'] * 1000:.0f} ms", flush=True)
    return points


# --- report ---------------------------------------------------------------------------------------------------------

def _load_average() -> str:
    with open("/proc/loadavg") as stream:
        return " ".join(stream.read().split()[:3])


def _calls(result: dict[str, Any], phase: str, mode: str) -> int:
    """Collective calls one rank made in one counted save or load."""
    return sum(v for k, v in result["collectives"][f"{phase}_{mode}"].items() if not k.endswith(" bytes"))


def report(results: dict[str, Any]) -> None:
    print(f"load average before {results['loadavg_before']}, after the real runs {results['loadavg_after_real']}, "
          f"after the model {results['loadavg_after']} (its simulated ranks are threads); {results['cpus']} CPUs")
    if results["real"]:
        print("| W | phase | native ms | protected ms | protected - native ms | median of pair ratios |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in results["real"]:
            rank0 = row["rank0"]
            for phase in ("save", "load"):
                print(f"| {row['world']} | {phase} | {rank0['times'][f'{phase}_native'] * 1000:.0f} | "
                      f"{rank0['times'][f'{phase}_protected'] * 1000:.0f} | {rank0['extra'][phase] * 1000:+.0f} | "
                      f"{rank0['ratios'][phase]:.2f} |")
        print()
        print("| W | phase | torch.distributed calls per rank, native | protected (rank 0) | protected (other "
              "ranks, max) | library exchanges | ms in them (rank 0) | hash + fsync ms (rank 0) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in results["real"]:
            for phase in ("save", "load"):
                split = row["rank0"]["breakdown"][phase]
                hashed = split["hash_and_fsync_s"]
                print(f"| {row['world']} | {phase} | {_calls(row['rank0'], phase, 'native')} | "
                      f"{_calls(row['rank0'], phase, 'protected')} | "
                      f"{max(_calls(r, phase, 'protected') for r in row['ranks'][1:])} | {split['exchanges']} | "
                      f"{split['in_exchanges_s'] * 1000:.0f} | {'-' if hashed is None else f'{hashed * 1000:.0f}'} |")
        print()
    if results["model"]:
        print("| W | files | manifest KiB | save: messages/rank | save: rank 0 receives KiB | save: other rank "
              "sends/receives B | save: rank 0 ms, peak MiB | save: other rank ms | load: messages/rank | "
              "load: other rank receives B | load: rank 0 ms, peak MiB | load: other rank ms | CLI verify / --full / "
              "inspect s |")
        print("| " + " | ".join(["---"] * 13) + " |")
        for p in results["model"]:
            s, ld = p["save"], p["load"]
            cli = p.get("cli")
            cli_text = " / ".join(f"{cli[k]:.2f}" for k in ("verify", "verify_full", "inspect")) if cli else "-"
            print(f"| {p['world']} | {p['files']} | {p['manifest_bytes'] / 1024:.0f} | {s['messages_other']} | "
                  f"{s['received_rank0'] / 1024:.0f} | {s['sent_other_max']} / {s['received_other_max']} | "
                  f"{s['rank0_s'] * 1000:.0f}, {s['rank0_peak_bytes'] / 2**20:.1f} | {s['other_s'] * 1000:.0f} | "
                  f"{ld['messages_other']} | {ld['received_other_max']} | "
                  f"{ld['rank0_s'] * 1000:.0f}, {ld['rank0_peak_bytes'] / 2**20:.1f} | {ld['other_s'] * 1000:.0f} | "
                  f"{cli_text} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8], help="real world sizes (none: skip)")
    parser.add_argument("--repeats", type=int, default=5, help="timed native/protected pairs per real world size")
    parser.add_argument("--million", type=float, default=4, help="model parameters of the real runs, in millions")
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=1)
    parser.add_argument("--model", type=int, nargs="*", default=[64, 256, 1024, 4096],
                        help="modelled world sizes (none: skip)")
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI timings of the model")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    results: dict[str, Any] = {"loadavg_before": _load_average(), "cpus": os.cpu_count(),
                               "million": args.million, "fsdp_version": args.fsdp_version}
    results["real"] = real_runs(args.ranks, args.million, args.repeats, args.fsdp_version) if args.ranks else []
    results["loadavg_after_real"] = _load_average()  # the model's thousands of threads raise the load average
    results["model"] = model(args.model, cli=not args.no_cli) if args.model else []
    results["loadavg_after"] = _load_average()
    report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
