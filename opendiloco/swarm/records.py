"""What workers publish in the DHT, under keys in their run's namespace (``membership.py``).

- ``{run}.workers``: one subkey per live worker, its progress (refreshed by a heartbeat, so a
  frozen or dead worker's record expires);
- ``{run}.round.{k}``: workers ready to average outer step ``k``;
- ``{run}.group.{k}.{attempt}``: the group the round's leader closed.

(``k`` is a round key: the outer step, and the fragment where the model is streamed in parts;
``{run}`` is the run id, followed in a closed run by a namespace only members can derive.)

Every record is signed by its writer under its own peer id (``signing.py``), and sealed in a
closed run; a reader drops any record that fails either check, or that claims to live longer
than its kind may (a forged record cannot outlive its writer's heartbeat by more than that).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, asdict, dataclass, fields

import hivemind
import msgpack

from opendiloco.comm.base import Progress
from opendiloco.errors import AveragingError, Interrupted
from opendiloco.pacing import Pace
from opendiloco.timeouts import DHT_CALL_TIMEOUT

from . import signing
from .clock import RunClock
from .connectivity.addresses import AddressBook, checked_addrs
from .connectivity.relays import RelayBook, checked_relays
from .membership import Membership
from .pushed_records import ELIGIBLE, TRUSTED, UNKNOWN, PushedRecord, RecordView
from .signing import Identity

log = logging.getLogger(__name__)


NAME_MAX = 64
"""Characters of a worker's name in its record (a longer one makes the record malformed)."""
GROUP_ID_MAX = 64
"""Characters of a group id in a record (``abandoned``; ids are 24)."""
MOVES_MAX = 1 << 31
"""The largest count of moves a record may claim (a larger one makes the record malformed)."""


@dataclass
class WorkerRecord(Progress):
    """A worker's record under the run's workers key: its ``Progress`` (what the worker reports; every
    field there, under its own name), and what its presence sets (``presence.py``). ``to_value`` is what
    goes on the wire, every field under its name: a worker of another version reads the keys it knows."""

    peer_id: str
    _: KW_ONLY
    time: float = 0.0
    """Its writer's clock when it was published: what readers estimate clock offsets from (``clock.py``)."""
    left: bool = False
    """Set when a worker leaves cleanly, so others stop waiting for it at once."""
    config: str = ""
    """The fingerprint of the settings the run's workers must share (``config_fingerprint``)."""
    relays: tuple[str, ...] = ()
    """Where a worker behind NAT (client mode) can be reached: the relays it holds a slot on (``relays.py``)."""
    abandoned: str = ""
    """The group id of the last attempt this worker failed (it heard nothing from any member, its
    address changed, say; or any other failure there): a member still waiting on it there gives up at
    once, where its refusal may never arrive."""
    addrs: tuple[str, ...] = ()
    """Where a public worker's daemon listens now (``addresses.py``): dialled when a dial to it fails."""
    moves: int = 0
    """How many times this worker saw its own address change (behind NAT: its router's, which its
    addresses do not show): its peers close their connections to it when the count grows."""

    @classmethod
    def of(cls, progress: Progress, *, peer_id: str, time: float, left: bool, config: str,
           relays: tuple[str, ...] = (), abandoned: str = "", addrs: tuple[str, ...] = (),
           moves: int = 0) -> WorkerRecord:
        """The record that publishes ``progress``."""
        return cls(peer_id=peer_id, time=time, left=left, config=config, relays=relays, abandoned=abandoned,
                   addrs=addrs, moves=moves, **{f.name: getattr(progress, f.name) for f in fields(Progress)})

    @property
    def heading(self) -> int:
        """The round this worker will enter next."""
        return self.next_round if self.next_round >= 0 else self.outer_step

    def pace(self, clock: RunClock | None = None) -> Pace:
        """Its pace, with the time its figures were true on ``clock`` (a reader's: ``RunClock.in_mine``)."""
        t = self.pace_time or self.time
        return Pace(work=self.round_work, rate=self.work_rate, per_step=self.work_per_step,
                    time=t if clock is None else clock.in_mine(self.peer_id, t), ready=self.ready)

    def to_value(self) -> dict:
        d = asdict(self)
        d.pop("peer_id")
        return d

    @classmethod
    def from_value(cls, peer_id: str, value) -> WorkerRecord | None:
        """Parses a DHT value, or None if it is malformed (a record is input from the network)."""
        if not isinstance(value, dict):
            return None
        known = {f.name for f in fields(cls)} - {"peer_id"}
        try:
            rec = cls(peer_id=str(peer_id), **{k: v for k, v in value.items() if k in known})
            rec.outer_step, rec.inner_step = int(rec.outer_step), int(rec.inner_step)
            rec.contributed_steps, rec.dropped_steps = int(rec.contributed_steps), int(rec.dropped_steps)
            for name in ("round_work", "work_rate", "work_per_step", "steps_per_s", "samples_per_s", "time",
                         "pace_time"):
                value = float(getattr(rec, name))
                if not math.isfinite(value) or value < 0:
                    return None
                setattr(rec, name, value)
            if rec.ready_at is not None:
                rec.ready_at = float(rec.ready_at)
                if not math.isfinite(rec.ready_at):
                    return None
            rec.ready = bool(rec.ready)
            rec.next_round = int(rec.next_round)
            if type(rec.moves) is not int or not 0 <= rec.moves <= MOVES_MAX:
                return None
            if not isinstance(rec.name, str) or len(rec.name) > NAME_MAX:
                return None
            if not isinstance(rec.abandoned, str) or len(rec.abandoned) > GROUP_ID_MAX:
                return None
            rec.relays, rec.addrs = checked_relays(rec.relays), checked_addrs(rec.addrs)
            if rec.relays is None or rec.addrs is None:
                return None
            if not isinstance(rec.global_hash, str) or not isinstance(rec.config, str) or not (
                    rec.loss is None or isinstance(rec.loss, (int, float))):
                return None
            return rec
        except (TypeError, ValueError, OverflowError):
            return None


DEPARTED_KEPT = 4096
"""Peers remembered as having left the run cleanly, at most (the oldest forgotten first)."""

MAX_READ_UNKNOWN = 1024
"""Records of writers this worker does not know (``rank``) whose signatures one read checks, at most."""
MAX_PUSHED_TTL = 24 * 3600.0
"""A pushed record set to live longer than this is dropped unread (readers apply their kind's own bound)."""

_INVALID = object()


def _log_failed_store(future) -> None:
    try:
        future.result()
    except BaseException as e:  # the peers that were pushed the record have it; the DHT's readers will not
        log.debug("a background DHT store failed: %s", e)


INTERRUPT_POLL = 0.1
"""Seconds between looks at the stop flag while a DHT call is awaited."""


def wait_dht(future, what: str, timeout: float = DHT_CALL_TIMEOUT, interrupted: threading.Event | None = None):
    """The result of a DHT call, or ``AveragingError`` after ``timeout``: a call whose DHT process died
    (or lost the request) would otherwise block the worker for ever. Once ``interrupted`` is set (the
    worker is stopping) the call is abandoned within ``INTERRUPT_POLL`` seconds (``Interrupted``): a DHT
    whose peers do not answer keeps a call waiting for seconds."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            if interrupted is None:
                return future.result(timeout)
            if interrupted.is_set():
                future.cancel()
                raise Interrupted(f"the worker is stopping: a DHT {what} abandoned")
            try:
                return future.result(max(0.0, min(INTERRUPT_POLL, deadline - time.monotonic())))
            except (TimeoutError, concurrent.futures.TimeoutError):
                if time.monotonic() >= deadline:
                    raise
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct types before Python 3.11
        future.cancel()
        raise AveragingError(f"the DHT did not answer a {what} within {timeout:.0f}s") from None


class RunRecords:
    """The run's records in the DHT, as one worker (or a reader such as ``opendiloco status``) sees them.

    Writing needs the worker's ``Identity``; reading needs only the membership. ``interrupted``: the
    worker's stop flag; once it is set, reads and writes give up at once (``Interrupted``). Expiration
    times come from ``clock``, which also learns the writers' clocks from the worker records read here.
    """

    def __init__(self, dht: hivemind.DHT, membership: Membership, identity: Identity | None = None, *,
                 interrupted: threading.Event | None = None, clock: RunClock | None = None):
        self.dht, self.membership, self.identity = dht, membership, identity
        self.interrupted = interrupted
        self.clock = clock if clock is not None else RunClock()
        self.relay_book = RelayBook()
        """The relays the live workers' records name: where streams to workers behind NAT go."""
        self.address_book = AddressBook()
        """Where the live public workers listen, as their last records read say (``addresses.py``)."""
        self.on_peers_moved: Callable[[set[str]], None] | None = None
        """Called (from the reading thread) with the workers whose records say their address changed."""
        self.view = RecordView()
        """The round and group records seen so far: read from the DHT, pushed by peers, or this worker's own."""
        self.trusted: Callable[[str], bool] = lambda peer: False
        """Whether a peer's records rank ``TRUSTED`` in ``view`` (its partners: set by ``Presence``)."""
        self._eligible: frozenset[str] = frozenset()
        """The workers with a live, valid progress record in the last read of the run's workers."""
        self._departed: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Peers whose latest record read says they left the run cleanly (``DEPARTED_KEPT`` at most)."""
        self._departed_lock = threading.Lock()

    # -- keys --------------------------------------------------------------------------------------
    def workers_key(self) -> str:
        return f"{self.membership.namespace}.workers"

    def secret_key(self) -> str:
        """Outside every namespace: each worker's ``Membership.tag`` under the bare run id, signed and not
        sealed, so that a worker with another secret (or none) is seen and told, not silently alone."""
        return f"{self.membership.run_id}.secrets"

    def round_key(self, key) -> str:
        return f"{self.membership.namespace}.round.{key}"

    def group_key(self, key, attempt: int) -> str:
        return f"{self.membership.namespace}.group.{key}.{attempt}"

    # -- writing -----------------------------------------------------------------------------------
    def _envelope(self, key: str, value, expiration_time: float, sealed: bool = True) -> bytes:
        if self.identity is None:
            raise RuntimeError("this reader has no identity to sign records with")
        subkey = self.identity.peer_id
        body = msgpack.packb(value, use_bin_type=True)
        if sealed:
            body = self.membership.seal(body, signing.key_id(key) + subkey.encode())
        return self.identity.envelope(key, subkey, expiration_time, body)

    def store(self, key: str, value, expiration_time: float, *, wait: bool = True) -> PushedRecord:
        """Stores ``value`` under ``key`` and this worker's peer id until ``expiration_time`` (``clock.now()``),
        and keeps it in ``view``; returns the signed record, to push to peers. Without ``wait`` the DHT store
        goes on in the background (for the peers that read the DHT rather than receive the push)."""
        envelope = self._envelope(key, value, expiration_time)
        record = PushedRecord(key, self.identity.peer_id, float(expiration_time), envelope)
        self.view.put(record, msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False),  # as read back
                      TRUSTED)
        future = self.dht.store(key, envelope, expiration_time, subkey=self.identity.peer_id, return_future=True)
        if wait:
            wait_dht(future, "store", interrupted=self.interrupted)
        else:
            future.add_done_callback(_log_failed_store)
        return record

    async def store_async(self, key: str, value, expiration_time: float, sealed: bool = True) -> None:
        envelope = self._envelope(key, value, expiration_time, sealed)
        await self.dht.store(key, envelope, expiration_time, subkey=self.identity.peer_id, return_future=True)

    # -- reading -----------------------------------------------------------------------------------
    def subkey_values(self, key: str, max_ttl: float, *, fresh: bool = True) -> dict[str, object]:
        """All live, valid peer id -> value pairs under ``key`` (empty if none) that this worker has seen:
        with ``fresh``, read from the DHT now; without, as pushed and read before (``view``)."""
        if fresh:
            self._keep(key, wait_dht(self.dht.get(key, latest=True, return_future=True), "get",
                                     interrupted=self.interrupted))
        now = self.clock.now()
        return self.view.values(key, now, now + max_ttl)

    def refresh(self, key: str, on_done: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """Reads ``key`` from the DHT in the background into ``view``, then calls ``on_done`` (from another
        thread): a reader that waits for pushes is not held two round trips by a read of what may come."""
        future = self.dht.get(key, latest=True, return_future=True)

        def done(answer) -> None:
            try:
                self._keep(key, answer.result())
            except BaseException as e:  # the DHT failed or is shutting down: what was pushed still counts
                log.debug("a background read of %s failed: %s", key, e)
            if on_done is not None:
                on_done()

        future.add_done_callback(done)
        return future

    def _keep(self, key: str, found) -> None:
        """Puts the valid records of a ``dht.get`` answer for ``key`` in ``view``: those of the writers that
        rank highest first, and only those ``view`` could keep are opened (a signature check costs more
        than the look: junk from many identities is dropped unread)."""
        if found is None or not isinstance(found.value, dict):
            return
        ranked = sorted(((self.rank(s) if isinstance(s, str) else UNKNOWN, s, item)
                         for s, item in found.value.items()), key=lambda t: -t[0])
        for rank, subkey, item in ranked:
            if not isinstance(subkey, str) or not isinstance(item.value, bytes):
                continue
            record = PushedRecord(key, subkey, item.expiration_time, item.value)
            if not self.view.admits(record, rank):
                continue
            value = self._open(key, subkey, item.expiration_time, item.value, sealed=True)
            if value is not _INVALID:
                self.view.put(record, value, rank)

    def rank(self, peer: str) -> int:
        """What ``peer`` is to this worker when its round or group records compete for ``view``'s places."""
        if self.identity is not None and peer == self.identity.peer_id or self.trusted(peer):
            return TRUSTED
        return ELIGIBLE if peer in self._eligible else UNKNOWN

    def records_of(self, key: str, subkeys) -> list[PushedRecord]:
        """The signed records of these writers under ``key`` seen so far (to pass them along)."""
        return self.view.records(key, subkeys, self.clock.now())

    def accept_pushed(self, pushed: list[PushedRecord]) -> int:
        """Keeps the pushed records that are round or group records of this run, unexpired, signed by their
        writer and (in a closed run) sealed: the checks a record read from the DHT passes. Returns how many
        were new."""
        ns = self.membership.namespace
        now, kept = self.clock.now(), 0
        for record in pushed:
            if not record.key.startswith((f"{ns}.round.", f"{ns}.group.")) or not (
                    now < record.expiration_time <= now + MAX_PUSHED_TTL):
                continue
            rank = self.rank(record.subkey)
            if not self.view.admits(record, rank):
                continue
            value = self._open(record.key, record.subkey, record.expiration_time, record.envelope, sealed=True)
            if value is not _INVALID:
                kept += self.view.put(record, value, rank)
        return kept

    def live_subkeys(self, key: str, found, max_ttl: float, sealed: bool = True) -> dict[str, object]:
        """The unexpired, valid records of a ``dht.get`` answer for ``key``; a record set to expire more
        than ``max_ttl`` seconds from now is dropped (its writer could otherwise outlive itself)."""
        now = self.clock.now()
        return {subkey: value for subkey, _, value in self._opened(key, found, sealed, (now, now + max_ttl))}

    def _opened(self, key: str, found, sealed: bool = True, live: tuple[float, float] | None = None,
                raw: bool = False) -> list[tuple]:
        """(subkey, expiration time, value) of every record of a ``dht.get`` answer that its writer
        signed (and, in a closed run and if ``sealed``, sealed) under ``key``; with ``live`` = (now,
        latest), only those expiring after now and no later than latest (checked before signatures);
        with ``raw``, each with its envelope as a fourth item."""
        if found is None or not isinstance(found.value, dict):
            return []
        out, verified = [], 0
        # Writers this worker knows first; of the others, at most ``MAX_READ_UNKNOWN`` signatures a read.
        ranked = sorted(found.value.items(), key=lambda kv: -self.rank(kv[0]) if isinstance(kv[0], str) else 0)
        for subkey, item in ranked:
            if live is not None and not live[0] < item.expiration_time <= live[1]:
                continue
            if self.rank(subkey) == UNKNOWN if isinstance(subkey, str) else True:
                if verified >= MAX_READ_UNKNOWN:
                    continue
                verified += self._passes_seal(key, subkey, item.value, sealed)
            value = self._open(key, subkey, item.expiration_time, item.value, sealed)
            if value is not _INVALID:
                out.append((subkey, item.expiration_time, value) + ((item.value,) if raw else ()))
        return out

    def _passes_seal(self, key: str, subkey, envelope, sealed: bool) -> bool:
        """Whether a record's signature would be checked (its seal is right, or there is none to check)."""
        if not (sealed and self.membership.closed):
            return True
        body = signing.peek_body(envelope)
        return body is not None and isinstance(subkey, str) and \
            self.membership.unseal(body, signing.key_id(key) + subkey.encode()) is not None

    def _open(self, key: str, subkey, expiration_time: float, envelope, sealed: bool):
        """The value of one signed (and, if ``sealed`` in a closed run, sealed) record, or ``_INVALID``."""
        kid = signing.key_id(key)
        if not isinstance(subkey, str):
            return _INVALID
        context = kid + subkey.encode()
        sealed = sealed and self.membership.closed
        # In a closed run the seal is checked first: an outsider's record costs an AES-GCM try, not a signature check.
        check = (lambda body: self.membership.unseal(body, context) is not None) if sealed else None
        body = signing.open_envelope(kid, subkey, expiration_time, envelope, check)
        plain = body if body is None or not sealed else self.membership.unseal(body, context)
        if plain is None:
            return _INVALID
        try:
            return msgpack.unpackb(plain, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.UnpackException):
            return _INVALID

    def workers_from(self, found, max_ttl: float) -> dict[str, WorkerRecord]:
        """The live workers of a ``dht.get`` answer for ``workers_key()``. Every valid record, expired
        or not by this clock, first tells ``clock`` its writer's clock (``clock.py``): a worker whose
        clock is off may see every record as expired, and must still learn that it is its clock."""
        opened = self._opened(self.workers_key(), found)
        me = self.identity.peer_id if self.identity is not None else None
        self.clock.observe({subkey: value.get("time") for subkey, _, value in opened
                            if subkey != me and isinstance(value, dict) and not value.get("left")})
        now = self.clock.now()
        workers = parse_workers({subkey: value for subkey, expiration, value in opened
                                 if now < expiration <= now + max_ttl})
        self._eligible = frozenset(workers)
        self._note_departures({subkey for subkey, expiration, value in opened if now < expiration
                               and isinstance(value, dict) and value.get("left") is True}, workers)
        for peer, rec in workers.items():
            self.relay_book.note(peer, rec.relays)
        moved = self.address_book.note({peer: (rec.time, rec.addrs, rec.moves) for peer, rec in workers.items()})
        if moved and self.on_peers_moved is not None:
            self.on_peers_moved(moved)
        return workers

    def _note_departures(self, left: set[str], live: dict) -> None:
        with self._departed_lock:
            for peer in left - set(live):
                self._departed[peer] = None
                self._departed.move_to_end(peer)
            for peer in set(live) & set(self._departed):  # it came back (restarted with the same identity)
                del self._departed[peer]
            while len(self._departed) > DEPARTED_KEPT:
                self._departed.popitem(last=False)

    def departed(self) -> frozenset[str]:
        """Peers whose signed record said they left the run cleanly (a stop, not a crash or a partition)."""
        with self._departed_lock:
            return frozenset(self._departed)

    def read_workers(self, max_ttl: float = 3600.0) -> dict[str, WorkerRecord]:
        """Live workers of the run (those that left cleanly are dropped)."""
        found = wait_dht(self.dht.get(self.workers_key(), latest=True, return_future=True), "get",
                         interrupted=self.interrupted)
        return self.workers_from(found, max_ttl)


def parse_workers(values: dict[str, object]) -> dict[str, WorkerRecord]:
    out = {}
    for peer, value in values.items():
        rec = WorkerRecord.from_value(peer, value)
        if rec is None:
            log.debug("ignoring a malformed worker record from %s", peer)
        elif not rec.left:
            out[peer] = rec
    return out
