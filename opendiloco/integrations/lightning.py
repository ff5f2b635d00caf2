"""DiLoCo in Lightning: a ``Callback`` for ``lightning.Trainer``; a Fabric loop needs none.

::

    trainer = lightning.Trainer(..., callbacks=[DiLoCoCallback(comm, local_steps=500)])  # comm = connect(...)

The optimizer ``configure_optimizers`` returns becomes DiLoCo's inner optimizer, its lr schedulers still
driving it; Lightning's optimizer steps are DiLoCo's inner steps. With Fabric, build the
``DiLoCoOptimizer`` and hand it to ``fabric.setup(model, optimizer)`` like any optimizer
(examples/lightning_fabric.py).
"""

from __future__ import annotations

from typing import Any

from opendiloco.comm.base import Communicator
from opendiloco.optimizer import DiLoCoOptimizer

from ..extras import require
from . import DiLoCoSettings

pl = require("lightning.pytorch", "lightning", "opendiloco.integrations.lightning")


def around(optimizer, *, local_steps: int, communicator: Communicator | None, module=None,
           **options: Any) -> DiLoCoOptimizer:
    """A ``DiLoCoOptimizer`` whose inner optimizer is ``optimizer``, already built (its param groups,
    state and the lr schedulers attached to it are kept)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return DiLoCoOptimizer(params, local_steps=local_steps, inner_optimizer=lambda _: optimizer,
                           communicator=communicator, module=module, **options)


class DiLoCoCallback(DiLoCoSettings, pl.Callback):
    """Makes a ``lightning.Trainer`` a DiLoCo worker averaging through ``communicator`` (None: alone).

    ``options`` are ``DiLoCoOptimizer``'s. At the start of ``fit`` the one optimizer of the module becomes
    DiLoCo's inner optimizer (before a checkpoint is restored, so resuming restores DiLoCo's state too).
    Each outer step is logged (``RoundLog``) and ``outer_step`` goes to the module's logged metrics.
    One process per worker (a worker of several processes: ``LocalRanks``, docs/multi_gpu.md).
    """

    def on_fit_start(self, trainer, pl_module):
        if len(trainer.optimizers) != 1:
            raise ValueError(f"DiLoCoCallback: configure_optimizers must return one optimizer, got "
                             f"{len(trainer.optimizers)}")
        diloco = around(trainer.optimizers[0], local_steps=self.local_steps, communicator=self.communicator,
                        module=pl_module, **self.options)
        trainer.strategy.optimizers = [self._made(diloco)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._rounds()
        pl_module.log("outer_step", float(self.optimizer.outer_step), on_step=True, prog_bar=True)

    def on_fit_end(self, trainer, pl_module):
        if self.optimizer is not None and self.optimizer.finish() is not None:
            self._rounds()
