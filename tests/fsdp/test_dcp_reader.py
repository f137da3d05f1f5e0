"""The direct DCP reader (accelerate_txn/fsdp/dcp_reader.py): every tensor it reads straight into its destination
is exactly what DCP's own ``FileSystemReader`` gives, everything it does not recognise goes through DCP's path,
and nothing a stored item names is ever called."""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from accelerate_txn.fsdp.dcp_reader import DirectReader, plain_tensor_span


def _save(state: dict[str, Any], root: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|torch.distributed is disabled).*")
        dcp.save(state, checkpoint_id=str(root), no_dist=True)


def _load(state: dict[str, Any], root: Path, reader: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|torch.distributed is disabled).*")
        dcp.load(state, storage_reader=reader, no_dist=True)


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.full_like(v, 7) if torch.is_tensor(v) else None for k, v in state.items()}


PLAIN = {
    "float32": torch.randn(64, 33),
    "int64": torch.arange(10),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
    "bfloat16": torch.randn(8, 8).to(torch.bfloat16),
    "float16": torch.randn(3, 5).to(torch.float16),
    "bool": torch.rand(6) > 0.5,
    "int8": torch.randint(-100, 100, (17,), dtype=torch.int8),
    "complex64": torch.randn(3, 4, dtype=torch.complex64),
    "row_slice": torch.randn(10, 10)[2:5],  # a view of a larger storage: DCP saves a clone of just these rows
    "column": torch.randn(4, 5)[:, 1],
}


def test_every_plain_tensor_is_read_straight_into_its_destination_exactly_as_dcp_reads_it(tmp_path: Path) -> None:
    saved = {**PLAIN, "transposed": torch.randn(5, 7).t(), "option": 0.25}
    _save(saved, tmp_path)
    ours, theirs = _blank(saved), _blank(saved)
    destinations = {k: v for k, v in ours.items() if torch.is_tensor(v)}
    reader = DirectReader.create(tmp_path)
    _load(ours, tmp_path, reader)
    _load(theirs, tmp_path, dcp.FileSystemReader(str(tmp_path)))
    for key, value in saved.items():
        if torch.is_tensor(value):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
            assert torch.equal(ours[key], theirs[key]), key
            assert ours[key] is destinations[key]  # read into the tensor the caller passed, not a new one
        else:
            assert ours[key] == theirs[key] == value
    stored = [k for k, v in PLAIN.items() if v.numel() > 0]  # DCP stores no bytes for an empty tensor
    assert reader.direct == len(stored)
    # The transposed tensor is stored with its strides (not contiguous) and the float is a bytes item: both
    # went through DCP's own path.
    assert reader.delegated == 2


def test_a_destination_of_another_dtype_or_layout_is_filled_by_dcp_path_with_its_cast(tmp_path: Path) -> None:
    saved = {"double": torch.randn(6, 4, dtype=torch.float64), "matrix": torch.randn(4, 6)}
    _save(saved, tmp_path)
    ours = {"double": torch.zeros(6, 4, dtype=torch.float32), "matrix": torch.zeros(6, 4).t()}
    theirs = {"double": torch.zeros(6, 4, dtype=torch.float32), "matrix": torch.zeros(6, 4).t()}
    reader = DirectReader.create(tmp_path)
    _load(ours, tmp_path, reader)
    _load(theirs, tmp_path, dcp.FileSystemReader(str(tmp_path)))
    assert reader.direct == 0 and reader.delegated == 2
    for key in saved:
        assert torch.equal(ours[key], theirs[key])
    assert torch.equal(ours["matrix"], saved["matrix"])


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
def test_a_dtype_outside_the_table_goes_through_dcp_path(tmp_path: Path) -> None:
    saved = {"f8": torch.randn(16).to(torch.float8_e4m3fn)}
    _save(saved, tmp_path)
    ours = {"f8": torch.zeros(16, dtype=torch.float8_e4m3fn)}
    reader = DirectReader.create(tmp_path)
    _load(ours, tmp_path, reader)
    assert reader.direct == 0 and reader.delegated == 1
    assert torch.equal(ours["f8"].view(torch.uint8), saved["f8"].view(torch.uint8))


def _span_of(data: bytes, tmp_path: Path) -> Any:
    path = tmp_path / "item"
    path.write_bytes(b"x" * 13 + data + b"y" * 5)  # an item in the middle of a file, as in a .distcp
    fd = os.open(path, os.O_RDONLY)
    try:
        return plain_tensor_span(fd, 13, len(data))
    finally:
        os.close(fd)


def test_the_span_of_a_saved_tensor_is_its_raw_bytes(tmp_path: Path) -> None:
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    stream = io.BytesIO()
    torch.save(tensor, stream)
    dtype, size, start, count = _span_of(stream.getvalue(), tmp_path)
    assert (dtype, size, count) == (torch.int32, (3, 4), 48)
    assert (tmp_path / "item").read_bytes()[start:start + count] == tensor.numpy().tobytes()


def test_garbage_truncated_and_foreign_archives_are_not_plain(tmp_path: Path) -> None:
    stream = io.BytesIO()
    torch.save(torch.arange(100.0), stream)
    whole = stream.getvalue()
    assert _span_of(os.urandom(3000), tmp_path) is None
    assert _span_of(whole[:-30], tmp_path) is None  # the end record cut off
    assert _span_of(whole[: len(whole) // 2], tmp_path) is None
    stream = io.BytesIO()
    torch.save({"a": torch.arange(3)}, stream)  # a dict, not one tensor
    assert _span_of(stream.getvalue(), tmp_path) is None
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(whole)) as source, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    assert _span_of(deflated.getvalue(), tmp_path) is None  # compressed records are never copied raw


class _Marker:
    def __reduce__(self) -> Any:
        return (os.mkdir, (str(_Marker.target),))


def test_a_hostile_archive_is_never_executed(tmp_path: Path) -> None:
    # A torch.save-shaped archive whose pickle calls os.mkdir: parsing it must not run it.
    _Marker.target = tmp_path / "pwned"  # type: ignore[attr-defined]
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps(_Marker(), protocol=2))
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", b"\0" * 16)
    assert _span_of(archive.getvalue(), tmp_path) is None
    assert not (tmp_path / "pwned").exists()
