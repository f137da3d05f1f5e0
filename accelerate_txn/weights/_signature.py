"""Signing an export in the format OpenSSF's model_signing verifies (``sign_key=`` of every export function).

The signature is a Sigstore bundle (a DSSE envelope over an in-toto statement listing every file of the export with
its SHA-256), made by ``model_signing.signing.Config().use_elliptic_key_signer(...)`` with model_signing's default
hashing (one SHA-256 per file, the signature file and git files ignored), so that ``model_signing verify key OUT
--signature OUT/model.sig --public_key PUB`` and its Python equivalent verify it. It is written into the staged
export before the publish (:func:`._publish.publish_export`): a published export is complete with its signature, or
absent.

Keys: what model_signing's key signer accepts, an ECDSA private key on NIST P-256, P-384 or P-521 in a PEM file,
unencrypted here (like every key file of the library). The key travels only as its path; nothing logs or raises it.
Ed25519 (the checkpoint manifests' key type, :mod:`accelerate_txn.core.signing`) is no model_signing key type.

model_signing names the signed model after the last component of the directory it hashes; the export is staged under
a hidden name, so its files are moved into ``STAGING/.model-signing/NAME/`` (renames within the staging directory)
while they are hashed, and back: the statement names the export as it is published.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointConfigurationError
from ..store.base import require_clients
from ._common import SIGNATURE_NAME, PathLike

logger = logging.getLogger(__name__.rpartition(".")[0])  # "accelerate_txn.weights"

INSTALL = "pip install 'accelerate-txn[model-signing]'"
#: The curves model_signing's key signer accepts (``sign_ec_key._check_supported_ec_key``), by their usual names.
CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
ACCEPTED = ("Accepted: an unencrypted PEM private key for ECDSA on NIST P-256, P-384 or P-521, what OpenSSF "
            "model_signing signs with (openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "
            "signing-key.pem; its public key, for verifiers: openssl pkey -in signing-key.pem -pubout -out "
            "signing-key.pub).")
_MAX_KEY_FILE = 64 * 1024
_HOLDER = ".model-signing"  # inside the staging directory, only while the export is hashed


@dataclass(frozen=True)
class ExportSigner:
    """Signs a staged export with the key in ``source`` (a path: the key itself is held by model_signing's signer,
    shown nowhere, not in ``repr``)."""

    source: str
    _config: Any = field(repr=False, compare=False)  # model_signing.signing.Config, key loaded

    def __call__(self, staging: Path, name: str) -> None:
        """Write ``staging/model.sig``, a signature of every file of ``staging`` under the model name ``name``."""
        holder = staging / _HOLDER
        model = holder / name
        entries = sorted(entry.name for entry in staging.iterdir())
        model.mkdir(parents=True)
        moved: list[str] = []
        try:
            for entry in entries:
                os.rename(staging / entry, model / entry)
                moved.append(entry)
            self._config.sign(model, holder / SIGNATURE_NAME)
        finally:
            for entry in moved:
                os.rename(model / entry, staging / entry)
        os.rename(holder / SIGNATURE_NAME, staging / SIGNATURE_NAME)
        model.rmdir()
        holder.rmdir()
        logger.info("Signed export %s for OpenSSF model_signing with the key in %s (%s)", name, self.source,
                    SIGNATURE_NAME)


def _problem(source: str, data: bytes) -> str | None:
    """Why ``data`` (the file ``source``) is no key model_signing signs with, or ``None`` when it is one."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # encrypted
        return f"The key file {source} holds an encrypted private key: store it unencrypted, readable by you only."
    except (ValueError, UnsupportedAlgorithm):
        try:
            serialization.load_pem_public_key(data)
        except (ValueError, UnsupportedAlgorithm):
            return f"The key file {source} holds no PEM private key."
        return f"The key file {source} holds a public key, which verifies but cannot sign: pass its private key."
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        kind = type(key).__name__.removesuffix("PrivateKey")
        return f"The key file {source} holds a private key of type {kind}, which model_signing cannot sign with."
    if key.curve.name not in CURVES:
        return f"The key file {source} holds an ECDSA key on {key.curve.name}, which model_signing cannot sign with."
    return None


def export_signer(sign_key: PathLike | None) -> ExportSigner | None:
    """The signer of ``sign_key`` (a key file, see the module docstring), or ``None`` for no signing.

    Raises :class:`CheckpointConfigurationError` naming the file and the accepted keys when it cannot be read or holds
    another kind of key, and naming the extra to install when model_signing is not installed: before an export writes
    anything."""
    if sign_key is None:
        return None
    source = os.fspath(sign_key)
    require_clients("model-signing", "signed exports (sign_key=, export --sign-key)")
    try:
        import model_signing.hashing
        import model_signing.signing
    except ImportError as exc:  # model_signing 1.1.1 imports pyOpenSSL (OpenSSL) without declaring it
        raise CheckpointConfigurationError(
            f"Signing an export needs OpenSSF's model_signing ({exc.name or exc} is not installed): {INSTALL}."
        ) from None
    try:
        with open(source, "rb") as stream:
            data = stream.read(_MAX_KEY_FILE + 1)
    except OSError as exc:
        raise CheckpointConfigurationError(
            f"Cannot read the signing key file {source}: {exc.strerror or type(exc).__name__}. {ACCEPTED}"
        ) from None
    problem = (f"The key file {source} is over {_MAX_KEY_FILE} bytes: it is no key file." if len(data) > _MAX_KEY_FILE
               else _problem(source, data))
    if problem is not None:
        raise CheckpointConfigurationError(f"{problem} {ACCEPTED}")
    try:
        config = model_signing.signing.Config().use_elliptic_key_signer(private_key=source)
    except (OSError, ValueError, TypeError) as exc:  # the file changed since it was read
        raise CheckpointConfigurationError(
            f"model_signing could not load the key file {source} ({type(exc).__name__}). {ACCEPTED}"
        ) from None
    # model_signing's default hashing (what `model_signing verify key` recomputes), the signature itself ignored.
    config.set_hashing_config(model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME]))
    return ExportSigner(source, config)
