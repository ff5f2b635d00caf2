"""DiLoCo in other frameworks' loops: ``hf`` (transformers' ``Trainer``), ``lightning`` (a Lightning
``Callback`` and a Fabric helper); an ``accelerate`` loop needs nothing beyond ``LocalRanks``
(examples/accelerate_loop.py). Each module imports its framework when it is imported, and says in
one line which extra installs it (``extras.require``)."""

from __future__ import annotations

import logging
from typing import Any

from opendiloco.comm.base import Communicator
from opendiloco.optimizer import DiLoCoOptimizer, SyncReport

log = logging.getLogger("opendiloco.integrations")


class RoundLog:
    """Says each outer step of ``optimizer`` once, after the inner step it landed in, in one log line
    (the same in every integration): its number, θ_global's hash (bit-identical on every worker of
    the group), the group's size and the seconds the step took. A failed one the optimizer has said."""

    def __init__(self, optimizer: DiLoCoOptimizer):
        self.optimizer = optimizer
        self._seen = optimizer.last_sync

    def __call__(self) -> SyncReport | None:
        """The outer step that landed since the last call (after logging it), or None."""
        report = self.optimizer.last_sync
        if report is None or report is self._seen:
            return None
        self._seen = report
        if report.ok:
            log.info("outer step %d: θ_global %s, group of %d, %.2f s", report.outer_step, report.global_hash,
                     report.group_size, report.seconds)
        return report


class DiLoCoSettings:
    """What a framework's DiLoCo callback is given, and the optimizer it makes of it: a worker averaging
    through ``communicator`` (None: a worker alone) every ``local_steps`` inner steps, with
    ``DiLoCoOptimizer``'s other ``options``; ``optimizer`` and the ``RoundLog`` that says its outer
    steps are None until the callback has made it."""

    def __init__(self, communicator: Communicator | None = None, *, local_steps: int, **options: Any):
        self.communicator = communicator
        self.local_steps = local_steps
        self.options = options
        self.optimizer: DiLoCoOptimizer | None = None
        self._rounds: RoundLog | None = None

    def _made(self, optimizer: DiLoCoOptimizer) -> DiLoCoOptimizer:
        """Keeps the optimizer the callback made, and starts logging its outer steps."""
        self.optimizer = optimizer
        self._rounds = RoundLog(optimizer)
        return optimizer
