"""Top-k contributions: each member sends the largest 1/N of its values in every chunk, with their indices.

``topk64+e2m1`` sends, of every ``CHUNK`` = 4096 consecutive values of a contribution, the 64 of
largest magnitude (4096 / 64), their positions as 12-bit indices (two in three bytes) and their
values in ``e2m1`` (SparseLoCo's shape). The contributions travel in the group's all-reduce like any other: a shard's
owner decodes each member's entries (zeros elsewhere) and averages them, so the average holds the
union of the members' indices, and it travels back dense in the value format (``averages``: the
codec the averages go in unless ``result_compression`` names another). Measured before this was
built (``benchmarks/topk_union.py``): the members' largest values overlap, so for 8-32 workers the
all-reduce moves fewer bytes than an all-gather of everyone's entries would.

What a member does not send is owed to its later rounds (error feedback, required). The codec's
error is exactly the values it left out plus what the value format rounded; ``DiLoCoOptimizer``
then owes the left-out values in the local weights (they keep their local progress) and only the
rounding in the residual, as with a subset (``opendiloco.comm.subset``, ``carry_unsent``).

A payload is checked before it is used: indices inside their chunk, strictly increasing (so no
value is counted twice), the padding of an odd count zero, and the value format's own checks. A
member picks its entries with ``torch.topk``; ties are its own affair, since every member decodes
the same bytes.
"""

from __future__ import annotations

import re

import torch

from ..errors import ProtocolError
from .compression import Codec

CHUNK = 4096
MAX_EVERY = CHUNK
_NAME = re.compile(r"^topk([1-9][0-9]*)\+(.+)$")


def parse_topk(name: str) -> tuple[int | None, str]:
    """(N, the value format) for ``topkN+F``; (None, name) for any other name; ``ValueError`` for a bad N."""
    match = _NAME.match(name)
    if match is None:
        return None, name
    every = int(match.group(1))
    if not 2 <= every <= MAX_EVERY or CHUNK % every:
        raise ValueError(f"{name!r}: N in topkN+ must divide {CHUNK} and be 2..{MAX_EVERY}")
    return every, match.group(2)


def pack_indices(index: torch.Tensor) -> torch.Tensor:
    """12-bit indices (0..4095), two in three bytes: a's low byte; a's high nibble | b's low nibble << 4;
    b's high byte. An odd count is padded with a zero."""
    index = index.to(torch.int32)
    if index.numel() % 2:
        index = torch.cat([index, index.new_zeros(1)])
    a, b = index[0::2], index[1::2]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], 1).to(torch.uint8).reshape(-1)


def unpack_indices(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` indices ``pack_indices`` packed (int64); ``ProtocolError`` if the padding is not zero."""
    triples = packed.to(torch.int64).view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    index = torch.stack([a, b], 1).reshape(-1)
    if index.numel() > count and bool(index[count:].any()):
        raise ProtocolError("top-k indices: nonzero padding")
    return index[:count]


def _chunk_sizes(numel: int) -> list[int]:
    full, tail = divmod(numel, CHUNK)
    return [CHUNK] * full + ([tail] if tail else [])


class TopK(Codec):
    """The largest ``1/every`` of each chunk's values (at least one), their values in ``values``."""

    def __init__(self, every: int, values: Codec):
        self.every, self.values = every, values
        self.name = f"topk{every}+{values.label}"
        self.revision = 2  # 2: 12-bit indices (1: 16-bit)

    @property
    def averages(self) -> Codec:
        return self.values

    def _k(self, size: int) -> int:
        return max(1, size // self.every)

    def _kept(self, numel: int) -> int:
        return sum(self._k(size) for size in _chunk_sizes(numel))

    def expected_fields(self, numel):
        kept = self._kept(numel)
        fields = {"index": (torch.uint8, 3 * ((kept + 1) // 2))}
        fields.update({f"v_{name}": spec for name, spec in self.values.expected_fields(kept).items()})
        return fields

    def _select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the whole vector, ascending within each chunk; their values)."""
        full = flat.numel() // CHUNK * CHUNK
        picks = []
        if full:
            blocks = flat[:full].view(-1, CHUNK)
            idx = blocks.abs().topk(self._k(CHUNK), dim=1, sorted=False).indices.sort(dim=1).values
            picks.append((idx + torch.arange(0, full, CHUNK).unsqueeze(1)).reshape(-1))
        if full < flat.numel():
            tail = flat[full:]
            idx = tail.abs().topk(self._k(tail.numel()), sorted=False).indices.sort().values
            picks.append(idx + full)
        positions = torch.cat(picks) if picks else torch.empty(0, dtype=torch.long)
        return positions, flat[positions]

    def encode(self, flat):
        flat = flat.detach().float().reshape(-1)
        positions, picked = self._select(flat)
        fields = {"index": pack_indices(positions % CHUNK)}
        fields.update({f"v_{name}": t for name, t in self.values.encode(picked.contiguous()).items()})
        return fields

    def _positions(self, index: torch.Tensor, numel: int) -> torch.Tensor:
        """Whole-vector positions of a payload's indices, refusing any outside its chunk or out of order."""
        sizes = _chunk_sizes(numel)
        counts = torch.tensor([self._k(s) for s in sizes], dtype=torch.long)
        index = unpack_indices(index, int(counts.sum()))
        chunk_of = torch.repeat_interleave(torch.arange(len(sizes)), counts)
        limit = torch.tensor(sizes, dtype=torch.long)[chunk_of]
        if bool(((index < 0) | (index >= limit)).any()):
            raise ProtocolError("top-k index outside its chunk")
        starts = torch.cumsum(counts, 0) - counts
        step = index[1:] - index[:-1]
        first = torch.zeros(index.numel(), dtype=torch.bool)
        first[starts] = True
        if bool((step <= 0)[~first[1:]].any()):
            raise ProtocolError("top-k indices not strictly increasing within a chunk")
        return chunk_of * CHUNK + index

    def decode(self, encoded, numel):
        kept = self._kept(numel)
        picked = self.values.decode({k[2:]: v for k, v in encoded.items() if k.startswith("v_")}, kept)
        out = torch.zeros(numel, dtype=torch.float32)
        out[self._positions(encoded["index"], numel)] = picked
        return out

    def to_bytes(self, flat):
        fields = self.encode(flat)
        return b"".join(bytes(fields[n].numpy().tobytes()) for n in sorted(fields))

    def decode_into(self, payload, out):
        out.copy_(self.from_bytes(payload, out.numel()))


def topk_codec(every: int, values: Codec) -> TopK:
    if getattr(values, "subset", None) is not None or isinstance(values, TopK):
        raise ValueError("topkN+ takes a plain value format (e.g. e2m1)")
    return TopK(every, values)
