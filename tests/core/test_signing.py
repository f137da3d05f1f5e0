"""Authenticated checkpoints (issue 37 item 1): manifests signed with an HMAC-SHA256 or Ed25519 key and refused, once
verification keys are configured, when the authenticator is missing, wrong, or made with a key not configured.

Single-process: crafted checkpoint directories for the signing and verification logic, real one-process protected
saves for ``configure_checkpointing`` and the command line. The 2-rank FSDP1 restore is in tests/core/test_signing_fsdp.py.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from accelerate_txn import (
    MANIFEST,
    CheckpointAuthenticationError,
    CheckpointConfigurationError,
    CheckpointIntegrityError,
    configure_checkpointing,
    save_training_checkpoint,
)
from accelerate_txn.cli import main
from accelerate_txn.core import signing
from accelerate_txn.core.manifest import build_inventory, read_manifest, verify_manifest, write_manifest
from accelerate_txn.core.select import check_candidate, latest_checkpoint
from accelerate_txn.store.base import hash_file
from accelerate_txn.store.posix import POSIX

REPO = Path(__file__).resolve().parents[2]


# --- keys and crafted checkpoints ---------------------------------------------------------------------------------

def hmac_key(path: Path) -> tuple[Path, str]:
    """A new HMAC key file (a hex line); returns it and its secret hex."""
    secret = secrets.token_hex(32)
    path.write_text(secret + "\n")
    return path, secret


def ed25519_keys(directory: Path, name: str = "ed") -> tuple[Path, Path]:
    """A new Ed25519 key pair as PEM files: (private, public)."""
    private = ed25519.Ed25519PrivateKey.generate()
    private_path, public_path = directory / f"{name}.pem", directory / f"{name}.pub.pem"
    private_path.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    public_path.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def crafted(directory: Path, signer: signing.Key | None) -> Path:
    """A small complete checkpoint (two files, full integrity) whose manifest ``signer`` signed (or none)."""
    directory.mkdir(parents=True)
    (directory / "scheduler.bin").write_bytes(b"scheduler state " * 8)
    (directory / "notes.txt").write_text("lr 0.01\n")
    manifest = {"protocol": 2, "status": "complete", "run_id": "a" * 32, "transaction_id": "b" * 32,
                "integrity": "full", "hash": "xxh3_128", "files": build_inventory(directory)}
    write_manifest(directory, manifest, store=POSIX, signer=signer)
    return directory


def verify(directory: Path, keys: signing.Keyring) -> dict[str, Any]:
    manifest = read_manifest(directory)
    assert manifest is not None
    return verify_manifest(directory, manifest, full=True, dcp=False, keys=keys)


def forge(directory: Path, name: str = "scheduler.bin") -> None:
    """What someone who can write the directory but holds no key can do: change a file and rewrite its manifest row
    (size and hash) to match, keeping everything else, the authenticator included."""
    (directory / name).write_bytes(b"forged scheduler state")
    manifest = json.loads((directory / MANIFEST).read_text())
    size, digest = hash_file(directory / name, "xxh3_128")
    manifest["files"][name].update(size=size, xxh3_128=digest)
    (directory / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=1))


# --- signing and verification ---------------------------------------------------------------------------------------

def test_hmac_signed_manifest_verifies_and_carries_no_key(tmp_path: Path) -> None:
    path, secret = hmac_key(tmp_path / "k.hex")
    key = signing.load_key(path)
    checkpoint = crafted(tmp_path / "checkpoint_0", key)
    text = (checkpoint / MANIFEST).read_text()
    authenticator = json.loads(text)["authenticator"]
    assert authenticator["algorithm"] == "hmac-sha256" and authenticator["key_id"] == key.key_id
    assert key.key_id.startswith("hmac-sha256:") and len(key.key_id) == len("hmac-sha256:") + 16
    assert secret not in text and secret not in key.key_id and secret not in repr(key)
    assert verify(checkpoint, signing.keyring(None, [path]))["signed_by"] == key.key_id
    # With no key configured nothing changes: the signed manifest verifies as any other, nothing is required.
    assert verify(checkpoint, signing.NO_KEYS)["signed_by"] is None


def test_ed25519_public_key_verifies_and_cannot_sign(tmp_path: Path) -> None:
    private, public = ed25519_keys(tmp_path)
    checkpoint = crafted(tmp_path / "checkpoint_0", signing.load_key(private))
    verifier = signing.load_key(public)
    assert verifier.key_id == signing.load_key(private).key_id and verifier.key_id.startswith("ed25519:")
    assert verify(checkpoint, signing.keyring(None, [public]))["signed_by"] == verifier.key_id
    with pytest.raises(CheckpointConfigurationError, match=r"is an Ed25519 public key: it verifies but cannot sign"):
        signing.keyring(public)


def test_rotation_accepts_every_configured_key_and_refuses_an_unknown_key_id(tmp_path: Path) -> None:
    old, _ = hmac_key(tmp_path / "old.hex")
    new, public = ed25519_keys(tmp_path, "new")
    by_old = crafted(tmp_path / "checkpoint_1", signing.load_key(old))
    by_new = crafted(tmp_path / "checkpoint_2", signing.load_key(new))
    both = signing.keyring(new, [old])  # signing with the new key, still accepting the old one
    assert verify(by_old, both)["signed_by"] == signing.load_key(old).key_id
    assert verify(by_new, both)["signed_by"] == signing.load_key(new).key_id
    old_id = signing.load_key(old).key_id
    with pytest.raises(CheckpointAuthenticationError) as caught:
        verify(by_old, signing.keyring(None, [public]))
    message = str(caught.value)
    assert f"{by_old / MANIFEST} is signed with key '{old_id}', which is not among the configured verification keys" \
        in message and signing.load_key(public).key_id in message


def test_unsigned_and_manifest_less_checkpoints_are_refused_once_keys_are_configured(tmp_path: Path) -> None:
    path, _ = hmac_key(tmp_path / "k.hex")
    keys = signing.keyring(None, [path])
    unsigned = crafted(tmp_path / "checkpoint_0", None)
    assert verify(unsigned, signing.NO_KEYS)["signed_by"] is None  # before keys existed: valid
    with pytest.raises(CheckpointAuthenticationError,
                       match=r"carries no authenticator, but verification keys are configured \(hmac-sha256:[0-9a-f]{16}\)"
                             r".*load it with no verification key configured and save it again under the signing key"):
        verify(unsigned, keys)
    legacy = tmp_path / "checkpoint_1"
    shutil.copytree(unsigned, legacy)
    (legacy / MANIFEST).unlink()  # deleting the manifest is no way around the authenticator
    with signing.using(keys), pytest.raises(CheckpointAuthenticationError, match=r"has no completion manifest, so no "
                                                                                 r"authenticator"):
        check_candidate(legacy, None, legacy=True)
    assert check_candidate(legacy, None, legacy=True) is None  # no keys: a legacy directory, as before


def test_a_file_and_its_hash_rewritten_without_the_key_is_refused(tmp_path: Path) -> None:
    path, _ = hmac_key(tmp_path / "k.hex")
    key = signing.load_key(path)
    checkpoint = crafted(tmp_path / "checkpoint_0", key)
    forge(checkpoint)
    assert verify(checkpoint, signing.NO_KEYS)["hashed"] == 2  # consistent: every hash matches, XXH3 cannot tell
    with pytest.raises(CheckpointAuthenticationError) as caught:
        verify(checkpoint, signing.keyring(None, [path]))
    assert str(caught.value).startswith(f"{checkpoint / MANIFEST}: its authenticator does not match its content under "
                                        f"key {key.key_id}: the manifest was altered")
    assert isinstance(caught.value, CheckpointIntegrityError)  # selection skips it as it skips a damaged one


@pytest.mark.parametrize("kind", ["hmac", "ed25519"])
def test_a_changed_byte_anywhere_in_the_manifest_is_refused_or_changes_nothing(tmp_path: Path, kind: str) -> None:
    """Every byte of a signed manifest replaced in turn: the result is refused (unreadable, or its authenticator
    fails), or it parses to exactly the signed manifest (a whitespace byte: not content)."""
    if kind == "hmac":
        path, _ = hmac_key(tmp_path / "k.hex")
        signer = verifier = path
    else:
        signer, verifier = ed25519_keys(tmp_path)
    keys = signing.keyring(None, [verifier])
    checkpoint = crafted(tmp_path / "checkpoint_0", signing.load_key(signer))
    original = (checkpoint / MANIFEST).read_bytes()
    signed = json.loads(original)
    accepted_changes = 0
    for offset in range(len(original)):
        for replacement in (original[offset] ^ 0x01,):
            (checkpoint / MANIFEST).write_bytes(original[:offset] + bytes([replacement]) + original[offset + 1:])
            try:
                manifest = read_manifest(checkpoint)
                assert manifest is not None
                verify_manifest(checkpoint, manifest, full=False, dcp=False, keys=keys)
            except CheckpointIntegrityError:
                continue
            assert manifest == signed, (offset, replacement)
            accepted_changes += 1
    assert accepted_changes < len(original) // 4  # whitespace only, not the bulk of the file


def test_key_files_hex_raw_and_errors_never_show_the_key(tmp_path: Path) -> None:
    raw = tmp_path / "raw.key"
    raw.write_bytes(b"\xff" + secrets.token_bytes(40))
    hex_path, secret = hmac_key(tmp_path / "k.hex")
    assert signing.load_key(raw).algorithm == "hmac-sha256"
    assert signing.load_key(hex_path).key_id != signing.load_key(raw).key_id
    (tmp_path / "short.hex").write_text(secret[:40])
    (tmp_path / "short.raw").write_bytes(b"\xff" * 10)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    (tmp_path / "rsa.pem").write_bytes(rsa_key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    encrypted = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw"))
    (tmp_path / "encrypted.pem").write_bytes(encrypted)
    cases = {"short.hex": r"holds 40 hex digits: use an even number, at least 64",
             "short.raw": r"holds 10 bytes: an HMAC key needs at least 32",
             "rsa.pem": r"holds a RSAPrivateKey: accelerate-txn signs with Ed25519 keys only",
             "encrypted.pem": r"is an encrypted private key",
             "missing.hex": r"Cannot read the key file .*missing\.hex"}
    for name, expected in cases.items():
        with pytest.raises(CheckpointConfigurationError, match=expected) as caught:
            signing.load_key(tmp_path / name)
        assert str(tmp_path / name) in str(caught.value) and secret[:40] not in str(caught.value)


def test_ed25519_without_cryptography_says_what_to_install(tmp_path: Path) -> None:
    private, _ = ed25519_keys(tmp_path)
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'cryptography' or name.startswith('cryptography.'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from accelerate_txn.core import signing\n"
            "from accelerate_txn.errors import CheckpointConfigurationError\n"
            "try:\n"
            "    signing.load_key(sys.argv[1])\n"
            "except CheckpointConfigurationError as exc:\n"
            "    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", code, str(private)], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert f"The key file {private} holds a PEM (Ed25519) key, which needs the cryptography package: pip install " \
           "'accelerate-txn[signing]'" in result.stdout, result.stderr
    # An HMAC key needs only the standard library, also in such an environment.
    hex_path, _ = hmac_key(tmp_path / "k.hex")
    result = subprocess.run([sys.executable, "-c", code.replace("signing.load_key(sys.argv[1])",
                                                                "print(signing.load_key(sys.argv[1]).key_id)"),
                             str(hex_path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.stdout.startswith("hmac-sha256:"), result.stderr


def test_environment_names_key_files_and_selection_skips_a_forgery(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = hmac_key(tmp_path / "k.hex")
    key = signing.load_key(path)
    run = tmp_path / "run"
    crafted(run / "checkpoint_1", key)
    crafted(run / "checkpoint_2", key)
    forge(run / "checkpoint_2")
    assert latest_checkpoint(run, legacy=False) == str(run / "checkpoint_2")  # no keys: XXH3 alone cannot tell
    other, _ = hmac_key(tmp_path / "other.hex")
    monkeypatch.setenv(signing.VERIFY_KEYS_ENV, f"{other}:{path}")
    assert {k.key_id for k in signing.active_keyring().verifiers} == {key.key_id, signing.load_key(other).key_id}
    assert latest_checkpoint(run, legacy=False) == str(run / "checkpoint_1")
    monkeypatch.setenv(signing.VERIFY_KEYS_ENV, str(tmp_path / "nowhere.hex"))
    with pytest.raises(CheckpointConfigurationError, match=r"Cannot read the key file .*nowhere\.hex"):
        latest_checkpoint(run, legacy=False)


# --- configure_checkpointing and a real save ------------------------------------------------------------------------

def _accelerator() -> Accelerator:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    accelerator.prepare(model, optimizer)
    return accelerator


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """checkpoint_0 and checkpoint_1 saved by a real one-process run under an HMAC signing key (pristine)."""
    root = tmp_path_factory.mktemp("signed")
    path, _ = hmac_key(root / "signing.hex")
    accelerator = configure_checkpointing(_accelerator(), signing_key=path)
    for number in range(2):
        accelerator.step = number
        save_training_checkpoint(accelerator, root / "run" / f"checkpoint_{number}")
    return root / "run", path


def test_configure_checkpointing_signs_every_save_and_validates_key_arguments(signed_run: tuple[Path, Path],
                                                                              tmp_path: Path) -> None:
    run, path = signed_run
    manifest = json.loads((run / "checkpoint_1" / MANIFEST).read_text())
    assert manifest["authenticator"]["key_id"] == signing.load_key(path).key_id
    assert path.read_text().strip() not in (run / "checkpoint_1" / MANIFEST).read_text()
    accelerator = _accelerator()
    with pytest.raises(CheckpointConfigurationError, match=r"takes the path of a key file .* not a bytes"):
        configure_checkpointing(accelerator, signing_key=b"secret")  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigurationError, match=r"takes a list of key file paths"):
        configure_checkpointing(accelerator, verification_keys=str(path))
    with pytest.raises(CheckpointConfigurationError, match=r"Cannot read the key file"):
        configure_checkpointing(accelerator, verification_keys=[tmp_path / "missing"])
    from accelerate_txn.accelerate.config import checkpoint_config

    assert not checkpoint_config(accelerator).keys.required  # nothing changed by the refused calls


# --- the command line -------------------------------------------------------------------------------------------------

def cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


def test_cli_verify_list_latest_with_key(signed_run: tuple[Path, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    source, path = signed_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    forge(run / "checkpoint_1", "optimizer.bin")
    key_id = signing.load_key(path).key_id
    other, _ = hmac_key(tmp_path / "other.hex")

    code, out, _ = cli(capsys, "verify", run / "checkpoint_0", "--key", path)
    assert code == 0 and f"the manifest's authenticator, made with key {key_id}" in out
    code, _, err = cli(capsys, "verify", run / "checkpoint_1", "--key", path)
    assert code == 1 and f"{run / 'checkpoint_1' / MANIFEST}: its authenticator does not match its content under key " \
        f"{key_id}" in err
    code, _, err = cli(capsys, "verify", run / "checkpoint_0", "--key", other)
    assert code == 1 and f"is signed with key '{key_id}', which is not among the configured verification keys" in err
    code, out, _ = cli(capsys, "verify", run / "checkpoint_1")  # no key: the forgery is consistent, as documented
    assert code == 0

    code, out, _ = cli(capsys, "list", run, "--key", path, "--json")
    listing = {entry["name"]: entry for entry in json.loads(out)["checkpoints"]}
    assert code == 0 and json.loads(out)["would_load"] == str(run / "checkpoint_0")
    assert listing["checkpoint_0"]["status"] == "complete" and listing["checkpoint_1"]["status"] != "complete"
    assert "its authenticator does not match its content" in listing["checkpoint_1"]["reason"]

    code, out, _ = cli(capsys, "latest", run, "--key", path)
    assert code == 0 and out.strip() == str(run / "checkpoint_0")
    code, out, _ = cli(capsys, "latest", run)
    assert code == 0 and out.strip() == str(run / "checkpoint_1")
    monkeypatch.setenv(signing.VERIFY_KEYS_ENV, str(path))  # the environment names the key file instead of --key
    code, out, _ = cli(capsys, "latest", run)
    assert code == 0 and out.strip() == str(run / "checkpoint_0")
