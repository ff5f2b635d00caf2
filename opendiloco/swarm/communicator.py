"""The swarm communicator: presence, matchmaking, the round runner and state transfer, composed.

hivemind's own DecentralizedAverager is not used for the averaging: it sends each peer back a
*difference* to add to its own values (peers never end bit-identical), and a failure mid round
can leave a partially averaged result reported as success. A round here goes through explicit
states, one job per module:

    ANNOUNCE  presence.py      our progress record; drift check against the run's majority
    GROUP     matchmaking.py   the run's live workers ready for this key form a group
    EXCHANGE  comm/runner.py   streamed reduce-scatter / all-gather over p2p streams (streams.py)
    VERIFY    comm/runner.py   every member confirms the digest of the whole average
    SETTLE    comm/outcome.py  an attempt that failed here after members may have completed it asks them
    DONE / FAILED

A failed attempt changes nothing and is retried with whoever is still there (less a member whose bytes
failed this worker's checks: it is left out of the next groups, exclusion.py), unless members may
have completed it (they apply without every confirmation): then this worker asks them, and ends
with the group's outcome (``outcome.resolve``): it applies the average it holds, adopts the group's
state (``RoundCounted``), or retries when they all failed it. A worker that finds the group ahead
of it raises ``BehindError`` so that its optimizer downloads state (state_transfer.py) instead.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import ClassVar

import hivemind
import torch
import uvloop

from ..comm.aggregation import Aggregation
from ..comm.audit import DEFAULT_AUDIT_CHUNKS
from ..comm.base import AverageResult, Communicator, FutureWork, RoundKey, StateProvider, Work
from ..comm.formats import get_codec
from ..comm.group import DEFAULT_PART_NUMEL, Group, group_label
from ..comm.local import average_alone
from ..comm.outcome import resolve
from ..comm.rounds_taken import Rounds
from ..comm.runner import RoundOutcome, RoundRunner
from ..comm.wire import ByteStream, Code
from ..comm.wire import field as meta_field
from ..errors import AveragingError, InDoubt, Interrupted, PeerFailure, RoundCounted, SplitHold
from ..pacing import Pace
from . import records
from .addresses import dial_addrs
from .doctor import startup_warnings
from .exclusion import EXCLUDE_ROUNDS, Breakers, Offenders, UnreachablePeers
from .frozen import PING_TIMEOUT_S, FrozenProbe, Unanswered
from .hooks import RoundHooks
from .majority import RecentMembers
from .matchmaking import Doorbell, Matchmaker, MatchmakingSettings
from .membership import SECRET_FILE_ENV, Membership, RunSecret
from .multi_donor import MAX_DONORS, DonorsAhead, Download, fetch_from_donors, tell_done
from .node import start_dht, visible_maddrs, worker_identity
from .partners import PARTNERS_FILE
from .presence import OtherSettings, Presence
from .pushed_records import MAX_PUSH_BYTES, PushedRecord, decode_push, encode_push
from .quorum import confirmed
from .relays import DIAL_TIMEOUT, RENEW_BEFORE_ROUND_S, RelayLinks, close_connections
from .reservations import WIDEN_EVERY_S, RelaySlots, ping, widen
from .reversal import ConnectionReversal
from .signing import Identity
from .state_transfer import StateServer, download_bound, fetch_state, own_check
from .streams import P2PStreams

log = logging.getLogger(__name__)


@dataclass
class SwarmSettings:
    """How a worker takes part in its run's rounds. The trainer sets every field from its ``[swarm]``
    config section, under the same name (``from_config``), except those in ``NOT_FROM_CONFIG``."""

    run_id: str = "opendiloco"
    """Workers with the same run id (and the same secret and config fingerprint) train together."""
    compression: str = "fp16"
    """The contributions' codec (``opendiloco.comm.compression``); part of what a group agrees on."""
    result_compression: str | None = None
    """The averaged shards' codec; None: the same as the contributions'."""
    min_group_size: int = 1
    """The fewest workers a round may have."""
    matchmaking_timeout: float = 30.0
    """Seconds a round waits for ``min_group_size`` workers (longer while a live peer says it is coming)."""
    allreduce_timeout: float = 60.0
    """Seconds an attempt's exchange may take once its group is formed."""
    straggler_wait: float = 10.0
    """Grace, in seconds, beyond the time a slower peer published it would be ready."""
    max_attempts: int = 3
    """Attempts of one round (each with whoever is still there) before it fails."""
    heartbeat_interval: float = 2.0
    """Seconds between two publications of this worker's record. Not from the config: it must stay
    well under ``record_ttl``, and a run's secret records live for ten heartbeats of their writer,
    bounded by each reader's own (library callers may set both together, the same on every worker)."""
    record_ttl: float = 8.0
    """Seconds a worker's record lives after its last heartbeat. Not from the config: every reader
    drops a record set to live longer than its own ``record_ttl`` (plus a clock slack) as a forgery,
    so a worker with a longer one would vanish from its peers' view; the same on every worker."""
    verify_timeout: float = 5.0
    """Seconds a member waits for the others' confirmations of the average's digest."""
    poll_interval: float = 0.02
    """Seconds between two looks at the DHT while a group forms (a doorbell ring wakes it sooner)."""
    quiet_poll_interval: float = 0.25
    """The longest gap between two looks while no announcement changes (doubled from ``poll_interval``)."""
    max_wait: float = 600.0
    """The longest a round waits for a live peer that says it is coming (its published ready time)."""
    part_numel: int = DEFAULT_PART_NUMEL
    """Values per streamed part of a contribution (a multiple of 1024, every codec's block); part of what
    a group agrees on."""
    aggregation: Aggregation = dataclass_field(default_factory=Aggregation)
    """How shard owners combine contributions: weight and norm bounds, optionally CenteredClip
    (``opendiloco.comm.aggregation``); part of what a group agrees on."""
    audit_chunks: int = DEFAULT_AUDIT_CHUNKS
    """Random chunks of every other owner's shard result a member recomputes per round
    (``opendiloco.comm.audit``; 0: none); part of what a group agrees on."""
    exclude_rounds: int = EXCLUDE_ROUNDS
    """How many outer steps a member caught sending malformed data is left out of this worker's groups
    (``exclusion.py``)."""
    partition_hold: float = 120.0
    """The longest, in seconds, a worker whose groups lack most of the workers it last averaged with (a
    partition, or a crash of most of them) holds its work instead of applying rounds apart from them
    (``majority.py``); 0: never holds (both sides of a partition go on, and the smaller heals)."""
    cut_off_after: float = 15.0
    """Seconds a member of an attempt may hear nothing from any other member, while it still waits on
    them, before it takes itself for cut off (its address changed, its links broke: its streams hang on
    connections that are gone while its record stays fresh). It abandons the attempt, drops its
    connections to the members and says so in its record, so they give up on it at once; 0: never."""
    config_fingerprint: str = ""
    """The hash of the settings every worker of the run must share: a worker with another one is
    refused at start when every live worker of the run has them (``refuse_other_settings``), and
    never grouped with, waited for or downloaded from. Not a config key: the trainer computes it
    from the config."""

    NOT_FROM_CONFIG: ClassVar[frozenset[str]] = frozenset({"heartbeat_interval", "record_ttl",
                                                           "config_fingerprint"})
    """The fields the trainer's config does not set (each says why); every other field is a ``[swarm]``
    key of the same name (``aggregation`` with ``clip_ratio`` and ``max_weight_ratio``)."""

    @classmethod
    def from_config(cls, cfg, config_fingerprint: str = "") -> SwarmSettings:
        """The settings of a ``[swarm]`` config section (``opendiloco.train.config.SwarmConfig``; taken
        as it comes, since this layer never imports the trainer), every field named: a field added here
        needs a key there, or a place in ``NOT_FROM_CONFIG`` (tests/test_swarm_settings.py checks it)."""
        return cls(
            run_id=cfg.run_id,
            compression=cfg.compression,
            result_compression=cfg.result_compression,
            min_group_size=cfg.min_group_size,
            matchmaking_timeout=cfg.matchmaking_timeout,
            allreduce_timeout=cfg.allreduce_timeout,
            straggler_wait=cfg.straggler_wait,
            max_attempts=cfg.max_attempts,
            verify_timeout=cfg.verify_timeout,
            poll_interval=cfg.poll_interval,
            quiet_poll_interval=cfg.quiet_poll_interval,
            max_wait=cfg.max_wait,
            part_numel=cfg.part_numel,
            aggregation=Aggregation(cfg.aggregation, clip_ratio=cfg.clip_ratio, max_weight_ratio=cfg.max_weight_ratio),
            audit_chunks=cfg.audit_chunks,
            exclude_rounds=cfg.exclude_rounds,
            partition_hold=cfg.partition_hold,
            cut_off_after=cfg.cut_off_after,
            config_fingerprint=config_fingerprint,
        )


LEAVE_TIMEOUT = 1.0
"""How long ``close`` waits, at most, for the record that tells the run this worker left (its peers stop
waiting for it at once). It goes out as soon as the worker is asked to stop, while the checkpoint is
written; on a working network it takes milliseconds. A DHT whose peers do not answer would keep it
for seconds (hivemind's 3 s per request): not waited for. Unannounced, a worker drops out of the run
when its record expires (``record_ttl``)."""
CLOSE_STEP_TIMEOUT = 1.0
"""How long ``close`` waits for each of its other steps (cancelling tasks, the p2p replica, the loop)."""
ATTEMPT_KEYS = 1024
"""Round keys whose used attempt numbers a worker remembers (the least recently used are forgotten)."""
VANISHED_S = 3.0
"""A member the exchange still waits on whose record has been gone from the run this long (and from two
reads of it) is given up on (``_give_up_on_vanished``)."""


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class RoundState(enum.Enum):
    ANNOUNCE = "announce"
    GROUP = "group"
    EXCHANGE = "exchange"
    VERIFY = "verify"
    SETTLE = "settle"
    DONE = "done"
    FAILED = "failed"


def _warn_if_unreachable(dht, initial_peers: list[str], client_mode: bool) -> None:
    """A worker's short reachability check at start (``doctor.startup_warnings``), off its start's path."""
    try:
        for finding in startup_warnings(dht, initial_peers, client_mode):
            log.warning("%s (check this machine with `opendiloco doctor`)", finding.text)
    except Exception as e:  # a check that could not run changes nothing
        log.debug("reachability check at start: %s: %s", type(e).__name__, e)


class SwarmCommunicator(Communicator):
    round_runner: type[RoundRunner] = RoundRunner
    """What runs an attempt's exchange (``comm/runner.py``): an attacker's script sets a subclass that
    sends what the protocol forbids, with the protocol itself left as it is."""
    hooks: RoundHooks = RoundHooks()
    """Called at fixed points of every round (``hooks.py``): the fault-injection and observation hook of
    tests and benchmarks (``opendiloco.testing.faults``)."""

    def __init__(self, dht: hivemind.DHT, settings: SwarmSettings | None = None, *, own_dht: bool = True,
                 secret: RunSecret | None = None, identity: Identity | None = None):
        """``secret``: the run secret (None: an open run). ``identity``: the key of the DHT node's p2p
        identity, which signs this worker's records (``start_dht`` keeps it on the DHT it starts)."""
        self.dht = dht
        self.settings = s = settings or SwarmSettings()
        self.membership = Membership(s.run_id, secret)
        identity = identity if identity is not None else getattr(dht, "identity", None)
        if identity is None or identity.peer_id != dht.peer_id.to_base58():
            raise ValueError("the DHT's identity key is needed to sign records: start it with start_dht")
        if s.min_group_size < 1:
            raise ValueError("min_group_size must be >= 1")
        if not isinstance(s.part_numel, int) or s.part_numel < 1024 or s.part_numel % 1024:
            raise ValueError("part_numel must be a positive multiple of 1024 (every codec's block)")
        self.codec = get_codec(s.compression)
        self.result_codec = get_codec(s.result_compression) if s.result_compression else self.codec.averages
        self._own_dht = own_dht
        self._peer_id = dht.peer_id.to_base58()
        self._closed = False
        self._interrupted = threading.Event()
        self._donor_rates: dict[str, float] = {}
        """Bytes per second each donor served this worker's last state download at (fast ones are asked first)."""
        self.state = RoundState.DONE
        """The state of the latest round (for status and tests)."""
        self._runner: RoundRunner | None = None
        """The latest attempt's runner (what a stop in the middle of it may leave in doubt)."""
        self._next_attempt: collections.OrderedDict[RoundKey, int] = collections.OrderedDict()
        """Per round key, the first attempt number this worker has not used yet (``ATTEMPT_KEYS`` keys at
        most). A used number names a group id its members have finished and refuse ("already
        finished"), and its group may still be in the records. A round that failed is tried again at
        the same key (the outer step did not move); a round that completed is done again at its key by
        a worker that went back to the run's state (the smaller side of a healed partition): either
        way its attempts go on from there."""
        self.offenders = Offenders(s.exclude_rounds)
        """Members this worker caught sending malformed data: left out of its next groups."""
        self.recent = RecentMembers(self._peer_id, s.partition_hold)
        """The members of this worker's last rounds: a group that lacks most of them holds (``majority.py``)."""
        self.unreachable = UnreachablePeers()
        self.breakers = Breakers()
        """Members that broke an attempt of this worker's (``RoundRunner.breakers``): out of the round's retries."""
        """Members this worker could not dial: apart from it for a few outer steps."""

        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="opendiloco-comm", daemon=True)
        self._thread.start()
        self._rounds_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opendiloco-round")
        self.records = records.RunRecords(dht, self.membership, identity, interrupted=self._interrupted)
        self._call(self._setup(), timeout=30)
        self.presence = Presence(self.records, self._peer_id, self._loop,
                                 heartbeat_interval=s.heartbeat_interval, record_ttl=s.record_ttl,
                                 config=s.config_fingerprint, relays=getattr(dht, "relays", ()),
                                 initial_peers=getattr(dht, "rejoin_peers", ()),
                                 find_addrs=functools.partial(self.p2p.get_visible_maddrs, latest=True),
                                 publish_addrs=not dht.client_mode)
        self.presence.on_new_address = self._on_new_address
        self.presence.on_rejoined = self._on_rejoined
        self.records.on_peers_moved = self._note_peers_moved
        self.unanswered = Unanswered(self._loop, self._ping)
        self.matchmaker = Matchmaker(self.records, self.presence, MatchmakingSettings(
            run_id=s.run_id, min_group_size=s.min_group_size, matchmaking_timeout=s.matchmaking_timeout,
            straggler_wait=s.straggler_wait, max_wait=s.max_wait,
            record_ttl=s.max_wait + s.matchmaking_timeout + s.allreduce_timeout,
            poll_interval=s.poll_interval, quiet_poll_interval=s.quiet_poll_interval, part_numel=s.part_numel,
            config=s.config_fingerprint),
            group_label(self.codec, self.result_codec, s.aggregation, s.audit_chunks),
            self._interrupted,
            doorbell=self.doorbell, push=self._push,
            joiners=lambda step: self.state_server.recent_joiners(step, within=s.straggler_wait + 10.0),
            offenders=self.offenders, unreachable=self.unreachable, liveness=self.unanswered, breakers=self.breakers)
        self._workers_snapshot: dict[str, records.WorkerRecord] = {}
        self._snapshot_reads = 0  # successful reads of the run's workers so far
        self._pace_refresh = asyncio.run_coroutine_threadsafe(self._refresh_workers(), self._loop)
        self._leaving = asyncio.run_coroutine_threadsafe(self._leave_when_stopping(), self._loop)

    @classmethod
    def from_config(cls, cfg, run_dir: str | None = None, config_fingerprint: str = "") -> SwarmCommunicator:
        """Starts a DHT node from a ``SwarmConfig`` and wraps it, with ``SwarmSettings.from_config``;
        refuses a run whose live workers have other settings (``OtherSettings``). The run secret comes
        from the environment or ``cfg.secret_file`` (``RunSecret.from_environment``)."""
        secret = RunSecret.from_environment(cfg.secret_file)
        # Its own identity in its run dir, unless one is given: restarted there, it is the same peer.
        own = cfg.identity_path is None and run_dir is not None
        dht = start_dht(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                        announce_maddrs=cfg.announce_maddrs,
                        identity_path=worker_identity(str(run_dir)) if own else cfg.identity_path,
                        identity_locked=own, client_mode=cfg.client_mode)
        settings = SwarmSettings.from_config(cfg, config_fingerprint)
        comm = cls(dht, settings, secret=secret)
        try:
            comm.refuse_other_settings()
        except BaseException:
            comm.close()
            raise
        addrs = visible_maddrs(dht)
        log.info("worker %s joined run %r; peers can join through: %s", comm.peer_id, settings.run_id,
                 " ".join(addrs))
        if secret is None:
            log.warning("run %r is open (no run secret): anyone who can reach a worker can read the run's records, "
                        "download its state and join it; to close it, start every worker with the same secret in "
                        "$%s or the secret_file setting (docs/trust.md)", settings.run_id, SECRET_FILE_ENV)
        else:
            log.info("run %r is closed: only workers started with its secret (%s) take part", settings.run_id,
                     secret.source)
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            comm.presence.partners.keep_in(os.path.join(run_dir, PARTNERS_FILE))  # known again after a restart
            with open(os.path.join(run_dir, "peer_addrs.txt"), "w") as f:
                f.write("\n".join(addrs) + "\n")
        threading.Thread(target=_warn_if_unreachable, args=(dht, list(cfg.initial_peers), cfg.client_mode),
                         name="opendiloco-reach-check", daemon=True).start()
        return comm

    def refuse_other_settings(self) -> None:
        """Raises ``OtherSettings`` (one line) if the run's live workers all train with another config
        fingerprint: this worker is the odd one out. Workers with other settings beside some with
        this worker's are their writers' problem (never grouped with, waited for or downloaded
        from, and named in a warning): one record cannot keep every newcomer out of a run."""
        try:
            workers = self.presence.records.read_workers(self.presence.max_ttl)
        except AveragingError as e:  # the DHT did not answer: the rounds' own checks still apply
            log.warning("could not compare settings with the run's workers: %s", e)
            return
        others = [r for p, r in workers.items() if p != self._peer_id]
        foreign = [r for r in others if r.config != self.settings.config_fingerprint]
        if not foreign:
            return
        if len(foreign) < len(others):
            self.presence.same_settings(workers)  # warns once for each of the others
            return
        rec, mine = foreign[0], self.settings.config_fingerprint or "none"
        raise OtherSettings(f"worker {rec.peer_id[-8:]} of run {self.settings.run_id!r} trains with other settings "
                            f"(config fingerprint {rec.config or 'none'}, this worker's {mine})")

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._peer_id

    def _call(self, coro, timeout: float, interruptible: bool = False):
        """Runs ``coro`` on the event loop and waits for it, at most ``timeout`` seconds; with
        ``interruptible``, a stop request (``interrupt``) cancels it at once (``Interrupted``)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:  # a result that is there is taken, even when stopping (a completed round is kept)
                    remaining = max(0.0, deadline - time.monotonic())
                    return future.result(min(records.INTERRUPT_POLL, remaining) if interruptible else timeout)
                except (TimeoutError, concurrent.futures.TimeoutError):  # distinct types before Python 3.11
                    if not interruptible or time.monotonic() >= deadline:
                        raise
                if self._interrupted.is_set():
                    future.cancel()
                    raise Interrupted("the worker is stopping: abandoned")
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise AveragingError(f"timed out after {timeout:.1f}s") from None

    async def _setup(self) -> None:
        s = self.settings
        self.p2p = await self.dht.replicate_p2p()
        self.rounds = Rounds(wait_for_group=s.straggler_wait + s.verify_timeout)
        ns, m = self.membership.namespace, self.membership
        # Only a worker behind NAT dials through relays, and only one behind NAT is dialled that way (and
        # held); a public one uses the connection the other dialled out, and serves no holds.
        links = None
        if getattr(self.dht, "relays", ()):
            hold_streams = P2PStreams(self.p2p, f"opendiloco.{ns}.hold", m)
            links = RelayLinks(self.records.relay_book, self.p2p, hold_streams.connect)
            await hold_streams.listen(links.serve_hold)
        self.relay_links = links
        self._relayed_round_done = False
        """A round completed since the relayed connections were last replaced (``_round`` replaces them)."""
        self.relay_slots = RelaySlots(self.p2p, self.dht.relays) if links is not None else None
        # A public worker that cannot dial one behind NAT asks it through its relay to dial back; one behind
        # NAT serves those asks (a NAT'd peer is reached through relays: ``links``).
        reversal_streams = P2PStreams(self.p2p, f"opendiloco.{ns}.reverse", m)
        self.reversal = ConnectionReversal(self.p2p, reversal_streams, self.records.relay_book,
                                           self.records.address_book)
        if links is not None:
            await reversal_streams.listen(self.reversal.serve)
        book, reversal = self.records.address_book, (None if links is not None else self.reversal)
        self.reduce_streams = P2PStreams(self.p2p, f"opendiloco.{ns}.reduce", m, links, book, reversal)
        self.state_streams = P2PStreams(self.p2p, f"opendiloco.{ns}.state", m, links, book, reversal)
        await self.reduce_streams.listen(self.rounds.serve)
        self.state_server = StateServer(self.state_streams)
        await self.state_server.listen()
        self.doorbell = Doorbell()
        self.match_streams = P2PStreams(self.p2p, f"opendiloco.{ns}.match", m, links, book, reversal)
        await self.match_streams.listen(self._on_ring)
        self._background: set[asyncio.Task] = set()
        if self.relay_slots is not None:  # behind NAT: a relay that restarted forgot its slot there
            self.relay_slots.on_moved = self._on_router_moved
            self.relay_slots.on_slot_back = self._on_slot_back
            self._in_background(self.relay_slots.keep())
            self._in_background(self.relay_slots.watch())
            self._in_background(self._widen_relays())

    async def _widen_relays(self) -> None:
        """Behind NAT: slots on the run's public workers too, named in this worker's record (``widen``)."""
        while True:
            await asyncio.sleep(WIDEN_EVERY_S)
            try:
                if await widen(self.relay_slots, self._peer_id, self._workers_snapshot):
                    self.presence.relays = self.relay_slots.named()
                    self.presence.publish_soon()
            except Exception as e:  # the next look tries again
                log.debug("holding slots on the run's workers: %s: %s", type(e).__name__, e)

    # -- matchmaking pushes ------------------------------------------------------------------
    async def _on_ring(self, stream: ByteStream) -> None:
        try:
            frame = await asyncio.wait_for(stream.recv(max_payload=MAX_PUSH_BYTES, expect=Code.GROUP), 5.0)
            key, attempt = meta_field(frame.meta, "key", str)[:64], meta_field(frame.meta, "attempt", int)
            if frame.payload:
                self.records.accept_pushed(decode_push(frame.payload))
            self.doorbell.ring(key, attempt)
        except Exception as e:  # a push is checked record by record; a bad one is dropped
            log.debug("dropped a matchmaking push from %s: %s", stream.remote[-8:], e)
        finally:
            stream.close()

    def _push(self, peers, key: str, attempt: int, pushed: list[PushedRecord]) -> None:
        """Called from the round thread: sends every peer these records and rings its doorbell, in the
        background (a peer that misses a push still finds the records in the DHT)."""
        payload = encode_push(pushed)

        async def push(peer: str) -> None:
            try:
                stream = await asyncio.wait_for(self.match_streams.connect(peer), 5.0)
                try:
                    await stream.send(Code.GROUP, {"key": key, "attempt": attempt}, payload)
                finally:
                    stream.close()
            except Exception as e:  # the peer still finds the records by reading the DHT
                log.debug("could not push to %s: %s", peer[-8:], e)

        def schedule() -> None:
            for peer in peers:
                self._in_background(push(peer))

        self._loop.call_soon_threadsafe(schedule)

    # -- progress records --------------------------------------------------------------------
    def report_progress(self, **fields) -> None:
        """Publishes this worker's ``Progress`` (``Presence.report``; a field it lacks: ``TypeError``)."""
        self.presence.report(**fields)

    def live_workers(self):
        return self.presence.live_workers()

    async def _refresh_workers(self) -> None:
        """Keeps a snapshot of the run's records for ``peer_paces`` (asked after every inner step).

        Read four times a heartbeat (0.5 s by default): a record changes at its writer's heartbeat, or at
        once when its outer step or readiness does, and the pace estimate extrapolates each peer's work
        from when its figure was true. Each read is a DHT lookup the peers answer, with every record's
        signature checked: at eight reads a heartbeat the reads were most of an idle run's CPU."""
        interval = min(1.0, max(0.25, self.settings.heartbeat_interval / 4))
        key = self.records.workers_key()
        while True:
            try:
                found = await self.dht.get(key, latest=True, return_future=True)
                workers = self.records.workers_from(found, self.presence.max_ttl)
                self._workers_snapshot = self.presence.same_settings(workers)
                self._snapshot_reads += 1
            except Exception as e:  # the DHT may be busy or shutting down: keep the last snapshot
                log.debug("refreshing the workers snapshot: %s", e)
            await asyncio.sleep(interval)

    def peer_paces(self, outer_step: int) -> list[Pace]:
        """The paces of the peers heading for ``outer_step`` whose word counts here (``partners.py``)."""
        snapshot = self.presence.partners.voters(self._workers_snapshot)
        return [r.pace(self.records.clock) for p, r in snapshot.items()
                if p != self._peer_id and r.heading == outer_step]

    # -- a round -------------------------------------------------------------------------------
    def start(self, flat, *, weight, key, out=None, error_out=None) -> Work:
        if self._closed:
            raise AveragingError("the communicator is closed")
        flat = flat.detach()
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.device.type != "cpu":
            raise ValueError("start() takes a flat fp32 CPU tensor")
        if out is None:
            out = torch.empty_like(flat)
        elif out.shape != flat.shape or out.dtype != torch.float32 or out.device.type != "cpu":
            raise ValueError("out must be a flat fp32 CPU tensor of the same size as flat")
        if error_out is not None and (error_out.shape != flat.shape or error_out.dtype != torch.float32):
            raise ValueError("error_out must be a flat fp32 tensor of the same size as flat")
        return FutureWork(self._rounds_thread.submit(self._round, flat, float(weight), key, out, error_out))

    def _round(self, flat: torch.Tensor, weight: float, key: RoundKey, out: torch.Tensor,
               error_out: torch.Tensor | None = None) -> AverageResult:
        """One round, from announcement to a verified average (runs on the round thread)."""
        s = self.settings
        began, entered_at = time.perf_counter(), time.time()
        self._loop.call_soon_threadsafe(self.rounds.reopen, str(key))  # before any peer can hear of this round
        self.hooks.round_began(key, flat)
        if self.relay_links is not None:
            # Relayed connections that carried the last round (a relay's quota is per connection), or are
            # about to reach its time limit, are replaced now, before this worker announces itself, so
            # that no member's stream of this round meets a connection being replaced. Replaced a second
            # after each round instead, they met the next round's first attempt whenever rounds came
            # that fast (natmix: the first attempt of every round failed).
            older_than, self._relayed_round_done = (0.0 if self._relayed_round_done else RENEW_BEFORE_ROUND_S), False
            try:
                self._call(self.relay_links.renew(older_than), timeout=DIAL_TIMEOUT + 5)
            except Exception as e:  # the round's streams dial anew
                log.debug("renewing relayed connections: %s: %s", type(e).__name__, e)
        self.state = RoundState.ANNOUNCE
        self.report_progress(outer_step=key.outer_step)
        # The live workers are read while this worker announces itself on the last snapshot of them: a read
        # costs two round trips, which the announcement spends travelling (``Matchmaker.form_group``).
        workers = self.presence.read_live_workers()
        snapshot = self._workers_snapshot
        try:
            if snapshot:
                self.presence.raise_if_drifted(key.outer_step, snapshot)
        except AveragingError:
            self.state = RoundState.FAILED
            raise
        attempt, errors, suspects = self._first_attempt(key), [], set()
        first_read, checked = workers, []

        def check(fresh):
            checked.append(True)
            self.presence.raise_if_drifted(key.outer_step, fresh)

        while len(errors) < s.max_attempts:
            self._raise_if_interrupted()
            self.state = RoundState.GROUP
            try:
                group, attempt = self.matchmaker.form_group(
                    key, attempt, flat.numel(), suspects, workers, provisional=snapshot or None, check=check)
                workers = snapshot = None  # a retry reads them afresh
            except AveragingError:
                self.state = RoundState.FAILED
                raise
            mm_s = time.perf_counter() - began
            held = self.recent.hold(group.members, self.records.departed())
            if held:  # a side of a split run: nothing is exchanged, the work stays for the next round
                self._used_attempt(key, attempt)
                self._loop.call_soon_threadsafe(self.rounds.finish, group.group_id)  # its streams are refused at once
                self.state = RoundState.FAILED
                raise SplitHold(f"round {key}: {held}")
            settled = False
            try:
                try:
                    outcome = self._exchange(group, flat, weight, out, error_out)
                except InDoubt as doubt:
                    outcome, settled = self._settle(group, doubt), True
                    if outcome is None:  # every member that could have completed it failed it
                        raise
                except Interrupted:
                    runner = self._runner
                    if runner is not None and runner.group is group and runner.may_have_completed():
                        raise RoundCounted(f"the worker stopped in round {key} ({group.group_id}) after members may "
                                           "have completed it; not keeping the work", completed=False,
                                           group_outer_step=key.outer_step + 1) from None
                    raise
                finally:
                    self._note_offenders(group)
            except RoundCounted:  # the group completed it (or may have): adopt its state, never retry
                self.state = RoundState.FAILED
                self._used_attempt(key, attempt)
                raise
            except AveragingError as e:
                if isinstance(e, PeerFailure):  # one that refused us, or said it failed too, is back for the retry
                    runner = self._runner if self._runner is not None and self._runner.group is group else None
                    suspects |= e.peers - {self._peer_id} - (runner.refused_by if runner else set()) - \
                        (e.failed_too if isinstance(e, InDoubt) else set())
                    suspects |= (e.gone if isinstance(e, InDoubt) else set()) - {self._peer_id}
                errors.append(f"attempt {attempt}: {e}")
                log.warning("round %s, attempt %d with %d peers failed: %s", key, attempt, len(group.members), e)
                self._used_attempt(key, attempt)
                attempt += 1
                continue
            self._used_attempt(key, attempt)
            if not checked:  # the group closed before the read came: the drift check is made on it now
                self._check_drift_late(key, first_read)
            self.state = RoundState.DONE
            self._loop.call_soon_threadsafe(self.rounds.completed, str(key), group.group_id)
            self.presence.last_group = set(group.members)
            self.presence.partners.add(group.members)
            self.unreachable.reached(group.members)
            self.recent.completed(group.members)
            self._relayed_round_done = True  # the next round starts on fresh relayed connections
            self.report_progress(last_sync_time=self.records.clock.now())
            result = AverageResult(outcome.flat, group.members, outcome.total_weight, time.perf_counter() - began,
                                     extra={"attempts": len(errors) + 1, "group_id": group.group_id,
                                          "digest": outcome.digest, "transfer_s": outcome.seconds,
                                          "matchmaking_s": mm_s, "bytes_sent": outcome.bytes_sent,
                                          "bytes_received": outcome.bytes_received, "entered_at": entered_at,
                                          "settled": settled, **outcome.bounded})
            self.hooks.round_ended(key, result, error_out)
            return result
        self.state = RoundState.FAILED
        raise AveragingError(f"round {key}: no complete round in {s.max_attempts} attempts: " + "; ".join(errors))

    def _check_drift_late(self, key: RoundKey, read: concurrent.futures.Future) -> None:
        """The drift check on the read of the run's workers made at the round's start, where the group
        closed on the recent view before it came (``form_group``). Without it a worker whose θ_global
        drifted went undetected as long as its rounds came faster than that view was refreshed, its
        peers' records always a step behind. Such a worker does not apply the round: ``DriftError``
        makes it take the run's state (which holds the round) from a peer."""
        try:
            fresh = read.result(timeout=records.DHT_CALL_TIMEOUT)
        except Exception as e:  # no read, no verdict: the next round's check is made
            log.debug("round %s: the late drift check had no read of the workers: %s", key, e)
            return
        try:
            self.presence.raise_if_drifted(key.outer_step, fresh)
        except AveragingError:
            self.state = RoundState.FAILED
            raise

    def _first_attempt(self, key: RoundKey) -> int:
        """Where this worker's attempts at ``key`` start: after those it used in earlier tries of it (the
        matchmaker still moves up to a later attempt that its peers announce)."""
        return self._next_attempt.get(key, 0)

    def _used_attempt(self, key: RoundKey, attempt: int) -> None:
        self._next_attempt[key] = max(self._next_attempt.get(key, 0), attempt + 1)
        self._next_attempt.move_to_end(key)
        while len(self._next_attempt) > ATTEMPT_KEYS:
            self._next_attempt.popitem(last=False)

    def _note_offenders(self, group: Group) -> None:
        """Remembers the members whose bytes failed this worker's own checks in this attempt, and the
        members it could not dial at all (``UnreachablePeers.failed_dial``: one behind NAT at once, its
        relay gone; a public one the second time, as the first may be a restart)."""
        runner = self._runner
        if runner is not None and runner.group is group:
            for peer, reason in dict(runner.malformed).items():  # a stopped attempt may still be ending
                self.offenders.add(peer, group.key.outer_step, reason)
            for peer in runner.breakers - set(runner.malformed):
                self.breakers.add(peer, group.key.outer_step, f"gave up on attempt {group.attempt} blaming no other "
                                                              "member")
            for peer in set(runner.unreachable):
                self.unreachable.failed_dial(peer, group.key.outer_step, relayed=peer in group.relayed)

    def _out_of(self, group: Group, peer: str) -> bool:
        """Whether ``peer`` cannot have completed ``group``'s attempt, by the run's records: it left them,
        or its record says it failed that attempt (``WorkerRecord.abandoned``; a member cut off by a new
        address keeps its record fresh, and a question to it hung for 15 s in the long scenario)."""
        record = self._workers_snapshot.get(peer)
        return record is None or record.abandoned == group.group_id

    def _settle(self, group: Group, doubt: InDoubt) -> RoundOutcome | None:
        """Asks the members that may have completed a failed attempt whether they did (``outcome.resolve``):
        the average to apply, None to retry, or ``RoundCounted``."""
        s = self.settings
        self.state = RoundState.SETTLE
        bound = s.allreduce_timeout + s.verify_timeout  # the longest a member's attempt may still last
        log.warning("round %s failed here (%s) after %d member(s) got this worker's whole shard: asking them whether "
                    "they completed it", group.group_id, doubt, len(doubt.ask))
        try:
            return self._call(resolve(doubt, self.reduce_streams.connect, group.key, bound, self.rounds,
                                      gone=lambda peer: self._out_of(group, peer)),
                              timeout=bound + 10, interruptible=True)
        except RoundCounted:
            raise
        except AveragingError as e:  # stopping, or the loop did not answer: the work may have been counted
            raise RoundCounted(f"round {group.key} ({group.group_id}) in doubt and unresolved ({e}); adopting the "
                               "run's state", group_outer_step=group.key.outer_step + 1, completed=False) from None

    def _exchange(self, group: Group, flat: torch.Tensor, weight: float, out: torch.Tensor,
                  error_out: torch.Tensor | None) -> RoundOutcome:
        try:
            outcome = self._exchange_once(group, flat, weight, out, error_out)
        except BaseException as e:
            self.hooks.attempt_ended(group, e)
            raise
        self.hooks.attempt_ended(group, None)
        return outcome

    def _exchange_once(self, group: Group, flat: torch.Tensor, weight: float, out: torch.Tensor,
                       error_out: torch.Tensor | None) -> RoundOutcome:
        s = self.settings
        self.state = RoundState.EXCHANGE
        if len(group.members) == 1:
            t0 = time.perf_counter()
            average_alone(self.codec, flat, weight, out, error_out, chunk=s.part_numel)  # or an AveragingError
            return RoundOutcome(out, weight, "solo", 0, time.perf_counter() - t0)
        return self._call(self._data_plane(group, flat, weight, out, error_out),
                          timeout=s.allreduce_timeout + s.verify_timeout + 10, interruptible=True)

    async def _data_plane(self, group: Group, flat: torch.Tensor, weight: float, out: torch.Tensor,
                          error_out: torch.Tensor | None = None) -> RoundOutcome:
        """The exchange and verification of one attempt, on the event loop."""
        s = self.settings
        await self.hooks.before_exchange(group)
        runner = self._runner = self.hooks.runner_for(group, self.round_runner)(
            group, self._peer_id, flat, weight, self.codec, out=out, part_numel=s.part_numel,
            timeout=s.allreduce_timeout, confirm_timeout=s.verify_timeout, result_codec=self.result_codec,
            error_out=error_out, aggregation=s.aggregation, audit_chunks=s.audit_chunks)
        await self.rounds.register(runner)
        watch = asyncio.create_task(self._give_up_on_vanished(runner, group))
        try:
            return await runner.run(self.reduce_streams.connect)
        except AveragingError:
            # It sends nothing more in this attempt: members still waiting on it there stop at once, where
            # its refusal does not reach them (a stream stuck in a relay left one waiting 60 s).
            self._in_background(self.presence.say_abandoned(group.group_id))
            raise
        finally:
            watch.cancel()
            self.rounds.finish(group.group_id)

    def _in_background(self, coro) -> None:
        """Runs ``coro`` on the loop (called there), kept referenced until it is done. An error it ends
        with is logged here, never left unretrieved (asyncio would print that with a traceback)."""
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a publish that failed: the next says it
            log.debug("background task: %s: %s", type(task.exception()).__name__, task.exception())

    async def _give_up_on_vanished(self, runner: RoundRunner, group: Group) -> None:
        """Fails the attempt as soon as a member it still waits on has left the run's records, or says
        in its record that it ended this attempt (failed it there); or as soon as this worker is cut off.

        A member frozen or cut off mid-exchange (SIGSTOP, a partition) sends nothing and closes nothing,
        so the attempt would wait out ``allreduce_timeout`` (60 s) while every other member idles. Its
        record expires ``record_ttl`` after its last heartbeat; once it has been gone from two reads
        and ``VANISHED_S``, the attempt fails as at its timeout and the next one forms without it (the
        matchmaker expects only live workers). What the attempt waits on includes the audit's answers:
        a member that froze once its parts and shard were in held eight others 36 s there. Sooner than
        that, a member whose daemon froze with it leaves a ping unanswered while the others echo
        (``swarm/frozen.py``): given up on then, some 5 s after its last frame. A member that is slow
        but alive keeps its record and echoes, and is waited for as before.

        A member whose address changed mid-exchange keeps its record fresh (its DHT node finds the run
        from the new address), while every stream of the attempt, its own and the others' to it, hangs
        on a connection that is gone: in the world scenario that held every worker 39-58 s. Such a
        member hears nothing from anyone; after ``cut_off_after`` seconds of that it abandons the
        attempt (``_cut_off``), and its record tells the others to stop waiting for it. Any member that
        fails an attempt says so the same way (``WorkerRecord.abandoned``): a refusal, its other word for
        it, does not reach a member whose stream to it is stuck (in a relay, say)."""
        loop = asyncio.get_running_loop()
        gone_since: dict[str, tuple[float, int]] = {}
        probe = FrozenProbe(runner, self._ping, self._peer_id, skip=group.relayed)
        try:
            while not runner.ended.is_set():
                await asyncio.sleep(1.0)
                if await self._gave_up(runner, group, probe, gone_since, loop.time()):
                    return
        finally:
            probe.close()

    async def _gave_up(self, runner: RoundRunner, group: Group, probe: FrozenProbe,
                       gone_since: dict[str, tuple[float, int]], now: float) -> bool:
        """One look of ``_give_up_on_vanished``: True once the attempt was given up (or abandoned) here."""
        cut_off_after = self.settings.cut_off_after
        if cut_off_after and runner.silent_for() >= cut_off_after:
            await self._cut_off(runner, group)
            return True
        frozen = probe.step()
        if frozen is not None and runner.waits_on(frozen) and not runner.ended.is_set():
            log.warning("round %s: member %s left a ping unanswered for %.0f s while the other members answered "
                        "(frozen, or its links to this worker broke), with its part of the exchange still owed: "
                        "giving up on it", group.group_id, frozen[-8:], PING_TIMEOUT_S)
            self.unanswered.found(frozen)  # not waited for in the retry's matchmaking either
            await runner.give_up_on(frozen, "left a ping unanswered")
            return True
        live, reads = self._workers_snapshot, self._snapshot_reads
        for m in group.members:
            if m == self._peer_id or not runner.waits_on(m):
                gone_since.pop(m, None)
                continue
            if m in live and live[m].abandoned == group.group_id:
                log.warning("round %s: member %s ended this attempt (it failed there) with its part of the "
                            "exchange still owed: giving up on it", group.group_id, m[-8:])
                await runner.give_up_on(m, "ended its attempt")
                if m not in runner.heard_from:  # cut off (a new address, say): the connection to it is dead
                    await self._disconnect({m})
                return True
            if m in live:
                gone_since.pop(m, None)
                continue
            since, at_read = gone_since.setdefault(m, (now, reads))
            if now - since >= VANISHED_S and reads - at_read >= 2:
                log.warning("round %s: member %s is gone from the run's records (no heartbeat for %.0f s) "
                            "with its part of the exchange still owed: giving up on it", group.group_id,
                            m[-8:], self.presence.record_ttl)
                await runner.give_up_on(m, "left the run's records")
                return True
        return False

    async def _cut_off(self, runner: RoundRunner, group: Group) -> None:
        """This worker heard nothing from any member of the attempt for ``cut_off_after`` seconds while
        it waits on them: its connections to them are taken for dead. It closes them (the next streams
        and DHT calls dial anew, from whatever address it has now), says so in its record, and abandons
        the attempt."""
        others = set(group.members) - {self._peer_id}
        log.warning("round %s: heard nothing from any of its %d other member(s) for %.0f s while waiting on them "
                    "(this worker's address changed, or its links broke): abandoning the attempt and dialling anew",
                    group.group_id, len(others), runner.silent_for())
        if self.relay_slots is not None:  # behind NAT, its router's address may have changed: its relays
            self.relay_slots.renew_soon()  # dropped its slots with its connections to them
        await self._disconnect(others)
        await runner.abandon("heard nothing from any member (cut off)")  # which its record then says

    def _on_new_address(self, gone: list[str], now: list[str]) -> None:
        log.warning("this worker's address changed (%s gone; %s now): closing its connections so that streams "
                    "dial anew%s", " ".join(gone), " ".join(now),
                    ", and abandoning the attempt in flight" if self._in_flight() else "")
        self._in_background(self._readdressed())

    def _on_router_moved(self, relay: str) -> None:
        self._router_moved(f"this worker's connection to its relay {relay[-8:]} broke, and a new one holds its "
                           "slot again", keep={relay})  # its new connection to the relay holds its slot

    def _router_moved(self, sign: str, keep: set[str]) -> None:
        log.warning("%s: its router's address changed. Closing its connections so that streams dial anew%s", sign,
                    ", and abandoning the attempt in flight" if self._in_flight() else "")
        self._in_background(self._readdressed(keep=keep))

    def _on_slot_back(self, relay: str) -> None:
        """The members behind NAT this worker could not dial while the relay was down are tried again at
        once, not only after ``UNREACHABLE_ROUNDS`` outer steps (their slots come back with the relay:
        in the long scenario the two NAT'd workers stayed apart 35 s after the bootstrap's return)."""
        def forget() -> None:  # on the round thread, which alone reads and names them (between two rounds)
            natted = [p for p in self.unreachable.named() if self.records.relay_book.of(p)]
            if natted:
                log.info("relay %s is back: trying %s again (behind NAT, named unreachable while it was down)",
                         relay[-8:], ", ".join(p[-8:] for p in natted))
                self.unreachable.forget(natted)

        try:
            self._rounds_thread.submit(forget)
        except RuntimeError:  # this worker is stopping
            pass

    def _on_rejoined(self) -> None:
        """Behind NAT, the other sign of its router's move: its DHT node lost every peer at once and its
        redial found them at once (it may beat the relay watch to the relay's connection, and the
        watch then sees a live one). Not within ``OWN_CLOSE_GRACE_S`` of closing its connections itself."""
        if self.relay_slots is None or self.relay_slots.closed_recently():
            return
        self._router_moved("this worker's DHT node lost every peer at once and found them again at the redial",
                           keep=set(self.relay_slots.relays))

    async def _ping(self, peer: str) -> bool | None:
        """libp2p's ping, as ``swarm/frozen.py`` reads it (this node's daemon is up once the loop runs)."""
        return await ping(self.p2p, peer, timeout=PING_TIMEOUT_S)

    def _in_flight(self) -> RoundRunner | None:
        runner = self._runner
        return runner if runner is not None and not runner.ended.is_set() else None

    async def _readdressed(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Its connections through the old address are dead, and a stream on one hangs until a transport
        timeout (39-58 s in the world scenario), its own and the members' to it alike: they are closed,
        and an attempt in flight is abandoned, which its record says, so the members stop waiting on it
        at once rather than after ``cut_off_after``. Its record counts the move (``WorkerRecord.moves``):
        its peers' connections to it are as dead, and they close them when they read it. Connections to
        ``keep`` were dialled since the move, and stay."""
        runner = self._in_flight()
        self.presence.moves += 1
        try:
            peers = {info.peer_id.to_base58() for info in await asyncio.wait_for(self.p2p.list_peers(), DIAL_TIMEOUT)}
        except Exception as e:  # asyncio.TimeoutError included: the members' connections are closed still
            log.debug("listing this node's connections: %s: %s", type(e).__name__, e)
            peers = set()
        if runner is not None:
            peers |= set(runner.group.members)
        if self.relay_slots is not None:  # its relays forget its slots with its connections to them (and
            self.relay_slots.renew_soon()  # the closes below are its own: no new move)
        await self._disconnect(peers - {self._peer_id} - set(keep))
        if runner is not None:
            await runner.abandon("this worker's address changed")  # which publishes its record
        else:
            self.presence.publish_soon()

    def _note_peers_moved(self, peers: set[str]) -> None:
        """``RunRecords.on_peers_moved`` (any thread): ``_peers_moved`` on the loop."""
        try:
            self._loop.call_soon_threadsafe(lambda: self._in_background(self._peers_moved(peers)))
        except RuntimeError:  # the loop is closed: this worker is stopping
            pass

    async def _peers_moved(self, peers: set[str]) -> None:
        """``peers``' records say their address changed: this node's connections to them are dead (streams
        on them hang until a transport timeout), so they are closed and the next stream dials the new
        address. Behind NAT this worker dials them at once: they cannot dial it back."""
        peers = peers - {self._peer_id}
        if not peers:
            return
        log.info("the address of %s changed (their records say): closing the connections to them so that "
                 "streams dial them anew", ", ".join(sorted(p[-8:] for p in peers)))
        await self._disconnect(peers)
        if self.presence.publish_addrs:
            return
        book = self.records.address_book
        await asyncio.gather(*(dial_addrs(self.p2p, p, book.of(p)) for p in sorted(peers) if book.of(p)))

    async def _disconnect(self, peers: set[str]) -> None:
        """Closes this node's connections to ``peers``: ones that hang are then dialled anew."""
        if self.relay_slots is not None:
            self.relay_slots.closing(peers)
        await asyncio.gather(*(close_connections(self.p2p, p) for p in sorted(peers)))

    # -- state for joiners -------------------------------------------------------------------
    def attach_state_provider(self, provider: StateProvider) -> None:
        self.state_server.provider = provider

    def download_state(self, timeout: float, min_outer_step: int | None = None,
                       max_bytes: int | None = None, majority_hash: str | None = None) -> dict | None:
        """The state the run confirms (``quorum``), from a live peer that holds it; None if the run has
        no other live worker. The returned state names that hash (``confirmed_hash``, set here, never
        by the donor), and ``load_shareable_state`` adopts it only if θ_global matches."""
        # This worker's own state (the optimizer's) bounds and checks what it downloads: a donor that
        # serves a state it would refuse is named, and the next donor is asked.
        max_bytes = download_bound(max_bytes, self.state_server.provider)
        check = own_check(self.state_server.provider)
        deadline = time.monotonic() + timeout
        errors: dict[str, str] = {}
        tried_parts = False
        while True:
            self._raise_if_interrupted(Interrupted("the worker is stopping: state download abandoned"))
            workers = self.live_workers()
            others = [r for p, r in workers.items() if p != self._peer_id and r.outer_step >= 0]
            if not others and min_outer_step is None:
                if errors:  # the donors failed and left (died mid-download): not the same as "nobody there"
                    raise AveragingError(f"the peers serving state failed and left: {errors}")
                return None
            if majority_hash is not None and any(r.global_hash == majority_hash for r in others):
                wanted = majority_hash
                # The step most of its holders say it is at: a record that pairs the hash with another
                # step (10**6, say) is no donor.
                steps = collections.Counter(r.outer_step for r in others if r.global_hash == wanted)
                wanted_step = max(steps, key=lambda k: (steps[k], -k))
            else:  # what the run confirms now (it may have moved past the state an error named)
                # Catching up (a step to reach) weighs this worker's own state; joining does not.
                mine = None if min_outer_step is None else self.presence.my_claim(self.presence.get("outer_step", -1))
                claim = confirmed(self._voters(workers, mine), self._peer_id, mine, min_outer_step)
                wanted, wanted_step = (None, None) if claim is None else (claim.global_hash, claim.outer_step)
            candidates = [r for r in others
                          if wanted is not None and (r.global_hash, r.outer_step) == (wanted, wanted_step)
                          and (min_outer_step is None or r.outer_step >= min_outer_step)]
            if candidates and not tried_parts:  # once per download: its manifests take a turn of each donor's
                tried_parts = True
                state = self._download_in_parts(candidates, wanted, wanted_step, min_outer_step, max_bytes, check,
                                                deadline, errors)
                if state is not None:
                    return state
            for rec in candidates:  # one donor at a time: donors of older versions, or a run that moved on
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                t0 = time.perf_counter()
                try:
                    state = self._call(fetch_state(self.state_streams, rec.peer_id, min_outer_step, max_bytes, check),
                                       remaining, interruptible=True)
                    served, confirmed_hash = state.get("outer_step"), wanted
                    if served != rec.outer_step:
                        if type(served) is not int or served < rec.outer_step:
                            raise AveragingError(f"served outer step {served!r}, its record says {rec.outer_step}")
                        # The donor applied a round while we asked (a busy run moves on every few
                        # seconds): its newer state is taken once the run confirms it, never on its word.
                        confirmed_hash = self._confirmed_hash_at(served, min_outer_step is not None,
                                                                 min(10.0, max(0.0, deadline - time.monotonic())))
                        if confirmed_hash is None:
                            raise AveragingError(f"served outer step {served}, which the run did not confirm "
                                                 f"(its record said {rec.outer_step})")
                    if check is not None:  # θ_global itself, against the hash the run confirms
                        check(state, min_outer_step, expected_hash=confirmed_hash)
                except Interrupted:
                    raise
                except Exception as e:
                    errors[rec.peer_id[-8:]] = str(e) or type(e).__name__
                    continue
                state["confirmed_hash"] = confirmed_hash
                log.info("downloaded state of outer step %s from %s in %.2fs", state.get("outer_step"),
                         rec.peer_id[-8:], time.perf_counter() - t0)
                return state
            if time.monotonic() >= deadline:
                raise AveragingError(f"no peer served the state the run confirms within {timeout:.0f}s"
                                     + (f": {errors}" if errors else ""))
            left = self.matchmaker.left_out
            if left is not None and min_outer_step == left.key.outer_step + 1:
                why = self.matchmaker.left_out_for_nothing(left)
                if why:  # no state of that step is coming: back to the round, where the others wait
                    raise AveragingError(why)
            self._interrupted.wait(0.5)

    def _download_in_parts(self, candidates: list, wanted_hash: str, wanted_step: int, min_outer_step: int | None,
                           max_bytes: int, check, deadline: float, errors: dict[str, str]) -> dict | None:
        """The state of ``wanted_step`` in parts from up to ``MAX_DONORS`` of ``candidates`` (those fast last
        time first), checked against ``wanted_hash``; None (the reason in ``errors``) if that failed."""
        donors = sorted((r.peer_id for r in candidates), key=lambda p: -self._donor_rates.get(p, 0.0))[:MAX_DONORS]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        t0 = time.perf_counter()

        def fetch(step: int) -> Download:
            return self._call(fetch_from_donors(self.state_streams, donors, step, max_bytes, check, min_outer_step),
                              max(1.0, deadline - time.monotonic()), interruptible=True)

        try:
            try:
                got = fetch(wanted_step)
            except DonorsAhead as ahead:  # the run moved on while we read its records: its next state, once confirmed
                wanted_hash = self._confirmed_hash_at(ahead.outer_step, min_outer_step is not None,
                                                      min(10.0, max(0.0, deadline - time.monotonic())))
                if wanted_hash is None:
                    raise
                wanted_step = ahead.outer_step
                got = fetch(wanted_step)
            if check is not None:  # θ_global itself, against the hash the run confirms
                check(got.state, min_outer_step, expected_hash=wanted_hash)
        except Interrupted:
            raise
        except Exception as e:
            errors["in parts"] = str(e) or type(e).__name__
            log.info("state of outer step %s in parts failed (%s); asking donors one at a time", wanted_step,
                     errors["in parts"])
            return None
        self._donor_rates.update(got.rates)
        self._call(tell_done(self.state_streams, got.donors, wanted_step), 10)
        got.state["confirmed_hash"] = wanted_hash
        log.info("downloaded state of outer step %s in parts from %d of %d donor(s) in %.2fs", wanted_step,
                 len(got.rates), len(donors), time.perf_counter() - t0)
        return got.state

    def _voters(self, workers: dict, mine) -> dict:
        """The records that vote on a state to download: a joiner's (``mine`` None) counts every worker,
        a worker catching up only those whose word counts here (``partners.py``)."""
        return workers if mine is None else self.presence.partners.voters(workers)

    def _confirmed_hash_at(self, outer_step: int, catching_up: bool, timeout: float) -> str | None:
        """The θ_global hash the run confirms at ``outer_step`` once its records say so (within
        ``timeout``); None if the run confirms another state there, or moves past it first."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self.live_workers()
            mine = self.presence.my_claim(self.presence.get("outer_step", -1)) if catching_up else None
            claim = confirmed(self._voters(workers, mine), self._peer_id, mine, outer_step)
            if claim is not None and claim.outer_step == outer_step:
                return claim.global_hash
            if claim is not None or time.monotonic() >= deadline:
                return None
            self._raise_if_interrupted(Interrupted("the worker is stopping: state download abandoned"))
            self._interrupted.wait(0.2)

    # -- shutdown ----------------------------------------------------------------------------
    def interrupt(self) -> None:
        """The worker is stopping: every wait for peers, the DHT or a download gives up at once, and the
        run is told that this worker leaves (its peers stop waiting for it while it writes its checkpoint).
        Called from a signal handler, so it only sets a flag."""
        self._interrupted.set()

    async def _leave_when_stopping(self) -> None:
        while not self._interrupted.is_set():
            await asyncio.sleep(records.INTERRUPT_POLL)
        await self.presence.leave()

    async def _left(self) -> None:
        await asyncio.wrap_future(self._leaving)

    def _raise_if_interrupted(self, error: AveragingError | None = None) -> None:
        if self._interrupted.is_set():
            raise error or Interrupted("the worker is stopping: round abandoned")

    def close(self) -> None:
        """Leaves the run and stops the node; a round or download still waiting gives up at once."""
        if self._closed:
            return
        self._closed = True
        self._interrupted.set()
        self._rounds_thread.shutdown(wait=False, cancel_futures=True)
        # Every step is bounded: a worker whose peers or network are gone still exits within seconds.
        steps = (("announcing that this worker leaves", self._left, LEAVE_TIMEOUT),  # begun when stopping
                 # a round still in its data plane ends now (its thread sees an error), not at its timeout
                 ("cancelling the communicator's tasks", _cancel_other_tasks, CLOSE_STEP_TIMEOUT),
                 ("shutting the p2p replica down", self.p2p.shutdown, CLOSE_STEP_TIMEOUT))
        for what, step, timeout in steps:
            try:
                self._call(step(), timeout=timeout)
            except Exception as e:
                log.debug("%s: %s", what, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_STEP_TIMEOUT)
        if self._own_dht:
            self.dht.shutdown()  # hivemind's own bound: its process is terminated after 3 s
