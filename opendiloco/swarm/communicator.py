"""The swarm communicator: a round's state machine over presence, matchmaking, the round runner and state transfer.

hivemind's own DecentralizedAverager is not used for the averaging: it sends each peer back a
*difference* to add to its own values (peers never end bit-identical), and a failure mid round
can leave a partially averaged result reported as success. A round here goes through explicit
states, one job per module:

    ANNOUNCE  presence.py      our progress record; drift check against the run's majority
    GROUP     matchmaking.py   the run's live workers ready for this key form a group
    EXCHANGE  comm/runner.py   streamed reduce-scatter / all-gather over p2p streams (streams.py),
                               its members watched (member_watch.py)
    VERIFY    comm/runner.py   every member confirms the digest of the whole average
    SETTLE    comm/outcome.py  an attempt that failed here after members may have completed it asks them
    DONE / FAILED

A failed attempt changes nothing and is retried with whoever is still there (less a member whose bytes
failed this worker's checks: it is left out of the next groups, exclusion.py), unless members may
have completed it (they apply without every confirmation): then this worker asks them, and ends
with the group's outcome (``outcome.resolve``): it applies the average it holds, adopts the group's
state (``RoundCounted``), or retries when they all failed it. A worker that finds the group ahead
of it raises ``BehindError`` so that its optimizer downloads state (state/download.py) instead.
What is not the round's lives beside it: the settings (settings.py), the start from a config
(startup.py), the p2p protocols (protocols.py), matchmaking pushes (pushes.py), the run's records
as last read (run_snapshot.py) and this worker's watch over its own connectivity (connectivity/watch.py).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import functools
import logging
import threading
import time

import hivemind
import torch
import uvloop

from ..comm.base import AverageResult, Communicator, FutureWork, RoundKey, StateProvider, Work
from ..comm.formats import get_codec
from ..comm.group import Group, group_label
from ..comm.local import average_alone
from ..comm.outcome import resolve
from ..comm.rounds_taken import Rounds
from ..comm.runner import RoundOutcome, RoundRunner
from ..errors import AveragingError, InDoubt, Interrupted, RoundCounted, SplitHold
from ..pacing import Pace
from ..timeouts import CLOSE_STEP_TIMEOUT, DHT_CALL_TIMEOUT, LEAVE_TIMEOUT, RENEW_BEFORE_ROUND_S
from ..timeouts import RELAY_DIAL_TIMEOUT as DIAL_TIMEOUT
from . import records
from .connectivity.frozen import Unanswered
from .connectivity.watch import ConnectivityWatch
from .exclusion import Breakers, Offenders, UnreachablePeers, retry_suspects
from .hooks import RoundHooks
from .majority import RecentMembers
from .matchmaking import Doorbell, Matchmaker
from .member_watch import MemberWatch
from .membership import Membership, RunSecret
from .presence import Presence
from .protocols import open_protocols
from .pushes import Pushes
from .run_snapshot import RunSnapshot
from .settings import SwarmSettings
from .signing import Identity
from .startup import start_from_config
from .state.download import StateDownload
from .state.transfer import StateServer

log = logging.getLogger(__name__)


ATTEMPT_KEYS = 1024
"""Round keys whose used attempt numbers a worker remembers (the least recently used are forgotten)."""


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
        s.check()
        self.codec = get_codec(s.compression)
        self.result_codec = get_codec(s.result_compression) if s.result_compression else self.codec.averages
        self._own_dht = own_dht
        self._peer_id = dht.peer_id.to_base58()
        self._closed = False
        self._interrupted = threading.Event()
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
        """Members this worker could not dial: apart from it for a few outer steps."""
        self.breakers = Breakers()
        """Members that broke an attempt of this worker's (``RoundRunner.breakers``): out of the round's retries."""

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
        self.snapshot = RunSnapshot(dht, self.records, self.presence, s.heartbeat_interval)
        self.connectivity = ConnectivityWatch(
            self.p2p, self._peer_id, self.records, self.presence, self.protocols.relay_slots, self.unreachable,
            loop=self._loop, in_flight=self._in_flight, in_background=self._in_background,
            on_round_thread=self._rounds_thread.submit, snapshot=self.snapshot)
        self.connectivity.start()
        self.unanswered = Unanswered(self._loop, self.connectivity.ping)
        self.matchmaker = Matchmaker(
            self.records, self.presence, s.matchmaking_settings(),
            group_label(self.codec, self.result_codec, s.aggregation, s.audit_chunks),
            self._interrupted,
            doorbell=self.doorbell, push=self.pushes.push,
            joiners=lambda step: self.state_server.recent_joiners(step, within=s.straggler_wait + 10.0),
            offenders=self.offenders, unreachable=self.unreachable, liveness=self.unanswered, breakers=self.breakers)
        self.state_download = StateDownload(self._peer_id, self.presence, self.state_server, self.protocols.state,
                                            self.matchmaker, self._call, self._interrupted)
        self._pace_refresh = asyncio.run_coroutine_threadsafe(self.snapshot.refresh(), self._loop)
        self._leaving = asyncio.run_coroutine_threadsafe(self._leave_when_stopping(), self._loop)

    @classmethod
    def from_config(cls, cfg, run_dir: str | None = None, config_fingerprint: str = "") -> SwarmCommunicator:
        """A worker's communicator in its run, started from a ``SwarmConfig`` (``startup.py``)."""
        return start_from_config(cls, cfg, run_dir, config_fingerprint)

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
        self.protocols = await open_protocols(self.p2p, self.membership, self.records, getattr(self.dht, "relays", ()))
        self.relay_links = self.protocols.relay_links
        self._relayed_round_done = False
        """A round completed since the relayed connections were last replaced (``_round`` replaces them)."""
        await self.protocols.reduce.listen(self.rounds.serve)
        self.state_server = StateServer(self.protocols.state)
        await self.state_server.listen()
        self.doorbell = Doorbell()
        self.pushes = Pushes(self.protocols.match, self.records, self.doorbell, self._loop, self._in_background)
        await self.protocols.match.listen(self.pushes.serve)
        self._background: set[asyncio.Task] = set()

    # -- progress records --------------------------------------------------------------------
    def report_progress(self, **fields) -> None:
        """Publishes this worker's ``Progress`` (``Presence.report``; a field it lacks: ``TypeError``)."""
        self.presence.report(**fields)

    def live_workers(self):
        return self.presence.live_workers()

    def peer_paces(self, outer_step: int) -> list[Pace]:
        """The paces of the peers heading for ``outer_step`` whose word counts here (``partners.py``)."""
        snapshot = self.presence.partners.voters(self.snapshot.workers)
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
        """One round, from announcement to a verified average (runs on the round thread): ANNOUNCE, then
        GROUP and EXCHANGE (and SETTLE) per attempt, until one completes or ``max_attempts`` failed."""
        began, entered_at = time.perf_counter(), time.time()
        self._loop.call_soon_threadsafe(self.rounds.reopen, str(key))  # before any peer can hear of this round
        self.hooks.round_began(key, flat)
        self._renew_relayed_links()
        workers, snapshot = self._announce(key)
        attempt, errors, suspects = self._first_attempt(key), [], set()
        first_read, checked = workers, []

        def check(fresh):
            checked.append(True)
            self.presence.raise_if_drifted(key.outer_step, fresh)

        while len(errors) < self.settings.max_attempts:
            self._raise_if_interrupted()
            group, attempt = self._group(key, attempt, flat, suspects, workers, snapshot, check)
            workers = snapshot = None  # a retry reads them afresh
            mm_s = time.perf_counter() - began
            try:
                outcome, settled = self._attempt(key, group, flat, weight, out, error_out)
            except RoundCounted:  # the group completed it (or may have): adopt its state, never retry
                self.state = RoundState.FAILED
                self._used_attempt(key, attempt)
                raise
            except AveragingError as e:
                suspects |= self._suspects(group, e)
                errors.append(f"attempt {attempt}: {e}")
                log.warning("round %s, attempt %d with %d peers failed: %s", key, attempt, len(group.members), e)
                self._used_attempt(key, attempt)
                attempt += 1
                continue
            self._used_attempt(key, attempt)
            if not checked:  # the group closed before the read came: the drift check is made on it now
                self._check_drift_late(key, first_read)
            return self._completed(key, group, outcome, error_out, began, attempts=len(errors) + 1, matchmaking_s=mm_s,
                                   entered_at=entered_at, settled=settled)
        self.state = RoundState.FAILED
        raise AveragingError(f"round {key}: no complete round in {self.settings.max_attempts} attempts: "
                             + "; ".join(errors))

    def _renew_relayed_links(self) -> None:
        """Relayed connections that carried the last round (a relay's quota is per connection), or are about
        to reach its time limit, are replaced now, before this worker announces itself, so that no member's
        stream of this round meets a connection being replaced. Replaced a second after each round instead,
        they met the next round's first attempt whenever rounds came that fast (natmix: the first attempt
        of every round failed)."""
        if self.relay_links is None:
            return
        older_than, self._relayed_round_done = (0.0 if self._relayed_round_done else RENEW_BEFORE_ROUND_S), False
        try:
            self._call(self.relay_links.renew(older_than), timeout=DIAL_TIMEOUT + 5)
        except Exception as e:  # the round's streams dial anew
            log.debug("renewing relayed connections: %s: %s", type(e).__name__, e)

    def _announce(self, key: RoundKey) -> tuple[concurrent.futures.Future, dict]:
        """ANNOUNCE: this worker's record heads for ``key``; the read of the live workers it starts, and the
        last snapshot of them, checked for drift. The read costs two round trips, which the announcement
        spends travelling (``Matchmaker.form_group``)."""
        self.state = RoundState.ANNOUNCE
        self.report_progress(outer_step=key.outer_step)
        workers = self.presence.read_live_workers()
        snapshot = self.snapshot.workers
        try:
            if snapshot:
                self.presence.raise_if_drifted(key.outer_step, snapshot)
        except AveragingError:
            self.state = RoundState.FAILED
            raise
        return workers, snapshot

    def _group(self, key: RoundKey, attempt: int, flat: torch.Tensor, suspects: set[str], workers, snapshot,
               check) -> tuple[Group, int]:
        """GROUP: the group of this attempt (or of a later one its peers announced) and its number;
        ``SplitHold`` where it lacks most of the members of this worker's last rounds (``majority.py``)."""
        self.state = RoundState.GROUP
        try:
            group, attempt = self.matchmaker.form_group(
                key, attempt, flat.numel(), suspects, workers, provisional=snapshot or None, check=check)
        except AveragingError:
            self.state = RoundState.FAILED
            raise
        held = self.recent.hold(group.members, self.records.departed())
        if held:  # a side of a split run: nothing is exchanged, the work stays for the next round
            self._used_attempt(key, attempt)
            self._loop.call_soon_threadsafe(self.rounds.finish, group.group_id)  # its streams are refused at once
            self.state = RoundState.FAILED
            raise SplitHold(f"round {key}: {held}")
        return group, attempt

    def _attempt(self, key: RoundKey, group: Group, flat: torch.Tensor, weight: float, out: torch.Tensor,
                 error_out: torch.Tensor | None) -> tuple[RoundOutcome, bool]:
        """EXCHANGE, and SETTLE where it failed in doubt: the attempt's outcome, and whether it was settled.
        ``RoundCounted`` where members may have completed it and this worker cannot apply their average."""
        settled = False
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
        return outcome, settled

    def _suspects(self, group: Group, error: AveragingError) -> set[str]:
        """The members a failed attempt names, left out of the retry (``exclusion.retry_suspects``)."""
        runner = self._runner if self._runner is not None and self._runner.group is group else None
        return retry_suspects(error, self._peer_id, runner.refused_by if runner else ())

    def _completed(self, key: RoundKey, group: Group, outcome: RoundOutcome, error_out: torch.Tensor | None,
                   began: float, *, attempts: int, matchmaking_s: float, entered_at: float,
                   settled: bool) -> AverageResult:
        """DONE: the round's members are this worker's partners, and its record says when it last synced."""
        self.state = RoundState.DONE
        self._loop.call_soon_threadsafe(self.rounds.completed, str(key), group.group_id)
        self.presence.last_group = set(group.members)
        self.presence.partners.add(group.members)
        self.unreachable.reached(group.members)
        self.recent.completed(group.members)
        self._relayed_round_done = True  # the next round starts on fresh relayed connections
        self.report_progress(last_sync_time=self.records.clock.now())
        result = AverageResult(outcome.flat, group.members, outcome.total_weight, time.perf_counter() - began,
                               extra={"attempts": attempts, "group_id": group.group_id,
                                      "digest": outcome.digest, "transfer_s": outcome.seconds,
                                      "matchmaking_s": matchmaking_s, "bytes_sent": outcome.bytes_sent,
                                      "bytes_received": outcome.bytes_received, "entered_at": entered_at,
                                      "settled": settled, **outcome.bounded})
        self.hooks.round_ended(key, result, error_out)
        return result

    def _check_drift_late(self, key: RoundKey, read: concurrent.futures.Future) -> None:
        """The drift check on the read of the run's workers made at the round's start, where the group
        closed on the recent view before it came (``form_group``). Without it a worker whose θ_global
        drifted went undetected as long as its rounds came faster than that view was refreshed, its
        peers' records always a step behind. Such a worker does not apply the round: ``DriftError``
        makes it take the run's state (which holds the round) from a peer."""
        try:
            fresh = read.result(timeout=DHT_CALL_TIMEOUT)
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
        record = self.snapshot.workers.get(peer)
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
            return self._call(resolve(doubt, self.protocols.reduce.connect, group.key, bound, self.rounds,
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
        watch = asyncio.create_task(MemberWatch(
            runner, group, self._peer_id, cut_off_after=s.cut_off_after, record_ttl=self.presence.record_ttl,
            snapshot=self.snapshot, connectivity=self.connectivity,
            unanswered=self.unanswered).run())
        try:
            return await runner.run(self.protocols.reduce.connect)
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

    def _in_flight(self) -> RoundRunner | None:
        runner = self._runner
        return runner if runner is not None and not runner.ended.is_set() else None


    # -- state for joiners -------------------------------------------------------------------
    def attach_state_provider(self, provider: StateProvider) -> None:
        self.state_server.provider = provider

    def download_state(self, timeout: float, min_outer_step: int | None = None,
                       max_bytes: int | None = None, majority_hash: str | None = None) -> dict | None:
        """The state the run confirms (``quorum``), from a live peer that holds it; None if the run has
        no other live worker. The returned state names that hash (``confirmed_hash``, set here, never
        by the donor), and ``load_shareable_state`` adopts it only if θ_global matches (``state/download.py``)."""
        return self.state_download.run(timeout, min_outer_step, max_bytes, majority_hash)

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
