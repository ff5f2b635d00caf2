"""An insider that breaks rounds: a member of the run (the test worker, same settings) that sends one
malformed part in every group it is in, to the first other member in the group's order.

Usage: the test worker's options (tests/swarm/worker.py), plus ``--malformed nan`` (a part of NaN, the
fp16 codec's size) or ``--malformed short`` (a part two bytes short).
"""

import sys

import torch
import worker  # tests/swarm/worker.py: this script's own folder is on the path

from opendiloco.comm.runner import RoundRunner

MODE = "nan"


class MalformedRunner(RoundRunner):
    """Its first part of the first other member's shard is malformed; everything else is honest."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.target = next(j for j in range(len(self.members)) if j != self.my_index)
        self.sent_bad = False

    def _commit(self, j, i, payload, numel):
        try:  # what owners would check it against: a short part has none (and it lies anyway)
            super()._commit(j, i, payload, numel)
        except Exception:
            pass

    def _encode(self, a: int, b: int):
        payload = super()._encode(a, b)
        if self.sent_bad or a != self.bounds[self.target][0]:
            return payload
        self.sent_bad = True
        if MODE == "short":
            return bytes(payload)[:-2]
        return torch.full((b - a,), float("nan"), dtype=torch.float16).view(torch.uint8).numpy().tobytes()


class Breaker(worker.SwarmCommunicator):
    round_runner = MalformedRunner


if __name__ == "__main__":
    if "--malformed" in sys.argv:
        i = sys.argv.index("--malformed")
        MODE = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    worker.Communicator = Breaker
    sys.exit(worker.main())
