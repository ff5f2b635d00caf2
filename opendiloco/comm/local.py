"""Communicators that live in one process: a lone worker, and a group of replicas in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from .base import AverageResult, AveragingError, Communicator
from .compression import Codec, get_codec


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape).clone())
        offset += n
    if offset != flat.numel():
        raise AveragingError(f"averaged vector has {flat.numel()} elements, expected {offset}")
    return out


class SingleWorker(Communicator):
    """A group of one: the average is the input (compressed like it would be on the wire)."""

    def __init__(self, compression: str = "none", peer_id: str = "local"):
        self.codec: Codec = get_codec(compression)
        self._peer_id = peer_id

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def average(self, tensors, *, weight=1.0, outer_step=0):
        flat = self.codec.roundtrip(flatten(tensors))
        return AverageResult(unflatten(flat, tensors), (self._peer_id,), float(weight))


class InProcessGroup:
    """N replicas in one process (one thread each) whose ``average`` really averages.

    Each member's contribution and the resulting average go through ``compression`` exactly
    as they would on the wire, so tests see the same rounding as a real swarm.
    """

    def __init__(self, size: int, compression: str = "none", timeout: float = 60.0):
        if size < 1:
            raise ValueError("group size must be >= 1")
        self.size = size
        self.codec = get_codec(compression)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._contrib: dict[int, tuple[torch.Tensor, float, int]] = {}
        self._result: torch.Tensor | None = None
        self._total_weight = 0.0
        self._generation = 0
        self.rounds = 0
        self.members = [_GroupMember(self, rank) for rank in range(size)]

    def _average(self, rank: int, flat: torch.Tensor, weight: float, outer_step: int):
        with self._cond:
            generation = self._generation
            self._contrib[rank] = (self.codec.roundtrip(flat), float(weight), outer_step)
            if len(self._contrib) == self.size:
                steps = {s for _, _, s in self._contrib.values()}
                if len(steps) != 1:
                    self._result = AveragingError(f"members are at different outer steps: {sorted(steps)}")
                else:
                    total = sum(w for _, w, _ in self._contrib.values())
                    acc = torch.zeros_like(flat)
                    for r in range(self.size):  # fixed order: the same sum on every run
                        t, w, _ = self._contrib[r]
                        if w:
                            acc.add_(t, alpha=w / total)
                    self._result = self.codec.roundtrip(acc) if total > 0 else None
                    self._total_weight = total
                self._contrib.clear()
                self._generation += 1
                self.rounds += 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._generation != generation, timeout=self.timeout):
                self._contrib.pop(rank, None)
                raise AveragingError(f"in-process group: timed out after {self.timeout}s waiting for peers")
            result, total = self._result, self._total_weight
            if isinstance(result, Exception):
                raise result
            if result is None:
                raise AveragingError("every member of the group contributed weight 0")
            return result, total


class _GroupMember(Communicator):
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank = group, rank

    @property
    def peer_id(self) -> str:
        return f"replica-{self.rank}"

    def average(self, tensors, *, weight=1.0, outer_step=0):
        start = time.perf_counter()
        flat, total = self.group._average(self.rank, flatten(tensors), weight, outer_step)
        peers = tuple(f"replica-{r}" for r in range(self.group.size))
        return AverageResult(unflatten(flat, tensors), peers, total, time.perf_counter() - start)
