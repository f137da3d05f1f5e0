"""fsdp.dcp_writer: each tensor written straight from its memory, into the archive torch.save writes, hashed as
written; what it cannot reproduce goes through DCP's own steps; the files load with DCP, torch.load, native
Accelerate and the direct reader (the 2-rank checks are in tests/scenarios/dcp_writer_scenarios.py)."""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

from accelerate_txn.fsdp import dcp_writer
from accelerate_txn.fsdp.dcp_reader import plain_tensor_span
from accelerate_txn.testing import launch


def _save(state: dict, path: Path, **writer_options: object) -> tuple[dict, bool]:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), **writer_options)
    record: dict[Path, tuple[int, str]] = {}
    installed = dcp_writer.write_directly(writer, record, xxhash.xxh3_128)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|torch.distributed is disabled).*")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return record, installed


def _load(like: dict, path: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    target = {key: torch.empty_like(value) if torch.is_tensor(value) else value for key, value in like.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|torch.distributed is disabled).*")
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def _items(path: Path) -> dict[str, tuple[str, int, int]]:
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata()
    return {index.fqn: (info.relative_path, info.offset, info.length) for index, info in metadata.storage_data.items()}


def _counts() -> tuple[int, int, int, int]:
    c = dcp_writer.DirectWriteCounts
    return c.direct, c.delegated, c.files_direct_io, c.files_buffered


def test_plain_tensors_are_written_from_memory_and_load_back_exactly(tmp_path: Path) -> None:
    flat = torch.randn(64)
    state = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "i64": torch.arange(10),
        "bool": torch.tensor([True, False, True]), "c64": torch.randn(4, dtype=torch.complex64),
        "box": flat[8:40].view(4, 8),  # a view into a larger storage (an FSDP1 shard box): stored as its elements
        "big": torch.randn(5 * dcp_writer.CHUNK // 4 + 3),  # spans several O_DIRECT chunks, odd tail
        "step": 7, "name": "x",  # non-tensor items (BYTE_IO)
    }
    before = _counts()
    record, installed = _save(state, tmp_path)
    after = _counts()
    assert installed
    assert after[0] - before[0] == 7 and after[1] == before[1]  # every tensor direct, none through DCP's steps
    loaded = _load(state, tmp_path)
    for key, value in state.items():
        if torch.is_tensor(value):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value
    # Each item is a plain torch.save archive: torch.load reads it, the direct reader finds its bytes.
    items = _items(tmp_path)
    box_file, box_offset, box_length = items["box"]
    with open(tmp_path / box_file, "rb") as stream:
        stream.seek(box_offset)
        assert torch.equal(torch.load(io.BytesIO(stream.read(box_length)), weights_only=True), state["box"])
    fd = os.open(tmp_path / box_file, os.O_RDONLY)
    try:
        span = plain_tensor_span(fd, box_offset, box_length)
    finally:
        os.close(fd)
    assert span is not None and span[0] == torch.float32 and span[1] == (4, 8) and span[3] == 32 * 4
    # The recorded hash is the file's own, over its exact size.
    (path, (size, digest)), = record.items()
    assert path == (tmp_path / box_file).absolute()
    data = path.read_bytes()
    assert size == len(data) and digest == xxhash.xxh3_128(data).hexdigest()


def test_the_archive_is_the_one_torch_save_writes(tmp_path: Path) -> None:
    # Same records, at the same offsets, with the same payloads; only the storage record's CRC-32 (0, as
    # torch.save writes with compute_crc32=False) and the per-save serialization id differ.
    tensor = torch.randn(6, 5)
    _save({"t": tensor}, tmp_path)
    file_name, offset, length = _items(tmp_path)["t"]
    with open(tmp_path / file_name, "rb") as stream:
        stream.seek(offset)
        mine = stream.read(length)
    reference = io.BytesIO()
    torch.save(tensor, reference)
    theirs = reference.getvalue()
    assert len(mine) == len(theirs)
    ours_zip, their_zip = zipfile.ZipFile(io.BytesIO(mine)), zipfile.ZipFile(io.BytesIO(theirs))
    rows = [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in ours_zip.infolist()]
    assert rows == [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in their_zip.infolist()]
    for info in ours_zip.infolist():
        if info.filename.endswith("serialization_id"):
            continue
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
        assert mine[start:start + info.file_size] == theirs[start:start + info.file_size], info.filename


def test_what_it_cannot_copy_byte_for_byte_goes_through_dcp_steps_in_the_same_file(tmp_path: Path) -> None:
    state = {"transposed": torch.randn(4, 6).t(), "empty": torch.empty(0, 3), "plain": torch.randn(5)}
    if hasattr(torch, "float8_e4m3fn"):
        state["fp8"] = torch.randn(8).to(torch.float8_e4m3fn)
    before = _counts()
    _save(state, tmp_path)
    after = _counts()
    assert after[0] - before[0] == 1 and after[1] - before[1] == len(state) - 1
    loaded = _load(state, tmp_path)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape
        assert torch.equal(loaded[key].float(), value.float()), key
    assert len({entry[0] for entry in _items(tmp_path).values()}) == 1  # one file per rank, as DCP's writer


@pytest.mark.parametrize("options", [{"thread_count": 2}, {"single_file_per_rank": False}])
def test_a_writer_it_does_not_reproduce_is_left_to_dcp(tmp_path: Path, options: dict) -> None:
    state = {"a": torch.randn(10), "b": torch.arange(4)}
    before = _counts()
    _, installed = _save(state, tmp_path, **options)
    assert not installed and _counts() == before
    loaded = _load(state, tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("off", ["0", "off", "False", " NO "])  # "off" once meant on (issue 43)
def test_direct_io_on_this_file_system_and_buffered_when_switched_off(tmp_path: Path, monkeypatch, off: str) -> None:
    state = {"a": torch.randn(1000), "b": torch.randn(3, 3)}
    before = _counts()
    _save(state, tmp_path / "disk")
    after = _counts()
    # ext4 (this machine's disk, and tmpfs since Linux 6.6) takes O_DIRECT; a file system that refuses it at
    # open gets the same bytes written buffered.
    assert (after[2] - before[2]) + (after[3] - before[3]) == 1
    loaded = _load(state, tmp_path / "disk")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    monkeypatch.setenv("ACCELERATE_TXN_DIRECT_IO", off)
    before = _counts()
    _save(state, tmp_path / "buffered")
    after = _counts()
    assert after[2] == before[2] and after[3] - before[3] == 1
    loaded = _load(state, tmp_path / "buffered")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert (tmp_path / "buffered" / "__0_0.distcp").read_bytes() == (tmp_path / "disk" / "__0_0.distcp").read_bytes()


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_a_protected_checkpoint_written_directly_loads_natively_and_protected(tmp_path: Path,
                                                                              fsdp_version: int) -> None:
    results = launch("tests.scenarios.dcp_writer_scenarios:written_directly", 2, args=(str(tmp_path), fsdp_version),
                     timeout=300)
    for rank, obs in enumerate(results):
        assert obs["direct_items"] > 0 and obs["delegated_items"] == 0, (rank, obs)
        assert obs["files_written"] >= 2, (rank, obs)  # the model's and the optimizer's DCP files
        assert obs["native_differences"] == [], (rank, obs)
        assert obs["protected_differences"] == [], (rank, obs)
        assert obs["not_direct_readable"] == [], (rank, obs)
