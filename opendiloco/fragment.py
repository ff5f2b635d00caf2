"""A fragment: one part of the model that synchronises in rounds of its own.

Without streaming there is one fragment, the whole model. With ``fragments=N`` the optimizer holds
N of them and syncs one per outer step (``opendiloco.streaming``). Everything a round of a fragment
needs lives here: which parameters it holds, the flat buffers its contribution and result travel in,
error feedback's residual, the digest of its θ_global and the work that no average holds yet.
"""

from __future__ import annotations

import torch

from .comm.buffers import FlatBuffer
from .outer import OuterState


class Fragment:
    """The parameters at ``params`` (indices into the optimizer's trainable parameters) and their round state.

    ``whole``: the only fragment (plain DiLoCo), which selects every parameter at once. The last
    fragment carries the module's buffers (it syncs at multiples of ``local_steps``).
    """

    def __init__(self, index: int, params: list[int], outer: OuterState, *, whole: bool, carries_buffers: bool):
        self.index = index
        self.params = list(params)
        self.whole = whole
        self.carries_buffers = carries_buffers
        self._outer = outer
        self.work = 0.0
        """Work (samples, or steps where none are counted) that no average holds yet."""
        self.digest: str | None = None
        """The digest of this fragment's θ_global (None: to compute); see ``outer.fragmented_hash``."""
        self._buffers: tuple[FlatBuffer, FlatBuffer] | None = None
        self._residuals: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def indices(self) -> list[int] | None:
        """The fragment's parameter indices for ``OuterState``; None for the whole model."""
        return None if self.whole else self.params

    @property
    def size(self) -> int:
        """How many parameter tensors the fragment holds (its module buffers follow them in a contribution)."""
        return len(self.params)

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(local, global) parameters of the fragment."""
        return self._outer.select(self.indices)

    def on_cuda(self) -> bool:
        return any(p.device.type == "cuda" for p in self.tensors()[0])

    def param_numel(self) -> int:
        """Values of the fragment's parameters at the head of its contribution (buffers follow)."""
        return sum(p.numel() for p in self.tensors()[0])

    def buffers(self) -> tuple[FlatBuffer, FlatBuffer]:
        """[this worker's contribution (pseudo-gradients, then buffers), the buffer the group's average
        lands in]: flat fp32, allocated once, so later rounds write into pages already in memory. The
        contribution is pinned for CUDA models."""
        if self._buffers is None:
            like = self.tensors()[0] + (self._outer.buffers if self.carries_buffers else [])
            self._buffers = (FlatBuffer(like), FlatBuffer(like, pin=False))
        return self._buffers

    def residuals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Error feedback's [residual owed to the next contribution, the error of the round in flight],
        shaped like the contribution; they swap when that round succeeds (``settle_residuals``)."""
        if self._residuals is None:
            numel = self.buffers()[0].numel
            self._residuals = (torch.zeros(numel), torch.zeros(numel))
        return self._residuals

    @property
    def residual(self) -> torch.Tensor | None:
        """What the wire format has lost so far of this fragment's contributions (None before its first round)."""
        return None if self._residuals is None else self._residuals[0]

    def settle_residuals(self) -> None:
        """The round in flight succeeded: its error is what the next contribution owes."""
        owed, error = self.residuals()
        self._residuals = (error, owed)

    def reset_residual(self) -> None:
        if self._residuals is not None:
            self._residuals[0].zero_()

    def __repr__(self) -> str:
        return f"Fragment({self.index}, params={self.params})"


def make_fragments(groups: list[list[int]], outer: OuterState) -> list[Fragment]:
    """Fragments over the parameter index ``groups``; the last one carries the module's buffers."""
    return [Fragment(i, g, outer, whole=len(groups) == 1, carries_buffers=i == len(groups) - 1)
            for i, g in enumerate(groups)]
