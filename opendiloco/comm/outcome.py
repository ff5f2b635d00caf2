"""How a round ended, when this worker's own attempt failed in doubt: asking the members, and answering
them.

A member whose attempt failed after it sent its last part to every other owner and the end of its own
shard to some member cannot tell on its own whether the round happened (``InDoubt``). It asks the other
members (``ASK_OUTCOME``: ``ask_outcome``, ``find_outcome``) and ends with the group's outcome
(``resolve``): the average it holds, the group's state, or a retry. Every worker answers such questions
about its own rounds (``OutcomeDesk``: ``OUTCOME``, once the round has ended there).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InDoubt, ProtocolError, RoundCounted, Unreachable
from ..timeouts import GONE_POLL_S, UNDIALLED_GONE_S
from .base import RoundKey
from .blame import MAX_BLAMED
from .wire import ByteStream, Code, Connect
from .wire import field as meta_field

if TYPE_CHECKING:
    from .rounds_taken import Rounds
    from .runner import RoundOutcome, RoundRunner

log = logging.getLogger(__name__)

ANSWERS = ("done", "failed", "running", "unknown")
"""What a member says of a round: it completed (and applied) it, failed it, is still in it, never knew it."""
MAX_DIGEST_CHARS = 64
HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Answer:
    state: str
    digest: str = ""
    sent_to: frozenset[str] = frozenset()
    """The members the answering member began sending its shard's end to (final once it is done or failed)."""


@dataclass
class Ended:
    """What this worker remembers of a finished round, to answer its members' ``ASK_OUTCOME``."""

    members: tuple[str, ...]
    digest: str | None
    """The average's digest if the round completed here (or the group completed it: ``Rounds.settle``)."""
    sent_to: frozenset[str]
    """The members this worker began sending the end of its own shard's result to."""
    blame: frozenset[str] = frozenset()
    """Whom this worker's failure of the round named (what a refusal of a late stream of it carries)."""


def outcome_meta(group_id: str, runner: RoundRunner | None, ended: Ended | None) -> dict:
    """A round here, as ``OUTCOME`` tells it: its state (done, failed, running or unknown), the digest
    if done, and the members this worker began sending its shard's end to. ``runner``: the round while
    this worker is in it; ``ended``: what it remembers of it once it is over."""
    if runner is not None:
        state = "done" if runner.finished else "failed" if runner.ended.is_set() else "running"
        ended = Ended(runner.members, runner.digest if runner.finished else None, runner.sent_to)
    else:
        state = "unknown" if ended is None else "done" if ended.digest else "failed"
    return {"group_id": group_id, "state": state, "digest": (ended.digest or "") if ended else "",
            "sent_to": sorted(ended.sent_to) if ended else []}


class OutcomeDesk:
    """Answers the members of this worker's rounds that ask how a round ended (``ASK_OUTCOME``; ``Rounds``
    routes those streams here). At most ``rounds.max_waiting_per_peer`` questions of one member wait for
    their round to end at a time."""

    def __init__(self, rounds: Rounds):
        self._rounds = rounds
        self._asking: collections.Counter = collections.Counter()
        """Questions waiting for a round of this worker to end, by remote peer."""

    async def answer(self, stream: ByteStream, group_id: str, blame: frozenset[str] = frozenset()) -> None:
        """Tells a member of round ``group_id`` whether the round completed here, once it has ended here
        (waiting at most as long as the round may still last). Only members of the round are answered. A
        member asks only once its own attempt failed: if the round here still waits for its bytes, it fails
        now."""
        remote = stream.remote
        runner = self._rounds.active(group_id)
        ended = self._rounds.ended(group_id)
        members = runner.members if runner is not None else ended.members if ended is not None else ()
        if (runner is not None or ended is not None) and remote not in members:
            raise ProtocolError(f"{remote[-8:]} is not a member of round {group_id}")
        if runner is not None and not runner.ended.is_set():
            if runner.waits_on(remote):  # it asks because its attempt failed: what we wait for never comes
                await runner.give_up_on(remote, blame=blame)
            if self._asking[remote] >= self._rounds.max_waiting_per_peer:
                raise ProtocolError(f"too many questions of {remote[-8:]} waiting; {group_id} refused")
            self._asking[remote] += 1
            try:
                await asyncio.wait_for(runner.ended.wait(), runner.timeout + runner.confirm_timeout)
            except asyncio.TimeoutError:
                pass  # answered "running": the member may ask again
            finally:
                self._asking[remote] -= 1
                if not self._asking[remote]:
                    del self._asking[remote]
        try:
            await stream.send(Code.OUTCOME, outcome_meta(group_id, self._rounds.active(group_id),
                                                         self._rounds.ended(group_id)))
        except Exception as e:  # the member is gone: nothing to tell
            log.debug("could not answer %s about round %s: %s", remote[-8:], group_id, e)
        finally:
            stream.close()


async def ask_outcome(connect: Connect, peer: str, group_id: str, members: Sequence[str],
                      blame: Sequence[str] = ()) -> Answer:
    """``peer``'s answer about round ``group_id`` (of ``members``); ``ProtocolError`` if it does not fit.
    ``blame``: whom this worker's failure of the round names (``blame.py``).

    The answer comes on the stream this worker opened to ``peer``: from that authenticated peer.
    """
    stream = await connect(peer)
    try:
        await stream.send(Code.ASK_OUTCOME, {"group_id": group_id, "blame": sorted(blame)[:MAX_BLAMED]})
        frame = await stream.recv(max_payload=0, expect=Code.OUTCOME)
    finally:
        stream.close()
    state, digest = meta_field(frame.meta, "state", str), meta_field(frame.meta, "digest", str)
    sent_to = meta_field(frame.meta, "sent_to", list)
    if meta_field(frame.meta, "group_id", str) != group_id or state not in ANSWERS:
        raise ProtocolError(f"{peer[-8:]} answered {state[:20]!r} about another round or in no known terms")
    if state == "done" and not (0 < len(digest) <= MAX_DIGEST_CHARS and set(digest) <= HEX):
        raise ProtocolError(f"{peer[-8:]} answered done with a malformed digest")
    if len(sent_to) > len(members) or not all(isinstance(m, str) and m in members for m in sent_to):
        raise ProtocolError(f"{peer[-8:]} named non-members")
    return Answer(state, digest if state == "done" else "", frozenset(sent_to))


class _Inquiry:
    """Asking the other members of the round of ``doubt`` how it ended (``find_outcome``): their answers so
    far, and whether they settle it."""

    def __init__(self, connect: Connect, doubt: InDoubt, timeout: float, gone: Callable[[str], bool] | None,
                 pause: float):
        self.connect, self.doubt, self.gone, self.pause = connect, doubt, gone, pause
        self.distrusted = frozenset(doubt.distrusted) - {doubt.me}
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + timeout
        self.answers = {m: "unanswered" for m in doubt.members if m != doubt.me}
        self.final: dict[str, frozenset[str]] = {}  # sent_to of the members that are done or failed
        self.found: list[str] = []
        self._undialled_since: dict[str, float] = {}
        """(loop time) The end of the first of the dials to a member that have all failed since."""

    def left(self) -> float:
        return self.deadline - self.loop.time()

    def ruled_out(self, m: str) -> bool:
        return any(m not in sent_to for p, sent_to in self.final.items() if p != m)

    def decided(self) -> bool:
        return bool(self.found) or all(self.answers[m] in ("failed", "gone", "distrusted") or self.ruled_out(m)
                                       for m in self.doubt.ask)

    def result(self) -> tuple[str | None, dict[str, str]]:
        """The digest a member that may have completed the round gave, if any, and the answers of
        ``doubt.ask`` ("ruled out" where none is needed any more)."""
        for m in self.doubt.ask:
            if self.answers[m] not in ("failed", "gone", "distrusted") and self.ruled_out(m) and not self.found:
                self.answers[m] = "ruled out"
        return (self.found[0] if self.found else None), {m: self.answers[m] for m in self.doubt.ask}

    async def ask(self, peer: str) -> None:
        """Asks ``peer`` until its answer is final, it is taken for gone or distrusted, or time runs out."""
        while self.left() > 0:
            answer = await self._ask_once(peer)
            if answer is None or self._settled_by(peer, answer):
                return
            await asyncio.sleep(min(self.pause, max(0.0, self.left())))

    async def _ask_once(self, peer: str) -> Answer | None:
        """``peer``'s answer ("unanswered" where none came); None once it is not to be asked again (time ran
        out, or it is taken for gone)."""
        doubt = self.doubt
        asking = asyncio.ensure_future(ask_outcome(self.connect, peer, doubt.group_id, doubt.members,
                                                   sorted(set(doubt.peers) - {doubt.me})))
        try:
            # A dial into a partition neither answers nor fails for as long as the daemon tries (30 s):
            # a member that has left the run meanwhile is not waited for that long.
            while not asking.done():
                if self.loop.time() >= self.deadline:
                    return None
                if self.gone is not None and self.gone(peer):
                    self.answers[peer] = "gone"
                    return None
                await asyncio.wait({asking}, timeout=min(GONE_POLL_S, max(0.0, self.left())))
            answer = asking.result()
            self._undialled_since.pop(peer, None)
        except Unreachable as e:  # no dial reached it
            since = self._undialled_since.setdefault(peer, self.loop.time())
            if self.loop.time() - since >= UNDIALLED_GONE_S:
                self.answers[peer] = "gone"
                log.info("round %s: %s could not be dialled for %.0f s while asked how the round ended: taken "
                         "for gone (%s)", doubt.group_id, peer[-8:], UNDIALLED_GONE_S, e)
                return None
            answer = Answer("unanswered")
        except Exception as e:  # refused, or out of form: not an answer
            log.debug("asking %s about round %s: %s", peer[-8:], doubt.group_id, e)
            self._undialled_since.pop(peer, None)
            answer = Answer("unanswered")
        finally:
            if not asking.done():
                asking.cancel()
                await asyncio.gather(asking, return_exceptions=True)
        return answer

    def _settled_by(self, peer: str, answer: Answer) -> bool:
        """Notes ``peer``'s answer: whether it needs no more asking."""
        self.answers[peer] = answer.state
        if answer.state == "unanswered" and self.gone is not None and self.gone(peer):
            self.answers[peer] = "gone"
            return True
        if answer.state == "done" and peer in self.distrusted:
            self.answers[peer] = "distrusted"
            log.warning("round %s: %s says it completed the round, but this worker's own checks of it failed "
                        "(%s): not believed", self.doubt.group_id, peer[-8:], self.doubt)
            return True
        if answer.state in ("done", "failed"):
            self.final[peer] = answer.sent_to
            if answer.state == "done" and peer in self.doubt.ask:  # only those can have completed it
                self.found.append(answer.digest)
            return True
        return False


async def find_outcome(connect: Connect, doubt: InDoubt, timeout: float, gone: Callable[[str], bool] | None = None,
                       pause: float = 0.25) -> tuple[str | None, dict[str, str]]:
    """Asks the other members of the round of ``doubt`` at once whether they completed it: (the digest,
    answers) as soon as one that may have (``doubt.ask``) says it did; (None, answers) once none of them can
    have (each said it failed it, or is ruled out), or when ``timeout`` runs out.

    A member of ``doubt.ask`` that cannot be reached, answers out of form, "running" or "unknown" is asked
    again until ``timeout``, unless it is ruled out: a member completes only with every owner's shard, so
    one that another owner never began sending its shard's end to (that owner's final answer says so) has
    not. The others are asked only for that. A member that does not answer and has left the run, or
    says in its record that it failed the attempt (``gone(peer)``), or that no dial has reached for
    ``UNDIALLED_GONE_S`` (a killed worker), is not waited for: had it completed
    the round, its state left with it, and the members' retry counts their work once in every state that
    remains. ``answers``: the last state of
    each member of ``doubt.ask`` ("unanswered" where none came, "gone", or "ruled out" where none is
    needed any more).

    A member whose bytes failed this worker's own checks or audit (or left it unanswered), or that gave up
    on the round blaming no other member (``doubt.distrusted``), is not believed when it says "done"
    ("distrusted"), nor about whom it sent its shard to: an owner that keeps its result from the audit and
    then says the round completed would otherwise have it applied. A member whose stream only closed, or
    that did not answer in time, may have completed the round, and is believed.
    """
    inquiry = _Inquiry(connect, doubt, timeout, gone, pause)
    pending = {asyncio.create_task(inquiry.ask(m)) for m in inquiry.answers}
    try:
        while pending and not inquiry.decided():
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return inquiry.result()


async def resolve(doubt: InDoubt, connect: Connect, key: RoundKey, timeout: float,
                  rounds: Rounds | None = None, gone: Callable[[str], bool] | None = None) -> RoundOutcome | None:
    """The group's outcome of an attempt that failed here in doubt, so that this worker ends with it.

    - A member completed the round: this worker's contribution is in the average. If this worker
      holds that very average (the same digest), it is returned to be applied; else ``RoundCounted``
      (completed): adopt the group's state, never apply or carry the work again.
    - No member that is still there can have completed it (``find_outcome``): None, retry.
    - Otherwise (no answer within ``timeout``): ``RoundCounted`` (not completed). Correctness over
      goodput: the work may have been counted, so it is dropped, and the run's state adopted.

    ``rounds`` (this worker's) learns that the round completed, to tell members that ask in turn.
    ``gone(peer)``: whether a member has left the run (see ``find_outcome``).
    """
    digest, answers = await find_outcome(connect, doubt, timeout, gone)
    gid, step = doubt.group_id, key.outer_step + 1
    if digest is not None:
        if rounds is not None:
            rounds.settle(gid, digest)
        if doubt.held is not None and doubt.held.digest == digest:
            log.warning("round %s failed here (%s), but the group completed it with the average this worker holds "
                        "(%s): applying it", gid, doubt, digest)
            return doubt.held
        raise RoundCounted(f"the group completed round {key} ({gid}) without this worker's confirmation (here: "
                           f"{doubt}); adopting its state", group_outer_step=step, completed=True)
    if all(a in ("failed", "ruled out", "gone", "distrusted") for a in answers.values()):
        doubt.failed_too = frozenset(p for p, a in answers.items() if a == "failed")
        doubt.gone = frozenset(p for p, a in answers.items() if a == "gone")
        log.info("round %s: no member can have completed it (%s): retrying", gid,
                 ", ".join(f"{p[-8:]} {a}" for p, a in sorted(answers.items())))
        return None
    silent = sorted(p[-8:] for p, a in answers.items() if a not in ("failed", "ruled out", "gone", "distrusted"))
    log.warning("round %s: %s did not say within %.0fs whether they completed it; this worker's contribution may "
                "have been counted, so its local work is dropped and the run's state adopted (correctness over "
                "goodput)", gid, silent, timeout)
    raise RoundCounted(f"nobody could say whether round {key} ({gid}) completed without this worker "
                       f"({', '.join(silent)} silent; here: {doubt}); adopting the run's state",
                       group_outer_step=step, completed=False)
