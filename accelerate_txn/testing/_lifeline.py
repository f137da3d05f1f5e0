"""Workers that end with the process that started them, however it ends (``kill -9`` included).

A daemon ``multiprocessing`` process is terminated only when its parent exits cleanly, and a ``subprocess`` child is
never: a harness killed with ``kill -9`` (or by the OOM killer, or a CI runner's timeout) would leave its ranks
training and publishing checkpoints with nobody watching. One mechanism serves :func:`~accelerate_txn.testing.launch`
and the script launcher's workers alike, a *lifeline*: a pipe whose write end only the starting process holds (it is
not inheritable, so no other child gets it) and whose read end each worker watches from a daemon thread. When the
starting process ends, the kernel closes the write end; the read returns end-of-file and the worker kills itself
with ``SIGKILL``, with its whole process group if it leads one (the script launcher's workers do: what the script
started goes too). Unlike Linux's ``PR_SET_PDEATHSIG`` it works on any POSIX system and does not fire when the
*thread* that started the worker ends (the parent process is what counts), and there is no start-up race: a pipe
whose writer is already gone reads end-of-file at once.

Stand-alone (standard library only): the script launcher's worker loads this file by path, since it must not import
the ``accelerate_txn`` package (see ``_worker.py``).
"""

from __future__ import annotations

import os
import signal
import threading

#: The environment variable through which a ``subprocess`` worker learns the descriptor of its lifeline.
LIFELINE_FD_ENV = "ACCELERATE_TXN_LIFELINE_FD"


def lifeline() -> tuple[int, int]:
    """A new lifeline: ``(read_fd, write_fd)``, neither inheritable. The starting process passes ``read_fd`` to each
    worker (``pass_fds``, or a ``multiprocessing`` connection), closes its own copy once they are started, and keeps
    ``write_fd`` open for as long as the workers may live (closing it ends them)."""
    return os.pipe()


def _end_this_process() -> None:
    if os.getpgid(0) == os.getpid():  # a group leader (the script launcher's workers): what the script started too
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(fd: int) -> None:
    try:
        while os.read(fd, 1):  # nobody writes: a read returns only at end-of-file (the starter has ended)
            pass
    except OSError:  # the descriptor broke: treat it as the starter's end too
        pass
    _end_this_process()


def watch(fd: int) -> None:
    """In a worker: die (``SIGKILL``, with the process group it leads) as soon as the process holding the write end
    of lifeline ``fd`` has ended. Returns at once; a daemon thread does the watching."""
    threading.Thread(target=_watch, args=(fd,), daemon=True, name="accelerate_txn.testing lifeline").start()
