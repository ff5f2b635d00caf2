"""Membership of a closed run: the run secret, and what is derived from it.

A closed run's workers are all started with the same secret (a file, or an environment
variable; never a command-line argument, never logged). From it and the run id each worker
first derives a master key with scrypt (``KDF``: some 0.1 s and 32 MiB per try, so that a guess at
a human-chosen secret checked against what the run publishes costs as much), then from that, with
HMAC-SHA256:

- a **namespace** for the run's DHT keys: without the secret a peer cannot name them;
- a **record key** (AES-256-GCM) that seals every record's value: a DHT node that stores a
  record without the secret learns nothing from it, and cannot write one that a member accepts;
- a **stream key**: every stream a member opens starts with a proof, an HMAC of the protocol,
  the opener's and the receiver's peer ids (libp2p authenticates both), so a non-member can
  neither contribute, ring a doorbell nor download state, and a member's proof is useless to
  anyone else.

An open run (no secret) has none of this and says so at start: anyone who can reach a worker
can read its records, download its state and join.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import math
import os
import stat

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import SwarmError

log = logging.getLogger(__name__)

SECRET_ENV = "OPENDILOCO_RUN_SECRET"
"""The run secret itself (at least 16 characters)."""
SECRET_FILE_ENV = "OPENDILOCO_RUN_SECRET_FILE"
"""A file holding the run secret (used when ``[swarm] secret_file`` is unset)."""
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
NONCE_BYTES = 12
MIN_SECRET_BITS = 64
"""A secret whose characters carry fewer bits than this (``estimated_bits``) is refused."""
WEAK_SECRET_BITS = 128
"""One whose characters carry fewer than this is used, with a warning (``opendiloco secret`` makes 256)."""
KDF = dict(n=1 << 15, r=8, p=1)
"""scrypt's cost: 32 MiB of memory and about 0.1 s of a core per derivation (``docs/trust.md``)."""
_masters: dict[tuple[bytes, str], bytes] = {}
"""Master keys derived in this process, by (a digest of the secret, run id): one derivation per run."""


def estimated_bits(value: bytes) -> float:
    """An upper estimate of the bits a secret carries: its length times the entropy of its characters'
    frequencies. A random secret scores near its true figure; a phrase or a pattern scores more than it
    carries (so a low score is damning, a high one proves nothing: hence the key derivation)."""
    if not value:
        return 0.0
    counts = collections.Counter(value)
    return -sum(n * math.log2(n / len(value)) for n in counts.values())


def master_key(value: bytes, run_id: str) -> bytes:
    """The key everything of a closed run derives from: scrypt of the secret, salted with the run id."""
    token = (hashlib.sha256(value).digest(), run_id)
    key = _masters.get(token)
    if key is None:
        key = hashlib.scrypt(value, salt=f"opendiloco/run/{run_id}".encode(), dklen=32, maxmem=64 << 20, **KDF)
        _masters[token] = key
    return key


class RunSecret:
    """The secret bytes; its repr never shows them."""

    def __init__(self, value: bytes, source: str):
        if not isinstance(value, bytes):
            raise TypeError("the run secret is bytes")
        value = value.strip()
        if len(value) < MIN_SECRET_BYTES:
            raise SwarmError(f"the run secret from {source} has {len(value)} bytes; at least {MIN_SECRET_BYTES} "
                             "are needed (make one with `opendiloco secret PATH`)")
        if len(value) > MAX_SECRET_BYTES:
            raise SwarmError(f"the run secret from {source} has {len(value)} bytes; at most {MAX_SECRET_BYTES}")
        bits = estimated_bits(value)
        if bits < MIN_SECRET_BITS:
            raise SwarmError(f"the run secret from {source} can be guessed (its characters carry about {bits:.0f} "
                             f"bits; at least {MIN_SECRET_BITS} are needed): make one with `opendiloco secret PATH`")
        if bits < WEAK_SECRET_BITS:
            log.warning("the run secret from %s may be guessable (its characters carry at most about %.0f bits): "
                        "make one with `opendiloco secret PATH`", source, bits)
        self._value, self.source = value, source

    def __repr__(self) -> str:
        return f"RunSecret(from {self.source})"

    def derive(self, label: str, run_id: str) -> bytes:
        return hmac.new(master_key(self._value, run_id), f"opendiloco/{label}/{run_id}".encode(),
                        hashlib.sha256).digest()

    @classmethod
    def from_file(cls, path: str) -> RunSecret:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise SwarmError(f"run secret file {path!r} is not a regular file")
            if st.st_size > MAX_SECRET_BYTES + 2:
                raise SwarmError(f"run secret file {path!r} has {st.st_size} bytes; at most {MAX_SECRET_BYTES}")
            with open(path, "rb") as f:
                value = f.read(MAX_SECRET_BYTES + 2)
        except FileNotFoundError:
            raise SwarmError(f"run secret file {path!r} does not exist") from None
        except PermissionError:
            raise SwarmError(f"run secret file {path!r} cannot be read (permission denied)") from None
        except IsADirectoryError:
            raise SwarmError(f"run secret file {path!r} is a directory") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("run secret file %s can be read by other users of this machine (chmod 600 it)", path)
        return cls(value, f"file {path}")

    @classmethod
    def from_environment(cls, secret_file: str | None = None, environ=None) -> RunSecret | None:
        """The secret from ``$OPENDILOCO_RUN_SECRET``, else ``secret_file``, else
        ``$OPENDILOCO_RUN_SECRET_FILE``; None for an open run."""
        environ = os.environ if environ is None else environ
        value = environ.get(SECRET_ENV)
        if value:
            return cls(value.encode(), f"${SECRET_ENV}")
        path = secret_file or environ.get(SECRET_FILE_ENV)
        return cls.from_file(path) if path else None


def new_secret_file(path: str) -> None:
    """Writes a fresh random secret (256 bits, hex) readable by its owner only; never overwrites."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")


class Membership:
    """What a run's secret gives its workers; ``Membership.open(run_id)`` for a run without one."""

    def __init__(self, run_id: str, secret: RunSecret | None):
        self.run_id, self.closed = run_id, secret is not None
        if secret is None:
            self.namespace = run_id
            self._aead = self._stream_key = None
            self.tag = "open"
        else:
            self.namespace = f"{run_id}.{secret.derive('keys', run_id).hex()[:20]}"
            # Which secret, as a one-way tag: published in plain, so that workers of one run id that hold
            # different secrets can tell one another so (``RunRecords.secret_key``).
            self.tag = secret.derive("tag", run_id).hex()[:16]
            self._aead = AESGCM(secret.derive("records", run_id))
            self._stream_key = secret.derive("streams", run_id)

    @classmethod
    def open(cls, run_id: str) -> Membership:
        return cls(run_id, None)

    def __repr__(self) -> str:
        return f"Membership({self.run_id!r}, {'closed' if self.closed else 'open'})"

    # -- records ---------------------------------------------------------------------------------
    def seal(self, plain: bytes, context: bytes) -> bytes:
        """A record's value as stored: encrypted and authenticated (closed runs), or as it is."""
        if self._aead is None:
            return plain
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plain, context)

    def unseal(self, body: bytes, context: bytes) -> bytes | None:
        """The plain value, or None if a non-member wrote it (or it was moved to another key)."""
        if self._aead is None:
            return body
        if len(body) < NONCE_BYTES + 16:
            return None
        try:
            return self._aead.decrypt(body[:NONCE_BYTES], body[NONCE_BYTES:], context)
        except InvalidTag:
            return None

    # -- streams ---------------------------------------------------------------------------------
    def stream_proof(self, protocol: str, opener: str, receiver: str) -> str:
        """What the opener of a stream shows the receiver ("" in an open run)."""
        if self._stream_key is None:
            return ""
        return hmac.new(self._stream_key, f"{protocol}|{opener}|{receiver}".encode(), hashlib.sha256).hexdigest()

    def admits(self, proof, protocol: str, opener: str, receiver: str) -> bool:
        if self._stream_key is None:
            return True
        return isinstance(proof, str) and hmac.compare_digest(proof, self.stream_proof(protocol, opener, receiver))
