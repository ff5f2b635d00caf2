"""DiLoCo in other frameworks' loops: ``hf`` (transformers' ``Trainer``), ``lightning`` (a Lightning
``Callback`` and a Fabric helper); an ``accelerate`` loop needs nothing beyond ``LocalRanks``
(examples/accelerate_loop.py). Each module imports its framework when it is imported, and says in
one line which extra installs it (``extras.require``)."""

from __future__ import annotations

import logging

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
