"""One worker made of several processes (a torchrun job): rank 0 speaks for it, the others follow.

Inside a worker the inner step is data-parallel (DDP), so every local rank holds the same
weights and computes the same pseudo-gradient. There is nothing to reduce locally: the leader
(local rank 0) alone takes part in the swarm's round, through the communicator it was given,
and hands the outcome to the other ranks over a gloo group of the worker's own processes:

- a successful round: its average (and error-feedback residual), byte for byte, so every rank
  applies the same update and holds a bit-identical θ_global;
- a failed one: the same error type and fields, so every rank takes the same branch
  (θ_global kept, or catching up);
- a state download: the state the leader downloaded (or its failure).

One swarm identity and one pseudo-gradient per worker on the wide-area link, whatever its
number of GPUs; the local hand-off runs over loopback or shared memory, never the slow link.
Every call that talks to the other ranks is collective: all ranks make the same calls in the
same order, which the optimizer guarantees as long as its decisions agree (``shared_decision``).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import (
    AveragingError,
    BehindError,
    DriftError,
    Interrupted,
    LocalRankFailure,
    NonFiniteError,
    PeerFailure,
    ProtocolError,
    RoundCounted,
)
from .base import AverageResult, Communicator, CompletedWork, RoundKey, Work
from .formats import get_codec

log = logging.getLogger(__name__)

__all__ = ["LocalRanks"]

_ERRORS = {cls.__name__: cls for cls in (AveragingError, BehindError, DriftError, Interrupted, NonFiniteError,
                                         PeerFailure, ProtocolError, RoundCounted)}


def describe_error(e: BaseException) -> dict:
    """An error as plain fields, rebuilt on the other ranks by ``rebuild_error``."""
    fields: dict = {"type": type(e).__name__ if type(e).__name__ in _ERRORS else "AveragingError",
                    "message": str(e) if isinstance(e, AveragingError) else f"{type(e).__name__}: {e}"}
    if isinstance(e, BehindError):
        fields["group_outer_step"] = e.group_outer_step
        fields["timeout"] = e.timeout
        fields["expected_hash"] = e.expected_hash
    if isinstance(e, DriftError):
        fields["majority_hash"] = e.majority_hash
    if isinstance(e, RoundCounted):
        fields["completed"] = e.completed
    if isinstance(e, PeerFailure):
        fields["peers"] = sorted(e.peers)
    return fields


def rebuild_error(fields: dict) -> AveragingError:
    kind, message = fields["type"], fields["message"]
    if kind == "DriftError":
        return DriftError(message, group_outer_step=fields["group_outer_step"], majority_hash=fields["majority_hash"])
    if kind == "RoundCounted":
        return RoundCounted(message, group_outer_step=fields["group_outer_step"], completed=fields["completed"],
                            timeout=fields["timeout"])
    if kind == "BehindError":
        return BehindError(message, group_outer_step=fields["group_outer_step"], timeout=fields["timeout"],
                           expected_hash=fields["expected_hash"])
    if kind == "PeerFailure":
        return PeerFailure(message, fields["peers"])
    return _ERRORS.get(kind, AveragingError)(message)


class LocalRanks(Communicator):
    """The communicator of every rank of a multi-process worker.

    ``leader`` is the worker's real communicator (e.g. a ``SwarmCommunicator``) on local rank 0
    and None elsewhere; a callable is called on rank 0 only, so only the leader joins the swarm::

        communicator = LocalRanks(lambda: SwarmCommunicator(initial_peers=[...]))

    The worker is the whole default process group: one torchrun job is one worker, and every
    process builds its ``LocalRanks`` at the same point. ``timeout`` bounds how long a follower
    waits for the leader's round, which includes matchmaking and any catch-up download: set it
    above the longest of those.

    A hand-off that fails (a process died, or the leader hit an unexpected error) raises
    ``LocalRankFailure`` on every rank that notices: the worker stops rather than carry on with
    ranks that disagree.
    """

    def __init__(self, leader: Communicator | Callable[[], Communicator] | None, timeout: float = 1800.0):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("LocalRanks needs torch.distributed initialised (run under torchrun)")
        # Our own gloo group: the hand-off is CPU tensors, and it never queues behind DDP's traffic.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._src = 0
        if self.rank == 0:
            if leader is None:
                raise ValueError("local rank 0 needs the worker's communicator")
            self.leader: Communicator | None = leader() if callable(leader) and not isinstance(leader, Communicator) \
                else leader
        else:
            self.leader = None
        self._peer_id = self._broadcast_object(self.leader.peer_id if self.leader is not None else None)
        # Every rank gathers the round's subset itself (the leader's wire format decides which), and knows
        # the format (a top-k round's unsent values are carried in every rank's weights).
        self._subset = self._broadcast_object(self.leader.subset if self.leader is not None else None)
        leader_format = self.leader.wire_format if self.leader is not None else None
        name = self._broadcast_object(leader_format.name if leader_format is not None else None)
        self._wire_format = None if name is None else (leader_format if self.leader is not None else get_codec(name))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def subset(self):
        return self._subset

    @property
    def wire_format(self):
        return self._wire_format

    # -- collectives ------------------------------------------------------------------------
    def _broadcast_object(self, obj):
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=self._src, group=self.group)
        except RuntimeError as e:
            raise LocalRankFailure(f"lost the worker's other processes: {_first_line(e)}") from e
        return box[0]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, src=self._src, group=self.group)
        except RuntimeError as e:
            raise LocalRankFailure(f"lost the worker's other processes: {_first_line(e)}") from e

    def shared_decision(self, flag: bool) -> bool:
        """The leader's ``flag`` on every rank (a decision that depends on timing, e.g. pacing)."""
        box = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._broadcast(box)
        return bool(box.item())

    def agree_step(self, loss: float, stop: bool) -> tuple[float, bool]:
        """After an inner step: the worker's loss (the mean over its ranks' rows) and whether any rank
        was asked to stop, the same on every rank, in one small all-reduce."""
        box = torch.tensor([float(loss), 1.0 if stop else 0.0], dtype=torch.float64)
        try:
            dist.all_reduce(box, group=self.group)
        except RuntimeError as e:
            raise LocalRankFailure(f"lost the worker's other processes: {_first_line(e)}") from e
        return float(box[0]) / self.size, bool(box[1] > 0)

    # -- rounds -----------------------------------------------------------------------------
    def start(self, flat, *, weight, key: RoundKey, out=None, error_out=None) -> Work:
        if self.leader is not None:
            try:
                inner = self.leader.start(flat, weight=weight, key=key, out=out, error_out=error_out)
            except Exception as e:  # settled (and raised) on every rank at wait(), never on the leader alone
                inner = CompletedWork(error=e)
            return _RankWork(self, flat, out, error_out, inner)
        return _RankWork(self, flat, out, error_out, None)

    def _settle(self, work: _RankWork) -> AverageResult:
        """The collective end of a round: the leader's outcome, on every rank. Every rank makes the
        same collectives whatever happens, then raises what there is to raise."""
        result = None
        header = None
        if work.inner is not None:
            try:
                result = work.inner.wait()
                flat = result.flat.contiguous()
                header = {"ok": True, "peers": list(result.peers), "total_weight": result.total_weight,
                          "seconds": result.seconds, "extra": result.extra, "numel": flat.numel(),
                          "dtype": str(flat.dtype)}
            except AveragingError as e:  # a failed round: every rank fails it alike
                header = {"ok": False, "error": describe_error(e)}
            except Exception as e:  # a bug or a broken transport on the leader: the worker stops
                header = {"ok": False, "fatal": f"{type(e).__name__}: {e}"}
        header = self._broadcast_object(header)
        if "fatal" in header:
            raise LocalRankFailure(f"the worker's rank 0 failed: {header['fatal']}")
        if not header["ok"]:
            raise rebuild_error(header["error"])
        mismatch = None
        if result is None:
            flat = work.out if work.out is not None else torch.empty(header["numel"], dtype=torch.float32)
            if flat.numel() != header["numel"] or str(flat.dtype) != header["dtype"] or not flat.is_contiguous():
                mismatch = f"{flat.numel()} {flat.dtype}"
                flat = torch.empty(header["numel"], dtype=getattr(torch, header["dtype"].split(".")[-1]))
        self._broadcast(flat)
        if work.error_out is not None:
            self._broadcast(work.error_out)
        if mismatch is not None:  # received anyway, so that both sides made the same collectives
            raise LocalRankFailure(f"the leader's average has {header['numel']} {header['dtype']} values, this "
                                   f"rank expects {mismatch}")
        return AverageResult(flat, tuple(header["peers"]), header["total_weight"], header["seconds"],
                             dict(header["extra"]))

    # -- the rest of the interface: the leader acts, the others follow -----------------------
    def download_state(self, timeout, min_outer_step=None, max_bytes=None, majority_hash=None):
        outcome = None
        if self.leader is not None:
            try:
                outcome = {"state": self.leader.download_state(timeout, min_outer_step=min_outer_step,
                                                               max_bytes=max_bytes, majority_hash=majority_hash)}
            except Exception as e:  # every rank takes the same branch (the caller's policy decides)
                outcome = {"error": describe_error(e)}
        outcome = self._broadcast_object(outcome)
        if "error" in outcome:
            raise rebuild_error(outcome["error"])
        return outcome["state"]

    def attach_state_provider(self, provider) -> None:
        if self.leader is not None:
            self.leader.attach_state_provider(provider)

    def report_progress(self, **fields) -> None:
        if self.leader is not None:
            self.leader.report_progress(**fields)
        else:  # refused on every rank alike, not on the leader alone
            super().report_progress(**fields)

    def peer_paces(self, outer_step: int):
        return self.leader.peer_paces(outer_step) if self.leader is not None else []

    def interrupt(self) -> None:
        if self.leader is not None:
            self.leader.interrupt()

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class _RankWork(Work):
    """A round of a multi-process worker; ``wait`` is collective and settles it once."""

    def __init__(self, ranks: LocalRanks, flat, out, error_out, inner: Work | None):
        self.ranks, self.flat, self.out, self.error_out, self.inner = ranks, flat, out, error_out, inner
        self._result: AverageResult | None = None
        self._error: AveragingError | None = None

    def wait(self, timeout=None) -> AverageResult:
        if self._result is None and self._error is None:
            try:
                self._result = self.ranks._settle(self)
            except AveragingError as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._result

    def done(self) -> bool:
        return self._result is not None or self._error is not None or (self.inner is not None and self.inner.done())
