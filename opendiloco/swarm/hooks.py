"""Where a test or a benchmark watches or disturbs a worker's rounds, with the protocol left as it is.

A ``SwarmCommunicator`` calls its ``hooks`` at fixed points of every round; the default hooks do
nothing. ``opendiloco.testing.faults`` has the ones the tests and benchmarks use (a record of every
attempt, dumps of what was sent and received, a stall inside the all-reduce, a fault injected into
one attempt's exchange), so none of them overrides the communicator's private methods.
"""

from __future__ import annotations

import torch

from ..comm.base import AverageResult, RoundKey
from ..comm.group import Group
from ..comm.runner import RoundRunner


class RoundHooks:
    """Every method is called on the round's thread unless it says otherwise, and must not change the
    tensors it is shown."""

    def round_began(self, key: RoundKey, contribution: torch.Tensor) -> None:
        """A round starts, with this worker's flat contribution to it."""

    def runner_for(self, group: Group, default: type[RoundRunner]) -> type[RoundRunner]:
        """The class that runs this attempt's exchange: ``default`` (the communicator's ``round_runner``),
        or a subclass that sends, stalls or breaks on purpose."""
        return default

    async def before_exchange(self, group: Group) -> None:
        """On the event loop, once a group of two or more is formed and before its exchange starts."""

    def attempt_ended(self, group: Group, error: BaseException | None) -> None:
        """An attempt's exchange ended, with the error that ended it (None: it succeeded)."""

    def round_ended(self, key: RoundKey, result: AverageResult, error: torch.Tensor | None) -> None:
        """A round's average was verified (``error``: what the wire format lost, with error feedback)."""
