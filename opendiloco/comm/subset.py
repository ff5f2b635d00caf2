"""Shared-seed random subsets: a round sends 1/N of a fragment's pseudo-gradient and no indices.

``subset32+int4`` sends 1/32 of the values, each in int4 (SPARTA; EXO, "SPARTA: distributed
training with sparse parameter averaging"). Every member of a group derives the same subset from
what it already agrees on: the round key (outer step and fragment), the fragment's size and the
format (the group label names it, so members with other settings never group). No index travels,
and no peer can choose or forge which values are sent. The selected values form an ordinary dense
vector: the group all-reduces it with the underlying codec, exactly like a whole contribution, and
every member scatters the same decoded bytes back, so replicas stay bit-identical; an unselected
value gets exactly zero pseudo-gradient in that round.

What is not sent is owed to later rounds (error feedback, required with a subset), and it is owed
in the local weights (``opendiloco.fragment.carry_unsent``): after the outer step an unselected
value of θ_local is θ_global minus its whole contribution, so local training goes on from where it
was and the next Δ holds the owed work. Owing it in the residual instead (θ_local reset to
θ_global, the contribution added to the next one) restarts every round of an unsent value from
the same stale θ_global, so N rounds of owed displacement overshoot N-fold: held-out loss 30
instead of 2 after 32 rounds of ``subset32+int4`` (benchmarks/convergence.py). The residual keeps
what the codec lost of the values that were sent.

The selection is by blocks of ``BLOCK`` consecutive values, and it cycles: over each ``N`` rounds of a
fragment, the fragment's blocks in a random order (seeded by the cycle, fragment and size) are cut
into ``N`` slices, one per round, so every value is sent once per cycle (a few blocks twice when the
block count is not a multiple of N); independent random subsets would leave a third of the values
unsent after N rounds. Blocks, not single values: choosing is an argsort of numel/256 hashed keys
(a randperm of every value costs more than the int4 codec at 10M values), and each of the codec's
blocks (64 or 256 values) lies within one run of a tensor. The keys come from SHAKE-256 and a
stable sort, so every machine, torch or numpy version draws the same subset.

Buffers (module statistics averaged as values, not updates) are never subsetted: they follow the
selected values whole.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import AveragingError
from .base import AverageResult, Communicator, RoundKey, Work
from .codec import Codec, Rounding

BLOCK = 256
"""Values per selectable block (a multiple of the int4/e2m1/e3m0 block, the int8 block)."""
MAX_EVERY = 1024


@dataclass(frozen=True)
class Subset:
    """Every round of a fragment sends ``1/every`` of its values (at least one block)."""

    every: int

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or not 2 <= self.every <= MAX_EVERY:
            raise ValueError(f"a subset sends 1/N of the values, N from 2 to {MAX_EVERY}; got {self.every!r}")

    @property
    def label(self) -> str:
        return f"subset{self.every}"

    def blocks(self, key: RoundKey, numel: int, fragments: int = 1) -> torch.Tensor:
        """The indices (ascending, int64) of the blocks of ``BLOCK`` values round ``key`` sends of a fragment
        of ``numel`` values. ``fragments``: how many fragments take turns (the fragment's own round is
        ``outer_step // fragments``), so that every fragment runs through its whole cycle."""
        nb = math.ceil(numel / BLOCK)
        if nb == 0:
            return torch.zeros(0, dtype=torch.int64)
        cycle, slot = divmod(key.outer_step // fragments, self.every)
        order = _block_order(self.every, cycle, key.fragment, numel)
        per_round = math.ceil(nb / self.every)  # the last slice wraps round: a few blocks go twice a cycle
        picked = order[(slot * per_round + torch.arange(per_round)) % nb]
        return picked.to(torch.int64).sort().values

    def indices(self, key: RoundKey, numel: int, fragments: int = 1) -> torch.Tensor:
        """The value indices (ascending, int64) round ``key`` sends of a fragment of ``numel`` values."""
        blocks = self.blocks(key, numel, fragments)
        idx = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
        short = BLOCK - (numel % BLOCK or BLOCK)  # the last block is partial: it is the last one if picked
        if short and blocks.numel() and int(blocks[-1]) == math.ceil(numel / BLOCK) - 1:
            idx = idx[: idx.numel() - short]
        return idx


@functools.lru_cache(maxsize=16)
def _block_order(every: int, cycle: int, fragment: int, numel: int) -> torch.Tensor:
    """A permutation of the fragment's blocks for one cycle (int32; cached: one argsort per cycle)."""
    nb = math.ceil(numel / BLOCK)
    seed = f"opendiloco subset|every={every}|cycle={cycle}|fragment={fragment}|numel={numel}".encode()
    keys = np.frombuffer(hashlib.shake_256(seed).digest(8 * nb), dtype="<u8")
    return torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int32))


def start_subset(communicator: Communicator, subset: Subset, flat: torch.Tensor, *, head: int, weight: float,
                 key: RoundKey, fragments: int, out: torch.Tensor, error_out: torch.Tensor | None) -> Work:
    """Starts the round of ``flat``'s subset: the selected values of ``flat[:head]`` (a fragment's
    pseudo-gradient), then ``flat[head:]`` (its buffers' values) whole, in one compact vector.
    Waiting scatters the average into ``out`` (zeros where nothing was sent) and, with ``error_out``,
    what the codec lost of each sent value (zeros elsewhere: the caller owes the unsent values, see
    ``carry_unsent``)."""
    idx = subset.indices(key, head, fragments)
    k = idx.numel()
    compact = torch.empty(k + flat.numel() - head)
    torch.index_select(flat[:head], 0, idx, out=compact[:k])
    compact[k:] = flat[head:]
    averaged = torch.empty_like(compact)
    error = torch.empty_like(compact) if error_out is not None else None
    extra = {} if error is None else {"error_out": error}
    inner = communicator.start(compact, weight=weight, key=key, out=averaged, **extra)
    return SubsetWork(inner, idx, head, flat, out, error_out, averaged, error)


class SubsetWork(Work):
    """A subset round in flight; ``wait`` scatters its outcome into the whole-fragment buffers once."""

    def __init__(self, inner: Work, idx: torch.Tensor, head: int, flat: torch.Tensor, out: torch.Tensor,
                 error_out: torch.Tensor | None, averaged: torch.Tensor, error: torch.Tensor | None):
        self.inner, self.idx, self.head, self.flat, self.out, self.error_out = inner, idx, head, flat, out, error_out
        self.averaged, self.error = averaged, error
        self._result: AverageResult | None = None

    def wait(self, timeout: float | None = None) -> AverageResult:
        if self._result is None:
            result = self.inner.wait(timeout)
            got = result.flat
            if got.numel() != self.averaged.numel() or got.dtype != torch.float32:
                raise AveragingError(f"the averaged subset has {got.numel()} {got.dtype} values, expected "
                                     f"{self.averaged.numel()} float32")
            head, k = self.head, self.idx.numel()
            self.out[:head].zero_()
            self.out[:head].index_copy_(0, self.idx, got[:k])
            self.out[head:] = got[k:]
            if self.error_out is not None:
                self.error_out[:head].zero_()
                self.error_out[:head].index_copy_(0, self.idx, self.error[:k])
                self.error_out[head:] = self.error[k:]
            extra = {**result.extra, "subset_values": k}
            self._result = AverageResult(self.out, result.peers, result.total_weight, result.seconds, extra)
        return self._result

    def done(self) -> bool:
        return self._result is not None or self.inner.done()



class SubsetCodec(Codec):
    """``subsetN+F``: a round sends the shared-seed ``subset`` of a fragment's pseudo-gradient (and its
    buffers whole) as one dense vector in the value format ``values``, whose bytes these are. What it
    does not send is owed in the local weights (error feedback, required)."""

    needs_error_feedback = True

    def __init__(self, every: int, values: Codec):
        self.subset, self.values = Subset(every), values
        self.name = f"{self.subset.label}+{values.name}"

    @property
    def label(self) -> str:
        return f"{self.subset.label}+{self.values.label}"

    @property
    def values_label(self) -> str:
        return self.values.label

    @property
    def averages(self) -> Codec:
        return self.values

    @property
    def rounding(self) -> Rounding:
        return self.values.rounding

    @property
    def view_dtype(self) -> torch.dtype:
        return self.values.view_dtype

    def start_round(self, communicator, flat, *, head, weight, key, fragments, out, error_out):
        return start_subset(communicator, self.subset, flat, head=head, weight=weight, key=key, fragments=fragments,
                            out=out, error_out=error_out)

    def sent(self, key, fragments, contribution, error):
        return self.subset.indices(key, contribution.numel(), fragments)

    # the bytes: the value format's
    def encode(self, flat):
        return self.values.encode(flat)

    def decode(self, encoded, numel):
        return self.values.decode(encoded, numel)

    def expected_fields(self, numel):
        return self.values.expected_fields(numel)

    def roundtrip_into(self, flat, out, chunk=1 << 20):
        return self.values.roundtrip_into(flat, out, chunk)

    def to_bytes_with_error(self, flat, error_out):
        return self.values.to_bytes_with_error(flat, error_out)

    def to_bytes(self, flat):
        return self.values.to_bytes(flat)

    def from_bytes(self, payload, numel):
        return self.values.from_bytes(payload, numel)

    def view_bytes(self, payload, numel):
        return self.values.view_bytes(payload, numel)

    def decode_into(self, payload, out):
        self.values.decode_into(payload, out)
