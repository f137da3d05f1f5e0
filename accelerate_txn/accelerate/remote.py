"""Checkpoints in object storage for the Accelerate front end: ``save_state("s3://...")``, ``load_state("s3://...")``
and the mirror tier (``configure_checkpointing(acc, mirror="s3://...")``). docs/storage.md has the whole story.

A save to a URL is the protected save published into the local cache (``core.remote.cache_path``), then
:func:`replicate`: leftovers of this run under the parent prefix removed (rank 0), every rank uploads its share of
the files (hashed as sent, checked against the manifest), then rank 0 commits the same manifest create-only, and
prunes the prefix (manifest first). Each step is a rank phase: a failure anywhere is the same error on every rank,
and nothing is committed. With a mirror the same :func:`replicate` runs after the local publish, in the background
(:func:`start_mirror`, on the background process group), and its error is raised at the next save, wait or load.

A restore from a URL is :func:`fetch`, then the ordinary protected load of the local copy (every check of a local
restore, on the downloaded files): rank 0 reads the manifest and the listing (missing, resized or extra objects
are refused before any download), then the ranks that share a cache directory (found by marker files, so
node-local disks work: each node downloads its own copy) split the files among them; each download is verified
before it appears under its name, and the group's lowest rank writes the manifest last and renames the copy into
place. The cache keeps the newest copy of each prefix only.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ..core import faults
from ..core import remote as objects
from ..core.manifest import MANIFEST, read_manifest, write_manifest
from ..core.ranks import any_rank, background_group, on_main, rank, run_phase, world_size
from ..core.select import CHECKPOINT_NAME, numbered_checkpoints
from ..core.signing import Keyring
from ..errors import (
    CheckpointConfigurationError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIntegrityError,
    CheckpointLockedError,
    NoCheckpointError,
)
from ..runtime import async_save
from ..store import local_store, object_store
from ..store.base import IN_USE, Hold, new_id
from .config import checkpoint_config

logger = logging.getLogger(__name__)

#: Fault points of an upload and of a restore from an object store (``core.faults``).
POINTS = (
    "upload:during",           # this rank uploaded one file of its share
    "upload:before-commit",    # every rank's upload succeeded, the manifest not yet committed
    "upload:after-commit",     # committed, the prefix not yet pruned
    "upload:during-retention",  # an old checkpoint's manifest is deleted, its objects not yet
    "fetch:during",            # this rank downloaded one file of its share
)

#: Seconds a download waits to publish its copy while another job restores from the copy it replaces.
COPY_WAIT = 600.0


def cache_root(owner: Any) -> Path:
    return checkpoint_config(owner).cache_dir or objects.default_cache_root()


def local_copy(owner: Any, url: str) -> Path:
    """Where the checkpoint at ``url`` is kept locally (published first when saving, downloaded when loading)."""
    return objects.cache_path(cache_root(owner), url)


def mirror_url(owner: Any, published: Path) -> str | None:
    """The mirror URL of a checkpoint published at ``published`` (``mirror/<its name>``), or None."""
    mirror = checkpoint_config(owner).mirror
    return None if mirror is None else objects.join(mirror, Path(published).name)


def refuse_existing(url: str, *, automatic: bool, overwrite: str) -> None:
    """Rank 0, before a save to ``url`` writes anything: an existing checkpoint there is refused where the rule on
    disk refuses it (automatic naming, ``overwrite="refuse"``)."""
    if not (automatic or overwrite == "refuse"):
        return
    if objects.read_manifest(object_store(url), url) is not None:
        fix = ("with automatic naming, set accelerator.project_configuration.iteration past it" if automatic
               else "or let it be replaced: configure_checkpointing(accelerator, overwrite='replace')")
        raise CheckpointExistsError(f"Refusing to overwrite {url}: it already exists. Resume from it, or save to a new "
                                    f"name ({fix}).")


def replicate(published: Path, url: str, run_id: str, limit: int | None, *, replace: bool, group: Any = None) -> str:
    """Upload the published checkpoint ``published`` to ``url`` and commit it there (collective over ``group``)."""
    store = run_phase(lambda: object_store(url), f"Connecting to the object store of {url}", group)
    manifest = run_phase(lambda: _published_manifest(published), f"Reading the manifest of {published}", group)
    parent, _name = objects.split(url)
    removed = on_main(lambda: objects.remove_leftovers(store, parent, run_id), f"Removing leftovers under {parent}",
                      group)
    if removed and rank(group) == 0:
        logger.info("Removed what unfinished uploads of this run left: %s", ", ".join(removed))
    mine = objects.shares(manifest["files"], world_size(group))[rank(group)]
    run_phase(lambda: objects.upload(store, published, url, manifest, mine,
                                     after_each=lambda _name: faults.point("upload:during")),
              f"Uploading {published} to {url}", group)
    faults.point("upload:before-commit")
    replaced = on_main(lambda: objects.commit(store, url, manifest, replace=replace), f"Committing {url}", group)
    faults.point("upload:after-commit")
    if rank(group) == 0:
        if replaced:
            logger.warning("Replaced the checkpoint at %s (the old one was deleted manifest first)", url)
        logger.info("Committed checkpoint %s", url)
    if limit is not None:
        try:
            on_main(lambda: objects.prune(store, parent, run_id, limit, url,
                                          between=lambda: faults.point("upload:during-retention")),
                    f"Retention under {parent}", group)
        except CheckpointError as exc:  # committed: report, don't fail the save
            if rank(group) == 0:
                logger.warning("Checkpoint %s is committed, but retention failed: %s", url, exc)
    return url


def _published_manifest(published: Path) -> dict[str, Any]:
    manifest = read_manifest(published)
    if manifest is None:
        raise CheckpointIntegrityError(f"{published} has no manifest: only a published checkpoint is uploaded")
    return manifest


def _download_held(copy: Path) -> bool:
    """Whether a download of ``copy``'s name into its cache directory is still owned by a live process (its in-use
    lock is held): it will publish ``copy``, and its ranks may be about to use it."""
    prefix = f"..{copy.name}.download-"
    return any(local_store().held(entry) for entry in copy.parent.glob(f"{prefix}*{IN_USE}"))


def keep_newest_copy(path: Path) -> list[Path]:
    """Bound the cache: remove the other checkpoint copies beside ``path``, downloads cut short, and lock files of
    directories that are gone (the lowest rank of a cache directory, after publishing ``path``). Only what no
    process uses: a copy another job restores from (or is downloading) holds its in-use lock, and so does a
    download in progress (``store.base.Hold``); each is claimed without waiting and skipped when in use, so two
    jobs sharing one cache never remove each other's copies. Returns what was removed."""
    removed = []
    parent = path.parent
    for _number, other in numbered_checkpoints(parent):
        if other == path or other.is_symlink() or _download_held(other):
            continue
        with local_store().claim(other) as free:
            if free:
                local_store().remove_tree(other)
                removed.append(other)
    for entry in sorted(parent.iterdir()):  # downloads into this cache that were cut short (their owner is gone)
        if entry.name.startswith(".") and ".download-" in entry.name and entry.is_dir() and not entry.is_symlink():
            with local_store().claim(entry) as free:
                if free:
                    local_store().remove_tree(entry)
                    removed.append(entry)
    for lock in sorted(parent.glob(f".*{IN_USE}")):  # lock files of directories that no longer exist
        target = parent / lock.name[1:-len(IN_USE)]
        if not target.exists() and not target.is_symlink():
            with local_store().claim(target):
                pass  # claimed: the lock file goes; held: someone is about to create and use it
    return removed


def start_mirror(owners: list[Any], published: Path, run_id: str, limit: int | None) -> None:
    """Upload the just-published ``published`` to its mirror in the background (on the background process group);
    its error is raised on every rank at the next save, ``wait_for_checkpoint`` or load."""
    url = mirror_url(owners[0], published)
    if url is None:
        return
    comm = run_phase(background_group, "Creating the background process group")
    handle = async_save.AsyncCheckpoint(published, owners, lambda: None)
    async_save.install_exit_handling()

    def upload(group: Any) -> str:
        try:
            return replicate(published, url, run_id, limit, replace=True, group=group)
        except CheckpointError as exc:  # the same error on every rank: say what it means for the two tiers
            exc.args = (f"Uploading {published} to the mirror {url} failed (the local checkpoint is published and "
                        f"restorable; the mirror does not hold it): {exc.args[0] if exc.args else exc}", *exc.args[1:])
            raise

    handle.start([], upload, lambda: None, comm)


def fetch(url: str, root: Path, group: Any = None, *, reuse: bool = True,
          keys: Keyring | None = None) -> tuple[Path, bool, Hold]:
    """Download the checkpoint at ``url`` into the cache ``root`` (collective); returns the local copy, complete
    (manifest last) and verified file by file as downloaded, whether a copy already there was reused (``reuse``,
    only for a checkpoint whose every file is hashed: the restore verifies it byte for byte, and the caller fetches
    again, ``reuse=False``, if that fails), and this rank's hold on the copy (:class:`~..store.base.Hold`): while
    it is held no other job sharing the cache removes or replaces the copy. The caller releases it when the restore
    is over (on every path: an exception here releases it already). ``keys``: the restore's verification keys
    (default: the environment's); a manifest whose authenticator they refuse is refused before anything is
    downloaded.

    Another job may use the same cache at the same time: each download has a directory of its own, held in use by
    its ranks from before it exists until they hold the published copy, and a copy is replaced only when no one
    holds it (waiting for a job restoring from it), so clean-up (:func:`keep_newest_copy`) never removes what a live
    job uses."""
    store = run_phase(lambda: object_store(url), f"Connecting to the object store of {url}", group)

    def inspect() -> dict[str, Any]:
        manifest = objects.read_manifest(store, url)
        if manifest is None:
            raise NoCheckpointError(f"{url} holds no committed checkpoint (no {MANIFEST}): a save that did not finish, "
                                    "or a wrong URL. `accelerate-txn list` on its parent shows the checkpoints there.")
        objects.check_listing(store, url, manifest, keys=keys)
        return manifest

    manifest = on_main(inspect, f"Reading the manifest and listing of {url}", group)
    final = objects.cache_path(root, url)
    txid = manifest["transaction_id"]
    # A directory of this download alone (the same name on every rank): one that a killed download left (with its
    # partial files) is never written into again, only removed once this download is published.
    download = on_main(new_id, "Naming the download", group)
    staging = final.parent / f".{final.name}.download-{download}"
    marker = f".peer-{download}-"
    using = local_store().hold(final)  # this rank's hold on the copy it restores from
    owning = local_store().hold(staging)  # this rank's hold on its download directory, from before it exists

    # A copy whose every file is hashed is verified byte for byte by the restore: it is not fsynced as it is
    # downloaded, and one already in the cache is reused. Otherwise (checksum="metadata") it is fsynced and never
    # reused: its large payloads are checked by size only.
    verified_again = objects.fully_hashed(manifest)
    reusable = reuse and verified_again

    def prepare() -> list[int]:
        _cache_directory(final.parent)
        if reusable:
            using.acquire()  # before looking: a copy held in use is neither removed nor replaced by another job
            if _holds(final, txid):
                return []  # this exact checkpoint is already here (the load verifies it like any local checkpoint)
            using.release()
        owning.acquire()  # before the directory exists: no other job's clean-up takes it for abandoned
        staging.mkdir(parents=True, exist_ok=True)
        (staging / f"{marker}{rank(group)}").touch()
        return [rank(group)]

    try:
        run_phase(prepare, f"Preparing the local copy of {url}", group)

        def peers() -> list[int]:
            if not staging.is_dir():
                return []
            return sorted(int(entry.name[len(marker):]) for entry in staging.iterdir() if entry.name.startswith(marker))

        sharing = run_phase(peers, "Finding the ranks that share a cache directory", group)
        reused = any_rank(not sharing, group)  # some rank found the copy already there
        # Every rank takes part in each phase (its context names no local path: caches may differ between ranks).
        mine = objects.shares(manifest["files"], len(sharing))[sharing.index(rank(group))] if sharing else []
        run_phase(lambda: objects.download(store, url, manifest, mine, staging,
                                           after_each=lambda _name: faults.point("fetch:during"),
                                           sync=not verified_again, listed=True),
                  f"Downloading {url} into the cache", group)

        def finish() -> None:
            if sharing and rank(group) == sharing[0]:  # the lowest rank of each cache directory publishes it
                for entry in staging.iterdir():
                    if entry.name.startswith(marker):
                        entry.unlink()
                write_manifest(staging, manifest, store=local_store())
                _publish_copy(staging, final, txid, reusable)
                keep_newest_copy(final)

        run_phase(finish, f"Publishing the local copy of {url}", group)

        def hold() -> None:
            if sharing:  # its own download holds the name meanwhile: no clean-up removed the copy since
                using.acquire()
            if not _holds(final, txid):
                _missing_copy(final)
            owning.release()

        run_phase(hold, f"Checking the local copy of {url}", group)
    except BaseException:
        using.release()
        owning.release()
        raise
    return final, reused, using


def _cache_directory(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointConfigurationError(
            f"Cannot create the local cache directory {directory} ({exc.strerror}): checkpoints from an object store "
            "are downloaded there. Choose a writable one: configure_checkpointing(accelerator, cache_dir=...).") from None


def _holds(copy: Path, txid: str) -> bool:
    """Whether ``copy`` is a complete local copy (manifest present, written last) of transaction ``txid``."""
    try:
        current = read_manifest(copy) if copy.is_dir() else None
    except CheckpointIntegrityError:
        return False
    return current is not None and current.get("transaction_id") == txid


def _publish_copy(staging: Path, final: Path, txid: str, reusable: bool) -> None:
    """Rename the complete download ``staging`` onto ``final``, only while no process uses ``final`` (another
    job's restore holds it in use: wait for it, bounded). A copy of the same transaction held by someone (with
    ``reusable``: a rank that reused it) is used as it is, and the download is removed."""
    deadline = time.monotonic() + COPY_WAIT
    warned = False
    while True:
        with local_store().claim(final) as free:
            if free:
                if final.exists() or final.is_symlink():
                    local_store().remove_tree(final)
                staging.rename(final)
                local_store().hold_file(final).unlink(missing_ok=True)  # while claimed: no lock file left beside an unused copy
                return
        if reusable and _holds(final, txid):  # in use, the same checkpoint: never replaced while anyone holds it
            local_store().remove_tree(staging)
            return
        if time.monotonic() >= deadline:
            raise CheckpointLockedError(
                f"The local copy {final} is in use by another process (it holds {local_store().hold_file(final)}) and it "
                f"holds another checkpoint than the one to load; waited {COPY_WAIT:g} s for it. The object store is "
                "not at fault. Load again when that job's restore is over, or give concurrent jobs separate cache "
                "directories: configure_checkpointing(accelerator, cache_dir=...).")
        if not warned:
            logger.warning("Waiting up to %g s for %s: another process restores from the copy there", COPY_WAIT, final)
            warned = True
        time.sleep(0.1)  # a poll inside the deadline: the holder releases when its restore ends


def _missing_copy(final: Path) -> None:
    raise CheckpointIntegrityError(f"The local copy {final} is not complete on this rank after the download: its cache "
                                   "directory changed while it was written (another process removed or replaced it; "
                                   "the object store is not at fault). Load again.")


def remote_candidates(mirror: str) -> list[tuple[int, str]]:
    """``(number, URL)`` of the committed checkpoints under ``mirror``, newest first (rank 0)."""
    return list(reversed(objects.checkpoints(object_store(mirror), mirror)))


def number_of(name: str) -> int | None:
    match = CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None
