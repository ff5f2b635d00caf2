"""A peer that announced a round and then left it (went back to catch up or heal drift, or died) must
not hold the round up: it neither leads the group nor is waited for as if ready. Seen in the world
scenario under load: the smallest id announced round 1, drifted back to round 0, and the other two
waited 40 s for its group, attempt after attempt ("no group was published for round 1.0").

The matchmaker runs as it does in a worker; only the DHT is an in-memory table of records."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import pytest

from opendiloco.comm.base import RoundKey
from opendiloco.errors import AveragingError
from opendiloco.swarm.clock import RunClock
from opendiloco.swarm.match_rule import Announcement, Closing, gone
from opendiloco.swarm.matchmaking import SLOW_READ_EVERY, Matchmaker, MatchmakingSettings, peers_here
from opendiloco.swarm.partners import Partners
from opendiloco.swarm.records import WorkerRecord
from tests.conftest import run_in_threads

pytestmark = pytest.mark.timeout(60)


class Table:
    """The run's records as a DHT would hold them: key -> {writer: value}."""

    def __init__(self):
        self.clock = RunClock()
        self.values: dict[str, dict[str, object]] = {}
        self.lock = threading.Lock()

    def round_key(self, key) -> str:
        return f"r.round.{key}"

    def group_key(self, key, attempt: int) -> str:
        return f"r.group.{key}.{attempt}"


class Writer:
    """One worker's view of the table (``RunRecords``' methods the matchmaker calls)."""

    def __init__(self, table: Table, me: str):
        self.table, self.me, self.clock = table, me, table.clock
        self.round_key, self.group_key = table.round_key, table.group_key

    def store(self, key: str, value, expiration_time: float, wait: bool = True) -> tuple:
        with self.table.lock:
            self.table.values.setdefault(key, {})[self.me] = value
        return key, self.me, value

    def subkey_values(self, key: str, max_ttl: float, fresh: bool = True) -> dict:
        with self.table.lock:
            return dict(self.table.values.get(key, {}))

    def refresh(self, key: str, on_done=None) -> concurrent.futures.Future:
        """Reads are always fresh here (``subkey_values``): a background read has nothing to add."""
        future = concurrent.futures.Future()
        future.set_result(None)
        return future

    def records_of(self, key: str, subkeys) -> list:
        with self.table.lock:
            return [(key, s, self.table.values[key][s]) for s in subkeys if s in self.table.values.get(key, {})]


class Presence:
    def __init__(self, me: str, workers, cut_off: str | None = None):
        self.peer_id, self._workers, self._cut_off = me, workers, cut_off
        self.last_group: set[str] = set()
        self.partners = Partners(me)

    def cut_off(self) -> str | None:
        return self._cut_off

    def live_workers(self):
        return dict(self._workers())

    def read_live_workers(self) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        future.set_result(self.live_workers())
        return future

    def raise_if_behind(self, workers, outer_step) -> None:
        pass


SETTINGS = MatchmakingSettings(run_id="r", min_group_size=2, matchmaking_timeout=6.0, straggler_wait=2.0,
                               poll_interval=0.01)


def test_a_smallest_peer_that_went_back_after_announcing_neither_leads_nor_holds_the_round():
    table, key = Table(), RoundKey(1)
    # "a" (the smallest id) announced round 1, then drifted back: its record, written after its
    # announcement, heads for round 0. "b" and "c" are in round 1.
    announced_at = table.clock.now() - 1.0
    table.values[table.round_key(key)] = {"a": {"attempt": 0, "numel": 10, "codec": "fp16", "part": SETTINGS.part_numel,
                                                "config": "", "since": announced_at}}
    workers = {"a": WorkerRecord("a", outer_step=0, time=announced_at + 0.5),
               "b": WorkerRecord("b", outer_step=1, time=table.clock.now()),
               "c": WorkerRecord("c", outer_step=1, time=table.clock.now())}
    results: dict[str, object] = {}

    def member(me: str) -> None:
        mm = Matchmaker(Writer(table, me), Presence(me, lambda: workers), SETTINGS, "fp16", threading.Event())
        try:
            results[me] = mm.form_group(key, 0, 10)[0].members
        except AveragingError as e:
            results[me] = e

    began = time.monotonic()
    run_in_threads([lambda m=m: member(m) for m in ("b", "c")], timeout=30)
    assert results == {"b": ("b", "c"), "c": ("b", "c")}, results
    assert time.monotonic() - began < SETTINGS.straggler_wait + SETTINGS.matchmaking_timeout  # not a timeout


def test_a_record_older_than_the_announcement_says_nothing_yet():
    """The announcement may be read before the record that goes with it: the peer is not dropped."""
    table, key = Table(), RoundKey(1)
    now = table.clock.now()
    announcements = {"a": Announcement(0, since=now), "d": Announcement(0, since=now)}
    workers = {"a": WorkerRecord("a", outer_step=0, time=now - 1.0)}  # d: no record at all (dead)
    assert gone(peers_here(workers, table.clock), announcements, key.outer_step, "b") == {"d"}


def test_a_peer_whose_streamed_round_is_in_flight_is_waited_for_before_its_announcement_arrives():
    """Streaming: "a" has started round 1 (its record says outer step 1, heading for 2: the round runs in the
    background) but its announcement of round 1 is not in the DHT yet. It is in the round: "b" and "c" wait
    for it instead of closing round 1 without it (seen with the owners' audit making rounds longer: the
    slowest streaming worker was left out, then caught up, round after round)."""
    table, key = Table(), RoundKey(1)
    now = table.clock.now()
    workers = {"a": WorkerRecord("a", outer_step=1, next_round=2, time=now),
               "b": WorkerRecord("b", outer_step=1, time=now), "c": WorkerRecord("c", outer_step=1, time=now)}
    results: dict[str, object] = {}

    def member(me: str, delay: float = 0.0) -> None:
        time.sleep(delay)
        mm = Matchmaker(Writer(table, me), Presence(me, lambda: workers), SETTINGS, "fp16", threading.Event())
        try:
            results[me] = mm.form_group(key, 0, 10)[0].members
        except AveragingError as e:
            results[me] = e

    run_in_threads([lambda m=m, d=d: member(m, d) for m, d in (("b", 0.0), ("c", 0.0), ("a", 0.5))], timeout=30)
    assert results == {m: ("a", "b", "c") for m in "abc"}, results


def test_a_worker_cut_off_from_the_run_does_not_average_alone():
    """A worker whose DHT node lost every peer sees only its own record: a round of one would fork θ_global
    from the run it cannot see (seen in the emulated world: a NAT'd worker whose router got a new address
    trained alone for the rest of the run). It refuses; the same worker not cut off (a run of one) averages alone."""
    settings = MatchmakingSettings(run_id="r", min_group_size=1, matchmaking_timeout=6.0, straggler_wait=2.0,
                                   poll_interval=0.01)
    for cut_off in ("cut off from the run: its DHT node knows no peer", None):
        table, key = Table(), RoundKey(3)
        alone = {"a": WorkerRecord("a", outer_step=3, time=table.clock.now())}
        mm = Matchmaker(Writer(table, "a"), Presence("a", lambda alone=alone: alone, cut_off), settings, "fp16",
                        threading.Event())
        if cut_off:
            with pytest.raises(AveragingError, match="not applied alone: cut off from the run"):
                mm.form_group(key, 0, 10)
        else:
            assert mm.form_group(key, 0, 10)[0].members == ("a",)


def test_a_worker_whose_peers_all_left_the_round_before_its_group_closed_does_not_average_alone():
    """Seen in the long world scenario as a partition healed: the members of a round that had announced it
    went back to heal their drift (their records, newer than their announcements, head for an earlier
    round) while "a" was closing the group. Five workers each published a group of one and applied it,
    five different θ_global at one outer step. A round of one while other workers live forks the run."""
    table, key = Table(), RoundKey(5)
    announced_at = table.clock.now() - 1.0
    for p in "ab":
        table.values.setdefault(table.round_key(key), {})[p] = {"attempt": 0, "numel": 10, "codec": "fp16",
                                                                "part": SETTINGS.part_numel, "config": "",
                                                                "since": announced_at}
    # "a" (the smallest id, so "b" waits for its group) went back after announcing: "b" learns it only
    # from a fresh read of the records, once it is already closing the group.
    workers = {"a": WorkerRecord("a", outer_step=4, time=announced_at + 0.5),
               "b": WorkerRecord("b", outer_step=5, time=announced_at)}
    settings = dataclasses.replace(SETTINGS, min_group_size=1)  # the default: a group of one is big enough
    mm = Matchmaker(Writer(table, "b"), Presence("b", lambda: workers), settings, "fp16", threading.Event())
    with pytest.raises(AveragingError, match="not applied alone"):
        mm._adopt_group(key, 0, 10, Closing(frozenset("ab"), frozenset()), workers,
                        mm._read_announcements(table.round_key(key)))
    assert table.group_key(key, 0) not in table.values  # no group of one was published


class CountingWriter(Writer):
    def __init__(self, table: Table, me: str):
        super().__init__(table, me)
        self.reads: list[float] = []

    def refresh(self, key: str, on_done=None) -> concurrent.futures.Future:
        if key.startswith("r.round."):  # a DHT lookup; looking at what was pushed costs none
            self.reads.append(time.monotonic())
        return super().refresh(key, on_done)


def test_a_waiting_worker_looks_less_often_while_nothing_changes():
    """Every look is a DHT lookup that the peers' DHT processes answer: a worker waiting for a straggler
    at one look each 20 ms kept its peers and itself at half a core of the 2 here. While the
    announcements stay the same the gap doubles, up to ``quiet_poll_interval``."""
    table, key = Table(), RoundKey(2)
    workers = {p: WorkerRecord(p, outer_step=2, time=table.clock.now()) for p in "ab"}  # "b" never comes
    settings = dataclasses.replace(SETTINGS, poll_interval=0.01, quiet_poll_interval=0.25, straggler_wait=3.0,
                                   matchmaking_timeout=3.0)
    writer = CountingWriter(table, "a")
    mm = Matchmaker(writer, Presence("a", lambda: workers), settings, "fp16", threading.Event())
    with pytest.raises(AveragingError, match="need 2"):
        mm.form_group(key, 0, 10)
    waited = writer.reads[-1] - writer.reads[0]
    assert waited >= 2.5 and len(writer.reads) < 40, (waited, len(writer.reads))  # at 0.01 s: some 300
    gaps = [b - a for a, b in zip(writer.reads, writer.reads[1:])]
    # The DHT is read every SLOW_READ_EVERY looks (what peers push is looked at in between): never longer
    # apart than that many quiet gaps (and the machine's hiccups).
    assert max(gaps) < SLOW_READ_EVERY * settings.quiet_poll_interval + 0.75, gaps


def test_an_announcement_is_pushed_to_the_peers_that_may_group_with_it():
    """The peer with the smallest id closes groups; it may be looking only now and then, so a worker
    that announces pushes its announcement to it (once per attempt), and to every other live peer
    that may group with it (they check a group against its members' announcements)."""
    table, key = Table(), RoundKey(4)
    now = table.clock.now()
    table.values[table.round_key(key)] = {"a": {"attempt": 0, "numel": 10, "codec": "fp16",
                                                "part": SETTINGS.part_numel, "config": "", "since": now}}
    workers = {p: WorkerRecord(p, outer_step=4, time=now) for p in "ab"}
    rings = []
    mm = Matchmaker(Writer(table, "b"), Presence("b", lambda: workers), SETTINGS, "fp16", threading.Event(),
                    push=lambda peers, k, attempt, pushed: rings.append((list(peers), k, attempt)))
    publish = threading.Timer(0.5, lambda: table.values.setdefault(table.group_key(key, 0), {}).update(a=["a", "b"]))
    publish.start()  # "a" closes the group
    try:
        group, attempt = mm.form_group(key, 0, 10)
    finally:
        publish.cancel()
    assert group.members == ("a", "b") and attempt == 0
    assert rings == [(["a"], str(key), 0)]
    leader_rings = []  # the peer that closes groups pushes its announcement to the live peers too
    workers_5 = {p: WorkerRecord(p, outer_step=5, time=now) for p in "ab"}
    quick = dataclasses.replace(SETTINGS, matchmaking_timeout=1.0, straggler_wait=0.5)
    leader = Matchmaker(Writer(table, "a"), Presence("a", lambda: workers_5), quick, "fp16", threading.Event(),
                        push=lambda peers, k, attempt, pushed: leader_rings.append(list(peers)))
    with pytest.raises(AveragingError, match="need 2"):
        leader.form_group(RoundKey(5), 0, 10)  # "b" never comes
    assert leader_rings == [["b"]]


def test_members_follow_the_peer_that_would_close_their_group_to_a_later_attempt():
    """Leaders can disagree on who is ready: in the long world scenario a worker's new address made some
    take it for frozen while it published a group of everyone. "a" (the smallest id, so it would close
    the group "b" and "c" wait for) took that other group, failed it, and announced attempt 1: it never
    publishes a group of attempt 0. "b" and "c" follow it to attempt 1 at once; before, they waited for
    its group until the run moved on without them (15 s of everyone's time there)."""
    table, key = Table(), RoundKey(6)
    now = table.clock.now()
    announce = {"numel": 10, "codec": "fp16", "part": SETTINGS.part_numel, "config": "", "since": now}
    table.values[table.round_key(key)] = {"a": {"attempt": 0, **announce}}
    workers = {p: WorkerRecord(p, outer_step=6, time=now) for p in "abc"}
    settings = dataclasses.replace(SETTINGS, straggler_wait=20.0, matchmaking_timeout=20.0)
    results: dict[str, object] = {}

    def member(me: str, attempt: int, delay: float = 0.0) -> None:
        time.sleep(delay)
        mm = Matchmaker(Writer(table, me), Presence(me, lambda: workers), settings, "fp16", threading.Event())
        try:
            group, at = mm.form_group(key, attempt, 10)
            results[me] = (group.members, at)
        except AveragingError as e:
            results[me] = e

    began = time.monotonic()
    run_in_threads([lambda args=args: member(*args) for args in (("b", 0), ("c", 0), ("a", 1, 1.0))], timeout=45)
    assert results == {m: (("a", "b", "c"), 1) for m in "abc"}, results
    assert time.monotonic() - began < settings.straggler_wait  # followed, not waited out


def _pinged_liveness(answers: dict[str, bool | None], sent: list[str]):
    """``frozen.Unanswered`` on a loop of its own, its pings answered from ``answers`` (libp2p's ping: True
    for an echo, False for a failed dial, None for none in time)."""
    import asyncio

    from opendiloco.swarm.connectivity.frozen import Unanswered

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def ping(peer):
        sent.append(peer)
        return answers[peer]

    def stop():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    return Unanswered(loop, ping), stop


@pytest.mark.parametrize("record", ["quiet", "fresh"])
def test_a_peer_behind_nat_is_asked_by_a_ping_once_its_record_missed_a_heartbeat(record):
    """"c" is behind NAT (its record names relays) and heading for the round. Killed, its record goes
    quiet and its relays refuse a dial to it: "a" and "b" go ahead without it at once (in the long world
    scenario each NAT'd worker's kill held the next round 7 s, until its record expired). Alive, its record
    is fresh: it is not pinged (a ping through a relay may fail for a live peer), and is waited for."""
    table, key = Table(), RoundKey(7)
    now = table.clock.now()
    stale = now - 5.0 if record == "quiet" else now + 60.0  # "fresh": written as the round goes on
    workers = {"a": WorkerRecord("a", outer_step=7, time=now), "b": WorkerRecord("b", outer_step=7, time=now),
               "c": WorkerRecord("c", outer_step=7, time=stale, relays=("/ip4/10.0.0.1/tcp/1/p2p/R",))}
    settings = dataclasses.replace(SETTINGS, straggler_wait=6.0, matchmaking_timeout=6.0)
    sent: list[str] = []
    liveness, stop = _pinged_liveness({"a": True, "b": True, "c": False}, sent)
    results: dict[str, object] = {}

    def member(me: str) -> None:
        mm = Matchmaker(Writer(table, me), Presence(me, lambda: workers), settings, "fp16", threading.Event(),
                        liveness=liveness)
        began = time.monotonic()
        try:
            results[me] = (mm.form_group(key, 0, 10)[0].members, time.monotonic() - began)
        except AveragingError as e:
            results[me] = e

    try:
        run_in_threads([lambda m=m: member(m) for m in "ab"], timeout=45)
    finally:
        stop()
    assert {m: r[0] for m, r in results.items()} == {"a": ("a", "b"), "b": ("a", "b")}, results
    if record == "quiet":
        assert "c" in sent and all(r[1] < settings.straggler_wait for r in results.values()), results
    else:
        assert "c" not in sent and all(r[1] >= settings.straggler_wait for r in results.values()), results
