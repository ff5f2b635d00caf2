"""An insider that breaks every attempt it is in without sending anything malformed in its parts: a member
of the run (the test worker, same settings) that

- ``--breaks refuse``: refuses every contribution to its shard at once, naming nobody as the cause;
- ``--breaks garbage``: answers every audit with bytes out of form (a two-value answer).

Before, such a member was never named: a refusal or a garbage answer counted as a failure of the
attempt, not of the member, so it was taken back into every retry (4 ok rounds and 67 failed attempts,
32.6 s per ok round against 1.17 s).

Usage: the test worker's options (tests/swarm/worker.py), plus ``--breaks``.
"""

import sys

import worker  # tests/swarm/worker.py: this script's own folder is on the path

from opendiloco.comm.runner import RoundRunner
from opendiloco.comm.wire import Code

MODE = "refuse"


class BreakingRunner(RoundRunner):
    async def serve(self, stream, opening):
        if MODE != "refuse":
            return await super().serve(stream, opening)
        await stream.refuse("not today")
        stream.close()

    async def _answer_audit(self, stream, sender, meta):
        if MODE != "garbage":
            return await super()._answer_audit(stream, sender, meta)
        await stream.send(Code.AUDIT_ANSWER, {"path": []}, b"\0" * 8)


class Breaker(worker.SwarmCommunicator):
    round_runner = BreakingRunner


if __name__ == "__main__":
    if "--breaks" in sys.argv:
        i = sys.argv.index("--breaks")
        MODE = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    worker.Communicator = Breaker
    sys.exit(worker.main())
