"""A DCP storage reader that reads each tensor straight into its destination.

DCP's ``FileSystemReader`` deserialises every stored tensor with ``torch.load`` into fresh memory and then copies it
into the tensor being restored: every byte is copied twice and every page of the fresh buffer is faulted in first.
:class:`DirectReader` parses the stored item itself (each tensor item is one ``torch.save`` archive: a zip of a small
pickle naming the storage, its dtype, offset, size and stride, and the raw storage bytes, stored uncompressed) and
reads the bytes with one ``preadv`` into the destination's own memory, when that is exactly what DCP's path would
produce: a plain CPU tensor of the saved dtype, contiguous, the read covering the whole stored tensor, little-endian
bytes. Anything else (a resharded read of part of a stored chunk, a transformed or compressed item, an archive it
does not recognise, a destination it cannot write into) goes through DCP's own path unchanged, so the result is the
same tensor either way.

On an N-D mesh (HSDP, FSDP2 + TP) the destination of an item is the rank's local shard narrowed to the item's box
(``DefaultLoadPlanner.resolve_tensor``): a box of whole rows is contiguous and read directly; a box of some columns
(a row-parallel weight's shard read on another mesh) is not, and DCP's path copies it. A resharded read is
likewise direct only where a stored chunk lands whole in one contiguous destination.

The restore calls it only after every byte of every file it reads was hash-checked on every rank (the protected
load's preflight), like the DCP reader it replaces.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch

from .internals import storage_item

_HEAD = 4096  # the pickle, the small records and the storage record's local header of a torch.save archive
_TAIL = 4096  # its central directory and end record
_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory, without the comment
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")


# The storage class names torch.save pickles (``torch.<Name>Storage``) for the dtypes read directly; any other
# (float8, unsigned 16-64 bit, quantized) goes through DCP's own path.
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


class _NotPlain(Exception):
    """The stored item is not a plain tensor archive this reader can copy byte for byte: use DCP's path."""


class _Storage:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Tensor:
    def __init__(self, storage: tuple, offset: int, size: tuple, stride: tuple, *rest: Any) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


class _ArchivePickle(pickle.Unpickler):
    """Reads only what ``torch.save`` writes for one dense tensor (any other global raises :class:`_NotPlain`, so
    nothing the file names is ever called)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            dtype = getattr(torch, _STORAGE_DTYPES[name])
            return _Storage(dtype)  # only named in the persistent id, never called
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ('storage', storage type, key, location, numel)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _records(fd: int, offset: int, length: int) -> tuple[bytes, dict[str, tuple[int, int, int]]]:
    """The archive's first bytes and its records: name -> (local header offset, stored size, compression)."""
    head = os.pread(fd, min(_HEAD, length), offset)
    tail_start = max(0, length - _TAIL)
    tail = head[tail_start:] if length <= _HEAD else os.pread(fd, length - tail_start, offset + tail_start)
    if len(tail) < _EOCD.size:
        raise _NotPlain("short item")
    (signature, _, _, _, count, cd_size, cd_offset, comment) = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if signature != b"PK\x05\x06" or comment or count == 0xFFFF or cd_offset == 0xFFFFFFFF:
        raise _NotPlain("no plain end record (zip64 or a comment)")
    start = cd_offset - tail_start
    if start < 0 or start + cd_size > len(tail) - _EOCD.size:
        raise _NotPlain("central directory out of range")
    records: dict[str, tuple[int, int, int]] = {}
    position = start
    for _ in range(count):
        fields = _CENTRAL.unpack_from(tail, position)
        if fields[0] != b"PK\x01\x02":
            raise _NotPlain("bad central directory entry")
        compression, stored, name_length, extra_length, comment_length, header = (
            fields[4], fields[8], fields[10], fields[11], fields[12], fields[16])
        name = tail[position + _CENTRAL.size:position + _CENTRAL.size + name_length].decode("utf-8", "replace")
        records[name] = (header, stored, compression)
        position += _CENTRAL.size + name_length + extra_length + comment_length
    return head, records


def _payload_start(head: bytes, record: tuple[int, int, int], length: int) -> int:
    header, stored, compression = record
    if compression != 0 or header + _LOCAL.size > len(head):
        raise _NotPlain("compressed record or header out of range")
    fields = _LOCAL.unpack_from(head, header)
    if fields[0] != b"PK\x03\x04":
        raise _NotPlain("bad local header")
    start = header + _LOCAL.size + fields[9] + fields[10]
    if start + stored > length:
        raise _NotPlain("record out of range")
    return start


def _small(head: bytes, records: dict[str, tuple[int, int, int]], suffix: str, length: int) -> bytes | None:
    names = [name for name in records if name.endswith(suffix) and name.count("/") == suffix.count("/")]
    if len(names) != 1:
        return None
    start = _payload_start(head, records[names[0]], length)
    if start + records[names[0]][1] > len(head):
        raise _NotPlain("record out of range")
    return head[start:start + records[names[0]][1]]


def plain_tensor_span(fd: int, offset: int, length: int) -> tuple[torch.dtype, tuple[int, ...], int, int] | None:
    """Where the raw bytes of the one tensor ``torch.save`` wrote at ``[offset, offset + length)`` of file ``fd``
    are: (dtype, size, absolute byte offset, byte count). None for anything but a dense, contiguous, little-endian
    tensor stored uncompressed whose storage holds exactly its elements (and for bytes it cannot parse)."""
    try:
        return _span(fd, offset, length)
    except (_NotPlain, struct.error, UnicodeDecodeError, ValueError):
        return None


def _span(fd: int, offset: int, length: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    head, records = _records(fd, offset, length)
    data = _small(head, records, "/data.pkl", length)
    if data is None:
        raise _NotPlain("no data.pkl")
    try:
        tensor = _ArchivePickle(io.BytesIO(data)).load()
    except _NotPlain:
        raise
    except Exception as exc:  # anything but the one plain shape DCP writes: DCP's own reader decides
        raise _NotPlain(f"unrecognised pickle: {exc}") from exc
    if not isinstance(tensor, _Tensor) or not all(isinstance(n, int) for n in (*tensor.size, *tensor.stride)):
        raise _NotPlain("not a tensor")
    if not isinstance(tensor.storage, tuple) or len(tensor.storage) != 5:
        raise _NotPlain("not a tensor")
    kind, storage, key, location, numel = tensor.storage
    if kind != "storage" or not isinstance(storage, _Storage) or location != "cpu":
        raise _NotPlain("not a CPU storage")
    order = _small(head, records, "/byteorder", length)
    if (order or b"little") != b"little" or sys.byteorder != "little":
        raise _NotPlain("not little-endian")
    names = [name for name in records if name.endswith(f"/data/{key}") and name.count("/") == 2]
    if len(names) != 1:
        raise _NotPlain("storage record not found")
    itemsize = storage.dtype.itemsize
    elements = 1
    for extent in tensor.size:
        elements *= extent
    if (tensor.offset != 0 or numel != elements or records[names[0]][1] != elements * itemsize
            or (elements > 1 and tensor.stride != _contiguous_strides(tensor.size))):
        raise _NotPlain("not a whole contiguous storage")
    start = _payload_start(head, records[names[0]], length)
    return storage.dtype, tensor.size, offset + start, elements * itemsize


def _writable_bytes(target: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, writable in place; None where it has no such view."""
    try:
        return memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
    except (RuntimeError, TypeError, ValueError):
        return None


def _read_into(fd: int, view: memoryview, start: int, count: int) -> None:
    done = 0
    while done < count:
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [view[done:]], start + done)
        else:  # macOS before 11
            os.lseek(fd, start + done, os.SEEK_SET)
            got = os.readv(fd, [view[done:]])
        if got <= 0:
            raise OSError(f"unexpected end of file reading {count} bytes at offset {start}")
        done += got


class DirectReader:
    """Factory for the reader (torch imports stay lazy): ``DirectReader.create(path)``. The reader counts what it
    did in ``direct`` (tensor items read straight into their destination) and ``delegated`` (items DCP's own
    path read)."""

    @staticmethod
    def create(path: str | os.PathLike) -> Any:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        class _Direct(FileSystemReader):
            direct = 0
            delegated = 0

            def read_data(self, plan: Any, planner: Any) -> Any:
                others = []
                per_file: dict[str, list[tuple[Any, int, int]]] = {}
                for item in plan.items:
                    relative, offset, length, transformed = storage_item(self, item.storage_index)
                    if item.type == LoadItemType.TENSOR and not transformed:
                        per_file.setdefault(relative, []).append((item, offset, length))
                    else:
                        others.append(item)
                for relative, items in per_file.items():
                    fd = os.open(os.path.join(str(self.path), relative), os.O_RDONLY)
                    try:
                        for item, offset, length in sorted(items, key=lambda entry: entry[1]):
                            if _direct(fd, item, offset, length, planner):
                                self.direct += 1
                            else:
                                others.append(item)
                    finally:
                        os.close(fd)
                if others:
                    self.delegated += len(others)
                    return super().read_data(replace(plan, items=others), planner)
                done: Future[None] = Future()  # what DCP waits on
                done.set_result(None)
                return done

        return _Direct(path)


def _direct(fd: int, item: Any, offset: int, length: int, planner: Any) -> bool:
    """Read ``item`` straight into its destination; False (nothing written) where DCP's path must do it."""
    span = plain_tensor_span(fd, offset, length)
    if span is None:
        return False
    dtype, size, start, count = span
    if any(item.storage_offsets) or tuple(item.lengths) != size:
        return False  # part of a stored chunk (a resharded read)
    target = planner.resolve_tensor(item).detach()
    if (target.device.type != "cpu" or target.dtype != dtype or tuple(target.shape) != size
            or not target.is_contiguous() or target.is_conj() or target.is_neg() or target.layout != torch.strided):
        return False
    view = _writable_bytes(target)
    if view is None or len(view) != count:
        return False
    if count:
        _read_into(fd, view, start, count)
    planner.commit_tensor(item, target)
    return True
