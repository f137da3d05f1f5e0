"""A signed export (``sign_key=``, ``accelerate-txn export --sign-key``) is verified by OpenSSF's model_signing itself.

Real keys (generated with cryptography here), real exports of a small ``torch.distributed.checkpoint`` directory,
verified by model_signing's Python API (``verifying.Config().use_elliptic_key_verifier``) and by its command line
(``python -m model_signing verify key``, a subprocess), which refuse the export once a weight file changes by one
byte, a file is added or a file is removed. The signature is published with the export (never left from an earlier
one), and a key model_signing cannot sign with is refused, naming the file and the keys it accepts, before anything is
written.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from accelerate_txn.errors import CheckpointConfigurationError
from accelerate_txn.weights import (
    export_dcp_to_diffusers,
    export_dcp_to_peft,
    export_dcp_to_transformers,
    save_diffusers_state_dict,
)

SIGNATURE = "model.sig"
ACCEPTED = "P-256, P-384 or P-521"
ADAPTER_CONFIG = {"peft_type": "LORA", "bias": "none", "r": 2, "lora_alpha": 4, "target_modules": ["layer"]}


def _pem_private(key: Any, password: bytes | None = None) -> bytes:
    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _pem_public(key: Any) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Key files: ``p256``/``p384`` private keys with their ``.pub`` public keys, another P-256 public key, and keys
    model_signing cannot sign with."""
    root = tmp_path_factory.mktemp("keys")
    files: dict[str, bytes] = {}
    for name, curve in (("p256", ec.SECP256R1()), ("p384", ec.SECP384R1())):
        key = ec.generate_private_key(curve)
        files[name], files[f"{name}.pub"] = _pem_private(key), _pem_public(key)
    files["other.pub"] = _pem_public(ec.generate_private_key(ec.SECP256R1()))
    p256 = serialization.load_pem_private_key(files["p256"], password=None)
    files["encrypted"] = _pem_private(p256, b"secret passphrase")
    files["ed25519"] = _pem_private(ed25519.Ed25519PrivateKey.generate())
    files["rsa"] = _pem_private(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    files["secp256k1"] = _pem_private(ec.generate_private_key(ec.SECP256K1()))
    files["hmac"] = b"00" * 32 + b"\n"  # the library's own HMAC key format: no model_signing key
    paths = {}
    for name, data in files.items():
        paths[name] = root / (name if name.endswith(".pub") else f"{name}.pem")
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model checkpoint (``dcp/``, with transformers and Diffusers configs) and a PEFT adapter's (``adapter/``)."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("checkpoint")
    generator = torch.Generator().manual_seed(0)
    model = {"layer.weight": torch.randn(64, 32, generator=generator), "layer.bias": torch.randn(64, generator=generator),
             "head.weight": torch.randn(16, 64, generator=generator)}
    adapter = {"base_model.model.layer.lora_A.weight": torch.randn(2, 32, generator=generator),
               "base_model.model.layer.lora_B.weight": torch.randn(64, 2, generator=generator)}
    for name, state in (("dcp", model), ("adapter", adapter)):
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(root / name)), no_dist=True)
    (root / "config.json").write_text(json.dumps({"model_type": "tiny", "hidden_size": 32}))
    (root / "diffusers.json").write_text(json.dumps({"_class_name": "Tiny", "width": 32}))
    (root / "adapter_config.json").write_text(json.dumps(ADAPTER_CONFIG))
    return root


class Model:
    """What save_diffusers_state_dict needs of a model: save_config."""

    def save_config(self, directory: str) -> None:
        (Path(directory) / "config.json").write_text(json.dumps({"_class_name": "Tiny"}))


def _verify(export: Path, public_key: Path) -> None:
    """model_signing's Python API: raises unless ``export/model.sig`` verifies ``export`` under ``public_key``."""
    from model_signing import verifying

    verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(export, export / SIGNATURE)


def _verify_cli(export: Path, public_key: Path) -> subprocess.CompletedProcess[str]:
    """model_signing's command line, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(export), "--signature",
                           str(export / SIGNATURE), "--public_key", str(public_key)],
                          capture_output=True, text=True, timeout=120)


def _statement(export: Path) -> dict[str, Any]:
    """The in-toto statement the signature's DSSE envelope carries."""
    bundle = json.loads((export / SIGNATURE).read_text())
    return json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))


def _tampered(export: Path, tmp_path: Path) -> dict[str, Path]:
    """Copies of ``export``: a weight file changed by one byte, a file added, a file removed."""
    copies = {change: tmp_path / change / export.name for change in ("byte", "added", "removed")}
    for copy in copies.values():
        shutil.copytree(export, copy)
    weights = sorted(copies["byte"].glob("*.safetensors"))[-1]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # a tensor byte (the payload follows the header)
    weights.write_bytes(bytes(data))
    (copies["added"] / "extra.safetensors").write_bytes(b"not signed")
    (copies["removed"] / "config.json").unlink()
    return copies


def test_a_signed_cli_export_verifies_with_model_signing_and_any_change_is_refused(
        cli: Any, source: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    export = tmp_path / "tiny-model"
    result = cli("export", source / "dcp", source / "config.json", export, "--sign-key", keys["p256"], "--json")
    assert result.code == 0, result.err
    assert result.json()["files"] == ["config.json", "model.safetensors", SIGNATURE]
    assert result.json()["signature"] == str(export / SIGNATURE)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".accelerate-txn.lock", "tiny-model"]  # no staging left
    _verify(export, keys["p256.pub"])
    verified = _verify_cli(export, keys["p256.pub"])
    assert verified.returncode == 0 and "Verification succeeded" in verified.stdout, verified.stdout + verified.stderr
    statement = _statement(export)  # names the export as published, lists every file but the signature
    assert statement["subject"][0]["name"] == "tiny-model"
    assert sorted(r["name"] for r in statement["predicate"]["resources"]) == ["config.json", "model.safetensors"]
    assert keys["p256"].read_bytes().decode() not in result.out + result.err  # never shown

    with pytest.raises(ValueError, match="Key mismatch"):
        _verify(export, keys["other.pub"])  # another key's public half
    for change, copy in _tampered(export, tmp_path).items():
        with pytest.raises(ValueError, match="Signature mismatch"):
            _verify(copy, keys["p256.pub"])
        refused = _verify_cli(copy, keys["p256.pub"])
        assert refused.returncode == 1 and "Verification failed" in refused.stderr, (change, refused.stdout)


@pytest.mark.parametrize("layout", ["diffusers", "peft", "state_dict"])
def test_every_export_function_signs_what_model_signing_verifies(
        source: Path, keys: dict[str, Path], tmp_path: Path, layout: str) -> None:
    out = tmp_path / "out"
    if layout == "diffusers":  # sharded: several weight files and the index, each signed
        export_dcp_to_diffusers(source / "dcp", source / "diffusers.json", out, 8192, sign_key=keys["p384"])
        index = "diffusion_pytorch_model.safetensors.index.json"
        shards = set(json.loads((out / index).read_text())["weight_map"].values())
        assert len(shards) == 2
        expected = {"config.json", index, *shards}
    elif layout == "peft":
        export_dcp_to_peft(source / "adapter", source / "adapter_config.json", out, sign_key=keys["p384"])
        expected = {"adapter_config.json", "adapter_model.safetensors"}
    else:
        save_diffusers_state_dict({"w": torch.ones(3, 2)}, Model(), out, sign_key=str(keys["p384"]))
        expected = {"config.json", "diffusion_pytorch_model.safetensors.index.json",
                    "diffusion_pytorch_model-00001-of-00001.safetensors"}
    assert {p.name for p in out.iterdir()} == expected | {SIGNATURE}
    assert {r["name"] for r in _statement(out)["predicate"]["resources"]} == expected
    _verify(out, keys["p384.pub"])
    with pytest.raises(ValueError, match="Key mismatch"):
        _verify(out, keys["p256.pub"])


def test_a_re_export_replaces_the_signature_with_the_export(cli: Any, source: Path, keys: dict[str, Path],
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_dcp_to_transformers(source / "dcp", source / "config.json", out, sign_key=keys["p256"])
    # Unsigned over signed: the earlier signature goes with the earlier export (it would not verify the new one).
    export_dcp_to_transformers(source / "dcp", source / "config.json", out, 8192)
    assert SIGNATURE not in {p.name for p in out.iterdir()} and (out / "model.safetensors.index.json").is_file()
    # Signed over unsigned, then over signed (a signature is an export file a re-export may replace).
    export_dcp_to_transformers(source / "dcp", source / "config.json", out, sign_key=keys["p256"])
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", SIGNATURE}
    _verify(out, keys["p256.pub"])
    result = cli("export", source / "dcp", source / "config.json", out, "--sign-key", keys["p384"])
    assert result.code == 0 and {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", SIGNATURE}
    assert f"signed with {keys['p384']}: {out / SIGNATURE}; verify with: model_signing verify key {out} " \
           f"--signature {out / SIGNATURE} --public_key PUBLIC_KEY" in result.out
    _verify(out, keys["p384.pub"])


@pytest.mark.parametrize(("key", "reason"), [
    ("missing", "Cannot read the signing key file"),
    ("public", "holds a public key, which verifies but cannot sign"),
    ("encrypted", "holds an encrypted private key"),
    ("ed25519", "holds a private key of type Ed25519, which model_signing cannot sign with"),
    ("rsa", "holds a private key of type RSA, which model_signing cannot sign with"),
    ("secp256k1", "holds an ECDSA key on secp256k1, which model_signing cannot sign with"),
    ("hmac", "holds no PEM private key"),
])
def test_a_key_model_signing_cannot_sign_with_is_refused_before_anything_is_written(
        cli: Any, source: Path, keys: dict[str, Path], tmp_path: Path, key: str, reason: str) -> None:
    path = {"missing": tmp_path / "no-such-key.pem", "public": keys["p256.pub"]}.get(key) or keys[key]
    out = tmp_path / "out"
    state = {"w": torch.ones(2)}
    with pytest.raises(CheckpointConfigurationError) as raised:
        save_diffusers_state_dict(state, Model(), out, sign_key=path)
    message = str(raised.value)
    assert f"key file {path}" in message and reason in message and ACCEPTED in message
    assert "ec_paramgen_curve:P-256" in message  # how to make one
    if path.exists():  # no key material (the PEM armour lines name only the kind of key)
        assert not [line for line in path.read_text().splitlines() if line.strip("-") == line and line in message]
    assert list(state) == ["w"] and not out.exists()  # the state dict untouched, nothing written

    result = cli("export", source / "dcp", source / "config.json", out, "--sign-key", path)
    assert result.code == 1 and reason in result.err and ACCEPTED in result.err
    assert not out.exists()


def test_without_model_signing_the_error_names_the_extra(source: Path, keys: dict[str, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "model_signing", None)  # as if not installed: `import model_signing` fails
    with pytest.raises(CheckpointConfigurationError, match=r"pip install 'accelerate-txn\[model-signing\]'"):
        export_dcp_to_transformers(source / "dcp", source / "config.json", tmp_path / "out", sign_key=keys["p256"])
    assert not (tmp_path / "out").exists()


def test_the_exports_import_model_signing_only_to_sign() -> None:
    code = ("import sys, accelerate_txn.weights, accelerate_txn.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('model_signing', 'sigstore', 'OpenSSL')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
