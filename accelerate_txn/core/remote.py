"""The checkpoint protocol on an object store: "complete or it does not exist" without rename.

Written against :class:`~..store.base.ObjectStore` (``store.s3``, ``store.azure`` and ``store.gcs`` implement it); which
process calls what is the front end's decision (rank 0 commits, prunes and cleans up; every rank uploads or downloads its
share). No process group here.

Layout under a checkpoint URL ``U`` (``s3://bucket/run/checkpoint_12``)::

    U/.txn-<run>-<txid>/<name>      every file of the inventory, uploaded by transaction <txid> of run <run>
    U/checkpoint_manifest.json      the commit: written last, create-only, the same bytes as on disk

A checkpoint exists exactly when ``U/checkpoint_manifest.json`` exists; it names its run and transaction, hence
the prefix its files are under. The data of each transaction has keys of its own, so two writers of one name never
touch each other's objects: both upload, one manifest wins the create-only write, the other writer gets
:class:`~..errors.CheckpointExistsError` and removes what it uploaded. A writer killed at any instant leaves no
manifest (or the complete checkpoint): what it left is a ``.txn-`` prefix no manifest names, and open multipart
uploads under it, which the next save of the same run removes (:func:`remove_leftovers`). Replacing a checkpoint
(the rule on disk: a re-save of a name replaces it as a whole) deletes the old manifest first, then commits the new
one, then deletes the old transaction's objects: at every instant the name holds the old checkpoint, nothing, or the
new one. Retention deletes a manifest first, then that transaction's objects (:func:`prune`). Before its commit a
writer lists its own objects again: an upload someone deleted meanwhile is never committed.

Nothing here deletes what another run wrote (an object store has no lock, so another run's uncommitted objects may
be a live writer's): a run killed before its first commit and never resumed leaves its ``.txn-`` prefix behind
(``accelerate-txn list`` shows it; a bucket lifecycle rule for incomplete multipart uploads is advised).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError, CheckpointIntegrityError
from ..store.base import HASH, ObjectStore
from .manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    READABLE_PROTOCOLS,
    loader_may_read,
    manifest_bytes,
    parse_manifest,
    relative_inside,
)
from .quarantine import remote_mark
from .select import CHECKPOINT_NAME
from .signing import Keyring, check_authenticator

logger = logging.getLogger(__name__)

#: URL schemes an object store serves (the only ones accepted where a path may be a URL).
SCHEMES = ("s3://", "az://", "gs://")
TXN_DIR = re.compile(r"\.txn-(?P<run>[0-9A-Za-z]+)-(?P<txid>[0-9a-f]+)\Z")
_ID = re.compile(r"[0-9A-Za-z]{1,64}\Z")
_TXID = re.compile(r"[0-9a-f]{1,64}\Z")
#: Files one rank uploads or downloads at once (each large one is itself split into parallel parts).
FILES_IN_FLIGHT = 4


def is_url(value: Any) -> bool:
    """Whether ``value`` (a path argument) names an object-store location."""
    return isinstance(value, str) and value.startswith(SCHEMES)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(part.strip("/") for part in parts)])


def split(url: str) -> tuple[str, str]:
    """``(parent URL, last name)`` of a checkpoint URL."""
    scheme, _, rest = url.partition("://")
    head, _, name = rest.rstrip("/").rpartition("/")
    if not head or not name:
        raise CheckpointIntegrityError(f"{url} names no checkpoint inside a bucket: use {scheme}://BUCKET/PREFIX/NAME")
    return f"{scheme}://{head}", name


def data_dir(manifest: Mapping[str, Any], where: str = "the manifest") -> str:
    """The prefix (relative to the checkpoint URL) holding the files of the transaction ``manifest`` commits."""
    run, txid = manifest.get("run_id"), manifest.get("transaction_id")
    if not (isinstance(run, str) and _ID.fullmatch(run) and isinstance(txid, str) and _TXID.fullmatch(txid)):
        raise CheckpointIntegrityError(f"Invalid checkpoint manifest {where}: its run_id/transaction_id do not name "
                                       "a transaction (it was not written by accelerate-txn, or was altered)")
    return f".txn-{run}-{txid}"


def read_manifest(store: ObjectStore, url: str) -> dict[str, Any] | None:
    """The manifest of the checkpoint at ``url``; ``None`` if it has none; integrity error if it is unreadable."""
    key = join(url, MANIFEST)
    if store.size(key) is None:
        return None
    return parse_manifest(store.read_bytes(key, limit=MAX_MANIFEST_BYTES), key)


def shares(files: Mapping[str, Mapping[str, Any]], count: int) -> list[list[str]]:
    """The inventory split over ``count`` workers by size (largest first, each to the least loaded; ties by name):
    the same split on every rank."""
    loads = [0] * count
    split_names: list[list[str]] = [[] for _ in range(count)]
    for name in sorted(files, key=lambda n: (-int(files[n]["size"]), n)):
        worker = min(range(count), key=lambda index: (loads[index], index))
        split_names[worker].append(name)
        loads[worker] += int(files[name]["size"])
    return split_names


def _expected_hash(manifest: Mapping[str, Any], name: str) -> str | None:
    row = manifest["files"][name]
    return row.get(HASH) if manifest.get("hash", HASH) == HASH else None


def upload(store: ObjectStore, directory: Path, url: str, manifest: Mapping[str, Any], names: Iterable[str],
           after_each: Callable[[str], None] | None = None) -> int:
    """Upload the files ``names`` of the published checkpoint ``directory`` under ``url``'s transaction prefix;
    each is hashed as it is sent and must be what the manifest lists. Returns the bytes uploaded."""
    prefix = join(url, data_dir(manifest))
    files = manifest["files"]

    def send(name: str) -> int:
        local = Path(directory) / relative_inside(name)
        size, digest = store.upload_file(local, join(prefix, name))
        expected = _expected_hash(manifest, name)
        if size != files[name]["size"] or (expected is not None and digest != expected):
            raise CheckpointIntegrityError(
                f"{local} changed after its checkpoint was published ({size} bytes, XXH3-128 {digest}; the manifest "
                f"lists {files[name]['size']} bytes{f', {expected}' if expected else ''}): it was not committed to "
                f"{url}. Something else writes into the checkpoint directory; save again.")
        if after_each is not None:
            after_each(name)
        return size

    names = list(names)
    if not names:
        return 0
    with ThreadPoolExecutor(max_workers=min(FILES_IN_FLIGHT, len(names)), thread_name_prefix="accelerate-txn-upload") as pool:
        return sum(pool.map(send, names))


def commit(store: ObjectStore, url: str, manifest: Mapping[str, Any], *, replace: bool) -> bool:
    """Commit the uploaded transaction of ``manifest`` at ``url`` (rank 0, after every rank's upload succeeded):
    the manifest written last, create-only. Returns whether an existing checkpoint was replaced.

    An existing checkpoint is refused (:class:`CheckpointExistsError`) unless ``replace``; replaced, its manifest is
    deleted first and its objects after the commit. A writer that loses the create-only race removes its own
    upload and raises."""
    ours = data_dir(manifest)
    target = join(url, MANIFEST)
    uploaded = store.list(join(url, ours))
    lost = sorted(name for name, row in manifest["files"].items() if uploaded.get(name) != row["size"])
    if lost:  # deleted or replaced by someone else while this save uploaded: never commit what is not there
        raise CheckpointIntegrityError(
            f"{join(url, ours, lost[0])} is not in the object store as uploaded (something deleted or replaced it "
            f"during the save); {url} was not committed. Save again, and keep other writers away from this prefix.")
    try:
        existing = read_manifest(store, url)
    except CheckpointIntegrityError:
        existing = {}  # an unreadable manifest: not a checkpoint, but not ours to keep either
    old = None
    if existing is not None:
        if existing.get("transaction_id") == manifest.get("transaction_id"):
            return False  # our own commit landed (a retry)
        if not replace:
            store.delete_prefix(join(url, ours))
            raise CheckpointExistsError(
                f"{url} already holds a checkpoint; nothing was committed there. Resume from it, save to a new name, "
                "or let a save replace it (configure_checkpointing(accelerator, overwrite='replace')).")
        try:
            old = data_dir(existing, target) if existing else None
        except CheckpointIntegrityError:
            old = None
        store.delete(target)  # from here the old checkpoint no longer exists
    try:
        store.write_new(target, manifest_bytes(dict(manifest)))
    except CheckpointExistsError:
        store.delete_prefix(join(url, ours))
        raise
    if old is not None and old != ours:
        try:
            store.delete_prefix(join(url, old))
        except Exception as exc:  # the new checkpoint is committed: the old objects are leftovers for the next save
            logger.warning("Committed %s, but deleting the replaced checkpoint's objects (%s) failed: %s; the next save "
                           "of this run removes them", url, old, exc)
    return existing is not None


def layout(store: ObjectStore, parent: str) -> dict[str, dict[str, Any]]:
    """``{checkpoint name: {"manifest": bool, "data": {txn dir: object count}, "bytes": stored bytes}}`` of every
    ``checkpoint_N`` under ``parent``, from one listing (incomplete uploads included as data directories with no
    objects; ``bytes`` counts every object under the name, leftovers included)."""
    found: dict[str, dict[str, Any]] = {}
    objects = store.list(parent)
    keys = list(objects) + list(store.incomplete_uploads(parent))
    for key in keys:
        name, _, rest = key.partition("/")
        if not CHECKPOINT_NAME.fullmatch(name) or not rest:
            continue
        entry = found.setdefault(name, {"manifest": False, "data": {}, "bytes": 0})
        entry["bytes"] += objects.get(key, 0)
        head = rest.partition("/")[0]
        if rest == MANIFEST:
            entry["manifest"] = True
        elif TXN_DIR.fullmatch(head):
            entry["data"][head] = entry["data"].get(head, 0) + 1
    return found


def checkpoints(store: ObjectStore, parent: str) -> list[tuple[int, str]]:
    """``(number, URL)`` of every ``checkpoint_N`` under ``parent`` that has a manifest object, oldest first
    (whether it is complete is for the verification to say)."""
    return sorted((int(CHECKPOINT_NAME.fullmatch(name).group(1)), join(parent, name))  # type: ignore[union-attr]
                  for name, entry in layout(store, parent).items() if entry["manifest"])


def _complete(store: ObjectStore, url: str) -> dict[str, Any] | None:
    """The manifest of the committed checkpoint at ``url`` if it is a readable, complete one naming its
    transaction, else ``None`` (never raises for a damaged one)."""
    try:
        manifest = read_manifest(store, url)
        if not manifest or manifest.get("protocol") not in READABLE_PROTOCOLS or manifest.get("status") != "complete":
            return None
        data_dir(manifest, url)
    except (CheckpointIntegrityError, OSError):
        return None
    return manifest


def complete_run_id(store: ObjectStore, url: str) -> str | None:
    """The run id of the committed checkpoint at ``url``, else ``None`` (never raises for a damaged one)."""
    run = (_complete(store, url) or {}).get("run_id")
    return run if isinstance(run, str) else None  # a manifest without a run id belongs to no run


def _ours(store: ObjectStore, parent: str, run_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    """``(number, URL, manifest)`` of every committed, complete checkpoint of ``run_id`` under ``parent``, oldest
    first, from one listing (each manifest read once)."""
    found = []
    for number, url in checkpoints(store, parent):
        manifest = _complete(store, url)
        if manifest is not None and manifest.get("run_id") == run_id:
            found.append((number, url, manifest))
    return found


def _still_a_victim(store: ObjectStore, parent: str, run_id: str, number: int, url: str, txid: Any) -> bool:
    """Whether the checkpoint ``url`` may still be deleted, from a listing taken now: it still holds the
    transaction the decision saw (a checkpoint committed under that name since is not the one decided on), and a
    newer complete checkpoint of ``run_id`` exists (the newest complete one of a run is never deleted, even when
    something else deleted the newer ones meanwhile)."""
    current = _complete(store, url)
    if current is None or current.get("transaction_id") != txid or current.get("run_id") != run_id:
        return False
    if remote_mark(store, url, current) is not None:  # quarantined since the decision: kept (core.quarantine)
        return False
    return any(other > number and (_complete(store, where) or {}).get("run_id") == run_id
               for other, where in reversed(checkpoints(store, parent)))


def prune(store: ObjectStore, parent: str, run_id: str, limit: int, newest: str | None = None,
          between: Callable[[], None] | None = None) -> list[str]:
    """Delete the oldest committed checkpoints of ``run_id`` under ``parent`` beyond ``limit``, each manifest first
    (``between()`` is called after each manifest's deletion). Returns the deleted URLs.

    An object store has no lock, so a save may commit while this runs. The decision is taken from this call's own
    listing (what a caller listed before is never trusted): the newest complete checkpoint of the run in that
    listing and ``newest`` (the one a save just committed) are never deleted, nor anything that listing did not
    show (a checkpoint committed after it is never a victim). Before each deletion the store is listed again: a
    victim is deleted only if it still holds the transaction the decision saw (a name re-committed since is
    another checkpoint) and a newer complete checkpoint of the run still exists (so the newest complete checkpoint
    of a run is never deleted, whatever else deleted meanwhile). Another run's checkpoints are never touched.

    A quarantined checkpoint (``core.quarantine``: its mark beside the prefix) is neither counted nor deleted (an INFO
    line says so), and the mark is read again just before each deletion. With no lock on an object store, a mark
    written in the moment between that read and the deletion is not seen: the quarantine then finds the checkpoint
    gone and says so."""
    ours = []
    for number, url, manifest in _ours(store, parent, run_id):
        mark = remote_mark(store, url, manifest)
        if mark is None:
            ours.append((number, url, manifest))
        else:
            logger.info("Retention under %s (limit %d): keeping %s out of the count and never deleting it: %s", parent,
                        limit, url, mark.describe())
    if not ours:
        return []
    spared = {ours[-1][1].rstrip("/")} | ({newest.rstrip("/")} if newest else set())
    excess = max(0, len(ours) - limit)
    doomed = [(number, url, manifest) for number, url, manifest in ours if url.rstrip("/") not in spared][:excess]
    deleted = []
    for number, url, manifest in doomed:
        if not _still_a_victim(store, parent, run_id, number, url, manifest.get("transaction_id")):
            logger.info("Retention under %s: %s changed since it was listed; it is kept", parent, url)
            continue
        store.delete(join(url, MANIFEST))  # acknowledged: from here the checkpoint does not exist
        if between is not None:
            between()
        store.delete_prefix(join(url, data_dir(manifest, url)))  # its own transaction only: not another writer's
        deleted.append(url)
    return deleted


def remove_leftovers(store: ObjectStore, parent: str, run_id: str) -> list[str]:
    """Remove what unfinished transactions of ``run_id`` left under ``parent``: ``.txn-`` prefixes of that run no
    manifest names (objects and open multipart uploads). Call only while no save of that run is in progress (the
    front end waits for the one in flight first). Another run's leftovers are not touched. Returns the prefixes."""
    removed = []
    for name, entry in layout(store, parent).items():
        url = join(parent, name)
        try:
            manifest = read_manifest(store, url) if entry["manifest"] else None
            live = data_dir(manifest, url) if manifest else None
        except CheckpointIntegrityError:
            live = None
        for directory in entry["data"]:
            match = TXN_DIR.fullmatch(directory)
            if directory == live or match is None or match.group("run") != run_id:
                continue
            prefix = join(url, directory)
            store.abort_incomplete_uploads(prefix)
            store.delete_prefix(prefix)
            removed.append(prefix)
    return removed


def check_listing(store: ObjectStore, url: str, manifest: Mapping[str, Any],
                  private_patterns: Iterable[re.Pattern[str]] = (), keys: Keyring | None = None) -> dict[str, Any]:
    """The structural check of a committed checkpoint from one listing: a readable protocol with status complete,
    every inventory file present with its size, and no unlisted object a loader could read under the transaction's
    prefix. Raises :class:`CheckpointIntegrityError` naming the object; returns ``files`` and ``extra`` (unlisted
    objects no loader reads, and other transactions' leftovers beside it). First the authenticator, when
    verification keys are configured (``keys``, a restore's; default: the environment's or the command line's)."""
    where = join(url, MANIFEST)
    check_authenticator(dict(manifest), where, keys)
    if manifest.get("protocol") not in READABLE_PROTOCOLS or manifest.get("status") != "complete":
        raise CheckpointIntegrityError(f"Checkpoint manifest {where} is not a complete manifest of a protocol this "
                                       f"accelerate-txn reads ({list(READABLE_PROTOCOLS)})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(row, dict) and isinstance(row.get("size"), int)
                                              for row in files.values()):
        raise CheckpointIntegrityError(f"Invalid checkpoint manifest {where}: no file inventory")
    for name in files:
        relative_inside(name)  # a name escaping the checkpoint is refused
    prefix = data_dir(manifest, where)
    listed = store.list(url)
    ours = {key[len(prefix) + 1:]: size for key, size in listed.items() if key.startswith(prefix + "/")}
    missing = sorted(set(files) - set(ours))
    if missing:
        raise CheckpointIntegrityError(f"{join(url, prefix, missing[0])} is missing: the checkpoint lists it "
                                       f"({files[missing[0]]['size']} bytes). It is incomplete; restore from another one.")
    for name in sorted(files):
        if ours[name] != files[name]["size"]:
            raise CheckpointIntegrityError(
                f"{join(url, prefix, name)} holds {ours[name]} bytes where the checkpoint lists {files[name]['size']}: "
                "it was truncated, extended or replaced. The checkpoint is damaged; restore from another one.")
    unlisted = sorted(set(ours) - set(files))
    readable = [name for name in unlisted if loader_may_read(name, private_patterns)]
    if readable:
        raise CheckpointIntegrityError(
            f"{join(url, prefix, readable[0])} is not in the checkpoint's inventory but a loader could read it: "
            "something was added after the commit. The checkpoint is not loadable as it is.")
    others = sorted(key for key in listed if key != MANIFEST and not key.startswith(prefix + "/"))
    return {"files": len(files), "extra": unlisted + others}


def download(store: ObjectStore, url: str, manifest: Mapping[str, Any], names: Iterable[str], directory: Path,
             after_each: Callable[[str], None] | None = None, *, sync: bool = True, listed: bool = False) -> int:
    """Download ``names`` of the checkpoint at ``url`` into ``directory``, each verified (size and hash) before it
    appears under its name; fsynced unless ``sync=False``; ``listed``: the caller checked the listing
    (:func:`check_listing`) just before. Returns the bytes downloaded."""
    prefix = join(url, data_dir(manifest))
    files = manifest["files"]

    def fetch(name: str) -> int:
        local = Path(directory) / relative_inside(name)
        local.parent.mkdir(parents=True, exist_ok=True)
        expected = _expected_hash(manifest, name)  # None: sized only (checksum="metadata"), as a local restore checks
        store.download_file(join(prefix, name), local, size=int(files[name]["size"]), digest=expected, sync=sync,
                            listed=listed)
        if after_each is not None:
            after_each(name)
        return int(files[name]["size"])

    names = list(names)
    if not names:
        return 0
    with ThreadPoolExecutor(max_workers=min(FILES_IN_FLIGHT, len(names)), thread_name_prefix="accelerate-txn-download") as pool:
        return sum(pool.map(fetch, names))


def cache_path(root: Path, url: str) -> Path:
    """Where the local copy of the checkpoint at ``url`` lives under the cache ``root``: ``root/<scheme>/<key>``."""
    scheme, _, rest = url.partition("://")
    parts = [part for part in rest.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise CheckpointIntegrityError(f"{url}: '.' and '..' are not allowed in a checkpoint URL")
    return Path(root).joinpath(scheme, *parts)


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/accelerate-txn`` (default ``~/.cache/accelerate-txn``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "accelerate-txn"


def fully_hashed(manifest: Mapping[str, Any]) -> bool:
    """Whether every file of ``manifest`` has its content hash (``checksum="full"``): a local copy of it is verified
    byte for byte by every restore, so it need not be made durable when downloaded."""
    return all(_expected_hash(manifest, name) is not None for name in manifest["files"])
