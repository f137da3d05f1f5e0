"""An installed optional client older than accelerate-txn's floor is named with the release required, by its user at
first use and by ``doctor`` (issue 43 item 4): an s3fs too old for the S3 store's calls failed with
``AttributeError: 'S3FileSystem' object has no attribute 'call_s3'`` inside a ``CheckpointRankError``.

Nothing is installed: each old client is a real distribution's metadata (``NAME-VERSION.dist-info/METADATA``) in a
directory ahead of the environment on ``sys.path`` of a fresh interpreter, which ``importlib.metadata`` finds first,
while the import still finds the real package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelerate_txn.store.base import CLIENT_FLOORS, installed_version, older_than, require_clients

REPO = Path(__file__).resolve().parents[2]
#: The old releases the fake metadata announces.
OLD = {"s3fs": "2021.4.0", "azure-storage-blob": "12.0.0", "google-cloud-storage": "1.44.0", "cryptography": "41.0.0",
       "model-signing": "0.2.0"}


@pytest.fixture(scope="module")
def old_clients(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("old-clients")
    for name, version in OLD.items():
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def _run(old_clients: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old_clients), str(REPO)])}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _message(name: str, user: str, extra: str) -> str:
    floor = next(floors[name] for floors in CLIENT_FLOORS.values() if name in floors)
    return (f"{name} {OLD[name]} is older than {floor}, required by {user}: pip install 'accelerate-txn[{extra}]' "
            f"(or pip install -U '{name}>={floor}')")


def test_the_installed_clients_meet_their_floors() -> None:
    for extra, floors in CLIENT_FLOORS.items():
        require_clients(extra, "this test")  # raises for any installed client below its floor
        assert any(installed_version(name) is not None for name in floors), extra  # the test extra installs each
    assert older_than("2021.4.0", "2024.12.0") and not older_than("2024.12.0", "2024.12.0")
    assert not older_than("2026.9.0", "2024.12.0") and older_than("50.0.2rc1", "50.0.2")
    assert not older_than("not a version", "1.0")  # unreadable: the client's import and calls decide


def test_the_metadata_ahead_on_the_path_is_what_the_check_reads(old_clients: Path) -> None:
    result = _run(old_clients, "-c", "import json, s3fs; from accelerate_txn.store.base import installed_version; "
                  "print(json.dumps([installed_version('s3fs'), s3fs.__version__]))")
    fake, real = json.loads(result.stdout)
    assert fake == OLD["s3fs"] and real != fake  # the real s3fs still imports: only its metadata is old


@pytest.mark.parametrize("url, name, user, extra", [
    ("s3://bucket/run", "s3fs", "the S3 store (s3:// URLs)", "s3"),
    ("az://container/run", "azure-storage-blob", "the Azure Blob Storage store (az:// URLs)", "azure"),
    ("gs://bucket/run", "google-cloud-storage", "the Google Cloud Storage store (gs:// URLs)", "gcs"),
])
def test_a_store_names_its_too_old_client_at_first_use(old_clients: Path, url: str, name: str, user: str,
                                                       extra: str) -> None:
    result = _run(old_clients, "-m", "accelerate_txn", "list", url)
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"accelerate-txn: {_message(name, user, extra)}\n"


def test_an_ed25519_key_names_a_too_old_cryptography(old_clients: Path, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = tmp_path / "verify.pem"
    key.write_bytes(ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    (tmp_path / "run").mkdir()
    result = _run(old_clients, "-m", "accelerate_txn", "list", "--key", str(key), str(tmp_path / "run"))
    # A --key file this installation cannot use is a bad option value (exit 2), named with the fix.
    assert result.returncode == 2, result.stderr
    assert (f"Error: Invalid value for '--key': "
            f"{_message('cryptography', f'Ed25519 keys (the key file {key})', 'signing')}") in result.stderr


def test_a_signed_export_names_a_too_old_model_signing(old_clients: Path, tmp_path: Path) -> None:
    result = _run(old_clients, "-c", "from accelerate_txn.weights import _signature\n"
                  f"_signature.export_signer({str(tmp_path / 'signing.pem')!r})")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "accelerate_txn.errors.CheckpointConfigurationError: " + _message(
        "model-signing", "signed exports (sign_key=, export --sign-key)", "model-signing")


def test_doctor_lists_each_client_as_too_old_with_the_release_required(old_clients: Path) -> None:
    result = _run(old_clients, "-m", "accelerate_txn", "doctor", "--json")
    report = json.loads(result.stdout)
    features = {**report["stores"], **report["signing"]}
    assert {name: feature["status"] for name, feature in features.items()} == {
        "local": "ok", "s3": "too old", "az": "too old", "gs": "too old", "hmac": "ok", "ed25519": "too old",
        "exported-weights": "too old"}
    assert features["s3"]["too_old"] == ["s3fs"] and features["s3"]["packages"]["s3fs"] == OLD["s3fs"]
    assert features["s3"]["required"] == CLIENT_FLOORS["s3"] and features["s3"]["available"] is False
    assert features["s3"]["install"] == "pip install 'accelerate-txn[s3]'"
    assert features["ed25519"]["too_old"] == ["cryptography"]
    # The paths' protection does not depend on the clients.
    assert result.returncode == 0 and report["protected"] is True

    text = _run(old_clients, "-m", "accelerate_txn", "doctor").stdout.splitlines()
    assert (f"  s3     too old: S3 and S3-compatible object storage (s3://) needs s3fs>=2024.12.0 ({OLD['s3fs']} "
            "installed): pip install 'accelerate-txn[s3]'") in text
