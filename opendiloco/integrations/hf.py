"""DiLoCo in Hugging Face ``transformers.Trainer``: a callback that also builds the optimizer.

::

    diloco = DiLoCoCallback(comm, local_steps=500)      # comm = opendiloco.connect(...)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[diloco],
                      optimizers=diloco.optimizers(model, args))

The inner optimizer is the one ``args`` names (``optim``, ``learning_rate``, ``adam_beta1``...,
``weight_decay`` on matrices only), driven by the Trainer's lr schedule, gradient clipping and
accumulation as before; the Trainer's steps are DiLoCo's inner steps.
"""

from __future__ import annotations

import functools

import torch

from opendiloco.optimizer import DiLoCoOptimizer

from ..extras import require
from . import DiLoCoSettings

transformers = require("transformers", "hf", "opendiloco.integrations.hf")


class DiLoCoCallback(DiLoCoSettings, transformers.TrainerCallback):
    """Makes a ``Trainer`` a DiLoCo worker averaging through ``communicator`` (None: a worker alone).

    ``options`` are ``DiLoCoOptimizer``'s (``outer_optimizer``, ``fragments``, ``error_feedback``...).
    ``optimizers(model, args)`` is what ``Trainer(optimizers=...)`` takes. The callback logs each outer
    step (``RoundLog``), adds ``outer_step`` to the Trainer's logs, and lands a streamed round still in
    flight when training ends.
    """

    def optimizers(self, model: torch.nn.Module, args) -> tuple[DiLoCoOptimizer, None]:
        """``(DiLoCoOptimizer, None)`` for ``Trainer(optimizers=...)``: the Trainer makes the lr schedule."""
        inner_cls, inner_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
                  {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]  # biases, norms
        diloco = DiLoCoOptimizer([g for g in groups if g["params"]], local_steps=self.local_steps,
                                 inner_optimizer=functools.partial(inner_cls, **inner_kwargs),
                                 communicator=self.communicator, module=model, **self.options)
        return self._made(diloco), None

    def _built(self) -> DiLoCoOptimizer:
        if self.optimizer is None:
            raise RuntimeError("DiLoCoCallback: pass optimizers=callback.optimizers(model, args) to the Trainer")
        return self.optimizer

    def on_train_begin(self, args, state, control, **kwargs):
        self._built()

    def on_step_end(self, args, state, control, **kwargs):
        self._rounds()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.optimizer is not None:
            logs["outer_step"] = self.optimizer.outer_step

    def on_train_end(self, args, state, control, **kwargs):
        if self._built().finish() is not None:
            self._rounds()
