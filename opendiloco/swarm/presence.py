"""Presence: this worker's progress record (with a heartbeat), the run's live workers, drift checks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable

from ..comm.base import Progress, check_progress
from ..errors import BehindError, DriftError, SwarmError
from ..timeouts import ADDRS_EVERY_S, ADDRS_TIMEOUT, REDIAL_TIMEOUT
from . import records
from .connectivity.addresses import is_local, is_loopback, own_addrs, plain_addrs
from .connectivity.rejoin import redial
from .connectivity.relays import MAX_RELAY_CHARS, MAX_RELAYS, checked_relays
from .partners import Partners
from .quorum import Claim, confirmed_ahead, drifted

log = logging.getLogger(__name__)

SECRET_CHECK_EVERY = 5
PARTNERS_GRACE_TTLS = 20
"""Record lifetimes a worker whose partners are all away counts its own word alone (``partners.py``)."""
MAX_OTHER_SECRETS = 64
"""Workers with another secret remembered (not to be told of twice), at most: anyone may write that key."""
NAMED_AT_MOST = 8
"""Peers a warning names, at most (then how many more)."""


def named(peers) -> str:
    """The ends of some of ``peers``' ids for a log line: ``NAMED_AT_MOST`` of them, and how many more."""
    peers = sorted(peers)
    shown = ", ".join(p[-8:] for p in peers[:NAMED_AT_MOST])
    return shown + (f" and {len(peers) - NAMED_AT_MOST} more" if len(peers) > NAMED_AT_MOST else "")

"""Heartbeats between two looks at which secrets the run id's workers hold (``RunRecords.secret_key``)."""


CLOCK_SLACK = 10.0
"""Seconds a record may claim to live beyond its kind's TTL (peers' clocks differ a little)."""


class OtherSettings(SwarmError):
    """Every live worker of the run has another config fingerprint than this worker: it is the odd one
    out (``startup.refuse_other_settings``). The swarm knows the fingerprint, not what it
    covers: whoever computes it names that (``covering``; the trainer names its config keys)."""

    def __init__(self, detail: str, covers: str = "the settings its config fingerprint covers", advice: str = ""):
        super().__init__(f"{detail}: {covers} must be the same on every worker{advice}")
        self.detail, self.covers, self.advice = detail, covers, advice

    def __reduce__(self):
        return type(self), (self.detail, self.covers, self.advice)

    def covering(self, covers: str, advice: str = "") -> OtherSettings:
        """The same refusal, naming what the fingerprint covers (and how to compare it)."""
        return type(self)(self.detail, covers, advice)


class Presence:
    """Publishes ``WorkerRecord``s under the run's workers key; reads everyone else's.

    ``report`` may be called from any thread; publishing happens on the communicator's event
    loop. A record expires ``record_ttl`` seconds after its last heartbeat, so a frozen or dead
    worker drops out of the live set by itself.
    """

    def __init__(self, run_records: records.RunRecords, peer_id: str, loop: asyncio.AbstractEventLoop, *,
                 heartbeat_interval: float, record_ttl: float, config: str = "", relays: tuple[str, ...] = (),
                 initial_peers: tuple[str, ...] = (), find_addrs: Callable[[], Awaitable[list]] | None = None,
                 publish_addrs: bool = True):
        self.records, self.peer_id, self.loop = run_records, peer_id, loop
        self.run_id = run_records.membership.run_id
        self.heartbeat_interval, self.record_ttl = heartbeat_interval, record_ttl
        self.max_ttl = record_ttl + CLOCK_SLACK
        """A progress record set to live longer than this is a forgery (or a broken clock): ignored."""
        self.config = config
        """This worker's config fingerprint: workers with another one are not part of its run."""
        self.relays = tuple(relays)
        """The relays this worker holds a slot on (behind NAT): its record names them."""
        if checked_relays(self.relays) is None:  # its readers would drop every record it writes, silently
            raise ValueError(f"a worker record names at most {MAX_RELAYS} relays of at most {MAX_RELAY_CHARS} "
                             f"characters each, given {len(self.relays)}: {self.relays}")
        self.abandoned = ""
        """The attempt this worker last failed (``say_abandoned``)."""
        self.moves = 0
        """How many times this worker saw its address change (``WorkerRecord.moves``)."""
        self.find_addrs = find_addrs
        """Where this worker's daemon listens (its visible addresses); looked up before each heartbeat and
        every ``ADDRS_EVERY_S`` beside it."""
        self.publish_addrs = publish_addrs
        """False behind NAT: its addresses are private, and nobody outside dials them."""
        self.addrs: tuple[str, ...] = ()
        """What its record names of them (``addresses.own_addrs``)."""
        self._listening: frozenset[str] = frozenset()
        self._looking_up = asyncio.Lock()
        self.on_new_address: Callable[[list[str], list[str]], None] | None = None
        """Called (on the loop) when an address the daemon listened on is gone: this worker's address
        changed, and every connection it held through the old one is dead."""
        self.on_rejoined: Callable[[], None] | None = None
        """Called (on the loop) when its DHT node had lost every peer and found the run again at the
        redial: every connection it held died at once (behind NAT: its router's address changed)."""
        self.initial_peers = tuple(initial_peers)
        """Where its DHT node joined the run: dialled again if it loses every peer (``rejoin.py``)."""
        self._lost_peers = False
        self._most_known = 0  # the most peers its DHT node knew at once (``_stay_joined``)
        self._rejoined_at = -math.inf  # (monotonic) when its DHT node last found peers after knowing none
        self.rejoin_settle_s = 2 * record_ttl
        """After losing every peer, how long its node must have known the run again before a round of one."""
        self._foreign: set[str] = set()
        self._other_secrets: set[str] = set()
        self._unconfirmed_ahead = -1
        """The outer step at which unconfirmed claims to be ahead were last reported (once per step:
        fresh identities can make new claims every second)."""
        self.last_group: set[str] = set()
        """The members of this worker's last completed round (set by the communicator)."""
        self.partners = Partners(peer_id, absent_grace=PARTNERS_GRACE_TTLS * record_ttl)
        """Every peer that completed a round with this worker: once there is one, only their
        records vote here (``partners.py``)."""
        run_records.trusted = self.partners.__contains__  # their round records keep their places (``RecordView``)
        self._progress = Progress()
        self._lock = threading.Lock()
        self._publishing: set = set()
        self._left = False
        self._heartbeat = asyncio.run_coroutine_threadsafe(self._beat(), loop)

    def get(self, name: str, default=None):
        """A field of this worker's ``Progress``."""
        with self._lock:
            return getattr(self._progress, name, default)

    def report(self, **fields) -> None:
        """Updates this worker's ``Progress``; published at once if its outer step or readiness changed,
        else with the next heartbeat. ``ready_in`` (seconds from now) is stored as ``ready_at``. A name
        that is not a field of ``Progress``, or a value of another type, is refused (``TypeError``)."""
        check_progress(fields)  # a misspelt field would otherwise vanish from the record without a word
        if "name" in fields:
            fields["name"] = fields["name"][:records.NAME_MAX]
        now = self.records.clock.now()
        if "ready_in" in fields:  # None: not known yet
            ready_in = fields.pop("ready_in")
            fields["ready_at"] = None if ready_in is None else now + min(float(ready_in), 1e7)
        if "round_work" in fields:
            fields["pace_time"] = now
        with self._lock:
            before, self._progress = self._progress, dataclasses.replace(self._progress, **fields)
            changed = any(getattr(before, k) != getattr(self._progress, k)
                          for k in ("outer_step", "ready", "next_round"))
        if changed:  # keep the future: an unreferenced task may be garbage-collected mid-flight
            future = asyncio.run_coroutine_threadsafe(self.publish(), self.loop)
            self._publishing.add(future)
            future.add_done_callback(self._publishing.discard)

    async def publish(self, left: bool = False) -> None:
        if self._left and not left:  # a record published now would take back the one that says it left
            return
        with self._lock:
            rec = records.WorkerRecord.of(self._progress, peer_id=self.peer_id, time=self.records.clock.now(),
                                          left=left, config=self.config, relays=self.relays, abandoned=self.abandoned,
                                          addrs=self.addrs, moves=self.moves)
        await self.records.store_async(self.records.workers_key(), rec.to_value(),
                                        self.records.clock.now() + self.record_ttl)

    def publish_soon(self) -> None:
        """Publishes in the background (on the loop): the caller does not wait on a DHT store that may hang."""
        async def publish() -> None:
            try:
                await self.publish()
            except Exception as e:  # the next heartbeat publishes again
                log.debug("publishing this worker's record: %s: %s", type(e).__name__, e)

        task = asyncio.ensure_future(publish())
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def say_abandoned(self, group_id: str) -> None:
        """Publishes at once that this worker failed attempt ``group_id`` (and sends nothing more there):
        its members still waiting on it there give up on it (``WorkerRecord.abandoned``)."""
        self.abandoned = group_id
        await self.publish()

    async def _beat(self) -> None:
        beats, checking, rejoining = 0, None, None
        watching = asyncio.ensure_future(self._watch_addrs())
        try:
            while True:
                await self._look_up_addrs()
                try:
                    await self.publish()
                except Exception as e:  # the DHT may be shutting down
                    log.debug("heartbeat failed: %s", e)
                if self.initial_peers and (rejoining is None or rejoining.done()):  # beside the heartbeat too
                    rejoining = asyncio.ensure_future(self._stay_joined())
                # Beside the heartbeat, never in its way: a slow DHT read must not let this worker's record expire.
                if beats % SECRET_CHECK_EVERY == 0 and (checking is None or checking.done()):
                    checking = asyncio.ensure_future(self._check_secrets())
                beats += 1
                await asyncio.sleep(self.heartbeat_interval)
        finally:
            for task in (checking, rejoining, watching):
                if task is not None:
                    task.cancel()

    async def _watch_addrs(self) -> None:
        while self.find_addrs is not None:
            await asyncio.sleep(ADDRS_EVERY_S)
            await self._look_up_addrs()

    async def _look_up_addrs(self) -> None:
        """Refreshes ``addrs`` from the daemon (a new address is in the next record); on failure keeps them."""
        if self.find_addrs is None:
            return
        async with self._looking_up:  # the heartbeat's and the watcher's: one move is reported once
            await self._look_up_addrs_now()

    async def _look_up_addrs_now(self) -> None:
        try:
            visible = await asyncio.wait_for(self.find_addrs(), ADDRS_TIMEOUT)
        except Exception as e:  # asyncio.TimeoutError included: the daemon is busy or shutting down
            log.debug("looking up this worker's addresses: %s: %s", type(e).__name__, e)
            return
        plain = plain_addrs(visible)
        listening = frozenset(a for a in plain if is_local(a))
        if not plain:  # the daemon said nothing usable: nothing is concluded from it
            return
        gone, self._listening = self._listening - listening, listening
        # Its own addresses; where it has none (an announced public address, a 1:1 NAT), what it announces.
        addrs = own_addrs(listening or plain) if self.publish_addrs else ()
        if all(map(is_loopback, addrs)) and not all(map(is_loopback, self.addrs)):
            # Mid-move the daemon may list loopback alone for a moment: a record naming only that sent its
            # peers dialling themselves (17 s in the long scenario). The old one stands until the new address.
            addrs = self.addrs
        if addrs != self.addrs:
            log.info("this worker's record names where it listens: %s", " ".join(addrs) or "nowhere")
            self.addrs = addrs
            self.publish_soon()  # its peers learn the new address now, not at the next heartbeat
        if gone and self.on_new_address is not None:
            self.on_new_address(sorted(gone), sorted(listening))

    async def _stay_joined(self) -> None:
        """Dials the initial peers again if this worker's DHT node knows no peer (``rejoin.py``); says so once."""
        below = max(1, (self._most_known + 1) // 2)  # fewer than half of the most it knew: a partition
        try:
            before, after = await asyncio.wait_for(self.records.dht.run_coroutine(
                functools.partial(redial, initial_peers=self.initial_peers, below=below), return_future=True),
                3 * REDIAL_TIMEOUT)
        except Exception as e:  # asyncio.TimeoutError included: the next heartbeat tries again
            log.debug("redialling the initial peers: %s", e)
            return
        self._most_known = max(self._most_known, after)
        if before == 0 and after:
            self._rejoined_at = time.monotonic()
            if self.on_rejoined is not None:
                self.on_rejoined()
        if 0 < before < after:
            log.info("this worker's DHT node knew %d peer(s), fewer than half of the %d it knew at most: it dialled "
                     "its initial peers again and knows %d now", before, self._most_known, after)
        if before == 0 and not self._lost_peers:
            log.warning("this worker's DHT node lost every peer (its address changed, or its links broke): %s",
                        f"it dialled its initial peers again and knows {after} peer(s) now" if after else
                        "none of its initial peers answers; it averages with nobody, alone included, until one does")
        self._lost_peers = before == 0 and after == 0

    def cut_off(self) -> str | None:
        """Why this worker cannot see the run (its DHT node knows no peer, and none of its initial peers
        answers a redial), or None. A worker with no initial peers started the run: never cut off."""
        if not self.initial_peers:
            return None
        future = self.records.dht.run_coroutine(functools.partial(redial, initial_peers=self.initial_peers),
                                                return_future=True)
        before, after = records.wait_dht(future, "redial", 3 * REDIAL_TIMEOUT, self.records.interrupted)
        if not after:
            return ("cut off from the run: its DHT node knows no peer and none of its initial peers answers "
                    "(a round of one would fork θ_global from the run it cannot see)")
        if before == 0:
            self._rejoined_at = time.monotonic()
        since = time.monotonic() - self._rejoined_at
        if since < self.rejoin_settle_s:
            # Its node knows its initial peers again, not yet the run: a read now may find no other worker's
            # record where they all are (a worker whose address changed went alone that way, a fork).
            return (f"its DHT node lost every peer and found the run again {since:.0f}s ago: it does not average "
                    f"alone before it has seen the run for {self.rejoin_settle_s:.0f}s")
        return None

    async def _check_secrets(self) -> None:
        """Publishes which secret this worker holds (a tag of it) under the bare run id, and says in one
        line when workers of the same run id hold another one (or none): they never average together,
        and each would otherwise train alone without a word."""
        try:
            await asyncio.wait_for(self._tell_other_secrets(), SECRET_CHECK_EVERY * self.heartbeat_interval)
        except Exception as e:  # asyncio.TimeoutError included: the next check tries again
            log.debug("checking the run's secrets: %s", e)

    async def _tell_other_secrets(self) -> None:
        if self._left:
            return
        key, ttl = self.records.secret_key(), 2 * SECRET_CHECK_EVERY * self.heartbeat_interval
        tag = self.records.membership.tag
        await self.records.store_async(key, {"tag": tag}, self.records.clock.now() + ttl, sealed=False)
        found = await self.records.dht.get(key, latest=True, return_future=True)
        others = {p for p, v in self.records.live_subkeys(key, found, ttl + CLOCK_SLACK, sealed=False).items()
                  if p != self.peer_id and isinstance(v, dict) and v.get("tag") != tag}
        new = others - self._other_secrets
        kept = self._other_secrets & others
        self._other_secrets = kept | set(sorted(new)[:max(0, MAX_OTHER_SECRETS - len(kept))])
        if new:  # those told of before and still there are not told of again; those gone are forgotten
            mine = "this run secret" if self.records.membership.closed else "no run secret (an open run)"
            log.warning("%d worker(s) of run %r hold another run secret or none (%s); this one holds %s, so they "
                        "never average together: give every worker of the run the same secret",
                        len(others), self.run_id, named(others), mine)

    def live_workers(self) -> dict[str, records.WorkerRecord]:
        """The run's live workers with this worker's settings (others are left out, with a warning)."""
        return self.same_settings(self.records.read_workers(self.max_ttl))

    def read_live_workers(self) -> concurrent.futures.Future:
        """``live_workers`` read in the background: a future of what it returns."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(found) -> None:
            if not out.set_running_or_notify_cancel():  # the reader gave up on it
                return
            try:
                out.set_result(self.same_settings(self.records.workers_from(found.result(), self.max_ttl)))
            except BaseException as e:  # the DHT call failed: the reader's wait says so
                out.set_exception(e)

        self.records.dht.get(self.records.workers_key(), latest=True, return_future=True).add_done_callback(done)
        return out

    def same_settings(self, workers: dict[str, records.WorkerRecord]) -> dict[str, records.WorkerRecord]:
        out = {}
        for peer, rec in workers.items():
            if peer == self.peer_id or rec.config == self.config:
                out[peer] = rec
            elif peer not in self._foreign:
                self._foreign.add(peer)
                log.warning("worker %s of run %r has other settings (config fingerprint %s, ours %s): it is "
                            "never waited for, averaged with or downloaded from", peer[-8:], self.run_id,
                            rec.config or "none", self.config or "none")
        return out

    def my_claim(self, outer_step: int) -> Claim | None:
        mine = self.get("global_hash")
        return Claim(outer_step, mine) if mine and outer_step >= 0 else None

    def raise_if_behind(self, workers: dict[str, records.WorkerRecord], outer_step: int) -> None:
        """``BehindError`` if the run confirms a state ahead of this worker's (``quorum``); one peer's
        claim to be ahead triggers nothing, nor do the claims of peers that never completed a round
        with this worker once it has partners (``partners.py``)."""
        mine = self.my_claim(outer_step) or Claim(outer_step, "")
        claim = confirmed_ahead(self.partners.voters(workers), self.peer_id, mine)
        if claim is not None:
            raise BehindError(f"the run is at outer step {claim.outer_step} (θ_global {claim.global_hash}), "
                              f"this worker at {outer_step}", group_outer_step=claim.outer_step,
                              expected_hash=claim.global_hash)
        ahead = {p for p, r in workers.items() if p != self.peer_id and r.outer_step > outer_step}
        if ahead and self._unconfirmed_ahead != outer_step:
            self._unconfirmed_ahead = outer_step
            log.warning("%d peer(s) say they are ahead (outer step %d) without the run confirming it; ignored",
                        len(ahead), max(workers[p].outer_step for p in ahead))

    def raise_if_drifted(self, outer_step: int, workers: dict[str, records.WorkerRecord]) -> None:
        """``DriftError`` if the run confirms another θ_global than ours (``quorum``): a claim with more
        votes than ours and at least half of them, at our outer step or behind it.

        Behind it: a worker that went on alone (its group left the others out) is the one that
        drifted, and goes back to the run's state. Members of our last round that have not yet
        published its result are not counted against us: they are on their way to our state.
        """
        mine = self.my_claim(outer_step)
        workers = self.partners.voters(workers)
        best = None if mine is None else drifted(workers, self.peer_id, mine, self.last_group)
        if best is None:
            return
        votes = sum(1 for p, r in workers.items() if p != self.peer_id and Claim(r.outer_step, r.global_hash) == best)
        raise DriftError(f"θ_global drifted: hash {mine.global_hash} at outer step {outer_step}, the run holds "
                         f"{best.global_hash} at outer step {best.outer_step} ({votes} of "
                         f"{len(workers)} workers)", group_outer_step=best.outer_step,
                         majority_hash=best.global_hash)

    async def leave(self) -> None:
        """Stops the heartbeat and tells the run this worker left (others stop waiting for it at once);
        nothing is published after that."""
        self._left = True
        self._heartbeat.cancel()
        await self.publish(left=True)
