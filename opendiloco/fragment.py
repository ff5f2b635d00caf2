"""A fragment: one part of the model that synchronises in rounds of its own, and runs them.

Without streaming there is one fragment, the whole model. With ``fragments=N`` the optimizer holds
N of them and syncs one per outer step (``opendiloco.streaming``). Everything a round of a fragment
needs lives here: which parameters it holds, the flat buffers its contribution and result travel in,
error feedback's residual, the digest of its θ_global and the work that no average holds yet; and
the round itself: ``prepare_sync`` writes this worker's contribution and starts the round,
``perform_sync`` applies the group's average once it has come (the optimizer decides when, and
handles a round that failed). What the wire format sends of a round and what it owes afterwards,
the format says (``opendiloco.comm.codec``); ``RoundRules`` is what every round of an optimizer
follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .comm.base import Communicator, CompletedWork, RoundKey, Work
from .comm.buffers import FlatBuffer, all_finite, unflatten
from .comm.codec import Codec
from .errors import AveragingError
from .outer import OuterState
from .staging import DeviceSnapshot

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """What happened at the last outer synchronisation."""

    outer_step: int
    ok: bool
    group_size: int = 0
    peers: tuple[str, ...] = ()
    allreduce_s: float = 0.0
    """Seconds inside the communicator (matchmaking, waiting for peers, transfer, verification)."""
    seconds: float = 0.0
    """Seconds of the whole outer step, as seen by the training loop (``allreduce_s`` plus local work)."""
    global_hash: str = ""
    reason: str = ""
    steps: int = 0
    """Inner steps this worker took in the round (since its previous round)."""
    contributed_steps: int = 0
    """Inner steps whose work entered this average (carried-over steps of earlier rounds included)."""
    dropped_steps: int = 0
    """Inner steps thrown away at this outer step (left out under ``pace="fixed"``, healed drift, NaN)."""
    weight: float = 0.0
    """The weight this worker's contribution carried."""
    fragment: int = 0
    """Which fragment of the model this round averaged (always 0 without streaming)."""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RoundRules:
    """What every round of an optimizer's fragments follows."""

    communicator: Communicator
    codec: Codec
    """The wire format's rules (a dense one where the communicator names none)."""
    error_feedback: bool
    error_decay: float | None
    mix: float
    fragments: int
    """How many fragments take turns (a subset's cycle counts a fragment's own rounds)."""

    @property
    def owes_unsent_in_weights(self) -> bool:
        """A round sends part of the values, and what it does not send keeps its local work in θ_local
        (owed to later rounds in the weights: owed in the residual, a value's displacement would be redone
        from the same θ_global every round it waits, and overshoot when it is sent)."""
        return self.codec.needs_error_feedback and self.error_decay is None


def check_wire_format(codec: Codec, *, error_feedback: bool, buffers: bool, error_decay: float | None) -> None:
    """``ValueError`` (one line) for optimizer settings that the communicator's wire format cannot run with."""
    if codec.needs_error_feedback and not error_feedback:
        raise ValueError(f"the communicator's wire format ({codec.label}) sends part of the values a round: it needs "
                         "error_feedback=True, which owes what is not sent to later rounds")
    if buffers and not codec.takes_buffers:
        raise ValueError(f"{codec.label} averages updates, not values: this module's buffers (e.g. BatchNorm "
                         "statistics) need a format that sends values (a dense or subsetN+ one)")
    if error_decay is not None and not (codec.allows_error_decay and 0 < error_decay <= 1):
        raise ValueError(f"error_decay ({error_decay!r}) is for the wire formats that may owe what they leave out in "
                         f"a residual (topkN+), in (0, 1]; this communicator sends {codec.label}")


def check_average(averaged: torch.Tensor, numel: int) -> None:
    """``AveragingError`` for a group's average that this worker cannot apply (its size, dtype or a non-finite
    value)."""
    if averaged.numel() != numel or averaged.dtype != torch.float32:
        raise AveragingError(f"the averaged vector has {averaged.numel()} {averaged.dtype} values, "
                             f"expected {numel} float32")
    if not all_finite(averaged):
        raise AveragingError("the averaged pseudo-gradient is not finite; refused")


@dataclass
class Round:
    """A round in flight: started at a fragment's sync event, applied ``overlap`` steps later."""

    key: RoundKey
    fragment: Fragment
    steps: int
    began: float
    weight: float = 0.0
    own_finite: bool = True
    work: Work | None = None
    prepared: object = None
    """A future that starts the round once a CUDA snapshot has reached host memory (None on CPU)."""
    blocked_s: float = 0.0

    def wait(self):
        if self.prepared is not None:
            self.prepared.result()  # raises what preparing or starting the round raised
        return self.work.wait()


class Fragment:
    """The parameters at ``params`` (indices into the optimizer's trainable parameters) and their round state.

    ``whole``: the only fragment (plain DiLoCo), which selects every parameter at once. The last
    fragment carries the module's buffers (it syncs at multiples of ``local_steps``).
    """

    def __init__(self, index: int, params: list[int], outer: OuterState, *, whole: bool, carries_buffers: bool):
        self.index = index
        self.params = list(params)
        self.whole = whole
        self.carries_buffers = carries_buffers
        self._outer = outer
        self.work = 0.0
        """Work (samples, or steps where none are counted) that no average holds yet."""
        self.digest: str | None = None
        """The digest of this fragment's θ_global (None: to compute); see ``outer.fragmented_hash``."""
        self._buffers: tuple[FlatBuffer, FlatBuffer] | None = None
        self._residuals: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def indices(self) -> list[int] | None:
        """The fragment's parameter indices for ``OuterState``; None for the whole model."""
        return None if self.whole else self.params

    @property
    def size(self) -> int:
        """How many parameter tensors the fragment holds (its module buffers follow them in a contribution)."""
        return len(self.params)

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(local, global) parameters of the fragment."""
        return self._outer.select(self.indices)

    def on_cuda(self) -> bool:
        return any(p.device.type == "cuda" for p in self.tensors()[0])

    def param_numel(self) -> int:
        """Values of the fragment's parameters at the head of its contribution (buffers follow)."""
        return sum(p.numel() for p in self.tensors()[0])

    def buffers(self) -> tuple[FlatBuffer, FlatBuffer]:
        """[this worker's contribution (pseudo-gradients, then buffers), the buffer the group's average
        lands in]: flat fp32, allocated once, so later rounds write into pages already in memory. The
        contribution is pinned for CUDA models."""
        if self._buffers is None:
            like = self.tensors()[0] + (self._outer.buffers if self.carries_buffers else [])
            self._buffers = (FlatBuffer(like), FlatBuffer(like, pin=False))
        return self._buffers

    def residuals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Error feedback's [residual owed to the next contribution, the error of the round in flight],
        shaped like the contribution; they swap when that round succeeds (``settle_residuals``)."""
        if self._residuals is None:
            numel = self.buffers()[0].numel
            self._residuals = (torch.zeros(numel), torch.zeros(numel))
        return self._residuals

    @property
    def residual(self) -> torch.Tensor | None:
        """What the wire format has lost so far of this fragment's contributions (None before its first round)."""
        return None if self._residuals is None else self._residuals[0]

    def settle_residuals(self) -> None:
        """The round in flight succeeded: its error is what the next contribution owes."""
        owed, error = self.residuals()
        self._residuals = (error, owed)

    def reset_residual(self) -> None:
        if self._residuals is not None:
            self._residuals[0].zero_()

    # -- its round -----------------------------------------------------------------------------
    def prepare_sync(self, rules: RoundRules, round_: Round, weight: float, snapshot: DeviceSnapshot | None) -> None:
        """Writes this worker's contribution (Δ = θ_global − θ_local, then the buffers' values) and starts
        ``round_`` (its ``work``). With ``snapshot`` (a CUDA model, rounds overlapping training) the training
        thread only queues a device-side snapshot and its copy to pinned host memory on a side stream; the
        subtraction and the round start on the snapshot's thread once the copy has landed (``prepared``)."""
        contribution, _ = self.buffers()
        n = self.size
        if snapshot is not None:
            ready = snapshot.capture(self.tensors()[0], contribution.views[:n])
            buffers = [b.detach().clone() for b in self._outer.buffers] if self.carries_buffers else []

            def prepare():
                ready()
                round_.weight, round_.own_finite = self._finish_contribution(
                    rules, round_.key, weight, from_snapshot=True, buffer_values=buffers)
                round_.work = self.start_round(rules, round_)

            round_.prepared = snapshot.executor.submit(prepare)
            return
        self._outer.pseudo_gradient_into(contribution.views[:n], self.indices)
        if self.carries_buffers:
            self._outer.buffer_values_into(contribution.views[n:])
        round_.weight, round_.own_finite = self._finish_contribution(rules, round_.key, weight)
        try:
            round_.work = self.start_round(rules, round_)
        except AveragingError as e:
            round_.work = CompletedWork(error=e)

    def start_round(self, rules: RoundRules, round_: Round) -> Work:
        """Hands the contribution to the wire format's round (with error feedback, where its error goes)."""
        contribution, result = self.buffers()
        error_out = self.residuals()[1] if rules.error_feedback else None
        return rules.codec.start_round(rules.communicator, contribution.flat, head=self.param_numel(),
                                       weight=round_.weight, key=round_.key, fragments=rules.fragments,
                                       out=result.flat, error_out=error_out)

    def _finish_contribution(self, rules: RoundRules, key: RoundKey, weight: float, *, from_snapshot: bool = False,
                             buffer_values=()) -> tuple[float, bool]:
        """Completes the contribution in place (Δ from a snapshot, buffers, what error feedback owes) and
        refuses a non-finite one: zeros with weight 0 go out instead. Returns (weight, own_finite)."""
        contribution, _ = self.buffers()
        n = self.size
        if from_snapshot:  # the views hold θ_local: Δ = θ_global − θ_local, in place
            for view, g in zip(contribution.views[:n], self.tensors()[1]):
                torch.sub(g.detach(), view, out=view)
            for view, b in zip(contribution.views[n:], buffer_values):
                view.copy_(b.reshape(view.shape))
        flat = contribution.flat
        own_finite = all_finite(flat)
        if not own_finite:
            log.warning("outer step %d: own pseudo-gradient is not finite; contributing zeros with weight 0",
                        key.outer_step)
            flat.zero_()
            weight = 0.0
        elif rules.error_feedback:  # buffers are values, not updates: no feedback for them
            m = self.param_numel()
            flat[:m].add_(self.residuals()[0][:m], alpha=1.0 if rules.error_decay is None else rules.error_decay)
        return weight, own_finite

    @torch.no_grad()
    def perform_sync(self, rules: RoundRules, round_: Round, averaged: torch.Tensor) -> None:
        """Applies the group's ``averaged`` vector (checked by the caller) to this fragment's θ_global and
        θ_local; what the round did not send keeps its local work; error feedback's residual settles."""
        contribution, _ = self.buffers()
        n, m = self.size, self.param_numel()
        views = unflatten(averaged, contribution.views)
        sent = work = None
        if round_.own_finite and rules.owes_unsent_in_weights:
            if round_.weight <= 0:  # nothing of it was counted: all of its work stays local
                sent = torch.empty(0, dtype=torch.long)
            else:
                sent = rules.codec.sent(round_.key, rules.fragments, contribution.flat[:m], self.residuals()[1][:m])
            work = self._unsent_work(rules)
        self._outer.apply(views[:n], views[n:] if self.carries_buffers else None, self.indices, mix=rules.mix)
        if work is not None:  # the averaged buffer is free once applied
            carry_unsent(*self.tensors(), work, sent, scratch=averaged[: work.numel()])
        self._settle_error(rules, round_, sent)
        self.work = 0.0

    def _unsent_work(self, rules: RoundRules) -> torch.Tensor:
        """θ_global − θ_local + what the contribution owed, per value of the fragment's parameters, written
        into its contribution buffer (free once its round is done): what a value not sent owes."""
        contribution, _ = self.buffers()
        self._outer.pseudo_gradient_into(contribution.views[: self.size], self.indices)
        work = contribution.flat[: self.param_numel()]
        if rules.error_feedback:
            work.add_(self.residuals()[0][: work.numel()])
        return work

    def _settle_error(self, rules: RoundRules, round_: Round, sent: torch.Tensor | None) -> None:
        """What the next contribution owes after a round that landed: its error, of the values it sent
        (what it did not send is owed in the weights now)."""
        if not rules.error_feedback:
            return
        m = self.param_numel()
        if round_.own_finite and round_.weight > 0:
            self.settle_residuals()
            if sent is not None:
                owed = self.residuals()[0]
                kept = owed[sent].clone()
                owed[:m].zero_()
                owed[sent] = kept
        elif sent is not None:  # a round of weight 0: what it owed is in the weights now
            self.residuals()[0][:m].zero_()
        elif rules.error_decay is not None and round_.own_finite:  # weight 0, θ_local reset: all of it is owed
            self.residuals()[0][:m].copy_(self.buffers()[0].flat[:m])

    def __repr__(self) -> str:
        return f"Fragment({self.index}, params={self.params})"


def make_fragments(groups: list[list[int]], outer: OuterState) -> list[Fragment]:
    """Fragments over the parameter index ``groups``; the last one carries the module's buffers."""
    return [Fragment(i, g, outer, whole=len(groups) == 1, carries_buffers=i == len(groups) - 1)
            for i, g in enumerate(groups)]


@torch.no_grad()
def carry_unsent(local: list[torch.Tensor], global_: list[torch.Tensor], work: torch.Tensor, idx: torch.Tensor,
                 scratch: torch.Tensor) -> None:
    """After a sparse round's outer step: every value of θ_local the round did not send (not in ``idx``)
    becomes the new θ_global minus ``work``, its θ_global − θ_local + owed taken before the step (its
    whole contribution, and the steps taken since, with overlap), so it keeps its local progress; the
    sent values keep what the step gave them. ``local``, ``global_``: a fragment's parameters; ``work``
    and ``scratch``: flat fp32 vectors of their size (reused buffers: no allocation, no boolean mask).
    """
    offset, first = 0, 0
    for p, g in zip(local, global_):
        n = p.numel()
        last = first + int(torch.searchsorted(idx[first:], offset + n))  # idx ascending
        target = scratch[offset : offset + n]
        torch.sub(g.detach().reshape(-1), work[offset : offset + n], out=target)
        if last > first:
            sent = idx[first:last] - offset
            values = p.detach().reshape(-1).index_select(0, sent.to(p.device))
            target.index_copy_(0, sent, values.to("cpu", torch.float32))
        p.copy_(target.view(p.shape))
        offset, first = offset + n, last
