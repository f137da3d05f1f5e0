"""Authenticated manifests: an HMAC-SHA256 or Ed25519 authenticator over a manifest's canonical bytes.

XXH3-128 rows prove that the files are those the manifest lists; they cannot prove who wrote the manifest (anyone
who can write the directory can rewrite a file and its row together). With a signing key configured, the manifest a
save writes carries an ``authenticator``; with verification keys configured, every check of a manifest
(:func:`check_authenticator`, called by ``core.manifest.check_structure``) refuses one whose authenticator is missing,
wrong, or made with a key that is not configured, before anything else of the checkpoint is trusted.

* ``hmac-sha256``: a shared secret. Whoever can verify can also sign: for one team's own training and resume.
* ``ed25519`` (``pip install 'accelerate-txn[signing]'``, the ``cryptography`` package): the writer holds the
  private key, verifiers only the public key, so a verifier (an evaluation cluster, the CLI) cannot forge.

Key files (the key itself never travels through an argument, an environment variable, a log line, a manifest or an
exception: only its path and its key id do):

* an HMAC key: one line of at least 64 hex digits (``python -c "import secrets; print(secrets.token_hex(32))"``),
  or a file of at least 32 raw random bytes (anything that is not all hex digits);
* an Ed25519 key: a PEM ``PRIVATE KEY`` (PKCS#8, unencrypted; signs and verifies) or ``PUBLIC KEY`` (verifies only).

A key's id is ``hmac-sha256:`` or ``ed25519:`` followed by 16 hex digits of a SHA-256 of the key (of the public key
for Ed25519): what a manifest, a message and the ranks' agreement name. Several verification keys may be configured
at once (rotation: a checkpoint signed by any of them verifies). A signing key is also a verification key.

Environment (read by the library where ``configure_checkpointing`` did not set keys, and by the command line):
:data:`SIGNING_KEY_ENV` names the signing key's file, :data:`VERIFY_KEYS_ENV` a list of verification key files
(separated by ``os.pathsep``). With no key configured nothing changes: no authenticator is written or required.

The canonical bytes are the manifest without its ``authenticator``, as compact key-sorted ASCII JSON, after a
domain prefix: what is verified is exactly the parsed object every reader then uses (whitespace is not content).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointAuthenticationError, CheckpointConfigurationError
from ..store.base import require_clients
from .environment import Variable

SIGNING_KEY_ENV = "ACCELERATE_TXN_SIGNING_KEY_FILE"
VERIFY_KEYS_ENV = "ACCELERATE_TXN_VERIFY_KEYS"
AUTHENTICATOR = "authenticator"  # the manifest key
HMAC_SHA256 = "hmac-sha256"
ED25519 = "ed25519"
ALGORITHMS = (HMAC_SHA256, ED25519)
_DOMAIN = b"accelerate-txn manifest authenticator v1\n"
_ID_PREFIX = b"accelerate-txn key id\0"  # a key id is a hash of the key under its own domain (never the MAC's)
_MIN_HMAC_BYTES = 32
_MAX_KEY_FILE = 64 * 1024
_HEX_KEY = re.compile(rb"[0-9a-fA-F]+")
_PEM = b"-----BEGIN "
_INSTALL = "pip install 'accelerate-txn[signing]' (the cryptography package)"


@dataclass(frozen=True)
class Key:
    """One key read from a file: ``algorithm``, ``key_id`` and where it came from; the secret is held privately and
    shown nowhere (not in ``repr``)."""

    algorithm: str
    key_id: str
    source: str
    can_sign: bool
    _material: Any = field(repr=False, compare=False)  # HMAC: the secret bytes; Ed25519: a cryptography key object

    def sign(self, data: bytes) -> str:
        if not self.can_sign:
            raise CheckpointConfigurationError(
                f"The key {self.key_id} ({self.source}) is an Ed25519 public key: it verifies but cannot sign. Configure "
                "its private key (a PEM PRIVATE KEY file) as the signing key.")
        if self.algorithm == HMAC_SHA256:
            return hmac.new(self._material, data, hashlib.sha256).hexdigest()
        return self._material.sign(data).hex()

    def verify(self, data: bytes, value: str) -> bool:
        if self.algorithm == HMAC_SHA256:
            return hmac.compare_digest(hmac.new(self._material, data, hashlib.sha256).hexdigest(), value)
        from cryptography.exceptions import InvalidSignature

        public = self._material.public_key() if self.can_sign else self._material
        try:
            public.verify(bytes.fromhex(value), data)
        except (InvalidSignature, ValueError):
            return False
        return True


@dataclass(frozen=True)
class Keyring:
    """The signing key (or none) and the verification keys of a writer or reader. ``verifiers`` includes the signing
    key. Empty (the default): nothing is signed and nothing is required."""

    signer: Key | None = None
    verifiers: tuple[Key, ...] = ()

    @property
    def required(self) -> bool:
        """Whether a manifest must carry a valid authenticator."""
        return bool(self.verifiers)

    def key_ids(self) -> dict[str, Any]:
        """What ranks compare (never the keys): the signing key's id and the sorted verification key ids."""
        return {"sign": self.signer.key_id if self.signer else None,
                "verify": sorted({key.key_id for key in self.verifiers})}


NO_KEYS = Keyring()


def load_key(path: str | os.PathLike[str]) -> Key:
    """The key held by the file ``path`` (format: the module docstring); :class:`CheckpointConfigurationError` naming
    the file (never its content) if it cannot be read or holds no key."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as stream:
            data = stream.read(_MAX_KEY_FILE + 1)
    except OSError as exc:
        raise CheckpointConfigurationError(
            f"Cannot read the key file {source}: {exc.strerror or exc}. Check the path (a key file is configured "
            f"by configure_checkpointing(signing_key=..., verification_keys=...), {SIGNING_KEY_ENV}, {VERIFY_KEYS_ENV} "
            "or the command line's --key).") from None
    if len(data) > _MAX_KEY_FILE:
        raise CheckpointConfigurationError(f"The key file {source} is over {_MAX_KEY_FILE} bytes: it is not a key file")
    if data.lstrip().startswith(_PEM):
        return _ed25519_key(data, source)
    stripped = data.strip()
    if stripped and _HEX_KEY.fullmatch(stripped):
        if len(stripped) < 2 * _MIN_HMAC_BYTES or len(stripped) % 2:
            raise CheckpointConfigurationError(
                f"The HMAC key file {source} holds {len(stripped)} hex digits: use an even number, at least "
                f"{2 * _MIN_HMAC_BYTES} ({_MIN_HMAC_BYTES} random bytes), e.g. python -c \"import secrets; "
                "print(secrets.token_hex(32))\" > KEYFILE")
        secret = bytes.fromhex(stripped.decode("ascii"))
    else:
        secret = data
        if len(secret) < _MIN_HMAC_BYTES:
            raise CheckpointConfigurationError(
                f"The HMAC key file {source} holds {len(secret)} bytes: an HMAC key needs at least {_MIN_HMAC_BYTES} "
                "random bytes (or a line of at least 64 hex digits).")
    key_id = f"{HMAC_SHA256}:{hashlib.sha256(_ID_PREFIX + secret).hexdigest()[:16]}"
    return Key(HMAC_SHA256, key_id, source, True, secret)


def _ed25519_key(data: bytes, source: str) -> Key:
    require_clients("signing", f"Ed25519 keys (the key file {source})")
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise CheckpointConfigurationError(
            f"The key file {source} holds a PEM (Ed25519) key, which needs the cryptography package: {_INSTALL}. "
            "Or use an HMAC key (a hex line) instead.") from None
    private = b"PRIVATE KEY" in data
    try:
        material: Any = (serialization.load_pem_private_key(data, password=None) if private
                         else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as exc:  # TypeError: an encrypted private key
        reason = "an encrypted private key (store it unencrypted, readable by the training user only)" \
            if isinstance(exc, TypeError) else "not a readable PEM key"
        raise CheckpointConfigurationError(f"The key file {source} is {reason}.") from None
    if not isinstance(material, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        raise CheckpointConfigurationError(
            f"The key file {source} holds a {type(material).__name__}: accelerate-txn signs with Ed25519 keys only "
            "(openssl genpkey -algorithm ed25519 -out signing.pem; openssl pkey -in signing.pem -pubout -out "
            "verify.pem).")
    public = material.public_key() if private else material
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return Key(ED25519, f"{ED25519}:{hashlib.sha256(raw).hexdigest()[:16]}", source, private, material)


def keyring(signing_key: str | os.PathLike[str] | None = None,
            verification_keys: Iterable[str | os.PathLike[str]] = ()) -> Keyring:
    """The keyring of a signing key file (or none) and verification key files (the signing key verifies too)."""
    signer = load_key(signing_key) if signing_key else None
    if signer is not None and not signer.can_sign:
        signer.sign(b"")  # raises: a public key cannot sign
    verifiers = {key.key_id: key for key in (load_key(path) for path in verification_keys)}
    if signer is not None:
        verifiers.setdefault(signer.key_id, signer)
    return Keyring(signer, tuple(verifiers[key_id] for key_id in sorted(verifiers)))


def _paths(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(os.pathsep) if part.strip()]


# Any value names files (read, and refused by name if they hold no key, by ``load_key``).
SIGNING_KEY = Variable(SIGNING_KEY_ENV, str, None, "use the path of a key file")
VERIFY_KEYS = Variable(VERIFY_KEYS_ENV, _paths, [], f"use key file paths separated by {os.pathsep!r}")


def environment_paths() -> tuple[str | None, list[str]]:
    """The key files the environment names: :data:`SIGNING_KEY_ENV` and the list in :data:`VERIFY_KEYS_ENV`."""
    return SIGNING_KEY.read(), list(VERIFY_KEYS.read())


def environment_keyring() -> Keyring:
    """The keyring the environment configures (:data:`SIGNING_KEY_ENV`, :data:`VERIFY_KEYS_ENV`); empty when neither
    is set. Read at each call (key files are small)."""
    signing, verify = environment_paths()
    return keyring(signing, verify) if signing or verify else NO_KEYS


_ACTIVE: contextvars.ContextVar[Keyring | None] = contextvars.ContextVar("accelerate_txn_keyring", default=None)


@contextlib.contextmanager
def using(keys: Keyring) -> Iterator[None]:
    """Within the block (this thread), checks that are not handed a keyring use ``keys`` instead of the
    environment's (the command line's ``--key``)."""
    token = _ACTIVE.set(keys)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_keyring() -> Keyring:
    """The keyring of :func:`using` if one is in effect, else :func:`environment_keyring`."""
    keys = _ACTIVE.get()
    return environment_keyring() if keys is None else keys


def check_legacy(where: str | Path, keys: Keyring | None = None) -> None:
    """Raise :class:`CheckpointAuthenticationError` if verification keys are configured (``keys``; default
    :func:`active_keyring`): a manifest-less (legacy) checkpoint at ``where`` carries nothing to authenticate, and
    deleting a manifest must not be a way around its authenticator."""
    keys = active_keyring() if keys is None else keys
    if keys.required:
        raise CheckpointAuthenticationError(
            f"{where} has no completion manifest, so no authenticator, and verification keys are configured "
            f"({', '.join(key.key_id for key in keys.verifiers)}): a manifest-less checkpoint is refused. To accept "
            "it, load it with no verification key configured and save it again under the signing key.")


def canonical_bytes(manifest: dict[str, Any]) -> bytes:
    """What an authenticator covers: the manifest without its ``authenticator``, compact key-sorted ASCII JSON, after
    a domain prefix. Raises ``ValueError`` for a value JSON cannot hold exactly (NaN)."""
    body = {key: value for key, value in manifest.items() if key != AUTHENTICATOR}
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                allow_nan=False).encode("ascii")


def signed(manifest: dict[str, Any], signer: Key) -> dict[str, Any]:
    """A copy of ``manifest`` carrying ``signer``'s authenticator over its canonical bytes."""
    body = {key: value for key, value in manifest.items() if key != AUTHENTICATOR}
    body[AUTHENTICATOR] = {"algorithm": signer.algorithm, "key_id": signer.key_id,
                           "value": signer.sign(canonical_bytes(body))}
    return body


def check_authenticator(manifest: dict[str, Any], where: str | Path, keys: Keyring | None = None) -> str | None:
    """Raise :class:`CheckpointAuthenticationError` unless ``manifest`` (read from ``where``) carries a valid
    authenticator made with one of ``keys``' verification keys (default: :func:`active_keyring`). With no
    verification key configured, nothing is required: returns ``None``; else the key id that verified it."""
    keys = active_keyring() if keys is None else keys
    if not keys.required:
        return None
    configured = ", ".join(key.key_id for key in keys.verifiers)
    value = manifest.get(AUTHENTICATOR)
    if value is None:
        raise CheckpointAuthenticationError(
            f"{where} carries no authenticator, but verification keys are configured ({configured}): it was saved "
            "before signing was configured, or by a writer without a signing key (or its authenticator was removed). "
            "To accept it, load it with no verification key configured and save it again under the signing key.")
    if not (isinstance(value, dict) and value.get("algorithm") in ALGORITHMS and isinstance(value.get("key_id"), str)
            and isinstance(value.get("value"), str) and len(value["key_id"]) <= 80 and len(value["value"]) <= 256):
        raise CheckpointAuthenticationError(f"{where} has a malformed authenticator: the manifest was altered.")
    key_id = value["key_id"]
    key = next((k for k in keys.verifiers if k.key_id == key_id), None)
    if key is None:
        raise CheckpointAuthenticationError(
            f"{where} is signed with key {key_id!r}, which is not among the configured verification keys "
            f"({configured}). If that key is yours, add its file to the verification keys (configure_checkpointing("
            f"verification_keys=...), {VERIFY_KEYS_ENV}, or --key); otherwise do not load this checkpoint.")
    try:
        data = canonical_bytes(manifest)
    except ValueError:
        data = b""
    if key.algorithm != value["algorithm"] or not data or not key.verify(data, value["value"]):
        raise CheckpointAuthenticationError(
            f"{where}: its authenticator does not match its content under key {key_id}: the manifest was altered "
            "after it was signed (or written by someone without the key). Do not load it; restore an intact copy.")
    return key_id
