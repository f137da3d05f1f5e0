"""Setting a checkpoint aside, and back: :func:`quarantine_checkpoint` and :func:`release_checkpoint` (public), on a
local directory or an object-store URL. The record, where it lives and who reads it: ``core.quarantine``.

For a script that detects divergence after a resume::

    accelerate_txn.quarantine_checkpoint(resumed_from, reason="loss NaN 3 steps after resume")
    accelerator.load_state()  # the newest complete checkpoint that is not set aside

No collective: call it on rank 0, or on every rank (each finds the mark the first one wrote and changes nothing), before
the ``load_state()`` that falls back; selection runs on rank 0, after its own call returned. On local storage the
checkpoint is held in use while the mark is written (``store.base.Hold``), so retention either leaves it alone or is
finished with it first (then the quarantine raises :class:`~accelerate_txn.errors.NoCheckpointError`); an object store
has no such hold (``core.remote.prune`` reads the mark again one request before each deletion, and the quarantine
checks the checkpoint is still there after writing the mark: a mark landing between those two requests of a retention
comes too late for that checkpoint).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..core import quarantine
from ..core import remote as objects
from ..core.manifest import READABLE_PROTOCOLS, read_manifest
from ..core.select import is_transient, symlink_reason
from ..errors import CheckpointConfigurationError, CheckpointExistsError, CheckpointIntegrityError, NoCheckpointError
from ..store import local_store, object_store

logger = logging.getLogger(__name__)

_WHAT = ("a quarantine marks a complete checkpoint (a directory or URL with its checkpoint_manifest.json), which "
         "automatic selection would otherwise take")


def _location(checkpoint: Any) -> Path | str:
    if objects.is_url(checkpoint):
        return str(checkpoint).rstrip("/")
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise CheckpointConfigurationError(f"A checkpoint path or object-store URL is needed, not {checkpoint!r}")
    return Path(checkpoint).expanduser().absolute()


def _complete(manifest: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """``manifest`` if it commits a complete checkpoint of a run and transaction; else a configuration error."""
    if manifest is None:
        raise CheckpointConfigurationError(
            f"{where} has no checkpoint manifest (a legacy or native checkpoint, an unfinished save, or not a checkpoint "
            f"at all): {_WHAT}. To keep a legacy checkpoint out of selection, move it out of the run directory or give "
            "it a name other than checkpoint_N")
    if (manifest.get("protocol") not in READABLE_PROTOCOLS or manifest.get("status") != "complete"
            or not isinstance(manifest.get("run_id"), str) or not isinstance(manifest.get("transaction_id"), str)):
        raise CheckpointConfigurationError(f"{where}: its manifest is not the manifest of a complete checkpoint of a "
                                           f"run (no status 'complete', run or transaction id): {_WHAT}")
    return manifest


def checked_local(path: Path) -> dict[str, Any]:
    """The manifest of the published checkpoint directory ``path``; :class:`NoCheckpointError` if nothing is there,
    :class:`CheckpointConfigurationError` (what it is instead) for anything else than a complete checkpoint."""
    link = symlink_reason(path)
    if link is not None:
        raise CheckpointConfigurationError(f"{path} is {link}")
    if not path.exists():
        raise NoCheckpointError(f"Checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointConfigurationError(f"{path} is a file, not a checkpoint directory: {_WHAT}")
    if is_transient(path):
        raise CheckpointConfigurationError(
            f"{path} is a staging (or retired) directory of accelerate-txn: a save that did not finish or a checkpoint "
            "being deleted, never selected. There is nothing to set aside; 'accelerate-txn list' shows the checkpoints")
    try:
        manifest = read_manifest(path)
    except (CheckpointIntegrityError, OSError) as exc:
        raise CheckpointConfigurationError(f"{path}: its manifest cannot be read ({exc}). Selection skips it already; "
                                           f"{_WHAT}") from None
    return _complete(manifest, str(path))


def checked_remote(url: str) -> dict[str, Any]:
    """The manifest of the committed checkpoint at ``url`` (as :func:`checked_local`)."""
    objects.split(url)  # a URL naming no checkpoint inside a bucket is refused, naming the form
    try:
        manifest = objects.read_manifest(object_store(url), url)
    except CheckpointIntegrityError as exc:
        raise CheckpointConfigurationError(f"{url}: its manifest cannot be read ({exc}). Selection skips it already; "
                                           f"{_WHAT}") from None
    return _complete(manifest, url)


def set_aside(checkpoint: Any, reason: str) -> tuple[quarantine.Mark, bool]:
    """Quarantine ``checkpoint`` (a path or a URL) for ``reason``: the mark in effect afterwards, and whether this call
    wrote it (``False``: the same mark was in effect already)."""
    reason = quarantine.check_reason(reason)
    where = _location(checkpoint)
    if isinstance(where, str):
        return _set_aside_remote(where, reason)
    checked_local(where)
    store = local_store()
    hold = store.hold(where)  # retention's claim of it fails while held, or it has retired it already
    hold.acquire()
    try:
        try:
            manifest = read_manifest(where) if where.is_dir() else None
        except (CheckpointIntegrityError, OSError):
            manifest = None
        if manifest is None:
            raise NoCheckpointError(f"{where} was deleted (retention, or by hand) while it was being quarantined: "
                                    "nothing was marked")
        existing = quarantine.read_local(where)
        if quarantine.in_effect(existing, manifest) and existing.readable and existing.reason == reason:  # type: ignore[union-attr]
            return existing, False  # type: ignore[return-value]
        mark = quarantine.new_mark(where.name, manifest, reason, existing)
        quarantine.write_local(where, mark, store)
    finally:
        hold.release()
    logger.warning("Quarantined %s (%s): automatic selection skips it, retention keeps it", where, mark.describe())
    return mark, True


def _set_aside_remote(url: str, reason: str) -> tuple[quarantine.Mark, bool]:
    manifest = checked_remote(url)
    store = object_store(url)
    existing = quarantine.read_remote(store, url)
    if quarantine.in_effect(existing, manifest) and existing.readable and existing.reason == reason:  # type: ignore[union-attr]
        return existing, False  # type: ignore[return-value]
    mark = quarantine.new_mark(objects.split(url)[1], manifest, reason, existing)
    try:
        quarantine.write_remote(store, url, mark, replacing=existing is not None)
    except CheckpointExistsError:  # another writer's mark landed between the delete and this create-only write
        won = quarantine.read_remote(store, url)
        if quarantine.in_effect(won, manifest):
            return won, False  # type: ignore[return-value]
        raise
    now = quarantine.remote_manifest(store, url)
    if now is None or now.get("transaction_id") != manifest.get("transaction_id"):
        raise NoCheckpointError(f"{url} was deleted or replaced (retention, or another writer) while it was being "
                                f"quarantined; its mark {quarantine.mark_url(url)} sets nothing aside")
    logger.warning("Quarantined %s (%s): automatic selection skips it, retention keeps it", url, mark.describe())
    return mark, True


def lift(checkpoint: Any) -> quarantine.Mark | None:
    """Release the quarantine of ``checkpoint`` (a path or a URL): the mark as released now, or ``None`` when there
    was no mark to release (none, or released already)."""
    where = _location(checkpoint)
    if isinstance(where, str):
        objects.split(where)
        store = object_store(where)
        existing = quarantine.read_remote(store, where)
    else:
        existing = quarantine.read_local(where)
    if existing is None or existing.released is not None:
        return None
    mark = quarantine.released(existing)
    if isinstance(where, str):
        try:
            quarantine.write_remote(store, where, mark, replacing=True)
        except CheckpointExistsError:  # another release (or quarantine) landed first: what is there now stands
            return None
    else:
        quarantine.write_local(where, mark, local_store())
    logger.warning("Released the quarantine of %s (it was %s): automatic selection may take it again", where,
                   existing.describe())
    return mark


def mark_of(checkpoint: Any, manifest: dict[str, Any] | None = None) -> quarantine.Mark | None:
    """The mark that sets ``checkpoint`` (a path or a URL) aside now, ``None`` if none does (``manifest``: its
    manifest, when the caller read it already)."""
    where = _location(checkpoint)
    if isinstance(where, str):
        return quarantine.remote_mark(object_store(where), where, manifest)
    return quarantine.local_mark(where, manifest)


def quarantine_checkpoint(checkpoint: str | os.PathLike[str], reason: str) -> dict[str, Any]:
    """Set the complete checkpoint ``checkpoint`` (a directory, or an ``s3://``/``az://``/``gs://`` URL) aside:
    automatic selection (``load_state()`` without a path, the Trainer's ``resume_from_checkpoint=True``,
    ``accelerate-txn latest``) skips it and falls back to the previous complete checkpoint; retention
    (``total_limit``, ``save_total_limit``, ``accelerate-txn prune``) neither counts nor deletes it; an explicit load
    of its path still loads it, with a WARNING. Nothing inside the checkpoint changes: the mark is a small JSON file
    beside it (``.NAME.quarantine.json``: the reason, the time, the user and host), written atomically.

    Call it on rank 0 or on every rank (no collective; calling it again with the same reason changes nothing), then
    ``load_state()`` to fall back. Returns the mark (``reason``, ``time``, ``user``, ``host``, ``checkpoint``,
    ``run_id``, ``transaction_id``, ...). Raises :class:`~accelerate_txn.errors.CheckpointConfigurationError` for an
    empty reason or a path that is not a complete checkpoint (a staging directory, a legacy checkpoint without a
    manifest, something else), :class:`~accelerate_txn.errors.NoCheckpointError` for a path with nothing there.
    """
    return set_aside(checkpoint, reason)[0].as_json()


def release_checkpoint(checkpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Undo :func:`quarantine_checkpoint`: automatic selection and retention treat ``checkpoint`` as any other again.
    The mark stays beside it as a record of the quarantine and of who released it (``released``: time, user, host).
    Returns that record, or ``None`` when the checkpoint was not quarantined (nothing changes: safe on every rank)."""
    mark = lift(checkpoint)
    return None if mark is None else mark.as_json()
