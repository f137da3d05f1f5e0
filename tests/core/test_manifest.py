"""Unit tests of the completion manifest: inventory, read/write, verification, and DCP metadata reading.

Pure file logic in one process: real files, real ``torch.distributed.checkpoint`` saves (``no_dist=True``)."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter

from accelerate_txn.core.manifest import (
    MANIFEST,
    PROTOCOL,
    build_inventory,
    check_dcp_payloads,
    read_dcp_metadata,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from accelerate_txn.errors import CheckpointIntegrityError
from accelerate_txn.store.posix import POSIX

LARGE = 17 * 1024 * 1024  # above the 16 MiB threshold under which payloads are always hashed


def _xxh3(path: Path) -> str:
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def _dcp_save(directory: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    state = state if state is not None else {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    return directory


def _checkpoint(root: Path) -> Path:
    """A small checkpoint-shaped directory: a control file, a small payload and a DCP sub-directory."""
    root.mkdir()
    (root / "random_states_0.pkl").write_bytes(b"rng-state" * 10)
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    _dcp_save(root / "pytorch_model_fsdp_0")
    return root


def _manifest_for(directory: Path, checksum: str = "metadata") -> dict[str, Any]:
    return {
        "protocol": PROTOCOL,
        "status": "complete",
        "run_id": "a" * 32,
        "transaction_id": "b" * 32,
        "files": build_inventory(directory, checksum),
    }


def _flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as stream:
        stream.seek(offset)
        value = stream.read(1)
        stream.seek(offset)
        stream.write(bytes([value[0] ^ 0xFF]))


# --- build_inventory ----------------------------------------------------------------------------------------

def test_build_inventory_records_size_of_every_file_by_relative_posix_path(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    inventory = build_inventory(root, "metadata")
    expected = {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    assert {name: row["size"] for name, row in inventory.items()} == expected
    assert "pytorch_model_fsdp_0/.metadata" in inventory


def test_build_inventory_hashes_control_files_and_small_payloads(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    inventory = build_inventory(root, "metadata")
    for name, row in inventory.items():
        assert row["xxh3_128"] == _xxh3(root / name), name


def test_build_inventory_metadata_mode_records_only_size_of_large_payload(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    (root / "__big_0.distcp").write_bytes(b"\x01" * LARGE)
    (root / "big_control.pkl").write_bytes(b"\x02" * LARGE)  # not a payload suffix: always hashed
    inventory = build_inventory(root, "metadata")
    assert inventory["__big_0.distcp"] == {"size": LARGE}
    assert inventory["big_control.pkl"]["xxh3_128"] == _xxh3(root / "big_control.pkl")


def test_build_inventory_full_mode_hashes_large_payload(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    (root / "__big_0.distcp").write_bytes(b"\x01" * LARGE)
    inventory = build_inventory(root, "full")
    assert inventory["__big_0.distcp"] == {"size": LARGE, "xxh3_128": _xxh3(root / "__big_0.distcp")}


def test_build_inventory_records_dcp_metadata_schema(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    row = build_inventory(root, "metadata")["pytorch_model_fsdp_0/.metadata"]
    assert row["schema"] == {
        "w": {"path": ["w"], "shape": [3, 4], "dtype": "torch.float32"},
        "b": {"path": ["b"], "shape": [2], "dtype": "torch.float32"},
    }
    assert "schema" not in build_inventory(root, "metadata")["random_states_0.pkl"]


def test_build_inventory_rejects_symlink(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    (root / "linked.bin").symlink_to(outside)
    with pytest.raises(CheckpointIntegrityError, match=r"linked\.bin is a symbolic link"):
        build_inventory(root, "metadata")


def test_build_inventory_leaves_out_the_manifest_itself(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    (root / MANIFEST).write_text("{}")
    assert MANIFEST not in build_inventory(root, "metadata")


# --- write_manifest / read_manifest -------------------------------------------------------------------------

def test_write_manifest_then_read_manifest_round_trips_and_leaves_no_temporary(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    write_manifest(root, manifest, store=POSIX)
    assert read_manifest(root) == manifest
    assert not (root / (MANIFEST + ".tmp")).exists()


def test_read_manifest_returns_none_without_manifest(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None


def test_read_manifest_invalid_json_raises_integrity_error_naming_path(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text('{"protocol": 1,')  # truncated
    with pytest.raises(CheckpointIntegrityError, match=rf"Unreadable checkpoint manifest {tmp_path / MANIFEST}"):
        read_manifest(tmp_path)


def test_read_manifest_non_object_raises_integrity_error(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text("[1, 2, 3]")
    with pytest.raises(CheckpointIntegrityError, match=rf"Invalid checkpoint manifest {tmp_path / MANIFEST}: not a JSON"):
        read_manifest(tmp_path)


# --- verify_manifest ----------------------------------------------------------------------------------------

def test_verify_manifest_accepts_intact_checkpoint(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    write_manifest(root, _manifest_for(root, "full"), store=POSIX)
    manifest = read_manifest(root)
    assert manifest is not None
    verify_manifest(root, manifest, full=False)
    verify_manifest(root, manifest, full=True)


@pytest.mark.parametrize("change, message", [
    ({"protocol": 3}, r"uses checkpoint protocol 3; this accelerate-txn reads protocols \[1, 2\]"),
    ({"protocol": None}, r"uses checkpoint protocol None"),
    ({"status": "writing"}, r"does not mark a complete checkpoint \(status 'writing'\)"),
    ({"run_id": None}, r"lacks a valid run_id"),
    ({"run_id": ""}, r"lacks a valid run_id"),
    ({"transaction_id": 7}, r"lacks a valid transaction_id"),
    ({"files": {}}, r"has no file inventory"),
])
def test_verify_manifest_rejects_invalid_header(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = {**_manifest_for(root), **change}
    with pytest.raises(CheckpointIntegrityError, match=message):
        verify_manifest(root, manifest, full=True)


def test_verify_manifest_rejects_missing_file(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    (root / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"random_states_0\.pkl is missing \(listed in .*checkpoint_manifest"):
        verify_manifest(root, manifest, full=False)


def test_verify_manifest_rejects_size_change(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    with (root / "model.safetensors").open("ab") as stream:
        stream.write(b"extra")
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors has 1029 bytes; the manifest recorded 1024"):
        verify_manifest(root, manifest, full=False)


def test_verify_manifest_detects_flipped_byte_in_control_file_without_full(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    _flip_byte(root / "random_states_0.pkl", 3)
    with pytest.raises(CheckpointIntegrityError, match=r"random_states_0\.pkl does not match its xxh3_128"):
        verify_manifest(root, manifest, full=False)


def test_verify_manifest_detects_flipped_byte_in_dcp_metadata(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    path = root / "pytorch_model_fsdp_0" / ".metadata"
    _flip_byte(path, path.stat().st_size - 2)
    with pytest.raises(CheckpointIntegrityError, match=r"\.metadata does not match its xxh3_128"):
        verify_manifest(root, manifest, full=False)


def test_verify_manifest_full_mode_large_payload_flip_detected_only_by_full_verification(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    (root / "__big_0.distcp").write_bytes(b"\x01" * LARGE)
    manifest = _manifest_for(root, "full")
    _flip_byte(root / "__big_0.distcp", LARGE // 2)
    verify_manifest(root, manifest, full=False)  # selection: sizes and control files only
    with pytest.raises(CheckpointIntegrityError, match=r"__big_0\.distcp does not match its xxh3_128"):
        verify_manifest(root, manifest, full=True)


def test_verify_manifest_metadata_mode_large_payload_is_checked_by_size_only(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    (root / "__big_0.distcp").write_bytes(b"\x01" * LARGE)
    manifest = _manifest_for(root, "metadata")
    _flip_byte(root / "__big_0.distcp", LARGE // 2)
    verify_manifest(root, manifest, full=True)  # nothing recorded to compare against: documented limit of the mode


def test_verify_manifest_rejects_recorded_schema_mismatch(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    manifest["files"]["pytorch_model_fsdp_0/.metadata"]["schema"]["w"]["shape"] = [4, 3]
    with pytest.raises(CheckpointIntegrityError, match=r"\.metadata describes other tensors than"):
        verify_manifest(root, manifest, full=False)


def test_verify_manifest_rejects_entry_outside_the_checkpoint(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    (tmp_path / "elsewhere.bin").write_bytes(b"abc")
    manifest = _manifest_for(root)
    manifest["files"]["../elsewhere.bin"] = {"size": 3}
    with pytest.raises(CheckpointIntegrityError, match=r"'\.\./elsewhere\.bin' points outside its checkpoint"):
        verify_manifest(root, manifest, full=False)


def test_verify_manifest_rejects_malformed_file_entry_as_integrity_error(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt")
    manifest = _manifest_for(root)
    manifest["files"]["model.safetensors"] = 1024
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors"):
        verify_manifest(root, manifest, full=False)


# --- read_dcp_metadata: restricted unpickler ----------------------------------------------------------------

class _Reduce:
    """Pickles as ``function(*args)``: what a malicious ``.metadata`` would contain."""

    def __init__(self, function: Any, args: tuple[Any, ...]) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, self.args


def test_read_dcp_metadata_loads_real_dcp_metadata(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    directory = _dcp_save(tmp_path / "dcp")
    metadata = read_dcp_metadata(directory)
    assert isinstance(metadata, Metadata)
    assert set(metadata.state_dict_metadata) == {"w", "b"}
    assert isinstance(metadata.state_dict_metadata["w"], TensorStorageMetadata)
    assert list(metadata.state_dict_metadata["w"].size) == [3, 4]


def test_read_dcp_metadata_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointIntegrityError, match=rf"Missing DCP metadata {tmp_path / '.metadata'}"):
        read_dcp_metadata(tmp_path)


@pytest.mark.parametrize("function", [os.system, eval], ids=["os.system", "builtins.eval"])
def test_read_dcp_metadata_refuses_malicious_pickle_without_executing_it(tmp_path: Path, function: Any) -> None:
    marker = tmp_path / "executed"
    code = f"touch {marker}" if function is os.system else f"__import__('os').mkdir({str(marker)!r})"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Reduce(function, (code,))))
    with pytest.raises(CheckpointIntegrityError, match=r"Unreadable DCP metadata .*is not allowed in DCP metadata"):
        read_dcp_metadata(tmp_path)
    assert not marker.exists()


def _short_unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def test_read_dcp_metadata_refuses_dotted_name_reaching_os_through_allowed_module(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    payload = (pickle.PROTO + b"\x04"
               + _short_unicode("torch.distributed.checkpoint.metadata") + _short_unicode("os.mkdir")
               + pickle.STACK_GLOBAL + _short_unicode(str(marker)) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointIntegrityError, match=r"is not allowed in DCP metadata"):
        read_dcp_metadata(tmp_path)
    assert not marker.exists()


# --- check_dcp_payloads -------------------------------------------------------------------------------------

def test_check_dcp_payloads_accepts_intact_dcp_directory(tmp_path: Path) -> None:
    directory = _dcp_save(tmp_path / "dcp")
    assert set(check_dcp_payloads(directory).state_dict_metadata) == {"w", "b"}


def test_check_dcp_payloads_rejects_truncated_payload(tmp_path: Path) -> None:
    directory = _dcp_save(tmp_path / "dcp")
    payload = directory / "__0_0.distcp"
    size = payload.stat().st_size
    os.truncate(payload, size - 10)
    with pytest.raises(CheckpointIntegrityError,
                       match=rf"Truncated DCP payload .*__0_0\.distcp: {size - 10} bytes, needs at least {size}"):
        check_dcp_payloads(directory)


def test_check_dcp_payloads_rejects_missing_payload(tmp_path: Path) -> None:
    directory = _dcp_save(tmp_path / "dcp")
    (directory / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"Missing DCP payload .*__0_0\.distcp \(named by .*\.metadata\)"):
        check_dcp_payloads(directory)


def test_check_dcp_payloads_rejects_metadata_that_is_not_dcp_metadata(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"storage": "not DCP metadata"}))
    with pytest.raises(CheckpointIntegrityError, match=r"\.metadata"):
        check_dcp_payloads(tmp_path)


def test_check_dcp_payloads_rejects_payload_path_outside_directory(tmp_path: Path) -> None:
    directory = _dcp_save(tmp_path / "dcp")
    metadata = read_dcp_metadata(directory)
    for storage in metadata.storage_data.values():
        storage.relative_path = "../escaped.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointIntegrityError, match=r"'\.\./escaped\.distcp' points outside its checkpoint"):
        check_dcp_payloads(directory)



def test_metadata_is_parsed_once_per_transaction_and_again_when_the_file_changes(tmp_path: Path) -> None:
    from accelerate_txn.core.manifest import metadata_cache

    directory = _dcp_save(tmp_path / "model")
    assert read_dcp_metadata(directory) is not read_dcp_metadata(directory)  # no cache outside a transaction
    with metadata_cache():
        first = read_dcp_metadata(directory)
        assert read_dcp_metadata(directory) is first
        with metadata_cache():  # nested: the same cache
            assert read_dcp_metadata(directory) is first
        assert read_dcp_metadata(directory) is first
        _dcp_save(directory, {"other": torch.zeros(3)})  # rewritten: another file (inode, size or times differ)
        again = read_dcp_metadata(directory)
        assert again is not first and set(again.state_dict_metadata) == {"other"}
        (directory / ".metadata").write_bytes(b"not a pickle")  # still opened and checked on every call
        with pytest.raises(CheckpointIntegrityError, match="Unreadable DCP metadata"):
            read_dcp_metadata(directory)
    assert read_dcp_metadata(_dcp_save(tmp_path / "fresh")) is not read_dcp_metadata(tmp_path / "fresh")
