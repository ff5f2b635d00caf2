"""Communicators that live in one process: a lone worker, and a group of replicas in threads."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from ..errors import AveragingError
from .base import AverageResult, Communicator, CompletedWork, FutureWork, RoundKey, Work
from .codec import Codec
from .formats import get_codec


def average_alone(codec: Codec, flat: torch.Tensor, weight: float, out: torch.Tensor,
                  error_out: torch.Tensor | None = None, *, chunk: int = 1 << 20) -> torch.Tensor:
    """The round of a group of one, for every communicator that finds itself alone: the average is the
    contribution as the wire would carry it (``out``, through ``codec``; ``chunk``: values encoded at a
    time, a multiple of every codec's block, so it changes no value), and ``error_out`` what the wire
    lost of it. ``AveragingError`` for a weight of 0 or less, or values the codec refuses (not finite)."""
    if weight <= 0:
        raise AveragingError("alone in the group and contributing weight 0")
    codec.roundtrip_into(flat, out, chunk=chunk)
    if error_out is not None:
        torch.sub(flat, out, out=error_out)
    return out


class SingleWorker(Communicator):
    """A group of one: the average is the input (compressed like it would be on the wire)."""

    def __init__(self, compression: str = "none", peer_id: str = "local"):
        self.codec: Codec = get_codec(compression)
        self._peer_id = peer_id

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def start(self, flat, *, weight, key, out=None, error_out=None):
        began = time.perf_counter()
        try:
            out = average_alone(self.codec, flat, weight, out if out is not None else torch.empty_like(flat), error_out)
        except AveragingError as e:  # a weight of 0, or values the codec refuses
            return CompletedWork(error=e)
        return CompletedWork(AverageResult(out, (self._peer_id,), float(weight), time.perf_counter() - began))


class InProcessGroup:
    """N replicas in one process whose ``start`` really averages, each round in a background thread.

    Each member's contribution and the resulting average go through ``compression`` exactly
    as they would on the wire, so tests see the same rounding as a real swarm. Rounds are matched
    by key: members that start the same ``RoundKey`` average together.
    """

    def __init__(self, size: int, compression: str = "none", timeout: float = 60.0,
                 result_compression: str | None = None):
        if size < 1:
            raise ValueError("group size must be >= 1")
        self.size = size
        self.codec = get_codec(compression)
        self.result_codec = get_codec(result_compression) if result_compression else self.codec.averages
        self.timeout = timeout
        self._cond = threading.Condition()
        self._pending: dict[RoundKey, dict[int, tuple[torch.Tensor, float]]] = {}
        self._results: dict[RoundKey, tuple[object, float, int]] = {}
        self.rounds = 0
        self.members = [_GroupMember(self, rank) for rank in range(size)]

    def _average(self, rank: int, flat: torch.Tensor, weight: float, key: RoundKey,
                 error_out: torch.Tensor | None = None):
        sent = self.codec.roundtrip(flat)
        if error_out is not None:
            torch.sub(flat, sent, out=error_out)
        with self._cond:
            contrib = self._pending.setdefault(key, {})
            contrib[rank] = (sent, float(weight))
            if len(contrib) == self.size:
                del self._pending[key]
                total = sum(w for _, w in contrib.values())
                acc = torch.zeros_like(flat)
                for r in range(self.size):  # fixed order: the same sum on every run
                    t, w = contrib[r]
                    if w:
                        acc.add_(t, alpha=w / total)
                result = self.result_codec.roundtrip(acc) if total > 0 else None
                self._results[key] = (result, total, self.size)
                self.rounds += 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: key in self._results, timeout=self.timeout):
                contrib.pop(rank, None)
                steps = sorted(k.outer_step for k in self._pending)
                raise AveragingError(f"in-process group: timed out after {self.timeout}s waiting for peers "
                                     f"(rounds waiting at outer steps {steps})")
            result, total, readers = self._results[key]
            if readers == 1:
                del self._results[key]
            else:
                self._results[key] = (result, total, readers - 1)
        if result is None:
            raise AveragingError("every member of the group contributed weight 0")
        return result.clone(), total  # each member owns its copy, as over a network


class _GroupMember(Communicator):
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank = group, rank
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"replica-{rank}-round")

    @property
    def peer_id(self) -> str:
        return f"replica-{self.rank}"

    @property
    def subset(self):
        return getattr(self.group.codec, "subset", None)

    @property
    def wire_format(self):
        return self.group.codec

    def start(self, flat, *, weight, key, out=None, error_out=None) -> Work:
        flat = flat.detach().to(torch.float32)

        def run():
            began = time.perf_counter()
            averaged, total = self.group._average(self.rank, flat, weight, key, error_out)
            if out is not None:
                averaged = out.copy_(averaged)
            peers = tuple(f"replica-{r}" for r in range(self.group.size))
            return AverageResult(averaged, peers, total, time.perf_counter() - began)

        return FutureWork(self._executor.submit(run))

    def close(self) -> None:
        self._executor.shutdown(wait=False)
