"""The command line on an object store: ``s3://BUCKET/PREFIX`` (a prefix of ``checkpoint_N``) or
``s3://BUCKET/PREFIX/checkpoint_N`` (one checkpoint) wherever a command takes a path.

The layout and the protocol are ``core.remote``'s (``URL/checkpoint_manifest.json`` committed last, create-only; the
files under ``URL/.txn-<run>-<txid>/``). The checks are the local ones: the structure from one listing
(``core.remote.check_listing``), then the files a local verification would hash are downloaded into a temporary
directory (each verified by size and hash as it arrives) and the local verification (``_scan.verify_checkpoint``)
runs there, the files it does not read stood in for by sparse placeholders of their listed size. Nothing is
written to the store except by ``prune``. Credentials and endpoint come from the client library's own environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, ...; Azure's and Google's for ``az://`` and ``gs://``). File
work only: no torch.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ..core import remote as objects
from ..core.manifest import MANIFEST, hashed_names, write_manifest
from ..core.quarantine import remote_mark, skip_reason
from ..core.select import CHECKPOINT_NAME
from ..errors import CheckpointConfigurationError, CheckpointError, CheckpointIntegrityError, NoCheckpointError
from ..store import object_store
from ..store.base import ObjectStore
from ._scan import (
    COMPLETE,
    CORRUPT,
    QUARANTINED,
    Entry,
    PathKindError,
    Verification,
    not_a_checkpoint,
    private_patterns,
    verify_checkpoint,
    with_mark,
)

logger = logging.getLogger(__name__)

#: A ``checkpoint_N`` with objects under a transaction prefix but no manifest.
UNFINISHED = "unfinished upload"
URL_FORMS = ("s3://BUCKET/PREFIX, az://CONTAINER/PREFIX or gs://BUCKET/PREFIX (a prefix of checkpoint_N), or "
             ".../PREFIX/checkpoint_N (one checkpoint)")
#: The DCP model directory Accelerate's FSDP saves, which ``export`` reads (``weights``' ACCELERATE_FSDP_MODEL_DIR).
MODEL_DIR = "pytorch_model_fsdp_0"
#: The model config a checkpoint may carry (a Trainer's save_model writes it), for ``export`` without CONFIG.
CONFIG = "config.json"
#: The adapter config a checkpoint of a PEFT model may carry (a protected Trainer save writes it), for ``export``.
ADAPTER_CONFIG = "adapter_config.json"


def is_url(value: Any) -> bool:
    return objects.is_url(value)


def name_of(location: Any) -> str:
    """The last name of a path or a URL (``checkpoint_3``)."""
    return str(location).rstrip("/").rpartition("/")[2]


class Location(click.ParamType):
    """A local path that exists, or an object-store URL (kept as a string, without a trailing ``/``). With
    ``local``, a local path of that type only: a URL is refused with a usage error that says so."""

    name = "PATH|URL"

    def __init__(self, local: click.Path | None = None) -> None:
        self.urls = local is None
        self.local = local or click.Path(exists=True, file_okay=True, dir_okay=True, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "://" in value:
            if not self.urls:
                self.fail(f"{value} is a URL; this argument is a local path (only the checkpoint may be in an "
                          "object store)", param, ctx)
            if not is_url(value):
                self.fail(f"{value!r}: {value.partition('://')[0]}:// is not supported; use a local path or {URL_FORMS}",
                          param, ctx)
            try:
                parse_url(value)
            except CheckpointConfigurationError as exc:
                self.fail(str(exc), param, ctx)
            return value.rstrip("/")
        return self.local.convert(value, param, ctx)


def parse_url(url: str) -> Any:
    """Check ``url`` with its store's own rules (parsing only: no client is created)."""
    if url.startswith("az://"):
        from ..store.azure import AzureUrl

        return AzureUrl.parse(url)
    if url.startswith("gs://"):
        from ..store.gcs import GcsUrl

        return GcsUrl.parse(url)
    from ..store.s3 import S3Url

    return S3Url.parse(url)


def store(url: str) -> ObjectStore:
    """The client for ``url`` (one per process), configured from the client library's standard environment."""
    return object_store(url)


def client_error(exc: BaseException) -> str | None:
    """A message for an error of the object-store client (no credentials, endpoint unreachable, access denied, no
    such bucket) that names the fix; ``None`` for anything else."""
    chain = [exc, exc.__cause__, exc.__context__]  # s3fs raises built-in errors caused by botocore's
    modules = {type(error).__module__.split(".")[0] for error in chain if error is not None}
    if "azure" in modules:
        return (f"the object store refused or could not be reached: {exc}. The client reads its settings from the "
                "standard Azure environment (AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with "
                "AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN); check them and the container name")
    if "google" in modules:
        return (f"the object store refused or could not be reached: {exc}. The client reads its settings from the "
                "standard Google environment (Application Default Credentials: GOOGLE_APPLICATION_CREDENTIALS or "
                "'gcloud auth application-default login'; STORAGE_EMULATOR_HOST for an emulator); check them and the "
                "bucket name")
    if not modules & {"botocore", "aiobotocore", "s3fs"}:
        return None
    return (f"the object store refused or could not be reached: {exc}. The client reads its settings from the "
            "standard AWS environment (AWS_ENDPOINT_URL for an S3-compatible store, AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_DEFAULT_REGION); check them and the bucket name")


def _parent_hint(url: str, command: str = "list") -> str:
    try:
        parent, _name = objects.split(url)
    except CheckpointError:
        return ""
    return f"; see the checkpoints of its prefix with 'accelerate-txn {command} {parent}'"


# --------------------------------------------------------------------------------------------- what a URL is


def checkpoint_manifest(url: str, command: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``url``. :class:`PathKindError` (usage) for a prefix of checkpoints or a
    URL with nothing under it, or one holding model weights alone (an uploaded export); :class:`CheckpointIntegrityError`
    (invalid) for an unfinished upload or other objects no manifest commits."""
    where = store(url)
    manifest = objects.read_manifest(where, url)
    if manifest is not None:
        return manifest
    found = objects.layout(where, url)
    if found:
        raise PathKindError(
            f"{url} is a prefix of checkpoints ({len(found)} checkpoint_N under it), not a checkpoint. See them with "
            f"'accelerate-txn list {url}', or the newest complete one with 'accelerate-txn latest {url}'")
    keys = list(where.list(url)) + list(where.incomplete_uploads(url))
    hint = nested_hint(url, keys, "list")
    if hint is not None:
        raise PathKindError(hint)
    if any(objects.TXN_DIR.fullmatch(key.partition("/")[0]) for key in keys):
        raise CheckpointIntegrityError(
            f"{url} has no {MANIFEST}: an unfinished upload (a save in progress, or one whose writer died; the next "
            f"save of its run removes what it left). It is not a checkpoint{_parent_hint(url)}")
    weights = None if CHECKPOINT_NAME.fullmatch(name_of(url)) else not_a_checkpoint(url, keys, command)
    if weights is not None:  # an exported model or adapter uploaded there: not a checkpoint at all
        raise weights
    if keys:
        raise CheckpointIntegrityError(
            f"{url} has no {MANIFEST}: its {len(keys)} object(s) were not committed by accelerate-txn, so there is "
            f"nothing to verify them against and load_state() does not read them{_parent_hint(url)}")
    raise PathKindError(f"{url}: nothing is stored there (no {MANIFEST}, no object under it). Check the bucket and "
                        f"the prefix{_parent_hint(url)}")


def nested_hint(url: str, keys: list[str], command: str) -> str | None:
    """For a URL that holds no checkpoint_N itself but prefixes of them deeper (a bucket or a directory of runs):
    where they are and the command to run instead; else ``None``."""
    below = set()
    for key in keys:
        head, _, name = key.rpartition("/")
        prefix, _, checkpoint = head.rpartition("/")
        if name == MANIFEST and prefix and CHECKPOINT_NAME.fullmatch(checkpoint):
            below.add(objects.join(url, prefix))
    if not below:
        return None
    runs = sorted(below)
    shown = ", ".join(runs[:5]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
    return (f"{url} holds no checkpoint_N itself, but checkpoints under {len(runs)} prefixes below it: {shown}. Pass one "
            f"of them, e.g. 'accelerate-txn {command} {runs[0]}'")


def run_prefix(url: str, command: str) -> str:
    """``url`` as a prefix of checkpoints: a usage error if it is a checkpoint itself, or holds none but prefixes of
    checkpoints deeper (with the command to run instead)."""
    where = store(url)
    if where.size(objects.join(url, MANIFEST)) is not None:
        raise click.UsageError(
            f"{url} is a checkpoint, not a prefix of checkpoints: check it with 'accelerate-txn verify {url}' or read "
            f"it with 'accelerate-txn inspect {url}'" + _parent_hint(url, command))
    if not objects.layout(where, url):
        hint = nested_hint(url, list(where.list(url)), command)
        if hint is not None:
            raise click.UsageError(hint)
    return url


# --------------------------------------------------------------------------------------------- verification


def _naming(exc: CheckpointError, scratch: str, url: str) -> CheckpointError:
    """``exc`` with the temporary directory ``scratch`` in its message replaced by the URL it was downloaded from."""
    message = str(exc).replace(scratch, url)
    if message == str(exc):
        return exc
    try:
        return type(exc)(message)
    except TypeError:  # an error class with another signature: the message is what the user sees
        return CheckpointError(message)


@contextlib.contextmanager
def local_copy(url: str, manifest: dict[str, Any], names: list[str]) -> Iterator[Path]:
    """A temporary directory holding ``names`` of the checkpoint at ``url`` (each verified by size and hash as it is
    downloaded), its manifest, and a sparse placeholder of the listed size for every other file of the inventory;
    removed afterwards. Messages naming the directory name the URL instead."""
    with tempfile.TemporaryDirectory(prefix="accelerate-txn-") as scratch:
        directory = Path(scratch)
        try:
            objects.download(store(url), url, manifest, names, directory, sync=False)  # a temporary copy
            wanted = set(names)
            for name, row in manifest["files"].items():
                if name not in wanted:
                    placeholder = directory / name
                    placeholder.parent.mkdir(parents=True, exist_ok=True)
                    with placeholder.open("wb") as stream:
                        stream.truncate(int(row["size"]))
            from ..store.posix import POSIX

            write_manifest(directory, manifest, store=POSIX)
            yield directory
        except CheckpointError as exc:
            raise _naming(exc, scratch, url) from None


def verify(url: str, manifest: dict[str, Any], *, full: bool, dcp: bool = False, progress: Any = None) -> Verification:
    """Verify the checkpoint at ``url`` as ``verify`` verifies a local one; never raises for an invalid checkpoint.

    The listing first (every object present with its size, no extra object a loader reads); then the files a local
    verification hashes (control files and small payloads; with ``full`` every file) are downloaded, each checked
    against the manifest as it arrives, and the local checks run on them (structure, rank coverage, hashes, DCP
    metadata with ``dcp``)."""
    result = Verification(url, manifest, full, dcp)
    try:
        listing = objects.check_listing(store(url), url, manifest, private_patterns(manifest))
        names = sorted(manifest["files"]) if full else hashed_names(manifest, full=False)
        if dcp:
            names = sorted(set(names) | {name for name in manifest["files"] if name_of(name) == ".metadata"})
        with local_copy(url, manifest, names) as directory:
            result = verify_checkpoint(directory, manifest, full=full, dcp=dcp, progress=progress)
            if result.error is not None:
                result.error = result.error.replace(str(directory), url)
    except CheckpointIntegrityError as exc:
        result.error = str(exc)
        return result
    result.path = url
    if result.valid:
        result.report["extra"] = listing["extra"]
        result.report["downloaded"] = len(names)
    return result


# --------------------------------------------------------------------------------------------- a prefix


@dataclass
class RemoteEntry(Entry):
    """One ``checkpoint_N`` under a prefix; ``path`` is its URL."""

    stored: int = 0

    @property
    def name(self) -> str:
        return name_of(self.path)

    def size(self) -> int:
        return self.stored

    def modified(self) -> float | None:  # a listing gives sizes only
        return None


def scan(url: str) -> list[RemoteEntry]:
    """Every ``checkpoint_N`` under the prefix ``url``, newest first: complete (the quick verification passed),
    corrupt (with the reason), or an unfinished upload (objects of a transaction, no manifest)."""
    entries = []
    for name, found in objects.layout(store(url), url).items():
        number = int(CHECKPOINT_NAME.fullmatch(name).group(1))  # type: ignore[union-attr]
        where = objects.join(url, name)
        runs = sorted({match.group("run") for match in map(objects.TXN_DIR.fullmatch, found["data"]) if match})
        run = runs[0] if len(runs) == 1 else None
        if not found["manifest"]:
            if found["data"]:
                entries.append(RemoteEntry(where, number, UNFINISHED, note=f"no {MANIFEST}: an upload in progress, or one "
                                           "whose writer died (the next save of its run removes it)", run_id=run,
                                           stored=found["bytes"]))
            else:
                entries.append(RemoteEntry(where, number, CORRUPT, note=f"no {MANIFEST} and no upload of accelerate-txn: "
                                           "objects another tool wrote, never selected", stored=found["bytes"]))
            continue
        try:
            manifest = objects.read_manifest(store(url), where)
        except CheckpointIntegrityError as exc:
            entries.append(RemoteEntry(where, number, CORRUPT, str(exc), stored=found["bytes"]))
            continue
        result = verify(where, manifest or {}, full=False)
        run_id = (manifest or {}).get("run_id")
        entries.append(with_mark(RemoteEntry(where, number, COMPLETE if result.valid else CORRUPT, result.error, manifest,
                                             run_id if isinstance(run_id, str) else None, stored=found["bytes"]),
                                 remote_mark(store(url), where, manifest)))
    order = {COMPLETE: 0, QUARANTINED: 0, CORRUPT: 1, UNFINISHED: 2}
    return sorted(entries, key=lambda entry: (-entry.number, order[entry.status], entry.name))


def latest(url: str) -> str | None:
    """The newest checkpoint under the prefix ``url`` that verifies fully (every file downloaded and hashed): the one
    a resume from this prefix (a mirror tier) would restore; ``None`` when there is none. Raises
    :class:`NoCheckpointError` naming why each one was skipped when there are checkpoints but none verifies."""
    reasons = []
    for _number, where in reversed(objects.checkpoints(store(url), url)):
        try:
            manifest = objects.read_manifest(store(url), where)
            mark = remote_mark(store(url), where, manifest)
            error = (skip_reason(mark, where) if mark is not None
                     else verify(where, manifest or {}, full=True).error)
        except CheckpointIntegrityError as exc:
            error = str(exc)
        if error is None:
            return where
        reasons.append(f"{name_of(where)}: {error}")
        logger.warning("Skipping checkpoint %s: %s", where, error)
    if reasons:
        raise NoCheckpointError(f"No complete checkpoint in {url}; skipped " + "; ".join(reasons)
                                + ". Restore an intact copy or save a new checkpoint.")
    return None


def published_run(entry: Entry) -> str | None:
    """The run id of a committed checkpoint (for ``prune``'s refusal), damaged or not."""
    return objects.complete_run_id(store(str(entry.path)), str(entry.path))


def prune(url: str, run_id: str, keep: int, newest: str) -> list[str]:
    """Delete the oldest committed checkpoints of ``run_id`` under ``url`` beyond ``keep`` (``core.remote.prune``:
    decides again from its own listing, never deletes the newest complete checkpoint it lists nor ``newest``, nor
    one committed after it listed; lists again before each deletion, each manifest first)."""
    return objects.prune(store(url), url, run_id, keep, newest)


@contextlib.contextmanager
def model_copy(url: str, model_dir: str = MODEL_DIR) -> Iterator[Path]:
    """A temporary directory holding the DCP model state ``model_dir/`` of the checkpoint at ``url`` and the
    ``config.json`` and ``adapter_config.json`` it carries, if any (after the listing check, each file verified as it is
    downloaded), for ``export``."""
    manifest = checkpoint_manifest(url, "export")
    objects.check_listing(store(url), url, manifest, private_patterns(manifest))
    names = sorted(name for name in manifest["files"] if name.startswith(model_dir + "/"))
    if not names:
        raise NoCheckpointError(f"{url} holds no torch.distributed.checkpoint model state ({model_dir}/, Accelerate's "
                                "FSDP SHARDED_STATE_DICT layout): nothing to export")
    names += [name for name in (CONFIG, ADAPTER_CONFIG) if name in manifest["files"]]  # the configs it carries
    with tempfile.TemporaryDirectory(prefix="accelerate-txn-export-") as scratch:
        objects.download(store(url), url, manifest, names, Path(scratch), sync=False, listed=True)
        try:
            yield Path(scratch)
        except CheckpointError as exc:
            raise _naming(exc, scratch, url) from None
