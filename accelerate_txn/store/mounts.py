"""Object stores mounted as file systems (gcsfuse, mountpoint-s3, s3fs-fuse, blobfuse2, ...): found, and refused as
the place a checkpoint is published by rename.

The POSIX protocol commits a checkpoint by renaming its complete staging directory onto its name (``store.posix``).
On a FUSE mount of an object store there is no directory: a rename is a copy and then a delete of every object under
the old prefix (mountpoint-s3 refuses it outright), so a crash in the middle leaves part of the tree under the
published name, and the lock, the replacement (``renameat2`` exchange) and retention (rename aside) rest on the same
rename. Committing there by a marker written last would mean a second protocol for local paths; the library already
has one for object stores, addressed by URL (``core.remote``: objects uploaded, then a create-only manifest). So a
directory on such a mount is refused, before anything is created there, with that fix (:func:`refuse_object_store_mount`,
called by ``store.posix.create_directory``, which every writer of a checkpoint directory, and the directory lock, go
through). The rank that publishes (rank 0) decides, inside a rank phase: every rank raises the same error.

Reading from such a mount is left alone: a restore verifies every file a manifest lists (present, of its size, hashed
where the manifest says), so a tree a crash left half-copied under its name is refused like any damaged checkpoint.

Detection reads the mount table of this process (``/proc/self/mountinfo``, Linux): the mount that holds a path is the
one with the longest mount point that is a prefix of the path after its symbolic links are resolved (the last one
listed where several share it: it is mounted on top); it is an object store when its file system type is ``fuse.NAME``
(or ``fuseblk.NAME``) with a known ``NAME``, or a plain ``fuse`` whose mount source names a known tool. Where there
is no mount table (not Linux) nothing is detected. ``ACCELERATE_TXN_MOUNTINFO`` names another mount table to read, for
the tests only (a crafted table makes any directory look mounted).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointConfigurationError

#: Tests only: the path of a mount table (``/proc/self/mountinfo`` format) read instead of this process's own.
MOUNTINFO_ENV = "ACCELERATE_TXN_MOUNTINFO"
MOUNTINFO = "/proc/self/mountinfo"

_S3_URL, _GCS_URL, _AZURE_URL = "s3://BUCKET/PREFIX", "gs://BUCKET/PREFIX", "az://CONTAINER/PREFIX"
_S3 = ("Amazon S3 (or an S3-compatible store)", (_S3_URL,))
_GCS = ("Google Cloud Storage", (_GCS_URL,))
_AZURE = ("Azure Blob Storage", (_AZURE_URL,))
#: FUSE file systems that present an object store, by the name in their type (``fuse.NAME``) or mount source:
#: ``NAME -> (the store, the URL forms of the library's own client for it)``.
OBJECT_STORE_FUSE: dict[str, tuple[str, tuple[str, ...]]] = {
    "gcsfuse": _GCS,
    "mountpoint-s3": _S3,
    "s3fs": _S3,
    "goofys": _S3,
    "geesefs": _S3,
    "tigrisfs": _S3,
    "ossfs": _S3,  # Alibaba OSS (s3fs-fuse's fork); its S3-compatible endpoint through s3://
    "cosfs": _S3,  # Tencent COS, likewise
    "obsfs": _S3,  # Huawei OBS, likewise
    "blobfuse2": _AZURE,
    "blobfuse": _AZURE,
    "rclone": ("a remote store through rclone", (_S3_URL, _GCS_URL, _AZURE_URL)),
}
_FUSE_TYPES = ("fuse", "fuseblk")
_ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of a mount table: where it is mounted, its root within the mounted file system (not ``/`` for a
    bind mount of a subdirectory), its file system type and its source."""

    mount_point: str
    root: str
    fstype: str
    source: str


@dataclass(frozen=True)
class ObjectStoreMount:
    """A path found on a FUSE mount of an object store: the mount, the tool's name, the store, and the URL forms the
    library addresses such a store by."""

    mount: Mount
    tool: str
    store: str
    urls: tuple[str, ...]


def _unescape(field: bytes) -> str:
    """A mount-table field with its octal escapes (``\\040`` space, ``\\011`` tab, ``\\012`` newline, ``\\134``
    backslash) decoded, as a file system path string."""
    return os.fsdecode(_ESCAPE.sub(lambda match: bytes([int(match.group(1), 8)]), field))


def parse_mountinfo(data: bytes) -> list[Mount]:
    """The mounts of a ``/proc/PID/mountinfo`` table, in its order; a line that is not one is skipped.

    Each line: ``ID PARENT MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``
    (proc(5)); the optional fields end at the lone ``-``."""
    mounts = []
    for line in data.splitlines():
        fields = line.split(b" ")
        try:
            separator = fields.index(b"-", 6)
        except ValueError:
            continue
        if len(fields) < separator + 3:
            continue
        mounts.append(Mount(mount_point=_unescape(fields[4]), root=_unescape(fields[3]),
                            fstype=_unescape(fields[separator + 1]), source=_unescape(fields[separator + 2])))
    return mounts


def read_mounts() -> list[Mount]:
    """This process's mounts (``ACCELERATE_TXN_MOUNTINFO``, tests only, names another table); empty where there is
    no mount table (not Linux)."""
    table = os.environ.get(MOUNTINFO_ENV)
    if table:
        try:
            return parse_mountinfo(Path(table).read_bytes())
        except OSError as exc:
            raise CheckpointConfigurationError(
                f"The environment variable {MOUNTINFO_ENV} is {table!r}, which cannot be read ({exc.strerror}): it "
                "must name a mount table (the /proc/self/mountinfo format). It is for the tests only: unset it."
            ) from None
    try:
        return parse_mountinfo(Path(MOUNTINFO).read_bytes())
    except OSError:
        return []


def _contains(mount_point: str, path: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_of(path: str | os.PathLike[str], mounts: list[Mount]) -> Mount | None:
    """The mount among ``mounts`` that holds ``path``: its symbolic links resolved (those of the part that exists),
    the longest mount point that contains it, the last listed of equals (a mount on top of another)."""
    resolved = os.path.realpath(os.fspath(path))
    found: Mount | None = None
    for mount in mounts:
        if _contains(mount.mount_point, resolved) and (
                found is None or len(mount.mount_point.rstrip("/")) >= len(found.mount_point.rstrip("/"))):
            found = mount
    return found


def _tool(mount: Mount) -> str | None:
    """The object-store tool ``mount`` is made by, or None: ``fuse.NAME``/``fuseblk.NAME`` with a known ``NAME``, or a
    plain FUSE type whose source names one (``s3fs``, ``s3fs#bucket``, ``/usr/bin/mount-s3``-style paths)."""
    kind, _dot, subtype = mount.fstype.partition(".")
    if kind not in _FUSE_TYPES:
        return None
    if subtype:
        return subtype if subtype in OBJECT_STORE_FUSE else None
    source = os.path.basename(mount.source.partition("#")[0])
    return source if source in OBJECT_STORE_FUSE else None


def object_store_mount(path: str | os.PathLike[str]) -> ObjectStoreMount | None:
    """The object-store FUSE mount that holds ``path`` (existing or not), or None."""
    mount = mount_of(path, read_mounts())
    tool = None if mount is None else _tool(mount)
    if mount is None or tool is None:
        return None
    store, urls = OBJECT_STORE_FUSE[tool]
    return ObjectStoreMount(mount=mount, tool=tool, store=store, urls=urls)


def refuse_object_store_mount(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointConfigurationError` if ``path`` is on a FUSE mount of an object store, where a
    checkpoint cannot be published atomically (see the module docstring); nothing is created or changed either
    way. The message names the path, the mount and its file system, and the fix: the store's URL."""
    found = object_store_mount(path)
    if found is None:
        return
    mount = found.mount
    urls = " or ".join(f'save_state("{url}/checkpoint_N")' for url in found.urls)
    raise CheckpointConfigurationError(
        f"Cannot publish checkpoints in {path}: it is on {mount.mount_point}, a {found.tool} mount of {found.store} "
        f"(file system {mount.fstype}, source {mount.source}), where a directory rename is a copy and a delete of "
        "each object, not an atomic commit: a crash while publishing could leave part of a checkpoint under its "
        f"published name. Save to the store by its URL instead ({urls}): accelerate-txn commits there with a "
        "create-only manifest written last. Or save to a local or shared POSIX file system, with "
        "configure_checkpointing(accelerator, mirror=URL) to upload each checkpoint (a save to a URL keeps its local "
        "copy under configure_checkpointing(cache_dir=...): not on such a mount either). Reading checkpoints from "
        "this mount is not affected."
    )
