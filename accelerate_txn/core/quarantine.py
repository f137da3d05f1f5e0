"""Quarantine: an operator's mark that sets one complete checkpoint aside, recorded beside it, never inside.

A checkpoint can verify and still be the wrong one to resume from: training diverges a few steps after loading it
(Megatron-LM #5281: NaN three steps after a resume, then an endless restart loop, because every restart resumed the
same checkpoint). The mark is how an operator, or a script that detects the divergence, takes it out of automatic
selection without deleting the evidence:

* **Where.** ``PARENT/.NAME.quarantine.json`` beside the checkpoint directory ``PARENT/NAME`` (the in-use lock file's
  convention): the checkpoint's files stay exactly its inventory, so it still verifies and an explicit load still
  reads it. In an object store, the object ``PARENT/.NAME.quarantine.json`` beside the checkpoint's prefix.
* **What.** A small JSON record (:class:`Mark`): the reason, when, by which user on which host (and process), the
  run and transaction of the checkpoint it sets aside, and, once released, who released it and when. Earlier
  records of the same name are kept under ``history`` (the last :data:`HISTORY` of them).
* **Bound to one transaction.** A mark applies to the checkpoint whose manifest names the transaction it records
  (:func:`in_effect`): when a save replaces the directory (the Trainer saves ``checkpoint-12`` again after falling
  back to ``checkpoint-10``), the new checkpoint is not set aside by the old mark. A released mark applies to
  nothing. A mark that cannot be read is taken as in effect (the operator's intent cannot be disproved) and says so.
* **Who reads it.** Automatic selection (``core.select.checkpoint_candidates``: ``load_state()``, the Trainer's
  ``resume_from_checkpoint=True``, ``latest``; ``core.remote`` over a bucket) skips a checkpoint set aside, with the
  mark as its reason; retention (``core.select.prune``, ``core.remote.prune``) neither counts nor deletes one, and says
  so in a log line; an explicit load still loads it, with a WARNING (:func:`explicit_load_warning`).

Writing is :func:`write_local` (through the store's :meth:`~..store.base.LocalStore.write_replacing`: a temporary of
the writer's own, fsynced, renamed, the parent fsynced) and :func:`write_remote` (create-only: a mark being replaced
is deleted first). Which path is a checkpoint, the hold that keeps retention from deleting it while the mark is
written, and the choice of store are the caller's (``runtime.quarantine``). No process group here: any rank may call
anything, and writing the same mark again changes nothing.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointConfigurationError, CheckpointIntegrityError
from ..store.base import LocalStore, ObjectStore, open_regular
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, parse_manifest, read_manifest

logger = logging.getLogger(__name__)

#: The suffix of a mark's name: ``.NAME.quarantine.json`` beside the checkpoint ``NAME``.
SUFFIX = ".quarantine.json"
#: The format of the record (its ``quarantine`` field).
FORMAT = 1
#: A mark is small: a larger file is not one (refused unread).
MAX_MARK_BYTES = 64 * 1024
#: The longest reason kept (a longer one is refused: it is a line for a listing, not a report).
MAX_REASON = 2000
#: Earlier records of a name kept in a mark's ``history``.
HISTORY = 16


def who() -> dict[str, Any]:
    """When, by whom and where, for a record: UTC time, user name, host name and process id."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without passwd entry): the uid says who
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "user": user, "host": socket.gethostname(),
            "pid": os.getpid()}


@dataclass(frozen=True)
class Mark:
    """One quarantine record (module docstring). ``readable=False``: a file that is not a valid mark (its
    ``reason`` says why); it is in effect until released."""

    checkpoint: str
    reason: str
    time: str = ""
    user: str = ""
    host: str = ""
    pid: int | None = None
    run_id: str | None = None
    transaction_id: str | None = None
    released: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    readable: bool = True

    def record(self) -> dict[str, Any]:
        """The JSON object the mark is written as."""
        return {"quarantine": FORMAT, "checkpoint": self.checkpoint, "reason": self.reason, "time": self.time,
                "user": self.user, "host": self.host, "pid": self.pid, "run_id": self.run_id,
                "transaction_id": self.transaction_id, "released": self.released, "history": self.history}

    def as_json(self) -> dict[str, Any]:
        """What ``--json`` shows of it (the record, without the history of earlier marks)."""
        shown = {key: value for key, value in self.record().items() if key not in ("quarantine", "history")}
        return {**shown, "readable": self.readable}

    def describe(self) -> str:
        """The mark in words, for a listing and a log line: ``quarantined by alice@node3 at 2026-...: reason``."""
        if not self.readable:
            return f"quarantined: {self.reason}"
        return f"quarantined by {self.user}@{self.host} at {self.time}: {self.reason}"


def mark_name(name: str) -> str:
    """The file (or object) name of the mark of the checkpoint named ``name``."""
    return f".{name}{SUFFIX}"


def mark_path(path: Path) -> Path:
    """Where the mark of the local checkpoint directory ``path`` lives: beside it."""
    path = Path(path)
    return path.parent / mark_name(path.name)


def mark_url(url: str) -> str:
    """Where the mark of the checkpoint at ``url`` lives: beside its prefix (``s3://b/run/.checkpoint_3.quarantine.json``
    for ``s3://b/run/checkpoint_3``)."""
    head, _, name = url.rstrip("/").rpartition("/")
    return f"{head}/{mark_name(name)}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def parse_mark(data: bytes, where: str, checkpoint: str) -> Mark:
    """The mark held by ``data`` (read from ``where``, for messages); :class:`CheckpointIntegrityError` if it is not one."""
    if len(data) > MAX_MARK_BYTES:
        raise CheckpointIntegrityError(f"{where} has {len(data)} bytes, over the {MAX_MARK_BYTES} byte limit of a "
                                       "quarantine mark")
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointIntegrityError(f"{where} is not a readable quarantine mark ({exc})") from None
    if not isinstance(value, dict) or value.get("quarantine") != FORMAT or not isinstance(value.get("reason"), str):
        raise CheckpointIntegrityError(f"{where} is not a quarantine mark of accelerate-txn (format {FORMAT})")
    released = value.get("released")
    history = value.get("history")
    pid = value.get("pid")
    return Mark(checkpoint=_text(value.get("checkpoint")) or checkpoint, reason=value["reason"],
                time=_text(value.get("time")), user=_text(value.get("user")), host=_text(value.get("host")),
                pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                run_id=value.get("run_id") if isinstance(value.get("run_id"), str) else None,
                transaction_id=value.get("transaction_id") if isinstance(value.get("transaction_id"), str) else None,
                released=released if isinstance(released, dict) else None,
                history=[entry for entry in history if isinstance(entry, dict)] if isinstance(history, list) else [])


def unreadable(checkpoint: str, where: str, error: Exception) -> Mark:
    """The stand-in for a mark file that cannot be read: in effect until released (:func:`in_effect`)."""
    return Mark(checkpoint=checkpoint, readable=False,
                reason=f"its quarantine mark {where} cannot be read ({error}); 'accelerate-txn release' replaces it "
                       "with a released record")


def in_effect(mark: Mark | None, manifest: Mapping[str, Any] | None) -> bool:
    """Whether ``mark`` sets aside the checkpoint whose manifest is ``manifest``: not released, and recording that
    checkpoint's transaction (a mark of a checkpoint since replaced under the same name does not apply to the new
    one). An unreadable mark, or a checkpoint whose manifest cannot be read, cannot be told apart: in effect."""
    if mark is None or mark.released is not None:
        return False
    if not mark.readable or manifest is None:
        return True
    return mark.transaction_id == manifest.get("transaction_id")


def new_mark(name: str, manifest: Mapping[str, Any], reason: str, earlier: Mark | None) -> Mark:
    """A fresh mark of the checkpoint ``name`` (manifest ``manifest``) for ``reason``, keeping ``earlier`` (the record
    it replaces, if any) in its history."""
    history = list(earlier.history) if earlier is not None else []
    if earlier is not None and earlier.readable:
        history.append({key: value for key, value in earlier.record().items() if key not in ("quarantine", "history")})
    stamp = who()
    return Mark(checkpoint=name, reason=reason, time=stamp["time"], user=stamp["user"], host=stamp["host"],
                pid=stamp["pid"], run_id=manifest.get("run_id"), transaction_id=manifest.get("transaction_id"),
                history=history[-HISTORY:])


def released(mark: Mark) -> Mark:
    """``mark`` released now, by this user on this host (an unreadable mark becomes a released record saying so)."""
    if not mark.readable:
        mark = Mark(checkpoint=mark.checkpoint, reason=f"(an unreadable mark, released: {mark.reason})")
    return replace(mark, released=who())


def mark_bytes(mark: Mark) -> bytes:
    return json.dumps(mark.record(), indent=1, sort_keys=True).encode() + b"\n"


def check_reason(reason: Any) -> str:
    """``reason`` stripped; :class:`CheckpointConfigurationError` naming what is wrong (not text, empty, over
    :data:`MAX_REASON` characters)."""
    if not isinstance(reason, str) or not reason.strip():
        raise CheckpointConfigurationError(
            f"A quarantine needs a reason (got {reason!r}): say what went wrong after resuming from the checkpoint, "
            "e.g. reason='loss NaN 3 steps after resume'")
    if len(reason.strip()) > MAX_REASON:
        raise CheckpointConfigurationError(f"The quarantine reason has {len(reason.strip())} characters; at most "
                                           f"{MAX_REASON} are kept: shorten it")
    return reason.strip()


# --------------------------------------------------------------------------------------------- local directories


def read_local(path: Path) -> Mark | None:
    """The mark beside the checkpoint directory ``path`` in whatever state (released, stale, unreadable), ``None`` if
    there is none. Never follows a symbolic link; bounded."""
    where = mark_path(path)
    if not os.path.lexists(where):
        return None
    try:
        fd = open_regular(where)
        try:
            with os.fdopen(fd, "rb", closefd=False) as stream:
                data = stream.read(MAX_MARK_BYTES + 1)
        finally:
            os.close(fd)
        return parse_mark(data, str(where), Path(path).name)
    except (CheckpointIntegrityError, OSError) as exc:
        return unreadable(Path(path).name, str(where), exc)


def local_mark(path: Path, manifest: Mapping[str, Any] | None = None) -> Mark | None:
    """The mark that sets the local checkpoint ``path`` aside, ``None`` if none does (:func:`in_effect`; ``manifest``:
    the checkpoint's, when the caller read it already). One ``lstat`` when there is no mark; never raises."""
    mark = read_local(path)
    if mark is None or mark.released is not None:
        return None
    if manifest is None:
        try:
            manifest = read_manifest(Path(path))
        except (CheckpointIntegrityError, OSError):
            manifest = None
    return mark if in_effect(mark, manifest) else None


def set_aside_reason(path: Path) -> str | None:
    """Why the local checkpoint ``path`` is set aside (its mark, in words), or ``None``: what retention checks again
    while it holds the directory claimed, just before taking it out of service (``store.base.Store.retire``)."""
    mark = local_mark(path)
    return None if mark is None else mark.describe()


def write_local(path: Path, mark: Mark, store: LocalStore) -> None:
    """Write ``mark`` beside the checkpoint directory ``path``, atomically and durably (``store.write_replacing``)."""
    store.write_replacing(mark_path(path), mark_bytes(mark))


def explicit_load_warning(where: str, mark: Mark) -> None:
    """The WARNING of an explicit load of a checkpoint set aside (it still loads: the path was asked for)."""
    logger.warning("Loading %s, which is %s. An explicit path still loads it; automatic selection (load_state() without "
                   "a path, resume_from_checkpoint=True, accelerate-txn latest) skips it and retention keeps it. "
                   "'accelerate-txn release %s' makes it selectable again.", where, mark.describe(), where)


def warn_if_set_aside(path: Path) -> Mark | None:
    """:func:`explicit_load_warning` when the local checkpoint ``path`` is set aside; returns its mark."""
    mark = local_mark(path)
    if mark is not None:
        explicit_load_warning(str(path), mark)
    return mark


def skip_reason(mark: Mark, where: str) -> str:
    """Why automatic selection skipped a checkpoint: its mark, and how to make it selectable again."""
    return f"{mark.describe()} (set aside: 'accelerate-txn release {where}' makes it selectable again)"


# --------------------------------------------------------------------------------------------- object stores


def read_remote(store: ObjectStore, url: str) -> Mark | None:
    """The mark beside the checkpoint at ``url`` in whatever state, ``None`` if there is none (one request then)."""
    where = mark_url(url)
    name = url.rstrip("/").rpartition("/")[2]
    try:
        if store.size(where) is None:
            return None
        return parse_mark(store.read_bytes(where, limit=MAX_MARK_BYTES), where, name)
    except CheckpointIntegrityError as exc:
        return unreadable(name, where, exc)


def remote_manifest(store: ObjectStore, url: str) -> dict[str, Any] | None:
    """The manifest of the checkpoint at ``url``, ``None`` if it has none or it cannot be read."""
    key = f"{url.rstrip('/')}/{MANIFEST}"
    try:
        if store.size(key) is None:
            return None
        return parse_manifest(store.read_bytes(key, limit=MAX_MANIFEST_BYTES), key)
    except CheckpointIntegrityError:
        return None


def remote_mark(store: ObjectStore, url: str, manifest: Mapping[str, Any] | None = None) -> Mark | None:
    """The mark that sets the checkpoint at ``url`` aside, ``None`` if none does (:func:`in_effect`)."""
    mark = read_remote(store, url)
    if mark is None or mark.released is not None:
        return None
    if manifest is None:
        manifest = remote_manifest(store, url)
    return mark if in_effect(mark, manifest) else None


def write_remote(store: ObjectStore, url: str, mark: Mark, *, replacing: bool) -> None:
    """Write ``mark`` beside the checkpoint at ``url`` with a create-only write; ``replacing``: a mark is there and is
    deleted first (for a moment there is none: the checkpoint is as it was before any mark). A writer that loses a
    race to another writer of the same key gets :class:`CheckpointExistsError` (the caller reads what won)."""
    where = mark_url(url)
    if replacing:
        store.delete(where)
    store.write_new(where, mark_bytes(mark))



def across_tiers(local: list[Path], remote: list[tuple[int, str]], store: ObjectStore, root: Path
                 ) -> tuple[list[Path], list[tuple[int, str]], list[str]]:
    """A local tier mirrored to an object store (``configure_checkpointing(mirror=...)``): the candidates of both,
    without every checkpoint set aside in either tier (the mirror's copy of a checkpoint quarantined locally is the
    same checkpoint: same name, same transaction; and the other way round), and why each was dropped. ``local``:
    the local candidates (those quarantined locally are not among them: ``core.select``); ``remote``: ``(number,
    URL)`` of the mirror's, newest first; ``root``: the local run directory. One request per mirror checkpoint, two
    more for each one with a mark."""
    kept_local = list(local)
    kept_remote = []
    reasons = []
    for number, url in remote:
        name = url.rstrip("/").rpartition("/")[2]
        mark = remote_mark(store, url)
        if mark is not None:
            reasons.append(f"{url}: {skip_reason(mark, url)}")
            logger.warning("Skipping checkpoint %s: %s", url, skip_reason(mark, url))
            twin = Path(root) / name
            if twin in kept_local and (not mark.readable or _transaction(twin) == mark.transaction_id):
                kept_local.remove(twin)
                reasons.append(f"{name}: the local copy of {url}, which is {mark.describe()}")
            continue
        here = local_mark(Path(root) / name)
        if here is not None:
            copy = remote_manifest(store, url)
            if not here.readable or (copy is not None and copy.get("transaction_id") == here.transaction_id):
                reasons.append(f"{url}: the mirror's copy of {Path(root) / name}, which is {here.describe()}")
                logger.warning("Skipping checkpoint %s: the mirror's copy of %s, which is %s", url, Path(root) / name,
                               here.describe())
                continue
        kept_remote.append((number, url))
    return kept_local, kept_remote, reasons


def _transaction(path: Path) -> str | None:
    try:
        manifest = read_manifest(path)
    except (CheckpointIntegrityError, OSError):
        return None
    return None if manifest is None else manifest.get("transaction_id")
