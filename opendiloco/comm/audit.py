"""Spot checks of a shard owner's result: no single member decides a shard.

A shard's owner combines its members' parts and sends the result; nobody else sees every input,
so without a check an owner could send anything it likes (60000 everywhere, or -4x the mean) and
every member would apply it. The check, at a fraction of the round's bytes:

- **The owner commits** to what it combined, in the bytes every member's digest covers (so it
  cannot tell two members two stories): per part, a Merkle root of each member's decoded values
  (chunks of ``chunk_numel`` values are the leaves) and each member's norm, and the weights every
  member declared.
- **Each member checks its own entries in full**: its root, its norm and its weight, for every part
  of every shard it contributed to. An owner that misreports one member's input is caught by that
  member, in every round.
- **Each member then audits ``audit_chunks`` random chunks of every other owner's shard**, picked
  after the result arrived (the owner cannot know which): every other member sends its values of
  those chunks with their Merkle paths (so nobody can answer with values other than those the owner
  committed to), and the auditor recomputes the chunk of the result from them, with the owner's
  committed norms and weights under the round's aggregation rule (``aggregation.py``). A result more
  than the result codec's rounding away from it names the owner (``Malformed``).

Under ``method="mean"`` the recomputation is exact up to rounding. Under ``"centered-clip"`` its
iterations need whole parts, so a chunk is only checked to lie within what the members sent (each
value between the smallest and the largest of the members' clipped values, and zero).

What an owner can still do: change a few values of its result, which a random chunk finds with a
probability of about (chunks audited x members) / chunks of the shard per round; and, as a member,
send its own shard any values within the clip bound, like any member.

Pure computation (no I/O): ``runner.py`` moves the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from blake3 import blake3

from ..fingerprint import tensor_bytes
from .aggregation import Aggregation
from .codec import Codec, Rounding

DEFAULT_AUDIT_CHUNKS = 4
"""Chunks of every other owner's shard a member audits per round (0: no audit)."""
MAX_AUDIT_CHUNKS = 64
MIN_CHUNK = 128
LEAVES_PER_PART = 16
"""A part's chunks: at least ``MIN_CHUNK`` values, about this many per part (paths stay short). Fewer,
larger chunks cost the same answer bytes per audited value and far fewer hashes: with 256 per part the
Merkle trees were most of the audit's cost (0.144 CPU-s per member per 10M values in a group of 4, against
0.046 with 16; ``docs/benchmarks.md``)."""
HASH_HEX = 64


def chunk_numel(part_numel: int) -> int:
    """Values per audited chunk of a part of ``part_numel`` values (a multiple of ``MIN_CHUNK``)."""
    per = math.ceil(max(part_numel, 1) / LEAVES_PER_PART)
    return max(MIN_CHUNK, math.ceil(per / MIN_CHUNK) * MIN_CHUNK)


AUDIT_BYTES_SHARE = 0.1
"""The audit's answers take at most about this share of a round's bytes (at least one chunk per owner)."""


def chunks_per_owner(audit_chunks: int, numel: int, group_size: int, part_numel: int, round_bytes: int) -> int:
    """Chunks a member audits of each other owner's shard: ``audit_chunks``, fewer where a small model
    in a large group would spend more than ``AUDIT_BYTES_SHARE`` of the round on answers.

    The same on every member (from the group's settings), so an answerer can bound what it is asked.
    """
    if audit_chunks <= 0 or group_size < 2:
        return 0
    shard = math.ceil(numel / group_size)
    answer = 4 * chunk_numel(min(part_numel, max(shard, 1))) + 80 * 12  # values, and a path of ~12 hex nodes
    per_chunk = (group_size - 1) ** 2 * answer  # every owner but ours, from every member but us
    return max(1, min(audit_chunks, int(AUDIT_BYTES_SHARE * round_bytes / per_chunk)))


def chunk_count(part_numel: int) -> int:
    return max(1, math.ceil(part_numel / chunk_numel(part_numel)))


def chunk_range(part_numel: int, c: int) -> tuple[int, int]:
    size = chunk_numel(part_numel)
    return c * size, min((c + 1) * size, part_numel)


_LEAF_KEY = b"opendiloco.audit.leaf".ljust(32, b".")
_NODE_KEY = b"opendiloco.audit.node".ljust(32, b".")
"""Keyed BLAKE3, one key per kind: a leaf can never pass for a node (domain separation)."""


def _leaf_bytes(raw) -> bytes:
    return blake3(raw, key=_LEAF_KEY).digest()


def leaf_hash(values: torch.Tensor) -> bytes:
    """The leaf of a chunk: its values as the owner decoded them, in their own dtype (``value_dtype``)."""
    return _leaf_bytes(tensor_bytes(values.contiguous()))


def value_dtype(codec: Codec) -> torch.dtype:
    """The dtype an owner decodes a member's part of ``codec`` to (``Codec.view_bytes``): what its Merkle
    leaves hash, and what audit answers carry (fp16 for ``fp16``: half the bytes of fp32)."""
    return codec.view_dtype


def _node(left: bytes, right: bytes) -> bytes:
    return blake3(left + right, key=_NODE_KEY).digest()


class MerkleTree:
    """A Merkle tree over a part's chunks: its root commits to every value, a path proves one chunk."""

    def __init__(self, values: torch.Tensor):
        n = values.numel()
        raw = tensor_bytes(values.contiguous())  # the decoded values' own bytes, sliced per chunk
        size = chunk_numel(n) * values.element_size()
        leaves = [_leaf_bytes(raw[a : a + size]) for a in range(0, max(len(raw), 1), size)]
        self.levels = [leaves]
        while len(self.levels[-1]) > 1:
            below = self.levels[-1]
            # An odd node out goes up unchanged.
            self.levels.append([_node(below[k], below[k + 1]) if k + 1 < len(below) else below[k]
                                for k in range(0, len(below), 2)])

    @property
    def root(self) -> str:
        return self.levels[-1][0].hex()

    def leaf(self, c: int) -> bytes:
        return self.levels[0][c]

    def path(self, c: int) -> list[str]:
        """The siblings from leaf ``c`` up ("" where a node went up alone)."""
        out = []
        for level in self.levels[:-1]:
            sibling = c ^ 1
            out.append(level[sibling].hex() if sibling < len(level) else "")
            c //= 2
        return out


def path_ok(values: torch.Tensor, c: int, path: Sequence, root: str, part_numel: int) -> bool:
    """Whether ``values`` are chunk ``c`` of a part whose tree has root ``root``."""
    count = chunk_count(part_numel)
    a, b = chunk_range(part_numel, c) if 0 <= c < count else (0, -1)
    if values.numel() != b - a or not isinstance(path, list):
        return False
    node, width = leaf_hash(values), count
    for sibling in path:
        if width <= 1 or not isinstance(sibling, str):
            return False
        if sibling == "":
            if c ^ 1 < width:  # only the last node of an odd level goes up alone
                return False
        else:
            try:
                other = bytes.fromhex(sibling)
            except ValueError:
                return False
            if len(other) != 32:
                return False
            node = _node(node, other) if c % 2 == 0 else _node(other, node)
        c, width = c // 2, (width + 1) // 2
    return width == 1 and node.hex() == root


def manifest_bytes(roots: Sequence[str], norms: Sequence[float]) -> bytes:
    """What a part's manifest adds to the owner's digest (every member hashes the same bytes)."""
    return ("|".join(roots) + "#" + ",".join(repr(float(x)) for x in norms)).encode()


def weights_bytes(weights: Sequence[float]) -> bytes:
    return ("weights:" + ",".join(repr(float(w)) for w in weights)).encode()


FP16_MAX = 65504.0


def norm_of(values: torch.Tensor) -> float:
    """A part's norm as the owner's clip takes it, summed in fp32 (3.5x faster than in fp16 here, and
    exact to fp32), with fp16's range kept: an fp16 part whose norm overflows fp16 is inf, and is scaled
    to nothing (``Aggregation.scales``)."""
    norm = float(torch.linalg.vector_norm(values, dtype=torch.float32))
    return math.inf if values.dtype == torch.float16 and norm > FP16_MAX else norm


def norms_agree(claimed: float, actual: float) -> bool:
    """Norms computed by two machines: thread counts change the summation order, and an fp16 norm
    may then round to the next fp16 value (2**-10 apart)."""
    if math.isinf(actual) or math.isinf(claimed):
        return claimed == actual
    return abs(claimed - actual) <= 2e-3 * abs(actual) + 1e-30


def rounding(codec: Codec) -> Rounding:
    """(block, relative step, absolute step): a decoded value is within ``relative`` x its block's
    largest magnitude, plus ``absolute``, of what was encoded; the codec says (``Codec.rounding``)."""
    return codec.rounding


def tolerance(result: torch.Tensor, part_result: torch.Tensor, offset: int, codec: Codec) -> torch.Tensor:
    """Per value of ``result`` (a chunk of ``part_result``, at ``offset``), how far rounding may move it."""
    block, step, absolute = codec.rounding
    if block == 1:
        scale = result.abs()
    else:
        first, last = offset // block, (offset + result.numel() - 1) // block
        blocks = part_result[first * block : (last + 1) * block]
        pad = (-blocks.numel()) % block
        maxima = torch.nn.functional.pad(blocks.abs(), (0, pad)).view(-1, block).amax(dim=1)
        index = (torch.arange(offset, offset + result.numel()) // block) - first
        scale = maxima[index]
    return scale * (2 * step) + 2 * absolute + 1e-6 * float(result.abs().max()) + 1e-30


def as_sent(expected: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What an honest owner would send of ``expected``, where a chunk alone encodes as it does in its
    part (value by value: fp16 saturates, say); else ``expected`` itself (``tolerance`` covers it)."""
    return codec.roundtrip(expected) if codec.rounding.block == 1 else expected


def result_norm_bound(aggregation: Aggregation, declared: Sequence[float], norms: Sequence[float], codec: Codec,
                      numel: int) -> float:
    """The largest norm an honest owner's result part of ``numel`` values can have, from what it committed
    to: the members' declared weights and their parts' norms (each member checks its own entries).

    The part is a weighted mean of the members' clipped parts (``"mean"``), or a point that CenteredClip
    moves only within their convex hull (``"centered-clip"``), so by the triangle inequality its norm is at
    most the weighted mean (or the largest) of their clipped norms; then the result codec's rounding (at
    most ``step`` of each block's largest magnitude per value: ``sqrt(block) * step`` of the norm), with
    1% for norms that two machines sum in another order. Every value of every part is bounded so, not
    only the audited chunks."""
    weights, _ = aggregation.weights(list(declared))
    total = sum(weights)
    members = [i for i, w in enumerate(weights) if w > 0]
    if total <= 0 or not members:
        return 0.0
    scale, _ = aggregation.scales({i: norms[i] for i in members})
    clipped = [0.0 if scale[i] == 0 else scale[i] * norms[i] for i in members]
    if aggregation.method == "mean":
        bound = sum(weights[i] / total * n for i, n in zip(members, clipped))
    else:
        bound = max(clipped)
    block, step, absolute = codec.rounding
    return bound * (1 + step * math.sqrt(min(block, max(numel, 1)))) * 1.01 + absolute * math.sqrt(numel) + 1e-30


def check_chunk(aggregation: Aggregation, declared: Sequence[float], norms: Sequence[float],
                values: Sequence[torch.Tensor], result: torch.Tensor, tol: torch.Tensor,
                codec: Codec | None = None) -> str | None:
    """What is wrong with an owner's chunk of result, recomputed from its members' values, or None.

    ``declared``: the weights the members declared (the owner's commitment); ``norms``: of each
    member's whole part; ``values``: each member's values of the chunk, in member order; ``codec``:
    the result's (``as_sent``).
    """
    for m, (x, n) in enumerate(zip(values, norms)):
        if float(x.double().square().sum()) > (n * n) * 1.01 + 1e-30:  # n may be an fp16 norm
            return f"member {m}'s values are larger than the norm the owner committed to"
    weights, _ = aggregation.weights(list(declared))
    total = sum(weights)
    members = [i for i, w in enumerate(weights) if w > 0]
    if total <= 0 or not members:
        return "no member has weight"
    scale, _ = aggregation.scales({i: norms[i] for i in members})
    if aggregation.method == "mean":
        expected = torch.zeros_like(result)
        for i in members:
            expected.add_(values[i], alpha=weights[i] * scale[i] / total)
        if codec is not None:
            expected = as_sent(expected, codec)
        off = (result - expected).abs() - tol
        if bool((off > 0).any()):
            return f"its result is {float((result - expected).abs().max()):.3g} away from what its members sent"
        return None
    clipped = torch.stack([values[i] * scale[i] for i in members])
    lo = torch.minimum(clipped.amin(dim=0), torch.zeros_like(result)) - tol
    hi = torch.maximum(clipped.amax(dim=0), torch.zeros_like(result)) + tol
    if bool(((result < lo) | (result > hi)).any()):
        return "its result lies outside what its members sent"
    return None
