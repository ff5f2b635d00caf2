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
"""Writers kept per key. Once a key is full, a record from a writer of a higher rank (below) takes the
place of one of the lowest rank; any other is dropped (the DHT still holds it)."""
MAX_UNKNOWN = 32
"""Writers of rank ``UNKNOWN`` kept per key: a fresh identity costs nothing, so all of them share these."""
MAX_UNKNOWN_KEYS = MAX_KEYS // 4
"""Keys held for writers of rank ``UNKNOWN`` alone: a flood of new keys from them evicts only their own."""
MAX_KEYS_PER_WRITER = 16
"""Keys under which one writer that is not ``TRUSTED`` has records here; a further one replaces its oldest."""

TRUSTED, ELIGIBLE, UNKNOWN = 2, 1, 0
"""What a writer is to the reader (``RunRecords.rank``): itself or a partner (``partners.py``); a writer
with a live, valid progress record in the run; anyone else. An honest record is never evicted by one of a
lower rank, and junk from identities of rank ``UNKNOWN`` can fill only ``MAX_UNKNOWN`` places of a key."""


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
    per key and writer, the one that expires last (what a DHT read with ``latest`` returns), and what its
    writer was to the reader (its rank) when it came. Bounded per key, per writer and in keys (see the
    constants above): one writer, or any number of fresh identities, cannot fill it.
    Thread-safe: pushes arrive on the event loop, the matchmaker reads on the round thread."""

    def __init__(self, max_keys: int = MAX_KEYS, max_subkeys: int = MAX_SUBKEYS, max_unknown: int = MAX_UNKNOWN,
                 max_unknown_keys: int = MAX_UNKNOWN_KEYS, max_keys_per_writer: int = MAX_KEYS_PER_WRITER):
        self._keys: collections.OrderedDict[str, dict[str, tuple[PushedRecord, object, int]]] = \
            collections.OrderedDict()
        self._writer_keys: dict[str, collections.OrderedDict[str, None]] = {}
        """Keys under which each writer that is not ``TRUSTED`` has a record here, oldest first."""
        self._lock = threading.Lock()
        self.max_keys, self.max_subkeys, self.max_unknown = max_keys, max_subkeys, max_unknown
        self.max_unknown_keys, self.max_keys_per_writer = max_unknown_keys, max_keys_per_writer

    def admits(self, record: PushedRecord, rank: int = ELIGIBLE) -> bool:
        """Whether ``put`` could keep this record (checked before its signature is: the cheap part first)."""
        with self._lock:
            held = self._keys.get(record.key)
            if held is None:
                return True  # a key of its rank that is used least goes instead
            old = held.get(record.subkey)
            if old is not None:
                return old[0].expiration_time < record.expiration_time or old[2] < rank
            return self._victim(held, rank) is not False

    def put(self, record: PushedRecord, value, rank: int = ELIGIBLE) -> bool:
        """Keeps ``value`` (already checked) unless a record of the same writer expires later, or the key is
        full of writers of at least its rank; True if kept."""
        with self._lock:
            held = self._keys.get(record.key)
            if held is None:
                if rank == UNKNOWN and self._unknown_keys() >= self.max_unknown_keys:
                    self._evict_key(only_unknown=True)
                held = self._keys[record.key] = {}
            old = held.get(record.subkey)
            if old is not None and old[0].expiration_time >= record.expiration_time:
                if old[2] >= rank:
                    return False
                record, value = old[0], old[1]  # the same writer, known better now
            if old is None:
                victim = self._victim(held, rank)
                if victim is False:
                    if not held:
                        del self._keys[record.key]
                    return False
                if victim is not None:
                    self._drop(record.key, victim)
            held[record.subkey] = (record, value, rank)
            self._note_writer(record.key, record.subkey, rank)
            while len(self._keys) > self.max_keys:
                self._evict_key()
            return record.key in self._keys and record.subkey in self._keys[record.key]

    def _victim(self, held: dict, rank: int):
        """None if a new writer of ``rank`` fits in ``held``; else the writer it replaces, or False."""
        unknown = sum(1 for h in held.values() if h[2] == UNKNOWN)
        if len(held) < self.max_subkeys and (rank > UNKNOWN or unknown < self.max_unknown):
            return None
        lower = [(h[2], h[0].expiration_time, s) for s, h in held.items() if h[2] < rank]
        return min(lower)[2] if lower else False

    @staticmethod
    def _rank_of(held: dict) -> int:
        return max((h[2] for h in held.values()), default=UNKNOWN)

    def _unknown_keys(self) -> int:
        return sum(1 for held in self._keys.values() if self._rank_of(held) == UNKNOWN)

    def _evict_key(self, only_unknown: bool = False) -> None:
        """Forgets the least recently used key of the lowest rank (of rank ``UNKNOWN`` only, if so asked)."""
        lowest = min(self._rank_of(held) for held in self._keys.values())
        if only_unknown and lowest != UNKNOWN:
            return
        key = next(k for k, held in self._keys.items() if self._rank_of(held) == lowest)
        for subkey in list(self._keys[key]):
            self._drop(key, subkey)
        self._keys.pop(key, None)

    def _drop(self, key: str, subkey: str) -> None:
        held = self._keys.get(key)
        if held is not None:
            held.pop(subkey, None)
        mine = self._writer_keys.get(subkey)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._writer_keys[subkey]

    def _note_writer(self, key: str, subkey: str, rank: int) -> None:
        if rank >= TRUSTED:
            return
        mine = self._writer_keys.setdefault(subkey, collections.OrderedDict())
        mine[key] = None
        mine.move_to_end(key)
        while len(mine) > self.max_keys_per_writer:
            oldest = next(iter(mine))
            self._drop(oldest, subkey)
            if not self._keys.get(oldest, True):
                del self._keys[oldest]

    def values(self, key: str, now: float, latest: float) -> dict[str, object]:
        """Writer -> value of the records under ``key`` that expire after ``now`` and no later than ``latest``."""
        with self._lock:
            held = self._keys.get(key)
            if held is None:
                return {}
            self._keys.move_to_end(key)
            return {s: v for s, (r, v, _) in held.items() if now < r.expiration_time <= latest}

    def __len__(self) -> int:
        """Keys held."""
        with self._lock:
            return len(self._keys)

    def records(self, key: str, subkeys, now: float) -> list[PushedRecord]:
        """The unexpired records of these writers under ``key``, as they travel (to pass them along)."""
        with self._lock:
            held = self._keys.get(key, {})
            return [held[s][0] for s in subkeys if s in held and held[s][0].expiration_time > now]
