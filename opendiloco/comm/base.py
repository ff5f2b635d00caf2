"""The small interface between the optimizer and whatever averages pseudo-gradients."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


class AveragingError(RuntimeError):
    """A round could not produce a complete, verified average. Nothing was applied."""


class BehindError(AveragingError):
    """The group has already moved past this worker's outer step: load state from a peer instead."""

    def __init__(self, message: str, *, group_outer_step: int, timeout: float | None = None):
        super().__init__(message)
        self.group_outer_step = group_outer_step
        self.timeout = timeout
        """How long catching up may wait for a peer to reach ``group_outer_step`` (None: the caller's bound)."""


@dataclass
class AverageResult:
    tensors: list[torch.Tensor]
    """The weighted average, fp32 on CPU, same shapes as the input, identical on every member."""
    peers: tuple[str, ...]
    """Ids of the workers whose contributions are in the average (this one included)."""
    total_weight: float
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return len(self.peers)


StateProvider = Callable[[], dict]
"""Returns the state a late joiner needs (see ``DiLoCoOptimizer.shareable_state``)."""


class Communicator(ABC):
    """Averages a list of tensors across the workers of a group, once per outer step."""

    @property
    @abstractmethod
    def peer_id(self) -> str: ...

    @abstractmethod
    def average(self, tensors: Sequence[torch.Tensor], *, weight: float, outer_step: int) -> AverageResult:
        """Weighted average of ``tensors`` (fp32, CPU) over the group for ``outer_step``.

        Either returns an average that is complete and identical on every member, or raises
        ``AveragingError`` without having applied anything. A zero ``weight`` means "take part
        but contribute nothing" (e.g. a worker whose own pseudo-gradient is not finite).
        """

    def attach_state_provider(self, provider: StateProvider) -> None:
        """Lets the communicator serve this worker's state to late joiners (no-op by default)."""

    def download_state(self, timeout: float, min_outer_step: int | None = None) -> dict | None:
        """State from a live peer (at ``min_outer_step`` or later), or None where there is nobody to ask."""
        return None

    def report_progress(self, **fields) -> None:
        """Publishes progress (outer step, inner step, throughput, hash...); no-op by default."""

    def interrupt(self) -> None:
        """The worker is stopping: a round still waiting for peers gives up at once (no-op by default).

        Called from a signal handler, so it only sets a flag.
        """

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
