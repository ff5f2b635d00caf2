"""Flat fp32 buffers: one preallocated vector per round instead of a copy per stage.

A pseudo-gradient travels as one contiguous fp32 CPU tensor. ``FlatBuffer`` allocates it once
(pinned when the model lives on CUDA, so device-to-host copies are asynchronous DMA) and hands
out views shaped like the model's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import AveragingError


def all_finite(values: torch.Tensor) -> bool:
    """Exact and much faster than ``isfinite(x).all()``: any NaN or ±inf reaches the min or the max."""
    if values.numel() == 0:
        return True
    if not values.is_floating_point():
        return True
    if values.dtype in (torch.float16, torch.bfloat16) and values.device.type == "cpu":
        values = values.float()  # CPU aminmax of half types is slow; a part is small
    return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new flat fp32 CPU copy of ``tensors``."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like`` (no copy)."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape))
        offset += n
    if offset != flat.numel():
        raise AveragingError(f"averaged vector has {flat.numel()} elements, expected {offset}")
    return out


class FlatBuffer:
    """A preallocated flat fp32 CPU vector with views shaped like ``like``."""

    def __init__(self, like: Sequence[torch.Tensor], *, pin: bool | None = None):
        self.shapes = [tuple(t.shape) for t in like]
        self.numel = sum(t.numel() for t in like)
        if pin is None:
            pin = any(t.device.type == "cuda" for t in like) and torch.cuda.is_available()
        self.flat = torch.empty(self.numel, dtype=torch.float32, pin_memory=bool(pin))
        self.views = unflatten(self.flat, like)
