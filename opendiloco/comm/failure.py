"""How one attempt at a round fails here, and what its failure says of the members.

The first failure stands (``error``); every wait of the attempt ends with it (``_unless_failed``),
so a handler never outlives its round. Along the way the attempt notes what each member did: bytes
that failed this worker's checks (``malformed``: evidence), a dial that never reached it
(``unreachable``), a refusal (``refused_by``: alive, its own attempt failed), and who gave up on the
attempt blaming nobody else (``breakers``, ``blame.py``).
"""

from __future__ import annotations

import asyncio

from ..errors import AveragingError, Malformed, PeerFailure, ProtocolError
from .blame import breaks_attempt
from .wire import Refused, StreamClosed


class AttemptFailure:
    """The failure side of a round member (mixed into ``runner.RoundRunner``, which sets ``me`` and
    ``members``): its first error, the condition its waits watch, and what the failure names."""

    def _init_failure(self) -> None:
        self.error: Exception | None = None
        self.malformed: dict[str, str] = {}
        """Members whose bytes failed this worker's own checks in this round, with what was wrong
        (``Malformed``): the communicator leaves them out of its next groups (``swarm/exclusion.py``)."""
        self.unreachable: set[str] = set()
        """Members this worker could not dial at all (``Unreachable``), whatever error ended the attempt."""
        self.refused_by: set[str] = set()
        """Members that refused this worker's streams (``REFUSE``): their attempt failed and they said so,
        so they are alive and back for the retry (not suspects to leave behind)."""
        self._gave_up: dict[str, frozenset[str]] = {}
        """Members that refused this worker's streams or asked how the round ended while it still needed their
        bytes, with whom they blamed for it (``blame.py``; ``breakers``)."""
        self._changed = asyncio.Condition()
        """Notified whenever the round's state moves on (a failure among it)."""
        self._failed = asyncio.Event()

    async def abandon(self, why: str) -> None:
        """Fails the attempt here now: this worker cannot do its part (``why``). Members that may have
        completed it are asked, as after any failure."""
        await self._fail(AveragingError(f"abandoned: {why}"))

    async def give_up_on(self, member: str, why: str = "failed its attempt",
                         blame: frozenset[str] | None = None) -> None:
        """What we still wait for from ``member`` will never come (its attempt failed: it asks how the round
        ended, naming ``blame``; or it left the run: ``blame`` None), so the round fails here now instead of
        at its timeout."""
        if blame is not None:
            self._gave_up.setdefault(member, blame)
        await self._fail(PeerFailure(f"{member[-8:]} {why} before this worker had all it sends", {member}))

    @property
    def breakers(self) -> set[str]:
        """The members that broke this attempt here: the culprits of its first failure that gave up on it
        (refused, or asked how it ended, while this worker still needed their bytes) without blaming a
        third member (``blame.breaks_attempt``). The communicator leaves them out of the round's retries."""
        error = self.error
        if not isinstance(error, PeerFailure) or isinstance(error, Malformed):
            return set()
        return set(error.peers) & self._broke

    @property
    def _broke(self) -> frozenset[str]:
        """The members that gave up on this attempt blaming no third member (``blame.breaks_attempt``)."""
        return frozenset(p for p, blame in self._gave_up.items() if breaks_attempt(p, self.me, blame, self.members))

    def blame(self) -> frozenset[str]:
        """Whom this worker's own failure of the round names (what its refusals and questions carry)."""
        error = self.error
        return frozenset(error.peers) - {self.me} if isinstance(error, PeerFailure) else frozenset()

    def _checked(self, peer: str, error: ProtocolError) -> AveragingError:
        """What a ``ProtocolError`` on ``peer``'s stream says of it: a ``Malformed`` (noted) when its own
        bytes failed a check here; the error itself when the stream only closed or was refused."""
        if isinstance(error, Refused):
            self.refused_by.add(peer)
            if not error.stale:
                self._gave_up.setdefault(peer, error.blame)
        if isinstance(error, (StreamClosed, Refused)):
            return error
        failure = Malformed(f"{peer[-8:]} sent malformed data: {error}", {peer})
        self._note_malformed(failure)
        return failure

    def _note_malformed(self, error: Malformed) -> None:
        for peer in error.peers:
            if peer != self.me:
                self.malformed.setdefault(peer, str(error))

    async def _unless_failed(self, awaitable):
        """Awaits ``awaitable``, or raises as soon as the round fails (a handler never outlives its round)."""
        task = asyncio.ensure_future(awaitable)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled() or self._failed.is_set():  # the round's failure, not what it left the task to trip on
            if not task.cancelled():
                task.exception()  # retrieved (asyncio would print it); the failure is what is raised
            self._raise_if_failed()
        if task.cancelled():
            raise AveragingError("round cancelled")
        return task.result()

    def _raise_if_failed(self) -> None:
        error = self.error
        if error is not None:  # a fresh exception each time: re-raising one object grows its traceback
            if isinstance(error, PeerFailure):  # still names its culprits, Malformed or not
                raise (Malformed if isinstance(error, Malformed) else PeerFailure)(str(error), error.peers) from None
            raise AveragingError(str(error) if isinstance(error, AveragingError) else f"round failed: {error}") \
                from None

    async def _fail(self, error: Exception) -> None:
        """Fails the attempt here with ``error`` (the first failure stands) and wakes every wait on it."""
        async with self._changed:
            if self.error is None:
                self.error = error
            self._failed.set()
            self._changed.notify_all()
