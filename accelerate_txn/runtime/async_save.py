"""Asynchronous protected save: training waits for a memory copy, not for the disk.

With ``async_save`` the protected save runs native ``save_state`` into staging as usual, except that the DCP
writes of the FSDP sharded model and optimizer state dicts are *captured*: the state dict Accelerate built is
copied to host memory (:func:`staged_copy`) and written later, with the same ``FileSystemWriter`` and planner
Accelerate passed, so the files are the ones native ``save_state`` writes (the capture is a wrapt wrapper on
``torch.distributed.checkpoint.save``, installed once and active only in the saving thread). FSDP1's state dicts
are not built in the caller at all: ``fsdp.capture`` stages the local shards and builds the same DCP entries
(keys, global shapes, dtypes; each rank's own boxes instead of dim-0 chunks) in the background. The small files
(scheduler, RNG, sampler, custom and private state) are written synchronously. Then ``save_state`` returns an
:class:`AsyncCheckpoint` handle and one background thread per process:

1. writes the captured state dicts with DCP over a dedicated gloo process group (``core.ranks.background_group``), so
   background collectives never interleave with training collectives;
2. runs the rest of the transaction unchanged (``accelerate.save._finish``: required files, per-rank hash + fsync, rows
   gathered to rank 0, manifest, atomic rename, retention), every step a rank phase on that group, so a failure
   on any rank becomes the same error on every rank;
3. releases the staged copy and the directory lock.

The thread runs at a lower CPU priority (:data:`BACKGROUND_NICENESS`) so that training keeps the CPU. What blocks
is the host copy of this rank's local state, and it is exact by construction: the checkpoint is the state at the
moment ``save_state`` returned, whatever the script does next (``p.data.add_()``, ``_foreach_`` updates,
``to_local()`` writes, ``load_state_dict``, another optimizer): nothing the background writes is read from a live
tensor. On CPU every copy is complete before ``save_state`` returns; on CUDA the copies into pinned host memory are
enqueued on the current stream, so everything training enqueues afterwards runs after them, and the host does not
wait: the background thread waits for an event recorded after the last copy (:func:`fsdp.host_memory.copy_fence`)
before it reads them. FSDP2's state dicts are local DTensor views: their local shards are copied. For FSDP1, whose
native sharded state dicts are built with collectives over the training group (every parameter unsharded, the
optimizer state gathered), ``fsdp.capture`` copies the local flat-parameter and optimizer shards instead and builds
the same DCP entries in the background (setups it cannot reproduce exactly keep native FSDP1's collective build in
the caller). The staged copy is fresh host memory released after its write, or, with ``reuse_staging_memory``, the
previous save's buffers (``fsdp.host_memory``).

Every protected save, synchronous or not, goes through the same wrapper: the ``FileSystemWriter`` of a DCP save
into the staging directory hashes each file as DCP writes it (``core.hashing``), so the hash pass does not read
the shards back, and skips DCP's own per-file fsync, since the hash pass fsyncs every file. A synchronous
protected save also skips FSDP1's collective build: ``fsdp.capture`` takes views of this rank's live local shards
(no copy) and the wrapper builds the same DCP entries from them right before the wrapped ``dcp.save`` writes
them, over the group DCP itself uses; setups it cannot reproduce exactly build natively, as above.

At most one save is in flight per Accelerator: :func:`settle` (called by the next save and by
:func:`wait_for_checkpoint`) waits for it and raises its error once. ``Accelerator.end_training`` and
``torch.distributed.destroy_process_group`` wait for every save in flight before the process group goes (the
background group is dropped with it, and a new one is created for the next process group); a background phase
whose group was destroyed anyway (a ``destroy_process_group`` bound before the library wrapped it) fails on every
rank instead of publishing what one rank wrote (``core.ranks.run_phase``). At interpreter exit the save in flight is
waited for and an error nobody waited for is logged.

``ACCELERATE_TXN_ASYNC_FAIL_AT=R`` makes rank ``R`` raise inside its background write (``R#K1,K2``: only in this
process's K1-th, K2-th asynchronous saves): for the tests only, like ``core.faults``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

from ..core.faults import ASYNC_FAIL_AT
from ..core.hashing import hash_while_writing
from ..core.manifest import HASH
from ..core.ranks import drop_background_group, is_background_group, run_phase
from ..errors import CheckpointError
from ..fsdp.capture import materialize
from ..fsdp.dcp_writer import write_directly
from ..fsdp.host_memory import StagingPool, staged_copy, staging_into, wait_for_copies
from ..store.base import new_hasher
from ..store.posix import start_writeback

logger = logging.getLogger(__name__)
FAIL_ENV = "ACCELERATE_TXN_ASYNC_FAIL_AT"
#: Niceness added to the background thread (Linux): the write yields the CPU to training when both compete.
BACKGROUND_NICENESS = 10

_IN_FLIGHT: WeakKeyDictionary = WeakKeyDictionary()  # Accelerator -> its newest unsettled AsyncCheckpoint
_HANDLES: list[AsyncCheckpoint] = []  # for the exit report (strong: a handle lives until settled or exit)
_saves_started = [0]


@dataclass
class _Write:
    """A DCP save Accelerate asked for, with its state dict copied to host memory."""

    state_dict: dict[str, Any]
    storage_writer: Any
    planner: Any


@dataclass
class Capture:
    """What a protected save's DCP writes leave for the transaction: with ``stage`` (asynchronous) the staged
    writes for the background; always the ``(size, digest)`` of every file DCP wrote, hashed as it was written
    (``core.hashing``), by absolute path."""

    stage: bool
    root: Path  # the staging directory: only writers into it are hashed (and their DCP fsync left to the pass)
    writes: list[_Write] = field(default_factory=list)
    hashes: dict[Path, tuple[int, str]] = field(default_factory=dict)


_capturing = threading.local()  # .current: the Capture of the protected save running in this thread


def _dcp_save(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    capture: Capture | None = getattr(_capturing, "current", None)
    if capture is None:
        return wrapped(*args, **kwargs)
    writer = kwargs.get("storage_writer")
    if _writes_into(writer, capture.root) and hash_while_writing(writer, capture.hashes, HASH, start_writeback):
        # Each tensor written from its own memory, O_DIRECT where the file system takes it (fsdp.dcp_writer);
        # a writer it does not reproduce keeps DCP's writes, hashed as they are written.
        write_directly(writer, capture.hashes, lambda: new_hasher(HASH), start_writeback)
        if getattr(writer, "sync_files", None) is True and kwargs.get("process_group") is None:
            # DCP's own per-file fsync would be the second of two: the transaction's hash pass fsyncs every file
            # (each by the rank that wrote it: over the default group, file and global rank agree) and rank 0
            # the directories, before anything is published.
            writer.sync_files = False
    if not capture.stage:
        # FSDP1 state captured as views of the live tensors (fsdp.capture) becomes DCP's ShardedTensors here,
        # over the group DCP itself uses (the default one unless Accelerate names another)
        group = kwargs.get("process_group")
        if args:
            args = (materialize(args[0], group), *args[1:])
        elif "state_dict" in kwargs:
            kwargs = {**kwargs, "state_dict": materialize(kwargs["state_dict"], group)}
        return wrapped(*args, **kwargs)
    state_dict = args[0] if args else kwargs.get("state_dict")
    if state_dict is None or writer is None or kwargs.get("checkpoint_id") is not None:
        raise CheckpointError("Asynchronous save expected Accelerate's dcp.save(state_dict, storage_writer=...) "
                              "call; this Accelerate version saves differently: save synchronously (async_save=False).")
    # Copied now (CUDA: enqueued on the current stream, waited for by the background: fsdp.host_memory.copy_fence)
    capture.writes.append(_Write(staged_copy(state_dict), writer, kwargs.get("planner")))
    return None


def _writes_into(writer: Any, root: Path) -> bool:
    """Whether ``writer`` writes inside ``root`` (``..`` collapsed: ``root/../x`` is outside)."""
    path = getattr(writer, "path", None)
    try:
        return path is not None and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(root))
    except TypeError:  # not a local path
        return False


@contextlib.contextmanager
def capture_dcp_saves(stage: bool, root: Path, pool: StagingPool | None = None) -> Iterator[Capture]:
    """During a protected save into ``root``, ``torch.distributed.checkpoint.save`` called from this thread (as
    Accelerate calls it) hashes every file it writes there; with ``stage`` (asynchronous) it stages the state dict in memory
    instead of writing (copying into ``pool``'s buffers, if given). The wrapper is installed once (wrapt) and
    passes every other call (other threads, the background write itself) through unchanged."""
    if not _installed_capture:
        import torch.distributed.checkpoint as dcp
        import wrapt

        from ..fsdp import capture as _async_capture
        from .accelerate_internals import model_state_dict_point

        wrapt.wrap_function_wrapper(dcp, "save", _dcp_save)
        _async_capture.install(_capture_mode, model_state_dict_point())
        _installed_capture.append(True)
    capture = Capture(stage, root)
    _capturing.current = capture
    try:
        with staging_into(pool if stage else None):
            yield capture
    finally:
        _capturing.current = None


_installed_capture: list[bool] = []


def _capture_mode() -> bool | None:
    """For ``fsdp.capture``: whether the protected save running in this thread stages (True, asynchronous) or
    writes before it returns (False); None outside a protected save."""
    capture: Capture | None = getattr(_capturing, "current", None)
    return None if capture is None else capture.stage


def wait_for_all() -> None:
    """Wait until no background save of this process is running (errors are kept for the next ``settle``/
    ``wait_for_checkpoint`` and for the exit report, not raised here)."""
    for handle in list(_HANDLES):
        if handle._thread is not None:
            handle._thread.join()


# ------------------------------------------------------------------------------------------------ the handle
def _injected_failure() -> None:
    spec = ASYNC_FAIL_AT.read()  # tests only (core.faults; read by the save's first rank phase too)
    if spec is None:
        return
    rank, counts = spec
    if rank == int(os.environ.get("RANK", "0")) and (not counts or _saves_started[0] in counts):
        raise OSError(f"injected background write failure on rank {rank} ({FAIL_ENV}={os.environ.get(FAIL_ENV)})")


def _yield_cpu() -> None:
    """Lower this (background) thread's priority so training keeps the CPU when they compete; threads it starts
    (the hashing pool) inherit it. Linux: a thread id is a valid ``PRIO_PROCESS`` target; elsewhere a no-op."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)


class AsyncCheckpoint(os.PathLike):
    """A protected save still being written in the background; ``os.fspath``/``str`` give its final path.

    :meth:`wait` blocks until it is published (returns the path) or raises the error every rank got.
    """

    def __init__(self, path: Path, owners: list[Any], on_failure: Callable[[], None]) -> None:
        self.path = path
        self._owners = owners
        self._on_failure = on_failure  # gives back what the failed save consumed (iteration, lineage), once
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        #: CPU seconds the background thread itself used (the DCP writes with their hashing, the gather and the
        #: publish; not the short-lived threads that fsync and hash the small files); set when it ends.
        self.cpu_seconds: float | None = None

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else ("failed" if self._error else "published")
        return f"<AsyncCheckpoint {self.path} {state}>"

    def start(self, writes: list[_Write], finish: Callable[[Any], str], close: Callable[[], None], group: Any,
              fence: Any = None) -> None:
        """Start the background thread; it reads the staged copies once ``fence`` (:func:`.copy_fence`: the CUDA
        copies enqueued by ``save_state``) has passed."""
        self._thread = threading.Thread(target=self._run, args=(writes, finish, close, group, fence),
                                        name=f"accelerate-txn async save {self.path.name}", daemon=False)
        for owner in self._owners:
            _IN_FLIGHT[owner] = self
        _HANDLES.append(self)
        self._thread.start()

    def _run(self, writes: list[_Write], finish: Callable[[Any], str], close: Callable[[], None], group: Any,
             fence: Any) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        _yield_cpu()
        started = time.thread_time()
        try:
            _saves_started[0] += 1
            wait_for_copies(fence)  # CUDA: the copies enqueued on training's stream are complete
            while writes:
                write = writes.pop(0)  # dropped after its write: the staged copy is released step by step

                def dcp_write(write: _Write = write) -> None:
                    # FSDP1 state staged as local copies is built into DCP's ShardedTensors here (fsdp.capture)
                    save(materialize(write.state_dict, group), storage_writer=write.storage_writer,
                         planner=write.planner, process_group=group)

                run_phase(dcp_write, f"Writing {write.storage_writer.path} in the background", group)
                del write, dcp_write  # release this staged state dict now, before the next write and the hashing
            if os.environ.get(FAIL_ENV):  # tests only (set alike on every rank)
                run_phase(_injected_failure, "Writing the checkpoint in the background", group)
            finish(group)
        except BaseException as exc:  # kept for the next save/wait on every rank (each got the same error)
            self._error = exc
        finally:
            writes.clear()
            try:
                close()
            except BaseException as exc:  # never lose it in the thread's excepthook
                self._error = self._error or exc
            self.cpu_seconds = time.thread_time() - started

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait until published; raise the background error (once: a settled handle is forgotten)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise CheckpointError(f"The asynchronous save of {self.path} is still running after {timeout} s.")
        self._settle()
        if self._error is not None:
            raise self._error
        return self.path

    def _settle(self) -> None:
        for owner in self._owners:
            if _IN_FLIGHT.get(owner) is self:
                del _IN_FLIGHT[owner]
        if self in _HANDLES:
            _HANDLES.remove(self)
        if self._error is not None and not self._reported:
            self._reported = True
            # Not published: give back what the save consumed (as a failed synchronous save does).
            self._on_failure()


def settle(owners: Any) -> None:
    """Wait for the in-flight save of any of ``owners`` (an Accelerator or several) and raise its error.

    Local (no collective): every rank's background ran the same rank phases, so every rank raises the same
    error here."""
    for owner in owners if isinstance(owners, (list, tuple)) else [owners]:
        handle = _IN_FLIGHT.get(owner)
        if handle is not None:
            handle.wait()


def in_flight(owner: Any) -> AsyncCheckpoint | None:
    return _IN_FLIGHT.get(owner)


def wait_for_checkpoint(accelerator: Any, timeout: float | None = None) -> Path | None:
    """Wait for ``accelerator``'s asynchronous save to be published; returns its path (None if none in flight).

    Raises the save's error, the same on every rank, if it failed on any rank. Local: no collective."""
    handle = _IN_FLIGHT.get(accelerator)
    return None if handle is None else handle.wait(timeout)


# ---------------------------------------------------------------------------------------------- exit handling
_installed = [False]


def install_exit_handling() -> None:
    """Once: ``Accelerator.end_training`` waits for the in-flight save before destroying the process group,
    ``torch.distributed.destroy_process_group`` waits for every background save first and drops the background
    group with the default one, and interpreter exit reports a background error nobody waited for."""
    if _installed[0]:
        return
    _installed[0] = True
    import wrapt

    from ..fsdp.internals import register_thread_exit_hook
    from .accelerate_internals import accelerator_module

    def end_training(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if instance is not None:
            settle(instance)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(accelerator_module(), "Accelerator.end_training", end_training)
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def destroy_process_group(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None or is_background_group(group):
            # The background writes run collectives over the background group (and rank 0 holds the directory
            # lock): let them finish, then the group goes with the default one. A destroyed group is never
            # reused: the next process group gets a new background group.
            wait_for_all()
            drop_background_group()
        return wrapped(*args, **kwargs)

    for module in {id(dist): dist, id(c10d): c10d}.values():  # torch.distributed re-exports c10d's function
        if hasattr(module, "destroy_process_group"):
            wrapt.wrap_function_wrapper(module, "destroy_process_group", destroy_process_group)
    # At interpreter exit the background must finish before concurrent.futures refuses new work (it hashes in a
    # thread pool). threading's exit hooks run newest first, before non-daemon threads are joined and before
    # atexit: registered after concurrent.futures' own, ours waits first. (Private API; atexit as a fallback.)
    if not register_thread_exit_hook(_finish_at_exit):  # pragma: no cover - CPython has had it since 3.9
        atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    """Wait for every save in flight; log the error of any that failed and was never waited for."""
    for handle in list(_HANDLES):
        with contextlib.suppress(BaseException):
            handle.wait()
            continue
        logger.error("accelerate-txn: the asynchronous save of %s failed and was never waited for: %s "
                     "(it was not published; the previous checkpoint is the newest complete one)",
                     handle.path, handle._error)
