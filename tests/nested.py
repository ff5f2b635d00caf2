"""Test helper: two nested states (dicts, lists, tuples, tensors, scalars) hold the same values."""

from __future__ import annotations

import torch


def same(a, b) -> bool:
    """Equal structure, types, shapes, dtypes and exactly equal values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
