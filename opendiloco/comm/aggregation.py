"""How a shard's owner combines its members' contributions, with bounds an insider cannot exceed.

A member of the group chooses what it sends: its values and the weight it claims. The plain
weighted mean lets one member take over a round (values of 60000 with weight 1e9). Two bounds
apply to every round, whatever the method:

- **weights** are capped at ``max_weight_ratio`` times the group's (lower) median weight, so a
  claim of 1e9 counts like a few honest members at most;
- **norms**: each member's part is scaled down to at most ``clip_ratio`` times the (lower) median
  of the members' norms of that part, so no contribution moves the average further than a few
  honest ones would.

``method="centered-clip"`` adds a robust aggregator (CenteredClip, Karimireddy et al. 2021, as in
"Secure Distributed Training at Scale", Gorbunov et al. 2022): starting from the bounded mean, it
moves towards each contribution by at most ``tau`` (the median distance to the current
estimate), ``iterations`` times. Contributing members count equally there: robustness needs an
honest majority of *weight*, and claimed weights cannot be checked.

The owner computes this in a fixed order in fp32 and sends its bytes to every member, so replicas
stay bit-identical whatever the method. Pure computation: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

METHODS = ("mean", "centered-clip")


def lower_median(values: Sequence[float]) -> float:
    """The median, taking the lower middle value of an even count: with two members, the smaller."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True)
class Aggregation:
    method: str = "mean"
    clip_ratio: float = 4.0
    """Parts are clipped to this multiple of the median part norm (inf: no clipping)."""
    max_weight_ratio: float = 4.0
    """Weights are capped at this multiple of the median weight (inf: no cap)."""
    iterations: int = 3
    """CenteredClip's steps (``method="centered-clip"``)."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"aggregation must be one of {METHODS}, got {self.method!r}")
        for name in ("clip_ratio", "max_weight_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
                raise ValueError(f"{name} must be a number >= 1 (inf: off), got {value!r}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or not 1 <= self.iterations <= 20:
            raise ValueError(f"iterations must be an int in [1, 20], got {self.iterations!r}")

    @property
    def label(self) -> str:
        """What the group must agree on (carried with the codec label: a different one never groups)."""
        bounds = f"clip{self.clip_ratio:g}-w{self.max_weight_ratio:g}"
        return f"{self.method}-{bounds}" + (f"-it{self.iterations}" if self.method == "centered-clip" else "")

    def weights(self, declared: Sequence[float]) -> tuple[list[float], list[int]]:
        """The weights a round uses, and the indices of members whose claim was cut."""
        positive = [w for w in declared if w > 0]
        cap = self.max_weight_ratio * lower_median(positive) if positive else math.inf
        over = [i for i, w in enumerate(declared) if w > cap]
        if self.method == "centered-clip":  # every contributing member counts once; excessive claims still named
            return [1.0 if w > 0 else 0.0 for w in declared], over
        return [min(w, cap) for w in declared], over

    def scales(self, norms: dict[int, float]) -> tuple[dict[int, float], list[int]]:
        """Each contributing member's scale (1, or down to the clip bound) and the indices clipped.

        ``norms``: the norms of the parts of the members with a positive weight, by member index.
        """
        scale, clipped = dict.fromkeys(norms, 1.0), []
        if not math.isinf(self.clip_ratio) and norms:
            bound = self.clip_ratio * lower_median(list(norms.values()))
            if bound > 0:  # all-zero parts (or most of them): nothing to compare against
                for i, n in norms.items():
                    if n > bound:
                        scale[i], clipped = bound / n, clipped + [i]
        return scale, clipped

    def combine(self, parts: Sequence[torch.Tensor], weights: Sequence[float],
                norms: Sequence[float] | None = None) -> tuple[torch.Tensor, list[int]]:
        """The aggregate of one part (fp32, fresh) and the indices of members whose part was clipped.

        ``weights`` are the round's (from ``weights``), with a positive sum; parts of weight 0 are left
        out. ``norms``: the parts' norms, if the caller has them already.
        """
        total = sum(weights)
        members = [i for i, w in enumerate(weights) if w > 0]
        scale, clipped = self.scales({i: float(torch.linalg.vector_norm(parts[i])) if norms is None else norms[i]
                                      for i in members})
        acc = torch.zeros_like(parts[members[0]], dtype=torch.float32)
        for i in members:  # a fixed order in fp32: the owner computes, everyone decodes its bytes
            acc.add_(parts[i], alpha=weights[i] * scale[i] / total)
        if self.method == "centered-clip":
            acc = self._centered_clip(acc, [parts[i] if scale[i] == 1.0 else parts[i] * scale[i] for i in members])
        return acc, clipped

    def _centered_clip(self, estimate: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        """Moves the estimate towards each (norm-bounded) part by at most the median distance."""
        diffs = [torch.empty_like(estimate) for _ in parts]
        for _ in range(self.iterations):
            for diff, part in zip(diffs, parts):
                torch.sub(part, estimate, out=diff)
            distances = [float(torch.linalg.vector_norm(d)) for d in diffs]
            tau = lower_median(distances)
            if tau == 0:
                break
            step = torch.zeros_like(estimate)
            for diff, distance in zip(diffs, distances):
                step.add_(diff, alpha=(min(1.0, tau / distance) if distance > 0 else 1.0) / len(parts))
            estimate = estimate.add_(step)
        return estimate
