"""The rounds this worker takes part in: where incoming streams find their round.

Each stream a member opens names its round in its opening frame (``CONTRIBUTE``, or ``ASK_OUTCOME`` for
a question about how a round ended: ``outcome.py``). ``Rounds`` routes it to that round's runner, waits
a bounded while for a round this worker has not learnt yet, and refuses at once a finished round's id
(a replay) and a stream for another group of a round this worker took a group of.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from ..errors import AveragingError, ProtocolError
from .blame import blamed
from .outcome import Ended, OutcomeDesk
from .runner import RoundRunner
from .wire import ByteStream, Code
from .wire import field as meta_field

log = logging.getLogger(__name__)


class Rounds:
    """The rounds this worker is in, by group id, so that incoming streams find theirs.

    A contribution may arrive before this worker has learnt its group: it waits up to
    ``wait_for_group`` seconds. At most ``max_waiting_per_peer`` streams of one peer, and
    ``max_waiting`` in all, wait like that; more are refused at once, so a flood of streams that
    name rounds nobody knows holds neither tasks nor memory. Finished group ids are remembered, so
    a replayed message of an earlier round is refused at once, with their members and outcome, so
    that a member whose attempt failed in doubt can ask whether this worker completed it
    (``ASK_OUTCOME``; ``resolve``).
    """

    def __init__(self, wait_for_group: float = 10.0, remember: int = 1024, max_waiting: int = 64,
                 max_waiting_per_peer: int = 4):
        self.wait_for_group, self.remember = wait_for_group, remember
        self.max_waiting, self.max_waiting_per_peer = max_waiting, max_waiting_per_peer
        self._waiting: collections.Counter = collections.Counter()
        """Streams waiting for their round to be registered, by remote peer."""
        self._active: dict[str, RoundRunner] = {}
        self._finished: collections.OrderedDict[str, Ended] = collections.OrderedDict()
        self._registered = asyncio.Condition()
        self._completed: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Round key -> the group id this worker completed it in (``completed``)."""
        self._attempted: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Round key -> the latest attempt this worker took a group of (``register``)."""
        self._desk = OutcomeDesk(self)

    def completed(self, key: str, group_id: str) -> None:
        """This worker completed round ``key`` in group ``group_id``: a contribution to another group of that
        round (a peer that saw this worker's announcement, but not yet that it had moved on) is refused at
        once, not after ``wait_for_group``: no group of that round will be registered here again."""
        self._completed[key] = group_id
        while len(self._completed) > self.remember:
            self._completed.popitem(last=False)

    def reopen(self, key: str) -> None:
        """This worker starts round ``key`` again (it went back to the run's state, after a partition say):
        whatever it completed there before no longer stands."""
        self._completed.pop(key, None)
        self._attempted.pop(key, None)

    async def register(self, runner: RoundRunner) -> None:
        async with self._registered:
            self._active[runner.group.group_id] = runner
            key, attempt = str(runner.group.key), runner.group.attempt
            self._attempted[key] = max(attempt, self._attempted.get(key, attempt))
            self._attempted.move_to_end(key)
            while len(self._attempted) > self.remember:
                self._attempted.popitem(last=False)
            self._registered.notify_all()

    def finish(self, group_id: str) -> None:
        runner = self._active.pop(group_id, None)
        if runner is None and group_id in self._finished:
            return
        self._finished[group_id] = Ended((), None, frozenset()) if runner is None else \
            Ended(runner.members, runner.digest if runner.finished else None, runner.sent_to, runner.blame())
        while len(self._finished) > self.remember:
            self._finished.popitem(last=False)

    def active(self, group_id: str) -> RoundRunner | None:
        """The runner of round ``group_id`` while this worker is in it."""
        return self._active.get(group_id)

    def ended(self, group_id: str) -> Ended | None:
        """What this worker remembers of round ``group_id`` once it has finished here."""
        return self._finished.get(group_id)

    def settle(self, group_id: str, digest: str) -> None:
        """A round that failed here in doubt turned out completed by its group (``resolve``): say so when asked."""
        if group_id in self._finished:
            self._finished[group_id].digest = digest

    async def serve(self, stream: ByteStream) -> None:
        """Entry point for an incoming stream: the opening frame names the round; its runner serves it."""
        group_id = None
        try:
            opening = await asyncio.wait_for(stream.recv(max_payload=0, expect=(Code.CONTRIBUTE, Code.ASK_OUTCOME)),
                                             self.wait_for_group)
            group_id = meta_field(opening.meta, "group_id", str)
            if opening.code == Code.ASK_OUTCOME:
                await self._desk.answer(stream, group_id, blamed(opening.meta.get("blame")))
                return
            if meta_field(opening.meta, "sender", str) != stream.remote:
                raise ProtocolError("sender field does not match the authenticated peer id")
            round_key = opening.meta.get("round")
            done_in = self._completed.get(round_key) if isinstance(round_key, str) else None
            if done_in is not None and done_in != group_id and group_id not in self._active:
                raise ProtocolError(f"this worker completed round {round_key[:32]} in another group")
            attempt = opening.meta.get("attempt")
            known = isinstance(round_key, str) and type(attempt) is int and attempt >= 0
            place = (round_key, attempt) if known else None
            runner = await self._find(group_id, stream.remote, place)
            if stream.remote not in runner.members or stream.remote == runner.me:
                # Refused without failing the round: an outsider must not be able to break it.
                raise ProtocolError(f"{stream.remote[-8:]} is not a member of round {group_id}")
        except Exception as e:
            log.warning("refused a stream from %s: %s", stream.remote[-8:], e)
            # A round that ended here (failed) names its culprits; otherwise this worker is not in that attempt.
            ended = self._finished.get(group_id) if group_id is not None else None
            await stream.refuse(str(e) if isinstance(e, AveragingError) else f"{type(e).__name__}",
                                blame=ended.blame if ended is not None else (), stale=ended is None)
            stream.close()
            return
        try:  # a handler never outlives its round, whatever the peer does
            await asyncio.wait_for(runner.serve(stream, opening.meta), runner.timeout + runner.confirm_timeout)
        except asyncio.TimeoutError:
            log.debug("contribution stream from %s outlived its round", stream.remote[-8:])
            stream.close()

    def _elsewhere(self, group_id: str, place: tuple[str, int] | None) -> str | None:
        """Why this worker will never join ``group_id``, if it took another group of the same round at that
        attempt or a later one: it is in it, or was (a member grouped it with another leader's group of the
        attempt, which it did not take, or took and failed: from there it only goes on to later attempts).
        Such a stream used to wait ``wait_for_group`` for nothing."""
        if place is None:
            return None
        round_key, attempt = place
        mine = next((r for r in self._active.values() if r.group.group_id != group_id and r.group.attempt >= attempt
                     >= 0 and str(r.group.key) == round_key), None)
        if mine is not None:
            return f"this worker is in another group of round {round_key[:32]} (attempt {mine.group.attempt})"
        took = self._attempted.get(round_key)
        if took is not None and took >= attempt >= 0 and group_id not in self._active:
            return f"this worker was in another group of round {round_key[:32]} at attempt {took}"
        return None

    def _refuse_if_elsewhere(self, group_id: str, place: tuple[str, int] | None) -> None:
        why = self._elsewhere(group_id, place)
        if why is not None:
            raise ProtocolError(f"{why}, not in {group_id}")

    async def _find(self, group_id: str, remote: str, place: tuple[str, int] | None = None) -> RoundRunner:
        """The runner of ``group_id``, once registered; ``place``: the round key and attempt its opening names."""
        if group_id in self._finished:
            raise ProtocolError(f"round {group_id} is already finished")
        if group_id not in self._active:  # it may still come: wait, within bounds
            self._refuse_if_elsewhere(group_id, place)
            if self._waiting[remote] >= self.max_waiting_per_peer or sum(self._waiting.values()) >= self.max_waiting:
                raise ProtocolError(f"too many streams waiting for unknown rounds; {group_id} refused")
            self._waiting[remote] += 1
            cond = self._registered
            try:
                async with cond:
                    await asyncio.wait_for(cond.wait_for(lambda: group_id in self._active or group_id in self._finished
                                                         or self._elsewhere(group_id, place) is not None),
                                           self.wait_for_group)
            except asyncio.TimeoutError:
                raise ProtocolError(f"unknown group {group_id}") from None
            finally:
                self._waiting[remote] -= 1
                if not self._waiting[remote]:
                    del self._waiting[remote]
            if group_id not in self._active and group_id not in self._finished:
                self._refuse_if_elsewhere(group_id, place)
        if group_id not in self._active:
            raise ProtocolError(f"round {group_id} is already finished")
        return self._active[group_id]

