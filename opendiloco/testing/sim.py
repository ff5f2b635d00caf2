"""A simulated swarm: N workers in one process, on one event loop, averaging a tiny vector in rounds with the
round's real code. Run it on a loop under virtual time (``virtual_time.run``) and minutes of the swarm's
waits pass in a fraction of a second of wall time.

Each worker, each round, "trains" for ``compute`` seconds (its record says when it will be ready), then:

- announces the round on an in-memory record board (``Board``: the workers' records, the rounds'
  announcements and the groups published, which the DHT and the pushed records hold in the swarm) and forms
  its group with the real matchmaking rule (``match_rule.decide``, looked at as ``Matchmaker`` does: at
  every change of the board, and at the moment the rule names);
- runs the real ``RoundRunner`` with the other members over in-memory streams (``MemoryNetwork``; its
  incoming streams served by its own ``Rounds``), while watching the board as ``MemberWatch`` does: a
  member the round still waits on whose record is gone is given up on (``give_up_on``);
- applies the verified average; or retries a failed attempt with the members its failure names left out of
  what the retry waits for (``exclusion.retry_suspects``), up to ``max_attempts``, as ``SwarmCommunicator``
  does. A failed matchmaking fails the round, as there.

A fault (``Death``): a worker dies as it sends its first part of a round. Its streams stop (nothing more
in or out, nothing closed: a machine gone) or close (a killed process), dials to it are refused, and its
record lives ``record_ttl`` more.

What it does not model: DHT latency and lost reads (the board answers at once and rings every waiter on a
change), the p2p daemon, NAT and relays, link latency and bandwidth (a frame arrives on the next turn of
the loop), pings and frozen peers, clock offsets between workers, partners and no-shows (every peer's word
counts), the majority rule of a split run, joiners and state downloads, and settling an attempt in doubt
(``outcome.resolve``: a death before the victim's parts are out leaves nobody in doubt; an ``InDoubt``
here ends the simulation with that error).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import torch

from ..comm.base import RoundKey
from ..comm.formats import get_codec
from ..comm.group import Group, make_group_id
from ..comm.runner import RoundOutcome, RoundRunner
from ..comm.wire import ByteStream, Code, memory_pipe
from ..errors import AveragingError, InDoubt
from ..fingerprint import new_hasher
from ..swarm import match_rule
from ..swarm.exclusion import retry_suspects
from ..swarm.match_rule import Announcement, Close, Fail, Follow, MatchmakingSettings, MatchView, Peer, Wait
from ..swarm.partners import Trust
from .memory import MemoryNetwork

RUN_ID = "sim"
CODEC = "fp16"


@dataclass(frozen=True)
class Death:
    """``peer`` dies as it sends its first part of round ``outer_step``."""

    peer: str
    outer_step: int
    closed: bool = False
    """Its streams close (a killed process); else they stop (a machine gone: nothing more in or out)."""


@dataclass(frozen=True)
class SimSettings:
    """The swarm's shape; the timeouts are ``SwarmSettings``' defaults."""

    workers: int = 8
    rounds: int = 3
    numel: int = 16
    part_numel: int = 4
    compute: float = 30.0
    """Seconds of inner steps before each round; worker i takes ``i * jitter`` more."""
    jitter: float = 0.5
    allreduce_timeout: float = 60.0
    verify_timeout: float = 5.0
    record_ttl: float = 8.0
    max_attempts: int = 3
    min_group_size: int = 2
    straggler_wait: float = 10.0
    matchmaking_timeout: float = 30.0
    look_every: float = 1.0
    """The longest gap between two looks at the board (matchmaking, and the member watch of an exchange)."""
    deaths: tuple[Death, ...] = ()
    seed: int = 0

    def matchmaking(self) -> MatchmakingSettings:
        return MatchmakingSettings(run_id=RUN_ID, min_group_size=self.min_group_size,
                                   matchmaking_timeout=self.matchmaking_timeout, straggler_wait=self.straggler_wait,
                                   part_numel=self.part_numel)


@dataclass(frozen=True)
class Applied:
    """A round a worker applied: its group and the average's digests (the round's, and of the values applied)."""

    peer: str
    outer_step: int
    attempt: int
    members: tuple[str, ...]
    digest: str
    value_hash: str
    at: float


@dataclass(frozen=True)
class Failed:
    """An attempt that failed at a worker (``members`` empty: its matchmaking failed), and whom it named."""

    peer: str
    outer_step: int
    attempt: int
    members: tuple[str, ...]
    error: str
    suspects: frozenset[str]
    at: float


@dataclass
class SimReport:
    applied: list[Applied] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    died: dict[str, float] = field(default_factory=dict)
    """The workers that died, and when (loop time)."""
    virtual_s: float = 0.0
    """Loop time from the start to the last worker's end."""


class Board:
    """The run's records in memory: live workers (a dead one's record lives ``record_ttl`` more), each round's
    announcements, and each attempt's published groups. Every write rings the waiters."""

    def __init__(self, record_ttl: float):
        self.record_ttl = record_ttl
        self.records: dict[str, Peer] = {}
        self.died: dict[str, float] = {}
        self.announcements: dict[str, dict[str, Announcement]] = {}
        self.groups: dict[tuple[str, int], dict[str, list[str]]] = {}
        self._changed = asyncio.Event()

    def live(self) -> dict[str, Peer]:
        now = _now()
        return {p: r for p, r in self.records.items() if now < self.died.get(p, now) + self.record_ttl}

    def write(self, peer: str, record: Peer) -> None:
        self.records[peer] = record
        self._ring()

    def death(self, peer: str) -> None:
        self.died[peer] = _now()
        self._ring()

    def announce(self, key: RoundKey, peer: str, announcement: Announcement) -> None:
        self.announcements.setdefault(str(key), {})[peer] = announcement
        self._ring()

    def publish(self, key: RoundKey, attempt: int, peer: str, members: tuple[str, ...]) -> None:
        self.groups.setdefault((str(key), attempt), {})[peer] = list(members)
        self._ring()

    async def wait(self, seconds: float) -> None:
        """Until the next write, or ``seconds``."""
        try:
            await asyncio.wait_for(self._changed.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _ring(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _End:
    """A doomed worker's end of a stream: as the stream until its death, then stopped or closed."""

    def __init__(self, stream: ByteStream, owner: str, net: SimNetwork):
        self.stream, self.owner, self.net, self.remote = stream, owner, net, stream.remote
        self.round: str | None = None

    async def send(self, code: Code, meta: dict | None = None, payload=b"") -> None:
        if code == Code.CONTRIBUTE:
            self.round = (meta or {}).get("round")
        if code == Code.PART and self.owner not in self.net.dead and self.net.doomed[self.owner][0] == self.round:
            self.net.kill(self.owner)
        if self.owner in self.net.dead:
            return  # into the void
        await self.stream.send(code, meta, payload)

    async def recv(self, **kw):
        if self.owner in self.net.dead:
            await asyncio.Event().wait()  # nothing reaches the dead (until cancelled)
        return await self.stream.recv(**kw)

    async def refuse(self, reason: str, **kw) -> None:
        if self.owner not in self.net.dead:
            await self.stream.refuse(reason, **kw)

    def close(self) -> None:
        if self.owner not in self.net.dead:
            self.stream.close()


class SimNetwork(MemoryNetwork):
    """``MemoryNetwork`` whose doomed workers (``doomed``: peer -> (round key, closed)) die as they send their
    first part of that round: ``on_death`` is called, dials to them are refused, the streams they serve end."""

    def __init__(self, doomed: dict[str, tuple[str, bool]], on_death, wait_for_group: float = 2.0):
        super().__init__(wait_for_group=wait_for_group)
        self.doomed, self.on_death = doomed, on_death
        self.dead: set[str] = set()
        self._streams: dict[str, list[ByteStream]] = {}
        self._serving: dict[str, set[asyncio.Task]] = {}

    def connector(self, me: str):
        async def connect(peer: str) -> ByteStream:
            if peer not in self.handlers:
                raise ConnectionRefusedError(f"no peer {peer}")
            mine, theirs = memory_pipe(me, peer)
            task = asyncio.create_task(self.handlers[peer](self._end(theirs, peer)))
            for tasks in (self._tasks, self._serving.setdefault(peer, set())):
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            return self._end(mine, me)

        return connect

    def _end(self, stream: ByteStream, owner: str):
        if owner not in self.doomed:
            return stream
        self._streams.setdefault(owner, []).append(stream)
        return _End(stream, owner, self)

    def kill(self, peer: str) -> None:
        self.dead.add(peer)
        self.handlers.pop(peer, None)
        for task in list(self._serving.pop(peer, ())):
            task.cancel()
        streams = self._streams.pop(peer, [])
        if self.doomed[peer][1]:
            for stream in streams:
                stream.close()
        self.on_death(peer)


def _now() -> float:
    return asyncio.get_running_loop().time()


def value_hash(flat: torch.Tensor) -> str:
    """The applied values' digest (what every member of a group must end with)."""
    h = new_hasher()
    h.update(flat.numpy().tobytes())
    return h.hexdigest()[:32]


class Swarm:
    """``SimSettings.workers`` workers (``w0``, ``w1``, ...) taking ``rounds`` rounds; ``run`` on a loop."""

    def __init__(self, settings: SimSettings):
        self.s = settings
        self.names = [f"w{i}" for i in range(settings.workers)]
        self.board = Board(settings.record_ttl)
        doomed = {d.peer: (str(RoundKey(d.outer_step)), d.closed) for d in settings.deaths}
        self.net = SimNetwork(doomed, self._died)
        g = torch.Generator().manual_seed(settings.seed)
        self.values = {n: torch.randn(settings.numel, generator=g) for n in self.names}
        self.last_group: dict[str, frozenset[str]] = {n: frozenset() for n in self.names}
        self.report = SimReport()
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(self) -> SimReport:
        began = _now()
        for n in self.names:
            self.net.add(n)
        self._tasks = {n: asyncio.create_task(self._worker(n)) for n in self.names}
        results = await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for n, r in zip(self.names, results):
            if isinstance(r, BaseException) and not (n in self.net.dead and isinstance(r, asyncio.CancelledError)):
                raise r
        self.report.virtual_s = _now() - began
        await self.net.drain()
        return self.report

    def _died(self, peer: str) -> None:
        self.report.died[peer] = _now()
        self.board.death(peer)
        self._tasks[peer].cancel()

    async def _worker(self, me: str) -> None:
        g = torch.Generator().manual_seed(self.s.seed * 1000 + self.names.index(me))
        compute = self.s.compute + self.s.jitter * self.names.index(me)
        for step in range(self.s.rounds):
            self.board.write(me, Peer(step, step, ready_at=_now() + compute, time=_now()))
            await asyncio.sleep(compute)
            work = self.values[me] + 0.1 * torch.randn(self.s.numel, generator=g)
            outcome = await self._round(me, RoundKey(step), work)
            if outcome is not None:
                self.values[me] = outcome.flat.clone()
        self.board.write(me, Peer(self.s.rounds, self.s.rounds, time=_now()))

    async def _round(self, me: str, key: RoundKey, flat: torch.Tensor) -> RoundOutcome | None:
        """The round's attempts, as ``SwarmCommunicator._round`` makes them: its outcome, or None (failed)."""
        attempt, suspects = 0, set()
        for _ in range(self.s.max_attempts):
            try:
                group = await self._form_group(me, key, attempt, frozenset(suspects))
            except AveragingError as e:
                self.report.failed.append(Failed(me, key.outer_step, attempt, (), str(e), frozenset(), _now()))
                return None
            attempt = group.attempt
            runner = RoundRunner(group, me, flat, 1.0, get_codec(CODEC), part_numel=self.s.part_numel,
                                 timeout=self.s.allreduce_timeout, confirm_timeout=self.s.verify_timeout)
            try:
                outcome = await self._exchange(runner)
            except InDoubt:
                raise
            except AveragingError as e:
                suspects |= retry_suspects(e, me, runner.refused_by)
                self.report.failed.append(Failed(me, key.outer_step, attempt, group.members, str(e),
                                                 frozenset(suspects), _now()))
                attempt += 1
                continue
            self.net.rounds[me].completed(str(key), group.group_id)
            self.last_group[me] = frozenset(group.members)
            self.report.applied.append(Applied(me, key.outer_step, attempt, group.members, outcome.digest,
                                               value_hash(outcome.flat), _now()))
            return outcome
        return None

    async def _exchange(self, runner: RoundRunner) -> RoundOutcome:
        rounds = self.net.rounds[runner.me]
        await rounds.register(runner)
        watch = asyncio.create_task(self._watch(runner))
        try:
            return await runner.run(self.net.connector(runner.me))
        finally:
            watch.cancel()
            rounds.finish(runner.group.group_id)

    async def _watch(self, runner: RoundRunner) -> None:
        """``MemberWatch``'s look at the run's records: a member still owing bytes whose record is gone."""
        while not runner.ended.is_set():
            await asyncio.sleep(self.s.look_every)
            live = self.board.live()
            for m in runner.members:
                if m != runner.me and m not in live and runner.waits_on(m):
                    await runner.give_up_on(m, "left the run's records")
                    return

    async def _form_group(self, me: str, key: RoundKey, attempt: int, suspects: frozenset[str]) -> Group:
        """``Matchmaker.form_group`` on the board: announce, look, do what ``match_rule.decide`` says."""
        s, rule = self.s, self.s.matchmaking()
        began, announced, closing, taken, adopting = _now(), None, None, frozenset(), 0.0
        while True:
            ready = self.board.announcements.get(str(key), {})
            if closing is None:
                attempt = match_rule.next_attempt(ready, self.board.live(), attempt, rule.max_attempt_jump)
            if announced != attempt:
                self.board.announce(key, me, Announcement(attempt, s.numel, CODEC, s.part_numel, rule.config,
                                                          since=began, since_here=began))
                announced = attempt
            if closing is not None:
                closing = replace(closing, overdue=_now() > adopting + s.straggler_wait + s.matchmaking_timeout)
            view = MatchView(me=me, key=key, attempt=attempt, numel=s.numel, codec=CODEC, now=_now(), began=began,
                             workers=self.board.live(), announcements=dict(ready),
                             trust=Trust(me, frozenset(), alone=False), taken=taken, suspects=suspects,
                             last_group=self.last_group[me], published=self.board.groups.get((str(key), attempt), {}),
                             closing=closing, fresh=closing is not None)
            outcome = match_rule.decide(view, rule)
            if outcome.notes.taken is not None:
                taken = outcome.notes.taken
            if isinstance(outcome, Close):
                closing, adopting = outcome.closing, _now()
                continue
            if isinstance(outcome, match_rule.Group):
                if outcome.publish:
                    self.board.publish(key, attempt, me, outcome.members)
                    closing = replace(closing, published_ours=True)
                    continue
                return Group(make_group_id(RUN_ID, key, attempt, outcome.members, outcome.relayed), outcome.members,
                             key, outcome.relayed, attempt)
            if isinstance(outcome, Follow):
                attempt, closing = outcome.attempt, None
                continue
            if isinstance(outcome, Fail):
                raise AveragingError(outcome.message)
            assert isinstance(outcome, Wait)
            closing = outcome.closing if closing is not None else None
            until = outcome.until if outcome.until is not None else _now() + s.look_every
            await self.board.wait(min(s.look_every, max(rule.poll_interval, until - _now())))
