"""An attempt's watch over its members: it gives up on one that vanished, froze or ended the attempt,
and abandons the attempt when this worker is cut off from all of them.

A member frozen or cut off mid-exchange (SIGSTOP, a partition) sends nothing and closes nothing, so the
attempt would wait out ``allreduce_timeout`` (60 s) while every other member idles. Its record expires
``record_ttl`` after its last heartbeat; once it has been gone from two reads and ``VANISHED_S``, the
attempt fails as at its timeout and the next one forms without it (the matchmaker expects only live
workers). What the attempt waits on includes the audit's answers: a member that froze once its parts
and shard were in held eight others 36 s there. Sooner than that, a member whose daemon froze with it
leaves a ping unanswered while the others echo (``frozen.py``): given up on then, some 5 s after its
last frame. A member that is slow but alive keeps its record and echoes, and is waited for as before.

A member whose address changed mid-exchange keeps its record fresh (its DHT node finds the run from the
new address), while every stream of the attempt, its own and the others' to it, hangs on a connection
that is gone: in the world scenario that held every worker 39-58 s. Such a member hears nothing from
anyone; after ``cut_off_after`` seconds of that it abandons the attempt, and its record tells the others
to stop waiting for it. Any member that fails an attempt says so the same way
(``WorkerRecord.abandoned``): a refusal, its other word for it, does not reach a member whose stream to
it is stuck (in a relay, say).
"""

from __future__ import annotations

import asyncio
import logging

from ..comm.group import Group
from ..comm.runner import RoundRunner
from ..timeouts import FROZEN_PING_TIMEOUT_S as PING_TIMEOUT_S
from ..timeouts import MEMBER_VANISHED_S as VANISHED_S
from .connectivity.frozen import FrozenProbe, Unanswered
from .connectivity.watch import ConnectivityWatch
from .run_snapshot import RunSnapshot

log = logging.getLogger(__name__)


class MemberWatch:
    """Watches the members of one attempt (``runner`` of ``group``) while it runs, once a second.

    ``snapshot``: the run's records as last read (``run_snapshot.py``).
    ``cut_off_after``: ``SwarmSettings.cut_off_after`` (0: never). ``record_ttl``: how long a record
    lives after its writer's last heartbeat (said in the log)."""

    def __init__(self, runner: RoundRunner, group: Group, peer_id: str, *, cut_off_after: float, record_ttl: float,
                 snapshot: RunSnapshot, connectivity: ConnectivityWatch, unanswered: Unanswered):
        self.runner, self.group, self.peer_id = runner, group, peer_id
        self.cut_off_after, self.record_ttl = cut_off_after, record_ttl
        self.snapshot, self.connectivity, self.unanswered = snapshot, connectivity, unanswered
        self._gone_since: dict[str, tuple[float, int]] = {}

    async def run(self) -> None:
        """Fails the attempt as soon as a member it still waits on has left the run's records, or says in
        its record that it ended this attempt (failed it there), or leaves a ping unanswered while the
        others echo; or abandons it as soon as this worker is cut off."""
        loop = asyncio.get_running_loop()
        probe = FrozenProbe(self.runner, self.connectivity.ping, self.peer_id, skip=self.group.relayed)
        try:
            while not self.runner.ended.is_set():
                await asyncio.sleep(1.0)
                if await self._gave_up(probe, loop.time()):
                    return
        finally:
            probe.close()

    async def _gave_up(self, probe: FrozenProbe, now: float) -> bool:
        """One look: True once the attempt was given up (or abandoned) here."""
        runner, group = self.runner, self.group
        if self.cut_off_after and runner.silent_for() >= self.cut_off_after:
            await self._cut_off()
            return True
        frozen = probe.step()
        if frozen is not None and runner.waits_on(frozen) and not runner.ended.is_set():
            log.warning("round %s: member %s left a ping unanswered for %.0f s while the other members answered "
                        "(frozen, or its links to this worker broke), with its part of the exchange still owed: "
                        "giving up on it", group.group_id, frozen[-8:], PING_TIMEOUT_S)
            self.unanswered.found(frozen)  # not waited for in the retry's matchmaking either
            await runner.give_up_on(frozen, "left a ping unanswered")
            return True
        live, reads = self.snapshot.workers, self.snapshot.reads
        for m in group.members:
            if m == self.peer_id or not runner.waits_on(m):
                self._gone_since.pop(m, None)
                continue
            if m in live and live[m].abandoned == group.group_id:
                log.warning("round %s: member %s ended this attempt (it failed there) with its part of the "
                            "exchange still owed: giving up on it", group.group_id, m[-8:])
                await runner.give_up_on(m, "ended its attempt")
                if m not in runner.heard_from:  # cut off (a new address, say): the connection to it is dead
                    await self.connectivity.disconnect({m})
                return True
            if m in live:
                self._gone_since.pop(m, None)
                continue
            since, at_read = self._gone_since.setdefault(m, (now, reads))
            if now - since >= VANISHED_S and reads - at_read >= 2:
                log.warning("round %s: member %s is gone from the run's records (no heartbeat for %.0f s) "
                            "with its part of the exchange still owed: giving up on it", group.group_id,
                            m[-8:], self.record_ttl)
                await runner.give_up_on(m, "left the run's records")
                return True
        return False

    async def _cut_off(self) -> None:
        """This worker heard nothing from any member of the attempt for ``cut_off_after`` seconds while
        it waits on them: its connections to them are taken for dead. It closes them (the next streams
        and DHT calls dial anew, from whatever address it has now), says so in its record, and abandons
        the attempt."""
        others = set(self.group.members) - {self.peer_id}
        log.warning("round %s: heard nothing from any of its %d other member(s) for %.0f s while waiting on them "
                    "(this worker's address changed, or its links broke): abandoning the attempt and dialling anew",
                    self.group.group_id, len(others), self.runner.silent_for())
        self.connectivity.cut_off()
        await self.connectivity.disconnect(others)
        await self.runner.abandon("heard nothing from any member (cut off)")  # which its record then says
