"""Object stores mounted through FUSE (``store.mounts``): the mount-table parser, which mount holds a path, and the
refusal of every writer of a checkpoint directory there, before anything is created; reading stays possible.

The detection is driven by crafted mount tables (``ACCELERATE_TXN_MOUNTINFO``); a real s3fs-fuse mount of the
loopback S3 server is tested where s3fs and /dev/fuse work (skipped otherwise, with the reason)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn import (
    MANIFEST,
    CheckpointConfigurationError,
    load_training_checkpoint,
    save_training_checkpoint,
)
from accelerate_txn.store import mounts
from accelerate_txn.store.mounts import (
    MOUNTINFO_ENV,
    Mount,
    mount_of,
    object_store_mount,
    parse_mountinfo,
    refuse_object_store_mount,
)
from accelerate_txn.store.posix import DirectoryLock, create_directory
from tests.support.s3_server import BUCKET, Server

REPO = Path(__file__).resolve().parents[2]
ROOT_LINE = "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw"


def _escape(path: str | Path) -> str:
    """``path`` as the kernel writes it in a mount table (space, tab, newline and backslash escaped in octal)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in str(path))


def _line(number: int, mount_point: str | Path, fstype: str, source: str, root: str = "/",
          optional: str = "shared:7") -> str:
    fields = [str(number), "27", f"0:{number}", _escape(root), _escape(mount_point), "rw,nosuid,nodev,relatime"]
    return " ".join([*fields, *optional.split(), "-", fstype, _escape(source), "rw,user_id=0,group_id=0"])


def _table(tmp_path: Path, *lines: str) -> Path:
    table = tmp_path / f"mountinfo-{uuid.uuid4().hex}"
    table.write_text("\n".join([ROOT_LINE, *lines]) + "\n")
    return table


@pytest.fixture
def real(tmp_path: Path) -> Path:
    """``tmp_path`` with its symbolic links resolved (a mount table lists real paths)."""
    return Path(os.path.realpath(tmp_path))


# ----------------------------------------------------------------------------------------------- the parser

def test_parse_mountinfo_reads_every_field_through_optional_fields_and_octal_escapes() -> None:
    data = (
        b"22 27 0:21 / /proc rw,relatime - proc proc rw\n"
        b"45 27 0:40 / /mnt/my\\040bucket rw,nosuid,nodev shared:3 master:1 - fuse.gcsfuse my-bucket rw,user_id=0\n"
        b"46 45 0:41 /sub\\011dir /data/a\\134b rw - fuse s3fs rw\n"
        b"not a mount line\n"
        b"47 27 0:42 / /broken rw - ext4\n"  # no source after the type: skipped
    )
    assert parse_mountinfo(data) == [
        Mount(mount_point="/proc", root="/", fstype="proc", source="proc"),
        Mount(mount_point="/mnt/my bucket", root="/", fstype="fuse.gcsfuse", source="my-bucket"),
        Mount(mount_point="/data/a\\b", root="/sub\tdir", fstype="fuse", source="s3fs"),
    ]


def test_the_mount_of_a_path_is_the_longest_mount_point_containing_it_not_a_string_prefix(real: Path) -> None:
    gcs, inner, sibling = real / "gcs", real / "gcs" / "local", real / "gcs2"
    table = parse_mountinfo(_table(real, _line(40, gcs, "fuse.gcsfuse", "bucket"),
                                   _line(41, inner, "ext4", "/dev/vdb"),
                                   _line(42, sibling, "tmpfs", "tmpfs")).read_bytes())
    assert mount_of(gcs / "run" / "checkpoint_1", table).fstype == "fuse.gcsfuse"  # type: ignore[union-attr]
    assert mount_of(gcs, table).fstype == "fuse.gcsfuse"  # type: ignore[union-attr]
    assert mount_of(inner / "run", table).fstype == "ext4"  # type: ignore[union-attr]  # nested: a local disk
    assert mount_of(sibling / "run", table).fstype == "tmpfs"  # type: ignore[union-attr]  # /gcs2 is not under /gcs
    assert mount_of(real / "elsewhere", table).mount_point == "/"  # type: ignore[union-attr]
    assert mount_of(real / "x", []) is None


def test_a_mount_on_top_of_another_at_the_same_point_wins(real: Path) -> None:
    point = real / "stacked"
    below_then_top = parse_mountinfo(_table(real, _line(40, point, "fuse.gcsfuse", "bucket"),
                                            _line(41, point, "ext4", "/dev/vdb")).read_bytes())
    assert mount_of(point / "ckpt", below_then_top).fstype == "ext4"  # type: ignore[union-attr]
    top_is_fuse = parse_mountinfo(_table(real, _line(40, point, "ext4", "/dev/vdb"),
                                         _line(41, point, "fuse.gcsfuse", "bucket")).read_bytes())
    assert mount_of(point / "ckpt", top_is_fuse).fstype == "fuse.gcsfuse"  # type: ignore[union-attr]


def test_a_mount_point_with_spaces_is_matched_after_unescaping(real: Path, monkeypatch: Any) -> None:
    point = real / "my bucket\twith\\odd names"
    monkeypatch.setenv(MOUNTINFO_ENV, str(_table(real, _line(40, point, "fuse.gcsfuse", "my-bucket"))))
    found = object_store_mount(point / "run" / "checkpoint_3")
    assert found is not None and found.mount.mount_point == str(point) and found.tool == "gcsfuse"
    assert object_store_mount(real / "my bucket" / "run") is None


def test_a_bind_mount_is_judged_by_the_file_system_it_shows(real: Path, monkeypatch: Any) -> None:
    # /data/ckpt shows a subdirectory of the bucket (root /team/run): it is the bucket; a local directory bound over
    # a directory inside the bucket mount is a local disk.
    data, local = real / "data" / "ckpt", real / "gcs" / "scratch"
    monkeypatch.setenv(MOUNTINFO_ENV, str(_table(
        real, _line(40, real / "gcs", "fuse.gcsfuse", "bucket"),
        _line(41, data, "fuse.gcsfuse", "bucket", root="/team/run"),
        _line(42, local, "ext4", "/dev/vda", root="/var/scratch"))))
    found = object_store_mount(data / "checkpoint_2")
    assert found is not None and found.mount.root == "/team/run"
    assert object_store_mount(local / "checkpoint_2") is None
    assert object_store_mount(real / "gcs" / "checkpoint_2") is not None


def test_symbolic_links_are_resolved_before_the_mount_is_looked_up(real: Path, monkeypatch: Any) -> None:
    mounted, local = real / "mnt", real / "local"
    mounted.mkdir()
    local.mkdir()
    (real / "to-mount").symlink_to(mounted)  # a local-looking name that leads onto the mount
    (mounted / "to-local").symlink_to(local)  # a name under the mount point that leads off it
    monkeypatch.setenv(MOUNTINFO_ENV, str(_table(real, _line(40, mounted, "fuse.mountpoint-s3", "mountpoint-s3"))))
    assert object_store_mount(real / "to-mount" / "run" / "checkpoint_1") is not None  # not created yet: still found
    assert object_store_mount(mounted / "to-local" / "checkpoint_1") is None


@pytest.mark.parametrize(("fstype", "source", "tool", "url"), [
    ("fuse.gcsfuse", "my-bucket", "gcsfuse", "gs://BUCKET/PREFIX"),
    ("fuse.mountpoint-s3", "mountpoint-s3", "mountpoint-s3", "s3://BUCKET/PREFIX"),
    ("fuse.s3fs", "s3fs", "s3fs", "s3://BUCKET/PREFIX"),
    ("fuse", "s3fs", "s3fs", "s3://BUCKET/PREFIX"),  # a plain FUSE type: the source names the tool
    ("fuse", "s3fs#my-bucket", "s3fs", "s3://BUCKET/PREFIX"),  # s3fs's old fstab form
    ("fuse.blobfuse2", "blobfuse2", "blobfuse2", "az://CONTAINER/PREFIX"),
    ("fuse", "blobfuse", "blobfuse", "az://CONTAINER/PREFIX"),
    ("fuse.goofys", "my-bucket", "goofys", "s3://BUCKET/PREFIX"),
    ("fuse.geesefs", "my-bucket", "geesefs", "s3://BUCKET/PREFIX"),
    ("fuse.rclone", "remote:bucket/run", "rclone", "gs://BUCKET/PREFIX"),
])
def test_each_object_store_fuse_is_refused_with_its_url(real: Path, monkeypatch: Any, fstype: str, source: str,
                                                        tool: str, url: str) -> None:
    point = real / "store"
    monkeypatch.setenv(MOUNTINFO_ENV, str(_table(real, _line(40, point, fstype, source))))
    target = point / "run" / "checkpoint_4"
    with pytest.raises(CheckpointConfigurationError) as raised:
        refuse_object_store_mount(target)
    message = str(raised.value)
    assert f"Cannot publish checkpoints in {target}: it is on {point}, a {tool} mount of " in message
    assert f"(file system {fstype}, source {source})" in message
    assert "a directory rename is a copy and a delete of each object, not an atomic commit" in message
    assert f'save_state("{url}/checkpoint_N")' in message
    assert "Reading checkpoints from this mount is not affected" in message
    assert not point.exists()


@pytest.mark.parametrize(("fstype", "source"), [
    ("fuse.sshfs", "user@host:/data"),  # FUSE, not an object store
    ("fuse.juicefs", "JuiceFS:vol"),  # an object store underneath, but its own metadata: atomic rename
    ("fuse", "sshfs"),
    ("nfs4", "s3fs"),  # the source names a tool, but this is no FUSE mount
    ("ext4", "/dev/vdb"),
    ("fuse.gcsfuse-like", "bucket"),
])
def test_other_file_systems_are_left_alone(real: Path, monkeypatch: Any, fstype: str, source: str) -> None:
    point = real / "store"
    monkeypatch.setenv(MOUNTINFO_ENV, str(_table(real, _line(40, point, fstype, source))))
    refuse_object_store_mount(point / "run")
    assert object_store_mount(point / "run") is None


def test_no_mount_table_detects_nothing(real: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv(MOUNTINFO_ENV, raising=False)
    monkeypatch.setattr(mounts, "MOUNTINFO", str(real / "absent"))  # as on a system without /proc (macOS)
    assert object_store_mount(real / "run") is None


def test_an_unreadable_test_mount_table_is_a_configuration_error(real: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv(MOUNTINFO_ENV, str(real / "absent"))
    with pytest.raises(CheckpointConfigurationError, match=rf"The environment variable {MOUNTINFO_ENV} is "
                                                           rf"'{real / 'absent'}', which cannot be read"):
        object_store_mount(real / "run")


def test_this_machines_own_mount_table_is_read(monkeypatch: Any) -> None:
    monkeypatch.delenv(MOUNTINFO_ENV, raising=False)
    if not Path(mounts.MOUNTINFO).exists():
        pytest.skip("no /proc/self/mountinfo on this system")
    assert mount_of("/", mounts.read_mounts()) is not None  # the root is always mounted


# ------------------------------------------------------------------------- every writer refuses, creating nothing

@pytest.fixture
def on_gcsfuse(real: Path, monkeypatch: Any) -> Path:
    """A directory that a crafted mount table says is a gcsfuse mount of the bucket ``my-bucket`` (empty)."""
    point = real / "gcs"
    point.mkdir()
    monkeypatch.setenv(MOUNTINFO_ENV, str(_table(real, _line(40, point, "fuse.gcsfuse", "my-bucket"))))
    return point


def test_create_directory_and_the_directory_lock_refuse_before_creating_anything(on_gcsfuse: Path) -> None:
    with pytest.raises(CheckpointConfigurationError, match="a gcsfuse mount of Google Cloud Storage"):
        create_directory(on_gcsfuse / "run")
    lock = DirectoryLock(on_gcsfuse / "run")
    with pytest.raises(CheckpointConfigurationError, match="a gcsfuse mount of Google Cloud Storage"):
        lock.acquire()
    assert not lock.is_locked
    with pytest.raises(CheckpointConfigurationError, match="gcsfuse"):
        DirectoryLock(on_gcsfuse).acquire()  # the mount point itself
    assert list(on_gcsfuse.iterdir()) == []  # no directory, no lock file


def test_a_protected_save_refuses_and_writes_nothing(on_gcsfuse: Path) -> None:
    from tests.support.single import stepped_accelerator

    accelerator, _, _ = stepped_accelerator()
    with pytest.raises(CheckpointConfigurationError, match=r'save_state\("gs://BUCKET/PREFIX/checkpoint_N"\)'):
        save_training_checkpoint(accelerator, on_gcsfuse / "run" / "checkpoint_0")
    assert list(on_gcsfuse.iterdir()) == []
    assert accelerator.project_configuration.iteration == 0  # nothing consumed


def test_the_trainer_reservation_refuses_before_creating_anything(on_gcsfuse: Path) -> None:
    from accelerate_txn.trainer.save import transaction

    reservation = transaction(on_gcsfuse / "out" / "checkpoint-5", "0" * 32)
    with pytest.raises(CheckpointConfigurationError, match="gcsfuse"):
        reservation.open()
    assert not reservation.lock.is_locked
    assert list(on_gcsfuse.iterdir()) == []


def test_a_weight_export_refuses_before_creating_anything(on_gcsfuse: Path) -> None:
    from accelerate_txn.weights import save_diffusers_state_dict

    class ConfigOnly:
        def save_config(self, directory: str) -> None:
            Path(directory, "config.json").write_text("{}")

    with pytest.raises(CheckpointConfigurationError, match="gcsfuse"):
        save_diffusers_state_dict({"w": torch.ones(2)}, ConfigOnly(), on_gcsfuse / "exports" / "unet")
    assert list(on_gcsfuse.iterdir()) == []


def test_cli_prune_refuses_there_and_list_and_verify_read_a_copied_checkpoint(on_gcsfuse: Path, real: Path) -> None:
    # Reading is fine: a checkpoint published on a local disk and copied onto the mount verifies from there (a copy
    # cut short would miss files the manifest lists, and fail verification like any damaged checkpoint).
    from tests.support.single import stepped_accelerator

    accelerator, saved, _ = stepped_accelerator()
    local = real / "local" / "checkpoint_0"
    save_training_checkpoint(accelerator, local)
    copied = on_gcsfuse / "run" / "checkpoint_0"
    shutil.copytree(local, copied)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(*args: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "accelerate_txn", *map(str, args)], capture_output=True,
                              text=True, timeout=120, cwd=REPO, env=env)

    verified = cli("verify", copied)
    assert verified.returncode == 0, verified.stderr
    restored, model, _ = stepped_accelerator(seed=1)
    load_training_checkpoint(restored, copied)  # load_state reads from the mount as from anywhere
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters(), strict=True))
    listed = cli("list", copied.parent)
    assert listed.returncode == 0 and "checkpoint_0" in listed.stdout, listed.stderr
    pruned = cli("prune", copied.parent, "--keep", "1")
    assert pruned.returncode == 1
    assert f"Cannot publish checkpoints in {copied.parent}" in pruned.stderr and "gcsfuse" in pruned.stderr
    assert sorted(p.name for p in copied.parent.iterdir()) == ["checkpoint_0"]  # no lock file
    (copied / "optimizer.bin").unlink()  # a copy cut short
    assert cli("verify", copied).returncode != 0


# ---------------------------------------------------------------------------------------- a real FUSE mount

def _abort_fuse(point: Path, device: int) -> None:
    """Abort the FUSE connection of the mount ``point`` (device ``device``) and detach it: a process blocked in a
    request to it returns (with an error) instead of staying unkillable."""
    connections = Path("/sys/fs/fuse/connections")
    if not any(connections.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "none", str(connections)], capture_output=True)
    abort = connections / str(os.minor(device)) / "abort"
    if abort.exists():
        abort.write_text("1")
    subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.fixture
def s3fs_mount(s3_server: Server, tmp_path: Path, monkeypatch: Any) -> Iterator[Path]:
    """The test bucket of the loopback S3 server mounted with s3fs-fuse (real FUSE, real kernel mount table)."""
    monkeypatch.delenv(MOUNTINFO_ENV, raising=False)
    if shutil.which("s3fs") is None or shutil.which("fusermount") is None:
        pytest.skip("s3fs-fuse is not installed (Debian: apt-get install s3fs)")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        pytest.skip("/dev/fuse is missing or not usable here")
    point = Path(os.path.realpath(tmp_path)) / "s3fs"
    point.mkdir()
    passwords = tmp_path / "passwd-s3fs"
    passwords.write_text(f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}\n")
    passwords.chmod(0o600)
    started = subprocess.run(
        ["s3fs", BUCKET, str(point), "-o", f"passwd_file={passwords},url={s3_server.endpoint},use_path_request_style"],
        capture_output=True, text=True, timeout=60)
    if started.returncode != 0 or not os.path.ismount(point):  # s3fs returns once the kernel mounted it
        pytest.skip(f"s3fs cannot mount here (exit {started.returncode}: {started.stderr.strip()[-300:]})")
    device = os.stat(point).st_dev
    try:
        yield point
    finally:
        if subprocess.run(["fusermount", "-u", str(point)], capture_output=True).returncode != 0:
            _abort_fuse(point, device)


def _in_a_process(code: str, point: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the S3 server answering the mount lives in this one: a client blocked
    on the mount in this process could hold the interpreter the server needs). A hang guard only: past it the mount
    is aborted so that the child can be killed."""
    device = os.stat(point).st_dev
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        _abort_fuse(point, device)
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"hung on the s3fs mount: {stderr[-2000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _saving_into(path: Path) -> str:
    """A script that trains one step and saves a protected checkpoint at ``path``."""
    return ("from accelerate_txn import save_training_checkpoint\n"
            "from tests.support.single import stepped_accelerator\n"
            "accelerator, _, _ = stepped_accelerator()\n"
            f"save_training_checkpoint(accelerator, {str(path)!r})\n")


def test_a_save_onto_a_real_s3fs_mount_is_refused_and_nothing_reaches_the_bucket(s3fs_mount: Path,
                                                                                 tmp_path: Path) -> None:
    from accelerate_txn.store.s3 import S3Store

    found = object_store_mount(s3fs_mount / "run")
    assert found is not None and found.tool == "s3fs" and found.mount.fstype == "fuse.s3fs"
    prefix = f"fuse-{uuid.uuid4().hex}"
    refused = _in_a_process(_saving_into(s3fs_mount / prefix / "checkpoint_0"), s3fs_mount)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "CheckpointConfigurationError" in refused.stderr, refused.stderr[-3000:]
    assert f"it is on {s3fs_mount}, a s3fs mount of Amazon S3" in refused.stderr
    assert 'save_state("s3://BUCKET/PREFIX/checkpoint_N")' in refused.stderr
    store = S3Store().fs
    store.invalidate_cache()
    assert store.find(f"{BUCKET}/{prefix}") == []  # not even the directory
    # Reading from the mount works: a checkpoint published locally and copied onto it verifies there, every file
    # hashed (the command line, in its own process).
    local = tmp_path / "local"
    saved = _in_a_process(_saving_into(local / "checkpoint_0"), s3fs_mount)
    assert saved.returncode == 0, saved.stderr[-3000:]
    copied = s3fs_mount / f"{prefix}-read" / "checkpoint_0"
    shutil.copytree(local / "checkpoint_0", copied)
    assert (copied / MANIFEST).is_file()
    verified = _in_a_process(f"from accelerate_txn.cli import main; raise SystemExit(main(['verify', '--full', "
                             f"{str(copied)!r}]))", s3fs_mount)
    assert verified.returncode == 0, verified.stdout + verified.stderr
