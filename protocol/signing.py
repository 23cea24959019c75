"""Signed device messages: Ed25519 signatures carried in MQTT 5 user properties.

Every ``update`` chunk and every ``stats`` message a device publishes carries four
user properties:

- ``fm-round``: the round number,
- ``fm-upload``: the upload id (the update's transfer id; for ``stats`` the transfer
  id of the update it references),
- ``fm-sha``: the sha256 the signature covers (for ``update`` chunks the whole blob's
  sha256 from the chunk header; for ``stats`` the sha256 of the JSON payload),
- ``fm-sig``: base64 Ed25519 signature of
  ``fedmoe/v1|{kind}|{device id}|{round}|{upload id}|{sha256}``.

The aggregator holds each device's public key (``fedmoe provision`` writes them) and
checks the signature, that its fields agree with the message (chunk header, stats
payload), and that the topic's device id is the key's owner. A message whose
(device, kind, round, upload id) was already seen with another sha256 is a replay and
is rejected; an exact repeat (a QoS 1 redelivery) is a harmless duplicate
(:class:`ReplayGuard`). Rounds bind signatures in time: a signature from round r never
validates a message of another round.

Keys are raw 32-byte Ed25519 keys, base64 in JSON files (see :mod:`fedmoe.provision`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

CONTEXT = "fedmoe/v1"
P_ROUND, P_UPLOAD, P_SHA, P_SIG = "fm-round", "fm-upload", "fm-sha", "fm-sig"
SIGNED_KINDS = ("update", "stats")


def unsigned_reason(kind: str, props: Mapping[str, str] | None) -> str | None:
    """Why a ``kind`` message (one of :data:`SIGNED_KINDS`) with MQTT user properties
    ``props`` is unsigned (the signature properties it lacks), or None if it carries all
    of them."""
    missing = [p for p in (P_ROUND, P_UPLOAD, P_SHA, P_SIG) if p not in (props or {})]
    return f"unsigned {kind} message (missing {', '.join(missing)})" if missing else None


class SignatureError(ValueError):
    """A message is unsigned, its signature is forged or stale, or it is a replay."""


def signed_bytes(kind: str, device_id: str, round: int, upload_id: str, sha256: str) -> bytes:
    """The exact bytes a device signs for one message."""
    return f"{CONTEXT}|{kind}|{device_id}|{int(round)}|{upload_id}|{sha256}".encode()


def generate_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 signing key."""
    return Ed25519PrivateKey.generate()


def private_key_b64(key: Ed25519PrivateKey) -> str:
    """Base64 of the raw 32-byte private key."""
    from cryptography.hazmat.primitives import serialization as s

    raw = key.private_bytes(s.Encoding.Raw, s.PrivateFormat.Raw, s.NoEncryption())
    return base64.b64encode(raw).decode()


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """Base64 of the raw 32-byte public key."""
    from cryptography.hazmat.primitives import serialization as s

    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(pub.public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)).decode()


def _raw32(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(f"{what} is not base64") from None
    if len(raw) != 32:
        raise ValueError(f"{what} must be 32 bytes, got {len(raw)}")
    return raw


def load_private_key(text: str) -> Ed25519PrivateKey:
    """Inverse of :func:`private_key_b64`. Raises ValueError."""
    return Ed25519PrivateKey.from_private_bytes(_raw32(text, "signing key"))


def load_public_key(text: str) -> Ed25519PublicKey:
    """Inverse of :func:`public_key_b64`. Raises ValueError."""
    return Ed25519PublicKey.from_public_bytes(_raw32(text, "public key"))


@dataclass
class Signer:
    """A device's signing side."""

    device_id: str
    key: Ed25519PrivateKey

    def properties(self, kind: str, round: int, upload_id: str, sha256: str) -> dict[str, str]:
        """User properties to attach to a message of ``kind`` (``update`` or ``stats``)."""
        sig = self.key.sign(signed_bytes(kind, self.device_id, round, upload_id, sha256))
        return {P_ROUND: str(int(round)), P_UPLOAD: upload_id, P_SHA: sha256,
                P_SIG: base64.b64encode(sig).decode()}

    def stats_properties(self, round: int, upload_id: str, payload: bytes) -> dict[str, str]:
        """Properties for a ``stats`` message (signs the payload's sha256)."""
        return self.properties("stats", round, upload_id, hashlib.sha256(payload).hexdigest())


@dataclass(frozen=True)
class Signed:
    """The verified signed fields of one message."""

    round: int
    upload_id: str
    sha256: str


class Verifier:
    """The aggregator's side: device public keys and signature checks.

    Args:
        keys: device id -> base64 raw Ed25519 public key.

    Raises:
        ValueError: a key is malformed.
    """

    VERIFIED_KEPT = 4096
    """Signatures that verified, kept to skip checking the same one again: every chunk of an
    upload carries its update's one signature (0.08 ms per Ed25519 check, five chunks a MiB)."""

    def __init__(self, keys: Mapping[str, str]):
        self.keys = {d: load_public_key(k) for d, k in keys.items()}
        self._verified: OrderedDict[tuple, tuple[Ed25519PublicKey, Signed]] = OrderedDict()

    def knows(self, device_id: str) -> bool:
        """Whether ``device_id`` is provisioned (has a public key here)."""
        return device_id in self.keys

    def verify(self, kind: str, device_id: str, props: Mapping[str, str]) -> Signed:
        """Check the signature of a message of ``kind`` published on ``device_id``'s topic.

        Returns:
            The signed fields; the caller checks they agree with the message itself.

        Raises:
            SignatureError: unknown device, missing or malformed properties, or a
                signature that does not verify with the device's key.
        """
        pub = self.keys.get(device_id)
        if pub is None:
            raise SignatureError(f"no signing key provisioned for device {device_id!r}")
        unsigned = unsigned_reason(kind, props)
        if unsigned:
            raise SignatureError(unsigned)
        try:
            rnd = int(props[P_ROUND])
            sig = base64.b64decode(props[P_SIG], validate=True)
        except (ValueError, binascii.Error):
            raise SignatureError(f"malformed signature properties on {kind} message") from None
        upload, sha = props[P_UPLOAD], props[P_SHA]
        if len(upload) > 64 or len(sha) != 64 or len(sig) != 64:
            raise SignatureError(f"malformed signature properties on {kind} message")
        key = (kind, device_id, rnd, upload, sha, sig)
        seen = self._verified.get(key)
        if seen is not None and seen[0] is pub:  # verified already, with this key object (a new key: anew)
            return seen[1]
        try:
            pub.verify(sig, signed_bytes(kind, device_id, rnd, upload, sha))
        except InvalidSignature:
            raise SignatureError(f"forged {kind} message: signature does not verify with {device_id}'s key") from None
        signed = Signed(rnd, upload, sha)
        self._verified[key] = (pub, signed)
        while len(self._verified) > self.VERIFIED_KEPT:
            self._verified.popitem(last=False)
        return signed


class ReplayGuard:
    """Remembers signed (device, kind, round, upload id) -> sha256, to catch replays.

    Args:
        max_entries: bound on remembered entries (oldest forgotten first).
    """

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str, int, str], str] = OrderedDict()

    def check(self, device_id: str, kind: str, signed: Signed) -> bool:
        """Record a verified message.

        Returns:
            True if new, False if an exact duplicate (same sha256) was seen before.

        Raises:
            SignatureError: the same (device, kind, round, upload id) came with another
                sha256 (a replayed signature on different content).
        """
        key = (device_id, kind, signed.round, signed.upload_id)
        prev = self._seen.get(key)
        if prev is not None:
            if prev != signed.sha256:
                raise SignatureError(f"replayed {kind} signature (round {signed.round}, upload {signed.upload_id})")
            return False
        self._seen[key] = signed.sha256
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return True

    def prune(self, before_round: int) -> None:
        """Forget entries of rounds before ``before_round`` (they are stale anyway)."""
        for key in [k for k in self._seen if k[2] < before_round]:
            del self._seen[key]

    def __len__(self) -> int:
        return len(self._seen)
