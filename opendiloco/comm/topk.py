"""Top-k contributions: each member sends the largest 1/N of its values in every chunk, with their indices.

``topk64+e2m1`` sends, of every ``CHUNK`` = 4096 consecutive values of a contribution, the 64 of
largest magnitude (4096 / 64), their positions and their values in ``e2m1`` (SparseLoCo's shape).
Positions are Elias-Fano coded per chunk (``pack_indices``): log2(N) + 2 bits each, 8 for
``topk64`` where plain 12-bit indices (SparseLoCo's, and this format's revision 2) take 12; a
chunk's field has a fixed size, so a payload's length is checked before anything is decoded.
The contributions travel in the group's all-reduce like any other: a shard's owner decodes each member's
entries (zeros elsewhere) and averages them, so the average holds the union of the members' indices, and
it travels back dense in the value format (``averages``: the codec the averages go in unless
``result_compression`` names another). Measured before this was built (``benchmarks/topk_union.py``):
the members' largest values overlap, so for 8-32 workers the all-reduce moves fewer bytes than an
all-gather of everyone's entries would.

What a member does not send is owed to its later rounds (error feedback, required). The codec's
error is exactly the values it left out plus what the value format rounded; ``DiLoCoOptimizer``
then owes the left-out values in the local weights (they keep their local progress) and only the
rounding in the residual, as with a subset (``opendiloco.comm.subset``; ``opendiloco.fragment.carry_unsent``).

A payload is checked before it is used: indices inside their chunk, strictly increasing (so no
value is counted twice), the padding of an odd count zero, and the value format's own checks. A
member picks its entries with ``torch.topk``; ties are its own affair, since every member decodes
the same bytes.
"""

from __future__ import annotations

import torch

from ..errors import ProtocolError
from .codec import Codec

CHUNK = 4096
MAX_EVERY = CHUNK


def _layout(size: int, k: int) -> tuple[int, int, int, int]:
    """Elias-Fano fields of one chunk of ``size`` values with ``k`` entries: (low bits per index, bits of
    the high part, bytes of the low part, bytes of the high part). Fixed by ``size`` and ``k`` alone,
    so a payload's length is known before it is read."""
    low = max(0, (size // k).bit_length() - 1)  # floor(log2(size / k))
    high = k + ((size - 1) >> low) + 1
    return low, high, (k * low + 7) // 8, (high + 7) // 8


def _entries(size: int, every: int) -> int:
    """How many values a chunk of ``size`` sends: 1/``every`` of them, at least one."""
    return max(1, size // every)


def _runs(numel: int, every: int) -> list[tuple[int, int, int]]:
    """(chunks, their size, entries each): the full chunks, then the tail chunk if any."""
    full, tail = divmod(numel, CHUNK)
    runs = [(full, CHUNK, _entries(CHUNK, every))] if full else []
    return runs + ([(1, tail, _entries(tail, every))] if tail else [])


def index_bytes(numel: int, every: int) -> int:
    """Bytes of the index field of a ``topk{every}+`` payload of ``numel`` values."""
    return sum(n * sum(_layout(size, k)[2:]) for n, size, k in _runs(numel, every))


_BIT = torch.arange(8, dtype=torch.int64)


def _to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """[rows, n] of 0/1 -> [rows, ceil(n / 8)] uint8, the first bit in each byte's lowest."""
    rows, n = bits.shape
    if n == 0:
        return torch.zeros(rows, 0, dtype=torch.uint8)
    bits = torch.nn.functional.pad(bits.to(torch.int64), (0, -n % 8))
    return (bits.view(rows, -1, 8) << _BIT).sum(-1).to(torch.uint8)


def _to_bits(data: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """The first ``n`` bits of each row of uint8 ``data`` (int64 0/1); ``ProtocolError`` if any bit past
    them (padding) is set."""
    if data.shape[1] == 0:
        return torch.zeros(data.shape[0], 0, dtype=torch.int64)
    bits = ((data.to(torch.int64).unsqueeze(-1) >> _BIT) & 1).view(data.shape[0], -1)
    if bool(bits[:, n:].any()):
        raise ProtocolError(f"top-k indices: nonzero padding in the {what} part")
    return bits[:, :n]


def pack_indices(index: torch.Tensor, numel: int, every: int) -> torch.Tensor:
    """Chunk-relative ``index`` (ascending within each chunk, ``_runs`` many per chunk), Elias-Fano coded:
    per chunk, each index's low bits, then a bitmap with bit ``(index >> low) + i`` set for its ``i``-th
    index (log2(every) + 2 bits per index: 8 for ``topk64``, where 12 bits spell any of 4096)."""
    out, at = [], 0
    for n, size, k in _runs(numel, every):
        low, high, _, _ = _layout(size, k)
        x = index[at : at + n * k].to(torch.int64).view(n, k)
        at += n * k
        low_bits = ((x.unsqueeze(-1) >> torch.arange(low)) & 1).view(n, k * low)
        where = (x >> low) + torch.arange(k)
        if bool((where >= high).any()):
            raise ValueError("top-k index outside its chunk")
        high_bits = torch.zeros(n, high, dtype=torch.int64).scatter_(1, where, 1)
        out.append(torch.cat([_to_bytes(low_bits), _to_bytes(high_bits)], 1).reshape(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8)


def unpack_indices(packed: torch.Tensor, numel: int, every: int) -> torch.Tensor:
    """The chunk-relative indices ``pack_indices`` coded (int64), each chunk's checked: as many as it
    holds, no padding bit set, strictly increasing, inside the chunk (``ProtocolError`` otherwise)."""
    out, at = [], 0
    for n, size, k in _runs(numel, every):
        low, high, low_bytes, high_bytes = _layout(size, k)
        rows = packed[at : at + n * (low_bytes + high_bytes)].view(n, low_bytes + high_bytes)
        at += n * (low_bytes + high_bytes)
        low_bits = _to_bits(rows[:, :low_bytes], k * low, "low").view(n, k, low)
        high_bits = _to_bits(rows[:, low_bytes:], high, "high")
        if bool((high_bits.sum(1) != k).any()):
            raise ProtocolError("top-k indices: a chunk's count is not what its size gives")
        where = high_bits.nonzero()[:, 1].view(n, k)  # row-major: ascending within each row
        x = ((where - torch.arange(k)) << low) | (low_bits << torch.arange(low)).sum(-1)
        if bool((x >= size).any()):
            raise ProtocolError("top-k index outside its chunk")
        if k > 1 and bool((x[:, 1:] <= x[:, :-1]).any()):
            raise ProtocolError("top-k indices not strictly increasing within a chunk")
        out.append(x.reshape(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


class TopK(Codec):
    """The largest ``1/every`` of each chunk's values (at least one), their values in ``values``.

    What it does not send is owed (error feedback, required); its averages are of updates, not values
    (no module buffers); the unsent may be owed in a decayed residual instead (``error_decay``)."""

    needs_error_feedback = allows_error_decay = True
    takes_buffers = False
    revision = 3  # 3: Elias-Fano indices (2: 12-bit, 1: 16-bit)

    def __init__(self, every: int, values: Codec):
        if not 2 <= every <= MAX_EVERY or CHUNK % every:
            raise ValueError(f"N in topkN+ must divide {CHUNK} and be 2..{MAX_EVERY}")
        self.every, self.values = every, values
        self.name = f"topk{every}+{values.name}"

    @property
    def label(self) -> str:
        return f"topk{self.every}+{self.values.label}.v{self.revision}"

    @property
    def averages(self) -> Codec:
        return self.values

    def sent(self, key, fragments, contribution, error):
        """The values it did not owe whole: the round's error of a sent value is its rounding only."""
        return torch.ne(contribution, error).nonzero().squeeze(1)

    def _k(self, size: int) -> int:
        return _entries(size, self.every)

    def _kept(self, numel: int) -> int:
        return sum(n * k for n, _, k in _runs(numel, self.every))

    def expected_fields(self, numel):
        kept = self._kept(numel)
        fields = {"index": (torch.uint8, index_bytes(numel, self.every))}
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
        fields = {"index": pack_indices(positions % CHUNK, flat.numel(), self.every)}
        fields.update({f"v_{name}": t for name, t in self.values.encode(picked.contiguous()).items()})
        return fields

    def _positions(self, index: torch.Tensor, numel: int) -> torch.Tensor:
        """Whole-vector positions of a payload's indices (checked by ``unpack_indices``)."""
        # the full chunks are the first numel // CHUNK; a tail chunk, if any, follows them
        chunk_of = [torch.arange(n).repeat_interleave(k) + (numel // CHUNK if size < CHUNK else 0)
                    for n, size, k in _runs(numel, self.every)]
        return torch.cat(chunk_of or [torch.zeros(0, dtype=torch.long)]) * CHUNK + unpack_indices(
            index, numel, self.every)

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

