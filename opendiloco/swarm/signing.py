"""Signed DHT records, bound to their writer's peer id.

Plain hivemind records are unsigned and a subkey may name anyone, so a peer could write
"progress of worker X" or "group published by X". Here every record a worker stores is an
envelope ``MAGIC | msgpack([public key, body, signature])``:

- its subkey is the writer's peer id, and that id must be the one the public key derives
  (libp2p's rule: the multihash of the key), the same id that authenticates the writer's streams;
- the signature (the key of the worker's p2p identity: Ed25519, or RSA-PSS for an RSA identity
  file) covers the DHT key id, the subkey, the expiration time and the body, so a record cannot be
  moved, re-dated or edited.

``SignedRecordValidator`` runs inside every DHT node of ours (hivemind calls it on each store):
a node refuses any record that is not such an envelope, so nobody can displace a worker's
record by storing one with a later expiry under its subkey. Readers check again
(``open_envelope``), because the node that answers a read may not be ours.
The body is the membership's (``membership.py``): sealed in a closed run, plain in an open one.
"""

from __future__ import annotations

import collections
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from google.protobuf.message import DecodeError
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.timed_storage import get_dht_time

MAGIC = b"odl1"
MAX_ENVELOPE_BYTES = 16 << 10
"""Records are small (a progress record is under 1 KiB, a group of 200 members some 11 KiB); anything
larger is refused unread, by our DHT nodes on store and by every reader."""
MAX_STORE_TTL = 24 * 3600.0
"""Our DHT nodes refuse a record set to live longer than this from now (readers bound each kind closer)."""
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


def key_id(key: str) -> bytes:
    """The id hivemind stores ``key`` under (what a storage node sees instead of the key)."""
    return DHTID.generate(source=key).to_bytes()


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id of a public key (its libp2p protobuf encoding), base58."""
    if len(public_key) <= 42:  # libp2p: short keys (Ed25519) are inlined, longer ones hashed
        return PeerID(b"\x00" + bytes([len(public_key)]) + public_key).to_base58()
    return PeerID(b"\x12\x20" + hashlib.sha256(public_key).digest()).to_base58()  # multihash: sha2-256


def _load_public(public_key: bytes):
    """The verifying key of a libp2p protobuf public key, or None (another type, a weak RSA key)."""
    proto = crypto_pb2.PublicKey.FromString(public_key)
    if proto.key_type == crypto_pb2.Ed25519 and len(proto.data) == 32:
        return ed25519.Ed25519PublicKey.from_public_bytes(proto.data)
    if proto.key_type == crypto_pb2.RSA and len(proto.data) <= 1024:
        key = serialization.load_der_public_key(proto.data)
        if isinstance(key, rsa.RSAPublicKey) and 2048 <= key.key_size <= 4096:
            return key
    return None


def _verify(key, signature: bytes, data: bytes) -> None:
    if isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(signature, data)
    else:
        key.verify(signature, data, _PSS, hashes.SHA256())


def _signed_part(key_id_bytes: bytes, subkey: str, expiration_time: float, body: bytes) -> bytes:
    return msgpack.packb([key_id_bytes, subkey, float(expiration_time), body], use_bin_type=True)


class Identity:
    """A worker's p2p identity key: its peer id, and the signer of its records."""

    def __init__(self, private_key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey):
        self._key = private_key
        if isinstance(private_key, ed25519.Ed25519PrivateKey):
            raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            proto = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=raw)
        else:
            der = private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)
            proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der)
        self.public_key = proto.SerializeToString()
        self.peer_id = peer_id_of(self.public_key)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"

    @classmethod
    def from_file(cls, path: str) -> Identity:
        """Loads a libp2p identity file: Ed25519 (ours) or RSA (``P2P.generate_identity``'s)."""
        with open(path, "rb") as f:
            try:
                proto = crypto_pb2.PrivateKey.FromString(f.read())
            except DecodeError:
                raise ValueError(f"identity {path!r} is not a libp2p key file") from None
        if proto.key_type == crypto_pb2.Ed25519 and len(proto.data) in (64, 96):
            return cls(ed25519.Ed25519PrivateKey.from_private_bytes(proto.data[:32]))
        if proto.key_type == crypto_pb2.RSA:
            key = serialization.load_der_private_key(proto.data, password=None)
            if isinstance(key, rsa.RSAPrivateKey):
                return cls(key)
        raise ValueError(f"identity {path!r} is neither an Ed25519 nor an RSA key")

    @staticmethod
    def generate(path: str) -> None:
        """Writes a new Ed25519 identity file (libp2p's format; readable by its owner only)."""
        key = ed25519.Ed25519PrivateKey.generate()
        seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        data = crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + public).SerializeToString()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    @classmethod
    def fresh(cls) -> Identity:
        """A new Ed25519 identity that lives in memory only (to sign with; a daemon needs a file)."""
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def temporary(cls) -> tuple[Identity, str]:
        """A fresh identity and a private file holding it (for p2pd to start with; delete it after)."""
        directory = tempfile.mkdtemp(prefix="opendiloco-identity-")
        path = os.path.join(directory, "identity.key")
        cls.generate(path)
        return cls.from_file(path), path

    def sign(self, data: bytes) -> bytes:
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            return self._key.sign(data)
        return self._key.sign(data, _PSS, hashes.SHA256())

    def envelope(self, key: str, subkey: str, expiration_time: float, body: bytes) -> bytes:
        if subkey != self.peer_id:
            raise ValueError("a worker signs records under its own peer id only")
        signature = self.sign(_signed_part(key_id(key), subkey, expiration_time, body))
        return MAGIC + msgpack.packb([self.public_key, body, signature], use_bin_type=True)


class _VerifiedCache:
    """Envelopes already verified (a heartbeat re-reads the same ones): bounded, thread-safe."""

    def __init__(self, size: int = 4096):
        self._seen: collections.OrderedDict = collections.OrderedDict()
        self._size, self._lock = size, threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def get(self, token):
        with self._lock:
            if token in self._seen:
                self._seen.move_to_end(token)
                return self._seen[token]
        return None

    def put(self, token, value) -> None:
        with self._lock:
            self._seen[token] = value
            while len(self._seen) > self._size:
                self._seen.popitem(last=False)


_verified = _VerifiedCache()


def peek_body(raw) -> bytes | None:
    """The body of an envelope, unverified (to check a seal before a signature), or None."""
    if not isinstance(raw, bytes) or len(raw) > MAX_ENVELOPE_BYTES or not raw.startswith(MAGIC):
        return None
    try:
        parts = msgpack.unpackb(raw[len(MAGIC):], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException, UnicodeDecodeError):
        return None
    return parts[1] if isinstance(parts, list) and len(parts) == 3 and isinstance(parts[1], bytes) else None


def open_envelope(key_id_bytes: bytes, subkey, expiration_time: float, raw,
                  check_body: Callable[[bytes], bool] | None = None) -> bytes | None:
    """The body of a valid envelope stored under ``subkey``, or None (unsigned, signed by
    someone else than ``subkey``, edited, moved or re-dated). ``check_body``: a cheap check of the body
    made before the signature's (a closed run's seal): a body that fails it is neither verified nor
    kept in the cache of verified envelopes, so junk from outsiders costs a reader little and evicts
    nothing from that cache."""
    if not isinstance(raw, bytes) or not isinstance(subkey, str) or len(raw) > MAX_ENVELOPE_BYTES \
            or not raw.startswith(MAGIC):
        return None
    token = (key_id_bytes, subkey, float(expiration_time), hashlib.sha256(raw).digest())
    cached = _verified.get(token)
    if cached is not None:
        return cached
    try:
        public_key, body, signature = msgpack.unpackb(raw[len(MAGIC):], raw=False)
        if not all(isinstance(x, bytes) for x in (public_key, body, signature)) or len(public_key) > 1100:
            return None
        if check_body is not None and not check_body(body):
            return None
        if peer_id_of(public_key) != subkey:
            return None
        key = _load_public(public_key)
        if key is None:
            return None
        _verify(key, signature, _signed_part(key_id_bytes, subkey, expiration_time, body))
    except (InvalidSignature, ValueError, TypeError, msgpack.UnpackException, UnicodeDecodeError, DecodeError):
        return None
    _verified.put(token, body)
    return body


class SignedRecordValidator(RecordValidatorBase):
    """Runs in our DHT nodes: a record is stored only if it is an envelope signed by its subkey's peer."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
            raw = msgpack.unpackb(record.value, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException, UnicodeDecodeError):
            return False
        if not record.expiration_time <= get_dht_time() + MAX_STORE_TTL:
            return False
        return open_envelope(record.key, subkey, record.expiration_time, raw) is not None

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value  # signed before it reaches the DHT (the key lives in the worker's process)

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator)
