"""An insider that tries to take over the average: a member of the run (it runs the test worker,
with the same settings) whose every contribution is 60000 everywhere, with a claimed weight of 1e9.

Usage: the test worker's options (tests/swarm/worker.py).
"""

import sys

import torch
import worker  # tests/swarm/worker.py: this script's own folder is on the path

VALUE, WEIGHT = 60000.0, 1e9


class Poisoner(worker.SwarmCommunicator):
    def start(self, flat, *, weight, key, out=None, error_out=None):
        return super().start(torch.full_like(flat, VALUE), weight=WEIGHT, key=key, out=out, error_out=error_out)


if __name__ == "__main__":
    worker.Communicator = Poisoner
    sys.exit(worker.main())
