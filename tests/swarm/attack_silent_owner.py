"""An insider that owns a shard, sets its result, and never answers an audit.

``--owner-result 60000`` sets it to 60000 everywhere; ``-1x`` to minus the true mean, whose size is the
mean's own, so that only the audit can tell (the owner's result is also bounded in size as a whole).

Everything else it does is honest (its contribution, its own checks, its confirmations). With ``--ask``
it also asks every other member how the round ended (``ASK_OUTCOME``) as soon as its own results are
out: a member still waiting for its audit answers then takes it for a member whose attempt failed.

Before the fix, members whose audit stalled failed "in doubt", heard "done" from this owner when they
asked, and applied the average they held: the run's loss went from 0.007 to 2e13 in one round, every
round "ok", nobody named.

Usage: the test worker's options (tests/swarm/worker.py), plus ``--owner-result`` and ``--ask``.
"""

import asyncio
import dataclasses
import sys

import torch
import worker  # tests/swarm/worker.py: this script's own folder is on the path

from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.outcome import ask_outcome
from opendiloco.comm.runner import RoundRunner
from opendiloco.comm.wire import Code

ASK = False
MODE = "60000"


@dataclasses.dataclass(frozen=True)
class Poisons(Aggregation):
    def combine(self, parts, weights, norms=None):
        acc, clipped = super().combine(parts, weights, norms)
        return (torch.full_like(acc, 60000.0) if MODE == "60000" else -acc), clipped


class SilentOwner(RoundRunner):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        a = self.reducer.aggregation
        self.reducer.aggregation = Poisons(a.method, a.clip_ratio, a.max_weight_ratio, a.iterations)
        self._connect = None

    async def run(self, connect):
        self._connect = connect
        return await super().run(connect)

    async def _answer_audit(self, stream, sender, meta):
        await asyncio.sleep(3600)  # the request is read, and never answered

    async def _audit(self):  # it asks the others to audit nothing, as an honest member asks, and moves on
        for stream in self._confirm_streams.values():
            await stream.send(Code.AUDIT, {"chunks": []})
        if ASK and self._connect is not None:
            for m in self.members:
                if m != self.me:
                    asyncio.ensure_future(self._ask_quietly(m))

    async def _ask_quietly(self, member):
        try:
            await ask_outcome(self._connect, member, self.group.group_id, self.members)
        except Exception:
            pass


class Owner(worker.SwarmCommunicator):
    round_runner = SilentOwner


if __name__ == "__main__":
    if "--owner-result" in sys.argv:
        i = sys.argv.index("--owner-result")
        MODE = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    if "--ask" in sys.argv:
        sys.argv.remove("--ask")
        ASK = True
    worker.Communicator = Owner
    sys.exit(worker.main())
