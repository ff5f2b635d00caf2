"""What a shard's owner does with the parts it receives: each member's contribution part by part,
the weighted average of part i in member order (fp32) as soon as every member's part i is in,
encoded once for every member; and, for the audit, what the owner commits to (``audit.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import AveragingError, Malformed, PeerFailure, ProtocolError
from ..fingerprint import new_hasher
from . import audit
from .aggregation import Aggregation
from .buffers import all_finite
from .compression import Codec
from .group import MAX_WEIGHT, part_bounds


class ShardReducer:
    """The owner's side of one shard: contributions come in part by part, averages go out part by part.

    Pure computation (no I/O, no asyncio): ``add_part`` returns the indices of the parts it
    completed; ``results[i]`` then holds the encoded average of part i.
    """

    def __init__(self, codec: Codec, numel: int, members: Sequence[str], part_numel: int,
                 result_codec: Codec | None = None, aggregation: Aggregation | None = None, committed: bool = False):
        """``committed``: the owner commits to what it combined (``audit.py``): per part, each member's
        Merkle root and norm (``manifests``), and the declared weights, all under its digest."""
        self.codec, self.numel, self.members = codec, numel, tuple(members)
        self.committed = committed
        self.result_codec = result_codec or codec.averages
        """The averages go out in this codec (it may be wider than the contributions')."""
        self.aggregation = aggregation or Aggregation()
        self.used_weights: list[float] = []
        """The weights the averages use (claims capped), in member order."""
        self.capped: list[str] = []
        self.clipped: set[str] = set()
        self.parts = part_bounds(numel, part_numel)
        self.weights: dict[str, float] = {}
        self._next_part: dict[str, int] = {}
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self.parts]
        self.results: list[bytes | memoryview | None] = [None] * len(self.parts)
        self._hasher = new_hasher()
        self.digest: str | None = None
        self.total_weight: float | None = None
        self._roots: list[dict[str, str]] = [{} for _ in self.parts]
        self._norms: list[dict[str, float]] = [{} for _ in self.parts]
        self.manifests: list[dict | None] = [None] * len(self.parts)
        """Per part, what the owner committed to: ``{"roots": [...], "norms": [...]}`` in member order."""

    @property
    def declared(self) -> list[float]:
        """The weights the members declared, in member order."""
        return [self.weights[m] for m in self.members]

    def part_bytes(self, i: int) -> int:
        """The size of member contributions' part i."""
        a, b = self.parts[i]
        return self.codec.wire_bytes(b - a)

    def begin(self, member: str, weight) -> None:
        if member not in self.members:
            raise ProtocolError(f"{member[-8:]} is not a member of this group")
        if member in self.weights:
            raise ProtocolError(f"{member[-8:]} contributed twice")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 <= weight <= MAX_WEIGHT:
            raise ProtocolError(f"{member[-8:]} sent an invalid weight {weight!r}")
        self.weights[member] = float(weight)
        self._next_part[member] = 0
        if len(self.weights) == len(self.members):
            used, capped = self.aggregation.weights([self.weights[m] for m in self.members])
            total = sum(used)
            if total <= 0:
                raise AveragingError("every member of the group contributed weight 0")
            self.used_weights, self.capped = used, [self.members[i] for i in capped]
            if self.committed:
                self._hasher.update(audit.weights_bytes(self.declared))
            self.total_weight = total

    def add_part(self, member: str, index, payload) -> list[int]:
        if member not in self.weights:
            raise ProtocolError(f"{member[-8:]} sent a part before opening its contribution")
        if isinstance(index, bool) or index != self._next_part[member]:
            raise ProtocolError(f"{member[-8:]} sent part {index!r}, expected part {self._next_part[member]}")
        if index >= len(self.parts):
            raise ProtocolError(f"{member[-8:]} sent more parts than the shard has")
        a, b = self.parts[index]
        values = self.codec.view_bytes(payload, b - a)  # size-checked; checked for finiteness when reduced
        if self.committed:
            self._roots[index][member], self._norms[index][member] = self._commitment(member, index, values)
        self._next_part[member] = index + 1
        self._pending[index][member] = values
        done = []
        # Parts complete in order: every member sends part i before part i + 1.
        while len(done) + index < len(self.parts) and self._complete(index + len(done)):
            done.append(self._reduce(index + len(done)))
        return done

    def _commitment(self, member: str, index: int, values: torch.Tensor) -> tuple[str, float]:
        """What the owner commits to for ``member``'s part ``index``: its Merkle root and norm."""
        return audit.MerkleTree(values).root, audit.norm_of(values)

    def _complete(self, i: int) -> bool:
        return self.results[i] is None and len(self._pending[i]) == len(self.members) \
            and self.total_weight is not None

    def _reduce(self, i: int) -> int:
        contributions = self._pending[i]
        # A fixed order in fp32, and only the owner computes it: bit-identical replicas. The result
        # is a fresh tensor (a payload's bytes may be the contribution itself, with the "none" codec).
        norms = [self._norms[i][m] for m in self.members] if self.committed else None
        acc, clipped = self.aggregation.combine([contributions[m] for m in self.members], self.used_weights, norms)
        self.clipped.update(self.members[j] for j in clipped)
        # A weighted mean of finite values is finite: one pass over it checks every contribution; only
        # when it fails are the contributions checked one by one, to name the sender.
        if not all_finite(acc):
            bad = [m for m in self.members if not all_finite(contributions[m])]
            if bad:  # checked here, value by value: evidence
                raise Malformed(f"{', '.join(m[-8:] for m in bad)} sent non-finite values", bad)
            raise PeerFailure("the members' values overflow when combined", self.members)
        self._pending[i] = {}
        encoded = self.result_codec.to_bytes(acc)
        self._hasher.update(encoded)
        if self.committed:
            manifest = {"roots": [self._roots[i][m] for m in self.members], "norms": norms}
            self._hasher.update(audit.manifest_bytes(manifest["roots"], manifest["norms"]))
            self.manifests[i] = manifest
            self._roots[i], self._norms[i] = {}, {}
        self.results[i] = encoded
        if i == len(self.parts) - 1:
            self.digest = self._hasher.hexdigest()
        return i

    @property
    def done(self) -> bool:
        return self.digest is not None

    def has_all_parts(self, member: str) -> bool:
        return self._next_part.get(member, 0) >= len(self.parts)
