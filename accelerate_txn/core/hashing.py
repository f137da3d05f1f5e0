"""Content hashes computed while DCP writes, so the protected save does not read its files back.

A protected save records the content hash of every file. Hashing after the write re-reads each file from the page
cache; for the DCP shards, by far the largest files, the hash can instead be taken from the bytes DCP hands to the
file as it writes them. :func:`hash_while_writing` wraps a ``FileSystemWriter``'s file system (``writer.fs``):
every stream it opens for writing feeds a digest, and when the stream is closed the file's ``(size, digest)`` is
recorded under its path (a rename, as DCP does for ``.metadata``, moves the record). A stream that is seeked,
truncated or used in any way other than sequential writes records nothing, and that file is hashed by reading it,
as before. The hash pass (``core.manifest.hash_rows``) then only fsyncs a recorded file and checks that its size on
disk is the size written; a file whose size differs fails the save.

With ``writeback`` (a store's ``start_writeback``), every :data:`WRITEBACK_EVERY` bytes the stream asks the kernel
to start writing what was written so far, so the disk writes overlap DCP's serialisation and the fsync of the
hash pass finds little left to flush. It claims nothing: durability is still only the fsync's.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..store.base import new_hasher

#: Stream attributes that neither write nor move the position: passed through without giving up the hash.
#: (Not ``fileno``: a write through the descriptor would bypass the digest. DCP asks for it only to fsync, which
#: it does not do for a hashed writer; any use of it makes the file be read back instead.)
_PASSIVE = frozenset({"flush", "close", "closed", "tell", "writable", "readable", "seekable", "isatty", "name",
                      "mode"})


#: Bytes written between two requests to start the write-back (see the module docstring).
WRITEBACK_EVERY = 16 * 1024 * 1024

#: ``writeback(fd, offset, length)``: start writing that range of an open file back to disk, asynchronously.
Writeback = Callable[[int, int, int], None]


class _HashingStream:
    """A binary write stream that hashes what it writes, as long as it is written strictly in sequence."""

    def __init__(self, inner: Any, algorithm: str, writeback: Writeback | None = None) -> None:
        self._inner = inner
        self._digest = new_hasher(algorithm)
        self._size = 0
        self._writeback = writeback
        self._started = 0  # bytes whose write-back was requested
        self.sequential = True

    def write(self, data: Any) -> int:
        written = self._inner.write(data)
        view = memoryview(data).cast("B")
        count = len(view) if written is None else written
        self._digest.update(view[:count])
        self._size += count
        if self._writeback is not None and self._size - self._started >= WRITEBACK_EVERY:
            self._start_writeback(self._writeback)
        return written

    def _start_writeback(self, writeback: Writeback) -> None:
        try:
            self._inner.flush()
            fd = self._inner.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._writeback = None  # not a local file: no early write-back
            return
        writeback(fd, self._started, self._size - self._started)
        self._started = self._size

    def __getattr__(self, name: str) -> Any:  # anything else (seek, truncate, writelines, ...) ends the hash
        if name not in _PASSIVE:
            self.sequential = False
        return getattr(self._inner, name)

    def result(self) -> tuple[int, str] | None:
        return (self._size, self._digest.hexdigest()) if self.sequential else None


class _HashingFileSystem:
    """A DCP file system whose write streams record ``(size, digest)`` per path in ``record``."""

    def __init__(self, inner: Any, record: dict[Path, tuple[int, str]], algorithm: str) -> None:
        self._inner = inner
        self._record = record
        self._algorithm = algorithm
        self.writeback: Writeback | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode not in ("wb", "xb"):
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        key = Path(path).absolute()
        self._record.pop(key, None)
        with self._inner.create_stream(path, mode) as stream:
            hashing = _HashingStream(stream, self._algorithm, self.writeback)
            yield hashing
        result = hashing.result()
        if result is not None:
            self._record[key] = result

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self._inner.rename(path, new_path)
        moved = self._record.pop(Path(path).absolute(), None)
        self._record.pop(Path(new_path).absolute(), None)
        if moved is not None:
            self._record[Path(new_path).absolute()] = moved

    def rm_file(self, path: str | os.PathLike) -> None:
        self._record.pop(Path(path).absolute(), None)
        self._inner.rm_file(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hash_while_writing(writer: Any, record: dict[Path, tuple[int, str]], algorithm: str,
                       writeback: Writeback | None = None) -> bool:
    """Make ``writer`` (a DCP ``FileSystemWriter``) record the hash of every file it writes in ``record``
    (absolute path -> ``(size, digest)``), starting the write-back as it goes with ``writeback``. Returns False,
    changing nothing, for a writer without a local file system (``writer.fs``) to wrap."""
    inner = getattr(writer, "fs", None)
    if inner is None or not callable(getattr(inner, "create_stream", None)):
        return False
    if isinstance(inner, _HashingFileSystem):  # the same writer in a later save: record into this save's dict
        inner._record, inner._algorithm = record, algorithm
        inner.writeback = writeback
    else:
        writer.fs = _HashingFileSystem(inner, record, algorithm)
        writer.fs.writeback = writeback
    return True
