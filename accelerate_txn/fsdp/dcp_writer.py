"""A DCP storage writer that writes each tensor straight from its memory: the save-side counterpart of
:mod:`accelerate_txn.fsdp.dcp_reader`.

DCP's ``FileSystemWriter`` writes every tensor item with ``torch.save`` into the rank's ``.distcp`` stream: it
pickles the tensor, computes a CRC-32 of every byte (half the CPU time of the write on this kind of machine) and,
for a tensor that views part of a larger storage (an FSDP1 shard box, a slice), first clones it into fresh memory.
:func:`write_directly` makes a ``FileSystemWriter`` of a protected save write its plan itself instead:

* each tensor item is the same ``torch.save`` archive, built by torch itself: the archive of an empty tensor of the
  same dtype and shape, written under ``torch.serialization.skip_data`` (the zip records with a hole where the
  storage bytes go), is cached per dtype and shape, and the tensor's bytes are written into the hole straight from
  its memory. The result is what ``torch.save`` writes with ``compute_crc32=False`` (the record's CRC-32 is 0:
  ``torch.load`` does not check it; the protected save records every file's XXH3-128 and the restore checks every
  byte), so DCP's reader, native Accelerate and this library's direct reader load it as before;
* the file is hashed as it is written and recorded like :func:`accelerate_txn.core.hashing.hash_while_writing`'s
  streams (the hash pass then only fsyncs it);
* where the file system takes ``O_DIRECT`` (:func:`direct_io`), the bytes go to the disk through two reused,
  page-aligned buffers of :data:`CHUNK` bytes (one written by a thread while the other fills) instead of through
  the page cache: no page-cache page is allocated and dirtied for the checkpoint (on a machine where fresh memory
  is slow to touch, that allocation, not the disk, limits a buffered write), and the fsync finds nothing left to
  write. A file system that refuses ``O_DIRECT`` (some network file systems, FUSE) gets the file written
  buffered, directly from the tensors' memory, with the early write-back.

What it does not reproduce byte for byte goes through DCP's own steps unchanged, inside the same file: a tensor
that is not a dense, contiguous, strided CPU tensor of a plain dtype (quantized, sparse, a tensor subclass, a
non-contiguous view: DCP's ``clone``/``torch.save``). A writer it cannot reproduce at all (another ``write_data``,
several files per rank or threads, stream extensions such as compression, another serialisation format, a torch
without ``skip_data``) is left to DCP entirely.
"""

from __future__ import annotations

import errno
import functools
import io
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..core.environment import flag
from .internals import storage_info

#: ``0`` (or false, no, off) writes the DCP files through the page cache, still straight from the tensors' memory.
DIRECT_IO = flag("ACCELERATE_TXN_DIRECT_IO", True)


def direct_io() -> bool:
    """Whether a protected save writes its DCP files with ``O_DIRECT`` where the file system allows it (read at
    every save: :data:`DIRECT_IO`; the front ends read it first in the save's first rank phase, so a value that is no
    switch raises there on every rank, not here inside DCP's write)."""
    return DIRECT_IO.read()


#: Bytes per ``O_DIRECT`` write (a multiple of every block size in use: 4 KiB pages and 512-byte sectors). Two
#: such buffers per file being written, kept for the next file (:func:`_take_buffers`).
CHUNK = 8 * 1024 * 1024
_FREE: list[mmap.mmap] = []  # aligned buffers of finished files, reused (fresh memory is slow to touch)
_FREE_LOCK = threading.Lock()


def _take_buffers() -> list[mmap.mmap]:
    with _FREE_LOCK:
        taken = [_FREE.pop() for _ in range(min(2, len(_FREE)))]
    return taken + [mmap.mmap(-1, CHUNK) for _ in range(2 - len(taken))]


def _give_back(buffers: list[mmap.mmap]) -> None:
    with _FREE_LOCK:
        _FREE.extend(buffers[:max(0, 2 - len(_FREE))])
_ALIGN = 4096
#: Buffered writes ask the kernel to start writing back every this many bytes (as ``core.hashing`` does).
WRITEBACK_EVERY = 16 * 1024 * 1024

#: ``writeback(fd, offset, length)``: start writing that range of an open file back to disk, asynchronously.
Writeback = Callable[[int, int, int], None]


class _Sink:
    """One file written strictly in sequence, hashed as written; ``O_DIRECT`` through an aligned buffer where
    the file system takes it, else buffered straight from the caller's memory."""

    def __init__(self, path: Path, hasher: Callable[[], Any], writeback: Writeback | None, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        self.direct = self.fd >= 0
        if not self.direct:
            self.fd = os.open(path, flags, 0o666)
        self.path = path
        # O_DIRECT: two aligned buffers; one is written (a thread: os.write releases the GIL) while the other fills.
        self._buffers = _take_buffers() if self.direct else []
        self._buffer = self._buffers[0] if self.direct else None
        self._pending: list[Any] = [None, None]  # the write in flight from each buffer
        self._current = 0
        self._executor: Any = None
        self._written = 0  # bytes handed to the file (O_DIRECT: whole chunks)
        self._fill = 0
        self._digest = hasher()
        self._writeback = writeback
        self._started = 0
        self.size = 0

    # The file-object methods torch.save needs (a fallback item is written by torch.save into this sink).
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = len(view)
        if not count:
            return 0
        self._digest.update(view)
        if self._buffers:  # opened with O_DIRECT: every byte through the aligned buffers, in order
            position = 0
            while position < count:
                take = min(CHUNK - self._fill, count - position)
                self._buffer[self._fill:self._fill + take] = view[position:position + take]  # type: ignore[index]
                self._fill += take
                position += take
                if self._fill == CHUNK:
                    self._flush_buffer(CHUNK)
        else:
            _write_all(self.fd, view)
            if self._writeback is not None and self.size + count - self._started >= WRITEBACK_EVERY:
                self._writeback(self.fd, self._started, self.size + count - self._started)
                self._started = self.size + count
        self.size += count
        return count

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def _flush_buffer(self, length: int) -> None:
        """Hand the current buffer's first ``length`` bytes to the writer thread and fill the other one."""
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="accelerate-txn-write")
        buffer = self._buffer
        self._pending[self._current] = self._executor.submit(self._write_chunk, buffer, length)
        self._current = 1 - self._current
        self._buffer = self._buffers[self._current]
        self._fill = 0
        self._wait(self._current)  # the write from the buffer about to be filled is done

    def _wait(self, index: int) -> None:
        pending, self._pending[index] = self._pending[index], None
        if pending is not None:
            pending.result()  # raises the write's error here

    def _write_chunk(self, buffer: Any, length: int) -> None:
        view = memoryview(buffer)[:length]
        try:
            if self.direct:
                try:
                    _write_all(self.fd, view)
                    return
                except OSError as exc:
                    if exc.errno != errno.EINVAL or self._written % _ALIGN:
                        raise
                    # The file system accepted O_DIRECT at open but not this write: the rest goes buffered.
                    import fcntl

                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    self.direct = False
            _write_all(self.fd, view)
        finally:
            view.release()
            self._written += length

    def finish(self, fsync: bool) -> tuple[int, str]:
        """Write what is buffered, close; ``(size, digest)`` of the file."""
        try:
            if self._buffer is not None and self._fill:
                padded = -(-self._fill // _ALIGN) * _ALIGN  # O_DIRECT: the last block padded, then cut back
                self._buffer[self._fill:padded] = bytes(padded - self._fill)
                self._flush_buffer(padded)
            self._wait(0)
            self._wait(1)
            if self._buffers:
                os.ftruncate(self.fd, self.size)
            if fsync:
                os.fsync(self.fd)
        finally:
            self.close()
        return self.size, self._digest.hexdigest()

    def close(self) -> None:
        """Release everything (after an error too: the writes in flight are waited for, their errors dropped,
        since the error that stopped the file is the one raised)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _give_back(self._buffers)  # the writes in flight were waited for (executor shut down)
        self._buffers = []
        self._buffer = None


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


class _Recorder(io.RawIOBase):
    """What ``torch.save`` writes under ``skip_data``: its bytes, and where it skips over a storage's bytes."""

    def __init__(self) -> None:
        self.parts: list[bytes | int] = []  # bytes written, or the byte count of a skipped storage
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        if self.parts and isinstance(self.parts[-1], bytes):
            self.parts[-1] += chunk
        else:
            self.parts.append(chunk)
        self.position += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation("only forward skips")
        self.parts.append(offset)
        self.position += offset
        return self.position

    def tell(self) -> int:
        return self.position


@functools.lru_cache(maxsize=1024)
def _shell(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """The bytes ``torch.save`` writes for a contiguous CPU tensor of ``dtype`` and ``shape`` before and after
    its storage's bytes, or None if torch's archive is not one hole of exactly that size."""
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None:
        return None
    template = torch.empty(shape, dtype=dtype)  # never touched: skip_data writes no storage byte
    recorder = _Recorder()
    with skip_data():
        torch.save(template, recorder)
    holes = [part for part in recorder.parts if isinstance(part, int)]
    if (holes != [template.nbytes] or len(recorder.parts) != 3 or not isinstance(recorder.parts[0], bytes)
            or not isinstance(recorder.parts[2], bytes)):
        return None
    return recorder.parts[0], recorder.parts[2]  # type: ignore[return-value]


_PLAIN_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
})


def _plain_bytes(tensor: torch.Tensor) -> memoryview | None:
    """The bytes of ``tensor`` as ``torch.save`` of its contiguous clone would store them, without copying; None
    for anything else (DCP's own steps write it)."""
    if (type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided
            or tensor.dtype not in _PLAIN_DTYPES or tensor.is_quantized or tensor.is_conj() or tensor.is_neg()
            or not tensor.is_contiguous() or tensor.numel() == 0):
        return None
    try:
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
    except (RuntimeError, TypeError, ValueError):
        return None


def _write_tensor(sink: _Sink, tensor: torch.Tensor) -> bool:
    """Write one tensor item as ``torch.save`` would; False (nothing written) where DCP's steps must."""
    data = _plain_bytes(tensor)
    shell = _shell(tensor.dtype, tuple(tensor.shape)) if data is not None else None
    if data is None or shell is None or len(data) != tensor.nbytes:
        return False
    head, tail = shell
    sink.write(head)
    sink.write(data)
    sink.write(tail)
    return True


def _writes_plan(writer: Any) -> bool:
    """Whether ``writer`` is a ``FileSystemWriter`` whose ``write_data`` this module reproduces."""
    from torch.distributed.checkpoint import FileSystemWriter

    transforms = getattr(writer, "transforms", None)
    return (isinstance(writer, FileSystemWriter) and type(writer).write_data is FileSystemWriter.write_data
            and getattr(writer, "single_file_per_rank", False) is True and getattr(writer, "thread_count", 1) == 1
            and not tuple(getattr(transforms, "extensions", ()) or ())
            # torch.save archives (SerializationFormat.TORCH_SAVE; torch 2.7 has no other format, nor the attribute)
            and getattr(getattr(writer, "serialization_format", None), "value", "torch_save") == "torch_save"
            and hasattr(torch.serialization, "skip_data"))


class DirectWriteCounts:
    """What the direct writes of one process did: tensor items written from memory, items written by DCP's
    steps inside a direct file, files written with ``O_DIRECT`` and buffered (for tests and benchmarks)."""

    direct = 0
    delegated = 0
    files_direct_io = 0
    files_buffered = 0


def _write_data(writer: Any, record: dict[Path, tuple[int, str]], hasher: Callable[[], Any],
                writeback: Writeback | None, plan: Any, planner: Any) -> Any:
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
    path = Path(os.path.abspath(os.path.join(str(writer.path), file_name)))
    record.pop(path, None)
    results = []
    sink = _Sink(path, hasher, writeback, direct_io())
    try:
        items = ([item for item in plan.items if item.type == WriteItemType.BYTE_IO]
                 + [item for item in plan.items if item.type != WriteItemType.BYTE_IO])
        for item in items:
            offset = sink.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                sink.write(data.getbuffer())
            else:
                tensor = data.detach()
                if _write_tensor(sink, tensor):
                    DirectWriteCounts.direct += 1
                else:  # DCP's own steps (filesystem._SerialCpuLoader, _write_item)
                    tensor = tensor.cpu()
                    if tensor.untyped_storage().size() != tensor.nbytes:
                        tensor = tensor.clone()
                    torch.save(tensor, sink)
                    DirectWriteCounts.delegated += 1
            length = sink.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=storage_info(file_name, offset, length)))
        if sink.direct:
            DirectWriteCounts.files_direct_io += 1
        else:
            DirectWriteCounts.files_buffered += 1
        record[path] = sink.finish(fsync=bool(getattr(writer, "sync_files", False)))
    finally:
        sink.close()
    done: Future[list[Any]] = Future()
    done.set_result(results)
    return done


def write_directly(writer: Any, record: dict[Path, tuple[int, str]], hasher: Callable[[], Any],
                   writeback: Writeback | None = None) -> bool:
    """Make ``writer`` (a DCP ``FileSystemWriter`` of a protected save) write its plan with this module, recording
    each file's ``(size, hexdigest)`` in ``record`` (absolute path), the digest of a fresh ``hasher()`` (an object
    with ``update`` and ``hexdigest``, such as ``xxhash.xxh3_128``) fed every byte written. Returns False, changing nothing,
    for a writer whose ``write_data`` it does not reproduce (see the module docstring)."""
    if not _writes_plan(writer):
        return False
    writer.write_data = functools.partial(_write_data, writer, record, hasher, writeback)
    return True
