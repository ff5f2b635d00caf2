"""The parts of a reduce-scatter / all-gather round that do not depend on the transport.

A group of G members splits the flat pseudo-gradient into G contiguous shards; member j
reduces shard j. Every member sends its *encoded* shard j to member j; member j decodes the
G contributions (its own included, so it sees the same rounding as everyone else), averages
them in member order, encodes the average once and sends those same bytes back to all.
Every member decodes identical bytes, so every member ends with a bit-identical average.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import AveragingError
from .compression import Codec

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class ProtocolError(AveragingError):
    """A peer sent something that does not fit the round (wrong group, shape, dtype, non-finite...)."""


def all_finite(values: torch.Tensor) -> bool:
    """Exact and much faster than ``isfinite(x).all()``: any NaN or ±inf reaches the min or the max."""
    if values.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) ranges covering ``numel`` elements."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def make_group_id(run_id: str, outer_step: int, attempt: int, members: Sequence[str]) -> str:
    h = hashlib.sha256(f"{run_id}|{outer_step}|{attempt}|{','.join(members)}".encode())
    return h.hexdigest()[:24]


# -- wire packing ---------------------------------------------------------------------------

def pack(encoded: dict[str, torch.Tensor]) -> tuple[list[list], bytes]:
    """Encoded fields -> (a header of [name, dtype, numel] rows, one payload)."""
    header, chunks = [], []
    for name in sorted(encoded):
        t = encoded[name].detach().contiguous().cpu()
        header.append([name, _DTYPE_NAMES[t.dtype], t.numel()])
        chunks.append(t.numpy().tobytes())
    return header, b"".join(chunks)


def unpack(header: list, payload: bytes, expected: dict[str, tuple[torch.dtype, int]]) -> dict[str, torch.Tensor]:
    """The inverse of ``pack``; refuses anything that differs from ``expected``."""
    try:
        fields = {str(name): (_DTYPES[str(dtype)], int(n)) for name, dtype, n in header}
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"malformed tensor header {header!r}") from None
    if fields != expected:
        raise ProtocolError(f"tensor fields {fields} do not match the expected {expected}")
    out, offset = {}, 0
    for name in sorted(fields):
        dtype, n = fields[name]
        size = n * torch.empty(0, dtype=dtype).element_size()
        if offset + size > len(payload):
            raise ProtocolError("payload shorter than its header says")
        array = np.frombuffer(payload, dtype=np.dtype(_DTYPE_NAMES[dtype]), count=n, offset=offset)
        out[name] = torch.from_numpy(array.copy())
        offset += size
    if offset != len(payload):
        raise ProtocolError(f"payload has {len(payload) - offset} bytes more than its header says")
    return out


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


# -- the reducer ----------------------------------------------------------------------------

@dataclass
class ShardResult:
    header: list
    payload: bytes
    digest: str
    total_weight: float
    contributors: tuple[str, ...]


class ShardReducer:
    """Collects the group's contributions to one shard and produces their encoded average."""

    def __init__(self, codec: Codec, numel: int, members: Sequence[str]):
        self.codec, self.numel, self.members = codec, numel, tuple(members)
        self.expected_fields = codec.expected_fields(numel)
        self._contributions: dict[str, tuple[float, torch.Tensor]] = {}

    @property
    def complete(self) -> bool:
        return len(self._contributions) == len(self.members)

    def missing(self) -> list[str]:
        return [m for m in self.members if m not in self._contributions]

    def add(self, sender: str, weight: float, header: list, payload: bytes) -> None:
        if sender not in self.members:
            raise ProtocolError(f"{sender} is not a member of this group")
        if sender in self._contributions:
            raise ProtocolError(f"{sender} contributed twice")
        if not (isinstance(weight, (int, float)) and np.isfinite(weight) and weight >= 0):
            raise ProtocolError(f"{sender} sent an invalid weight {weight!r}")
        values = self.codec.decode(unpack(header, payload, self.expected_fields), self.numel)
        if not all_finite(values):
            raise ProtocolError(f"{sender} sent non-finite values")
        self._contributions[sender] = (float(weight), values)

    def reduce(self) -> ShardResult:
        if not self.complete:
            raise AveragingError(f"shard incomplete, missing {self.missing()}")
        total = sum(w for w, _ in self._contributions.values())
        if total <= 0:
            raise AveragingError("every member of the group contributed weight 0")
        # Only this shard's owner computes its average and everyone decodes the same bytes, so a
        # fixed summation order in fp32 is enough for bit-identical replicas.
        acc = torch.zeros(self.numel, dtype=torch.float32)
        for member in self.members:
            w, values = self._contributions[member]
            if w:
                acc.add_(values, alpha=w / total)
        average = acc
        header, payload = pack(self.codec.encode(average))
        self._contributions.clear()
        return ShardResult(header, payload, digest(payload), total, self.members)


def decode_shard(codec: Codec, numel: int, result_header: list, payload: bytes, claimed_digest: str) -> torch.Tensor:
    """Checks a reducer's answer (digest, fields, finiteness) and decodes it."""
    if digest(payload) != claimed_digest:
        raise ProtocolError("averaged shard does not match its digest")
    values = codec.decode(unpack(result_header, payload, codec.expected_fields(numel)), numel)
    if not all_finite(values):
        raise ProtocolError("averaged shard is not finite")
    return values
