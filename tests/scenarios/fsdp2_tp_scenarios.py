"""FSDP2 + tensor parallelism scenarios run inside launched gloo ranks: Accelerate's ``ParallelismConfig(dp_shard_size,
tp_size)`` mesh built on CPU by ``fsdp_accelerator``, the model tensor-parallelised by the script before ``prepare``
(``parallelize_module`` on ``accelerator.torch_device_mesh["tp"]``, as a user does on Accelerate 1.15), then
``fully_shard`` over the data-parallel dimension by Accelerate's ``prepare``. Each scenario performs several checks
in one process group and returns observations that tests/fsdp/test_fsdp2_tp.py asserts on."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn.testing import TinyModel, fsdp_accelerator
from tests.scenarios.corruption_scenarios import flip_middle_byte
from tests.scenarios.fsdp2_scenarios import _differences, _snapshot, next_step_differences
from tests.scenarios.scenarios import _error, warmup_lambda

WIDTH = 18  # 18 rows over tp 2 are 9, over dp_shard 2 then 5 and 4: uneven strided shards
# Megatron-style pairs: a column-parallel layer's sharded output feeds a row-parallel one; every Linear is split.
PLAN = {"body.0": "colwise", "body.3": "rowwise", "body.6": "colwise", "head": "rowwise"}


def _build(seed: int, *, dp_shard: int = 2, tp: int = 2, dp_replicate: int = 1,
           plan: dict[str, str] | None = None) -> tuple[Any, ...]:
    """A TinyModel tensor-parallelised over ``tp`` (``plan``: module -> "colwise"/"rowwise", default :data:`PLAN`;
    Accelerate's ``prepare`` makes every parameter a plan leaves alone a ``Replicate()`` DTensor on the ``tp``
    mesh) and fully sharded over the data-parallel dimensions."""
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = ParallelismConfig(dp_replicate_size=dp_replicate, dp_shard_size=dp_shard, tp_size=tp)
    accelerator = fsdp_accelerator(fsdp_version=2, parallelism_config=config)
    torch.manual_seed(seed)  # every rank: the same initial weights and the same dropout draws within a TP group
    raw = TinyModel(width=WIDTH)
    if tp > 1:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(raw, accelerator.torch_device_mesh["tp"], {k: styles[v]() for k, v in (plan or PLAN).items()})
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_lambda, warmup=3))
    model, opt, scheduler = accelerator.prepare(raw, opt, scheduler)
    return accelerator, model, opt, scheduler


def _data_rank(accelerator: Any) -> int:
    """The rank's data-parallel index: the ranks of one TP group see the same batch."""
    mesh = accelerator.torch_device_mesh
    tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
    return accelerator.process_index // tp  # "tp" is the mesh's last dimension


def _train(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + _data_rank(accelerator))
    for _ in range(steps):
        loss = model(torch.randn(4, WIDTH, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _full(model: Any, optimizer: Any) -> dict[str, Any]:
    """Every parameter and optimizer state tensor gathered whole (collective): comparable across mesh shapes."""
    names = {id(p): n for n, p in model.named_parameters()}
    raw = getattr(optimizer, "optimizer", optimizer)

    def whole(value: Any) -> Any:
        return value.full_tensor().detach().clone() if hasattr(value, "full_tensor") else (
            value.detach().clone() if torch.is_tensor(value) else value)

    return {"params": {n: whole(p) for n, p in model.named_parameters()},
            "optim": {names[id(p)]: {k: whole(v) for k, v in s.items()} for p, s in raw.state.items() if s}}


@contextlib.contextmanager
def _readers() -> Iterator[list[Any]]:
    """Every DCP reader the protected FSDP2 model restore creates in this process (each counts the items it read
    straight into place, ``direct``, and those DCP's own reader read, ``delegated``)."""
    from accelerate_txn.fsdp import dcp_reader

    created: list[Any] = []
    original = dcp_reader.DirectReader.create

    def create(path: Any) -> Any:
        created.append(original(path))
        return created[-1]

    dcp_reader.DirectReader.create = staticmethod(create)
    try:
        yield created
    finally:
        dcp_reader.DirectReader.create = staticmethod(original)


def _boxes(model: Any) -> dict[str, Any]:
    """Per parameter: its placements, and whether each DCP write item of this rank (the chunk DCP records for the
    local shard) holds exactly what the gathered tensor holds there (collective)."""
    found = {}
    for name, parameter in model.named_parameters():
        full = parameter.full_tensor()
        local = parameter.to_local()
        exact = []
        for item in parameter.__create_write_items__(name, parameter):
            box = full
            for dim, (offset, size) in enumerate(zip(item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes)):
                box = box.narrow(dim, offset, size)
            exact.append(box.shape == local.shape and torch.equal(box, local))
        found[name] = {"placements": [str(p) for p in parameter.placements], "boxes_exact": exact}
    return found


def _chunk_report(directory: Path) -> dict[str, Any]:
    """From a DCP ``.metadata``: for each tensor, its elements, the elements its chunks cover, whether any two
    chunks overlap or repeat, and how many stored payloads each chunk has (and in which files)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    payloads: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for index, info in metadata.storage_data.items():
        payloads.setdefault((index.fqn, tuple(index.offset or ())), []).append(info.relative_path)
    report = {}
    for key, stored in metadata.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in stored.chunks]
        overlaps = 0
        for i, (a_off, a_size) in enumerate(boxes):
            for b_off, b_size in boxes[i + 1:]:
                if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size)):
                    overlaps += 1
        report[key] = {
            "numel": math.prod(stored.size),
            "covered": sum(math.prod(size) for _, size in boxes),
            "overlaps": overlaps,
            "chunks": len(boxes),
            "payloads": [payloads.get((key, offset), []) for offset, _ in boxes],
        }
    return report


def tp_roundtrip(root: str) -> dict[str, Any]:
    """On a dp_shard 2 x tp 2 mesh: protected save; train on; restore into the same objects and into fresh ones
    (model, optimizer, groups, scheduler, RNG bitwise; the next step equal); the DCP chunks; a damaged payload of
    rank 3 refused on every rank before anything changes; native Accelerate loading the protected checkpoint;
    elastic resume onto dp_shard 4 (no TP) in the same ranks."""
    from accelerate_txn.accelerate.patch import _protected
    from accelerate_txn.fsdp.fsdp2 import mesh_dim_names, unsupported_fsdp2

    base = Path(root)
    rank = int(os.environ["RANK"])
    obs: dict[str, Any] = {}
    acc, model, opt, sched = _build(0)
    obs["mesh"] = [list(acc.torch_device_mesh.shape), list(acc.torch_device_mesh.mesh_dim_names)]
    obs["parameter_mesh"] = mesh_dim_names(model)
    obs["unsupported"] = unsupported_fsdp2([model], acc.num_processes)
    obs["protected"] = _protected(acc)
    obs["boxes"] = _boxes(model)
    _train(acc, model, opt, sched, 3, seed=1)
    path = base / "c1"
    obs["save_error"] = _error(lambda: acc.save_state(str(path)))
    expected = _snapshot(model, opt, sched)
    full = _full(model, opt)
    if rank == 0:
        torch.save({**full, "scheduler": sched.scheduler.state_dict()}, base / "expected.pt")
        obs["manifest"] = (path / accelerate_txn.MANIFEST).is_file()
        obs["chunks"] = {"model": _chunk_report(path / "pytorch_model_fsdp_0"),
                         "optimizer": _chunk_report(path / "optimizer_0")}

    # Train on, then restore into the same objects: DCP reads into the live shards.
    _train(acc, model, opt, sched, 2, seed=4)
    obs["trained_on_differences"] = _differences(expected, _snapshot(model, opt, sched))
    with _readers() as readers:
        obs["same_error"] = _error(lambda: acc.load_state(str(path)))
    obs["same_direct"] = sum(r.direct for r in readers)
    obs["same_differences"] = _differences(expected, _snapshot(model, opt, sched))

    # A fresh model (other seed), a fresh optimizer, the scheduler at 0, the RNG elsewhere.
    acc2, model2, opt2, sched2 = _build(7)
    torch.manual_seed(1234 + rank)
    obs["fresh_error"] = _error(lambda: acc2.load_state(str(path)))
    obs["fresh_differences"] = _differences(expected, _snapshot(model2, opt2, sched2))
    obs["next_step_differences"] = next_step_differences(_train, (acc, model, opt, sched), (acc2, model2, opt2, sched2))

    # A flipped byte in rank 3's model payload: refused on every rank, nothing restored anywhere.
    damaged = base / "damaged"
    if rank == 0:
        shutil.copytree(path, damaged)
        flip_middle_byte(damaged / "pytorch_model_fsdp_0" / "__3_0.distcp")
    acc2.wait_for_everyone()
    before = _snapshot(model2, opt2, sched2)
    obs["corrupt_error"] = _error(lambda: acc2.load_state(str(damaged)))
    obs["corrupt_unchanged"] = _differences(before, _snapshot(model2, opt2, sched2))

    # Native Accelerate (this Accelerator opted out) loads the protected checkpoint.
    acc3, model3, opt3, sched3 = _build(11)
    accelerate_txn.unpatch_accelerate_fsdp(acc3)
    torch.manual_seed(99 + rank)
    obs["native_error"] = _error(lambda: acc3.load_state(str(path)))
    obs["native_differences"] = _differences(expected, _snapshot(model3, opt3, sched3))

    # A plan that leaves the last two layers alone: prepare replicates them over TP (FSDP shards them over dp).
    half = {"body.0": "colwise", "body.3": "rowwise"}
    acc4, model4, opt4, sched4 = _build(3, plan=half)
    obs["half_placements"] = {n: [str(p) for p in q.placements] for n, q in model4.named_parameters()}
    _train(acc4, model4, opt4, sched4, 2, seed=6)
    obs["half_save_error"] = _error(lambda: acc4.save_state(str(base / "half")))
    expected4 = _snapshot(model4, opt4, sched4)
    acc5, model5, opt5, sched5 = _build(8, plan=half)
    obs["half_load_error"] = _error(lambda: acc5.load_state(str(base / "half")))
    obs["half_differences"] = _differences(expected4, _snapshot(model5, opt5, sched5))

    # Asynchronous save (host copy of the 2-D shards, written in the background while training goes on).
    accelerate_txn.configure_checkpointing(acc5, async_save=True)
    obs["async_save_error"] = _error(lambda: acc5.save_state(str(base / "async")))
    expected5 = _snapshot(model5, opt5, sched5)
    _train(acc5, model5, opt5, sched5, 1, seed=2)
    obs["async_wait_error"] = _error(lambda: accelerate_txn.wait_for_checkpoint(acc5))
    acc6, model6, opt6, sched6 = _build(9, plan=half)
    obs["async_load_error"] = _error(lambda: acc6.load_state(str(base / "async")))
    obs["async_differences"] = _differences(expected5, _snapshot(model6, opt6, sched6))

    # Elastic: the same checkpoint onto dp_shard 4 without TP, in these 4 ranks.
    obs.update(_elastic(base, dp_shard=4, tp=1, prefix="dp4"))
    return obs


def _elastic(base: Path, *, dp_shard: int, tp: int, prefix: str) -> dict[str, Any]:
    """Resume ``base/c1`` on another mesh under ``allow_reshard``: every parameter and optimizer state tensor equal
    to the saved one (gathered whole on both sides), the scheduler too."""
    acc, model, opt, sched = _build(21, dp_shard=dp_shard, tp=tp)
    accelerate_txn.configure_checkpointing(acc, allow_reshard=True)
    obs: dict[str, Any] = {f"{prefix}_placements": sorted({str(p.placements) for p in model.parameters()})}
    obs[f"{prefix}_error"] = _error(lambda: acc.load_state(str(base / "c1")))
    expected = torch.load(base / "expected.pt", weights_only=True)
    restored = {**_full(model, opt), "scheduler": sched.scheduler.state_dict()}
    obs[f"{prefix}_differences"] = _differences(expected, restored, ("params", "optim", "scheduler"))
    return obs


def elastic_tp1(root: str) -> dict[str, Any]:
    """The dp_shard 2 x tp 2 checkpoint resumed on 2 ranks, dp_shard 2 x tp 1."""
    return _elastic(Path(root), dp_shard=2, tp=1, prefix="dp2")


def tp_3d(root: str) -> dict[str, Any]:
    """On 8 ranks, dp_replicate 2 x dp_shard 2 x tp 2 (run by hand, not in CI): protected save, exact restore into
    fresh objects, every DCP chunk exactly its rank's shard, a damaged payload of rank 5 refused before anything
    changes."""
    from accelerate_txn.accelerate.patch import _protected

    base = Path(root)
    rank = int(os.environ["RANK"])
    acc, model, opt, sched = _build(0, dp_replicate=2)
    obs: dict[str, Any] = {"mesh": [list(acc.torch_device_mesh.shape), list(acc.torch_device_mesh.mesh_dim_names)],
                           "protected": _protected(acc), "boxes": _boxes(model)}
    _train(acc, model, opt, sched, 2, seed=1)
    path = base / "c3d"
    obs["save_error"] = _error(lambda: acc.save_state(str(path)))
    expected = _snapshot(model, opt, sched)
    acc2, model2, opt2, sched2 = _build(7, dp_replicate=2)
    torch.manual_seed(1234 + rank)
    obs["fresh_error"] = _error(lambda: acc2.load_state(str(path)))
    obs["fresh_differences"] = _differences(expected, _snapshot(model2, opt2, sched2))
    damaged = base / "damaged"
    if rank == 0:
        shutil.copytree(path, damaged)
        flip_middle_byte(damaged / "optimizer_0" / "__5_0.distcp")
    acc2.wait_for_everyone()
    _train(acc2, model2, opt2, sched2, 1, seed=3)
    before = _snapshot(model2, opt2, sched2)
    obs["corrupt_error"] = _error(lambda: acc2.load_state(str(damaged)))
    obs["corrupt_unchanged"] = _differences(before, _snapshot(model2, opt2, sched2))
    return obs
