"""Hashes taken while DCP writes (``_stream_hash``) and reused staging buffers (``_host_memory``): one process,
real DCP files."""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from accelerate_txn import CheckpointIntegrityError
from accelerate_txn.core.hashing import hash_while_writing
from accelerate_txn.core.manifest import HASH, hash_file, hash_rows
from accelerate_txn.fsdp.host_memory import StagingPool, staged_tensor, staging_into


def _dcp_save(directory: Path, state: dict[str, Any], record: dict[Path, tuple[int, str]], **options: Any) -> None:
    writer = dcp.FileSystemWriter(str(directory), **{"sync_files": False, **options})  # as a protected save sets it
    assert hash_while_writing(writer, record, HASH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended here
        dcp.save(state, storage_writer=writer)


@pytest.mark.parametrize("options", [{}, {"thread_count": 2}, {"single_file_per_rank": False}],
                         ids=["default", "two-writer-threads", "file-per-tensor"])
def test_every_file_dcp_writes_is_recorded_with_the_hash_of_its_content(tmp_path: Path, options: dict) -> None:
    record: dict[Path, tuple[int, str]] = {}
    state = {"weight": torch.randn(300, 70), "bias": torch.randn(70), "step": torch.tensor(4),
             "nested": {"ids": torch.arange(9), "x": 2}}
    _dcp_save(tmp_path, state, record, **options)
    files = sorted(p for p in tmp_path.iterdir() if p.is_file())
    assert ".metadata" in {p.name for p in files} and len(files) >= (3 if options else 2)
    # Every file under its final name (DCP writes .metadata under a temporary name and renames it).
    assert sorted(record) == [p.absolute() for p in files]
    for path in files:
        assert record[path.absolute()] == hash_file(path), path.name


def test_a_stream_written_out_of_sequence_or_failing_records_nothing(tmp_path: Path) -> None:
    record: dict[Path, tuple[int, str]] = {}
    writer = dcp.FileSystemWriter(str(tmp_path))
    hash_while_writing(writer, record, HASH)
    with writer.fs.create_stream(tmp_path / "sequential", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"def"))
    with writer.fs.create_stream(tmp_path / "seeked", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(1)
        stream.write(b"X")
    with pytest.raises(RuntimeError), writer.fs.create_stream(tmp_path / "failed", "wb") as stream:
        stream.write(b"partial")
        raise RuntimeError("the writer failed half way")
    assert list(record) == [(tmp_path / "sequential").absolute()]
    assert record[(tmp_path / "sequential").absolute()] == hash_file(tmp_path / "sequential")
    assert (tmp_path / "seeked").read_bytes() == b"aXcdef"  # the file itself is written as asked
    # DCP's own fsync asks for the descriptor, through which writes would bypass the digest: read back instead.
    synced: dict[Path, tuple[int, str]] = {}
    _dcp_save(tmp_path / "fsynced", {"w": torch.ones(3)}, synced, sync_files=True)
    assert synced == {}


def test_hash_rows_uses_the_recorded_hash_and_refuses_a_file_whose_size_changed(tmp_path: Path) -> None:
    (tmp_path / "shard").write_bytes(b"0123456789")
    # A recorded digest is taken as it is: the file is not read again (the digest below is not its content's).
    rows = hash_rows(tmp_path, ["shard"], flush=True, written={"shard": (10, "recorded-while-writing")})
    assert rows == {"shard": {"size": 10, HASH: "recorded-while-writing"}}
    assert hash_rows(tmp_path, ["shard"])["shard"][HASH] == hash_file(tmp_path / "shard")[1]
    with pytest.raises(CheckpointIntegrityError, match=r"shard holds 10 bytes, but 12 were written to it"):
        hash_rows(tmp_path, ["shard"], written={"shard": (12, "stale")})
    # Integrity "metadata": a large payload is sized only, recorded hash or not.
    with open(tmp_path / "large.distcp", "wb") as stream:
        stream.truncate(17 << 20)
    rows = hash_rows(tmp_path, ["large.distcp"], integrity="metadata", written={"large.distcp": (17 << 20, "unused")})
    assert rows == {"large.distcp": {"size": 17 << 20}}


def test_reused_staging_buffers_are_copied_into_again_and_unused_ones_released() -> None:
    pool = StagingPool()
    sources = [torch.randn(64, 8), torch.arange(10)]
    with staging_into(pool):
        first = [staged_tensor(s) for s in sources]
    assert pool.nbytes() == sum(t.nbytes for t in first)
    sources[0].add_(1.0)
    with staging_into(pool):
        second = [staged_tensor(s) for s in (sources[0], torch.zeros(3))]
    assert second[0].data_ptr() == first[0].data_ptr()  # the same shape and dtype: the same memory
    assert torch.equal(second[0], sources[0]) and second[0].data_ptr() != sources[0].data_ptr()
    assert second[1].data_ptr() != first[1].data_ptr()  # another shape: fresh memory
    # The int64 buffer of the first save was not used by the second: the pool no longer holds it.
    assert pool.nbytes() == second[0].nbytes + second[1].nbytes
    without_pool = staged_tensor(sources[0])
    assert without_pool.data_ptr() != second[0].data_ptr() and torch.equal(without_pool, sources[0])


def test_during_a_protected_save_only_dcp_writes_into_its_staging_directory_are_hashed(tmp_path: Path) -> None:
    from accelerate_txn.runtime.async_save import capture_dcp_saves

    staging = tmp_path / "staging"
    inside = dcp.FileSystemWriter(str(staging / "model"))
    # e.g. a user hook saving its own files, also through a path that only looks inside the staging directory
    outside = [dcp.FileSystemWriter(str(tmp_path / "user_files")), dcp.FileSystemWriter(f"{staging}/../escaped")]
    with capture_dcp_saves(False, staging) as capture, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for writer in [inside, *outside]:
            dcp.save({"w": torch.ones(4)}, storage_writer=writer)
    assert sorted(p.parent.name for p in capture.hashes) == ["model", "model"]  # shard and .metadata
    # The staged files are fsynced by the transaction's hash pass; the user's own saves keep DCP's fsync.
    assert inside.sync_files is False and all(writer.sync_files is True for writer in outside)
    assert all(not isinstance(writer.fs, type(inside.fs)) for writer in outside)


def test_the_write_back_of_a_large_file_is_started_as_it_is_written_and_the_hash_still_holds(tmp_path: Path) -> None:
    """With a store's ``start_writeback``, each further ``WRITEBACK_EVERY`` bytes of a file ask for their write-back
    (consecutive ranges from 0, the real POSIX call made), small files ask for none, and the recorded hash is the
    file's."""
    from accelerate_txn.core.hashing import WRITEBACK_EVERY
    from accelerate_txn.store.posix import start_writeback

    asked: list[tuple[str, int, int]] = []

    def writeback(fd: int, offset: int, length: int) -> None:
        asked.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        start_writeback(fd, offset, length)  # the real call: must accept what the stream passes

    record: dict[Path, tuple[int, str]] = {}
    writer = dcp.FileSystemWriter(str(tmp_path), sync_files=False)
    assert hash_while_writing(writer, record, HASH, writeback)
    # DCP writes each tensor with one write call: five tensors of half a chunk each (40 MiB of floats in all).
    state = {f"t{index}": torch.randn(WRITEBACK_EVERY // 8) for index in range(5)} | {"small": torch.randn(10)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer)
    payloads = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    assert len(payloads) == 1 and payloads[0].stat().st_size > 2 * WRITEBACK_EVERY
    ranges = [(offset, length) for name, offset, length in asked if name == payloads[0].name]
    size = payloads[0].stat().st_size
    assert len(ranges) >= 2 and ranges[0][0] == 0
    assert all(offset == previous + length_before
               for (previous, length_before), (offset, _l) in itertools.pairwise(ranges))
    assert all(length >= WRITEBACK_EVERY for _offset, length in ranges)
    assert size - WRITEBACK_EVERY < ranges[-1][0] + ranges[-1][1] <= size  # all but the last part, as it went
    assert not [name for name, _o, _l in asked if name.startswith(".metadata")]  # small: nothing asked
    for path in (p for p in tmp_path.iterdir() if p.is_file()):
        assert record[path.absolute()] == hash_file(path), path.name
