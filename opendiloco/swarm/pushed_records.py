"""Matchmaking records that workers push to each other over p2p streams, beside the DHT.

A round's announcements and its leader's group are DHT records (``records.py``). Reading one back
from the DHT costs about two round trips (a new stream, then the request), and a round used to read
several in turn: at a 200 ms round trip, matchmaking cost some 12 round trips. So a worker that
stores an announcement or a group also pushes the very same signed record to the peers that need
it, and keeps what it receives here; the matchmaker reads this view first and the DHT now and then
(a push can be lost, a worker of an older version pushes nothing).

A pushed record is worth exactly what the same record read from the DHT is worth: its signature
binds it to its writer's peer id, key and expiration, and in a closed run it is sealed. It is
checked the same way before it is kept (``RunRecords.accept_pushed``), so relaying a record (a
leader passes its members' announcements along with its group) gives the relayer no power. What
a push may carry and what this view keeps are bounded.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass

import msgpack

MAX_PUSH_RECORDS = 64
"""Records in one push (a group and its members' announcements)."""
MAX_PUSH_BYTES = 256 << 10
"""Bytes of one push's payload."""
MAX_KEY_CHARS = 256
MAX_KEYS = 128
"""Keys this view holds; the least recently used is forgotten first (a round reads its keys every poll)."""
MAX_SUBKEYS = 512
"""Writers kept per key: a record from a further writer is dropped (the DHT still holds it)."""


@dataclass(frozen=True)
class PushedRecord:
    """A signed record as it travels: DHT key, subkey (its writer's peer id), expiration, envelope."""

    key: str
    subkey: str
    expiration_time: float
    envelope: bytes

    def to_wire(self) -> list:
        return [self.key, self.subkey, self.expiration_time, self.envelope]


def encode_push(records: list[PushedRecord]) -> bytes:
    return msgpack.packb([r.to_wire() for r in records[:MAX_PUSH_RECORDS]], use_bin_type=True)


def decode_push(payload: bytes) -> list[PushedRecord]:
    """The records of a push's payload, well-formed ones only; ``ValueError`` if the payload is not a
    list of at most ``MAX_PUSH_RECORDS`` (the caller checked its size). Signatures are not checked here."""
    try:
        items = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"a push that is not msgpack ({type(e).__name__})") from None
    if not isinstance(items, list) or len(items) > MAX_PUSH_RECORDS:
        raise ValueError(f"a push must be a list of at most {MAX_PUSH_RECORDS} records")
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 4):
            continue
        key, subkey, expiration, envelope = item
        if (isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS and isinstance(subkey, str) and
                0 < len(subkey) <= MAX_KEY_CHARS and isinstance(expiration, (int, float)) and
                not isinstance(expiration, bool) and math.isfinite(expiration) and isinstance(envelope, bytes)):
            out.append(PushedRecord(key, subkey, float(expiration), envelope))
    return out


class RecordView:
    """The valid records this worker has seen under some keys, from the DHT, from pushes and its own:
    per key and writer, the one that expires last (what a DHT read with ``latest`` returns).
    Thread-safe: pushes arrive on the event loop, the matchmaker reads on the round thread."""

    def __init__(self, max_keys: int = MAX_KEYS, max_subkeys: int = MAX_SUBKEYS):
        self._keys: collections.OrderedDict[str, dict[str, tuple[PushedRecord, object]]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.max_keys, self.max_subkeys = max_keys, max_subkeys

    def put(self, record: PushedRecord, value) -> bool:
        """Keeps ``value`` (already checked) unless a record of the same writer expires later; True if kept."""
        with self._lock:
            held = self._keys.get(record.key)
            if held is None:
                held = self._keys[record.key] = {}
                while len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            old = held.get(record.subkey)
            if old is None and len(held) >= self.max_subkeys:
                return False
            if old is not None and old[0].expiration_time >= record.expiration_time:
                return False
            held[record.subkey] = (record, value)
            return True

    def values(self, key: str, now: float, latest: float) -> dict[str, object]:
        """Writer -> value of the records under ``key`` that expire after ``now`` and no later than ``latest``."""
        with self._lock:
            held = self._keys.get(key)
            if held is None:
                return {}
            self._keys.move_to_end(key)
            return {s: v for s, (r, v) in held.items() if now < r.expiration_time <= latest}

    def __len__(self) -> int:
        """Keys held."""
        with self._lock:
            return len(self._keys)

    def records(self, key: str, subkeys, now: float) -> list[PushedRecord]:
        """The unexpired records of these writers under ``key``, as they travel (to pass them along)."""
        with self._lock:
            held = self._keys.get(key, {})
            return [held[s][0] for s in subkeys if s in held and held[s][0].expiration_time > now]
