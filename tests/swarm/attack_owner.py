"""An insider that decides the result of the shard it owns: a member of the run (the test worker, same
settings) whose shard's average is 60000 everywhere (``--owner-result 60000``) or -4x the true mean
(``--owner-result -4x``). Everything else it does is honest: its own contribution, its checks, its
answers to other members' audits.

Usage: the test worker's options (tests/swarm/worker.py), plus ``--owner-result``.
"""

import dataclasses
import sys

import torch
import worker  # tests/swarm/worker.py: this script's own folder is on the path

from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.runner import RoundRunner

MODE = "60000"


@dataclasses.dataclass(frozen=True)
class Decides(Aggregation):
    def combine(self, parts, weights, norms=None):
        acc, clipped = super().combine(parts, weights, norms)
        return (torch.full_like(acc, 60000.0) if MODE == "60000" else acc * -4), clipped


class DecidingOwner(RoundRunner):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        a = self.reducer.aggregation
        self.reducer.aggregation = Decides(a.method, a.clip_ratio, a.max_weight_ratio, a.iterations)


class Owner(worker.SwarmCommunicator):
    round_runner = DecidingOwner


if __name__ == "__main__":
    if "--owner-result" in sys.argv:
        i = sys.argv.index("--owner-result")
        MODE = sys.argv[i + 1]
        del sys.argv[i : i + 2]
    worker.Communicator = Owner
    sys.exit(worker.main())
