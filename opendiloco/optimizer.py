"""DiLoCoOptimizer: the inner and the outer optimizer in one drop-in replacement for AdamW."""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from .comm.base import Communicator, CompletedWork, RoundKey, SharedState, Work
from .comm.buffers import FlatBuffer, all_finite, unflatten
from .comm.local import SingleWorker
from .comm.subset import carry_unsent, start_subset
from .comm.topk import TopK
from .errors import AveragingError, BehindError, DriftError, LocalRankFailure, RoundCounted, SplitHold
from .fragment import Fragment, make_fragments
from .optimizer_state import SavedRound, check_checkpoint, joiner_position, settings_of
from .outer import OptimizerFactory, OuterState, fragmented_hash
from .pacing import PACES, Pace, retry_delay, round_due, seconds_to_target
from .staging import DeviceSnapshot
from .state_check import ADAM_ENTRIES, Reference, adoptable_optimizer_state, check_state, reference_groups
from .streaming import check_schedule, event_gap, event_start, fragment_of, fragments_from_groups, split_evenly

log = logging.getLogger(__name__)

default_inner_optimizer = functools.partial(torch.optim.AdamW, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
default_outer_optimizer = functools.partial(torch.optim.SGD, lr=0.4, momentum=0.9, nesterov=True)


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


@dataclass
class _Round:
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


def averaged_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers ``module=`` averages: the floating, persistent ones (those in ``state_dict``, e.g.
    BatchNorm's running statistics), each once, in ``module.buffers()`` order. Integer buffers are
    counters, and non-persistent ones are constants a module computes for itself (a rotary
    embedding's ``inv_freq``): averaging those through a lossy wire would only round them, and a run
    restored from a checkpoint would then differ from one that never stopped."""
    seen, out = set(), []
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is None or name in owner._non_persistent_buffers_set or not buf.is_floating_point():
                continue
            if id(buf) not in seen:
                seen.add(id(buf))
                out.append(buf)
    return out


class DiLoCoOptimizer(torch.optim.Optimizer):
    """Inner optimizer every step, outer optimizer every ``local_steps`` inner steps.

    Use it where ``torch.optim.AdamW`` was: ``param_groups`` are the inner optimizer's, so lr
    schedulers drive the inner lr, and ``GradScaler`` can skip a step (a skipped step does not
    count towards ``local_steps``). Pass ``module=`` to also average the module's persistent
    floating buffers (e.g. BatchNorm running statistics) at each outer step (``averaged_buffers``).

    ``pace`` decides when a round is due (see ``opendiloco.pacing``): ``"fixed"`` (default,
    reproducible) takes exactly ``local_steps`` inner steps; ``"swarm"`` closes the round when
    the group has done ``local_steps`` steps' worth of work per member, so workers of different
    speed stop together and each contributes what it did, weighted by its samples (or steps).
    Under ``"swarm"``, a worker left out of a round keeps its local work and adds it to the next
    round instead of throwing it away.

    Streaming (see ``opendiloco.streaming``): ``fragments`` cuts the model into that many parts
    (or takes an explicit list of parameter groups, e.g. one per transformer block) that
    synchronise in turn, one every ``local_steps / fragments`` steps; each fragment's round runs
    in the background for ``overlap`` inner steps before it is applied, and ``mix`` keeps that share
    of the local weights when it is (0 takes θ_global). ``fragments=1, overlap=0`` is plain DiLoCo.
    An outer step is then one fragment's sync.

    ``error_feedback``: what the communicator's wire format loses of this worker's pseudo-gradient
    (quantisation error, with 8- and 4-bit codecs) is kept and added to its next contribution of
    the same fragment. The residual is this worker's own: saved in ``state_dict``, never shared
    with joiners, reset when state is downloaded. It costs two fp32 copies of the model on the host.
    It is required with a subset wire format (``subset32+int4``: ``opendiloco.comm.subset``), where a
    round sends a shared-seed 1/N of the pseudo-gradient and owes the rest to later rounds: an unsent
    value keeps its local work in θ_local (the next Δ holds it), a sent one owes the codec's error.

    ``error_decay`` (top-k formats only; SparseLoCo's rule): every value's θ_local restarts from θ_global
    after a round, and what was not sent is owed in the residual instead, decayed by ``error_decay``
    each round (the contribution is Δ + decay · residual). The decayed residual then does what outer
    momentum does, so it goes with a plain outer step (SGD, no momentum). Unset: the unsent keep
    their local work, as with a subset.

    ``warm_start``: with an Adam inner optimizer, the state this worker serves joiners carries its Adam
    moments too, and a joiner whose inner optimizer has no state yet starts from the donor's (checked:
    ``opendiloco.state_check``) instead of empty moments, so that its first round counts as much as its
    peers'. It triples what a joiner downloads.
    """

    def __init__(
        self,
        params,
        *,
        local_steps: int,
        inner_optimizer: OptimizerFactory = default_inner_optimizer,
        outer_optimizer: OptimizerFactory = default_outer_optimizer,
        communicator: Communicator | None = None,
        module: torch.nn.Module | None = None,
        weight_by_samples: bool = False,
        catch_up_timeout: float = 60.0,
        pace: str = "fixed",
        fragments=1,
        overlap: int = 0,
        mix: float = 0.0,
        error_feedback: bool = False,
        warm_start: bool = False,
        error_decay: float | None = None,
    ):
        if not isinstance(local_steps, int) or isinstance(local_steps, bool) or local_steps < 1:
            raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}")
        if pace not in PACES:
            raise ValueError(f"pace must be one of {PACES}, got {pace!r}")
        params = list(params) if not isinstance(params, torch.Tensor) else [params]
        if not params:
            raise ValueError("DiLoCoOptimizer got an empty parameter list")
        self.inner = inner_optimizer(params)
        super().__init__(self.inner.param_groups, dict(self.inner.defaults))
        # Share, not copy: schedulers and GradScaler act on the inner optimizer's groups and state.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

        # θ_global's layout follows the parameters as given, not the inner optimizer's grouping (Muon
        # groups the matrices first): workers with different inner optimizers share one layout.
        given = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
        stepped = {id(p) for g in self.param_groups for p in g["params"]}
        trainable = [p for p in given if id(p) in stepped and p.requires_grad and p.is_floating_point()]
        buffers = averaged_buffers(module) if module is not None else []
        self.outer = OuterState(trainable, buffers, outer_optimizer)
        if isinstance(fragments, int) and not isinstance(fragments, bool):
            check_schedule(local_steps, fragments, overlap, mix)
            groups = split_evenly(trainable, fragments) if fragments > 1 else [list(range(len(trainable)))]
        else:
            groups = fragments_from_groups(trainable, fragments)
            check_schedule(local_steps, len(groups), overlap, mix)
        self.fragments: list[Fragment] = make_fragments(groups, self.outer)
        self.overlap, self.mix = overlap, float(mix)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.warm_started = False
        """Whether this worker's inner optimizer started from a donor's state (``warm_start``)."""
        self.local_steps = local_steps
        self.communicator = communicator if communicator is not None else SingleWorker()
        self.subset = self.communicator.subset
        """The shared-seed subset a round sends (``opendiloco.comm.subset``); None: whole contributions."""
        if self.subset is not None and not self.error_feedback:
            raise ValueError(f"the communicator's wire format sends 1/{self.subset.every} of the values a round: "
                             "it needs error_feedback=True, which owes what is not sent to later rounds")
        codec = self.communicator.wire_format
        self.topk = codec if isinstance(codec, TopK) else None
        """The top-k format a round sends (``opendiloco.comm.topk``); None: another."""
        if isinstance(codec, TopK):
            if not self.error_feedback:
                raise ValueError(f"the communicator's wire format ({codec.label}) sends the largest 1/{codec.every} "
                                 "of the values a round: it needs error_feedback=True, which owes the rest to later "
                                 "rounds")
            if self.outer.buffers:
                raise ValueError(f"{codec.label} averages updates, not values: this module's buffers (e.g. BatchNorm "
                                 "statistics) need a dense or subsetN+ format")
        if error_decay is not None and (self.topk is None or not 0 < error_decay <= 1):
            raise ValueError(f"error_decay ({error_decay!r}) is for top-k wire formats, in (0, 1]; this communicator "
                             f"sends {codec.label}")
        self.error_decay = error_decay
        """SparseLoCo's rule (top-k): the unsent owed in a residual decayed by this, θ_local reset; None: in
        the weights."""
        self.weight_by_samples = weight_by_samples or pace == "swarm"
        self.pace = pace
        self.catch_up_timeout = catch_up_timeout
        # Held while θ_global changes, so state served to a joiner from another thread is never torn.
        self._state_lock = threading.RLock()
        self._hash: str | None = None
        self._local_step = 0
        self._outer_step = 0
        self._inner_steps_total = 0
        self._step_samples = 0
        self._pace_work = 0.0
        """Work since the last round attempt: what the pacing rule counts."""
        self._failed_in_a_row = 0
        self._retry_at = 0.0  # (monotonic) under pace "swarm", no round before this (``retry_delay``)
        self._work_per_step = 0.0
        self._step_s = 0.0
        """Moving average of the seconds between two inner steps (outer steps left out)."""
        self._last_step_end: float | None = None
        self._uncommitted_steps = 0
        self._contributed_steps = 0
        self._dropped_steps = 0
        self.last_sync: SyncReport | None = None
        self._pending: _Round | None = None
        self._snapshot: DeviceSnapshot | None = None
        self._schedule_high = 0
        self.blocked_s = 0.0
        """Seconds the last ``step()`` spent on outer-step work (starting or landing a round, waiting
        for one) after the inner step: what a loop should count as time not training."""
        # The communicator serves our state, and bounds and checks what it downloads for us (so that it can
        # go on to another donor when one serves a state we would refuse).
        self.communicator.attach_state_provider(SharedState(self.shareable_state, self.shareable_state_bound(),
                                                            self.check_shareable_state))
        self._global_changed()  # the swarm learns our outer step (and θ_global hash) at once

    # -- counters ---------------------------------------------------------------------------
    @property
    def local_step(self) -> int:
        """Inner steps taken since the last outer step."""
        return self._local_step

    @property
    def outer_step(self) -> int:
        """Outer steps done."""
        return self._outer_step

    @property
    def inner_kind(self) -> str:
        """The inner optimizer's class name (a checkpoint is loaded only by the same kind)."""
        return type(self.inner).__name__

    @property
    def inner_steps_total(self) -> int:
        """Inner steps this worker has taken (or adopted from a peer when it joined)."""
        return self._inner_steps_total

    @property
    def schedule_step(self) -> int:
        """Where the run stands, for learning-rate schedules and for when to stop: the same on
        every worker of a swarm. ``inner_steps_total`` under ``pace="fixed"``; under ``"swarm"``
        (where a fast worker takes more inner steps than a slow one) ``local_steps`` per outer
        step plus this round's steps, capped below ``local_steps``: only the outer step itself
        completes a round, so a run that ends at a multiple of ``local_steps`` ends on one."""
        if self.pace == "fixed":
            return self._inner_steps_total
        event = self._next_round()  # the event this round's steps lead to
        position = event_start(event - 1, self.local_steps, self.num_fragments) + min(self._local_step,
                                                                                       self._gap(event) - 1)
        # A failed round restarts its count of local steps; the run's position never goes back.
        self._schedule_high = max(self._schedule_high, position)
        return self._schedule_high

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def _gap(self, event: int) -> int:
        return event_gap(event, self.local_steps, self.num_fragments)

    @property
    def contributed_steps(self) -> int:
        """Inner steps of this worker whose work entered an average."""
        return self._contributed_steps

    @property
    def dropped_steps(self) -> int:
        """Inner steps of this worker that were thrown away (and why is in each ``SyncReport``)."""
        return self._dropped_steps

    def count_samples(self, n: int) -> None:
        """Tells the optimizer how many samples the coming inner step sees (for weighting and pacing)."""
        self._step_samples += int(n)

    def global_hash(self) -> str:
        """Short hash of θ_global's exact bytes (cached; recomputed after each change)."""
        if self._hash is None:
            with self._state_lock:
                digests = [f.digest for f in self.fragments]
                self._hash = fragmented_hash(self.outer.global_params, [f.params for f in self.fragments], digests)
                for f, digest in zip(self.fragments, digests):
                    f.digest = digest
        return self._hash

    def _global_changed(self, fragment: Fragment | None = None) -> None:
        """θ_global moved (one fragment of it, or all): the swarm learns the new outer step, hash and
        this worker's fresh pace in one record, published at once."""
        self._hash = None
        self._failed_in_a_row, self._retry_at = 0, 0.0
        for f in self.fragments if fragment is None else [fragment]:
            f.digest = None
        self.communicator.report_progress(outer_step=self._outer_step, global_hash=self.global_hash(),
                                          **self._pace_fields())

    def _next_round(self) -> int:
        """The round this worker enters next: one more than ``outer_step`` while a round is in flight."""
        return self._outer_step + (self._pending is not None)

    # -- the torch.optim.Optimizer surface ---------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.inner.step(closure)
        now = time.perf_counter()
        if self._last_step_end is not None:
            dt = now - self._last_step_end
            self._step_s = dt if self._step_s == 0 else 0.7 * self._step_s + 0.3 * dt
        work = float(self._step_samples) if self._step_samples > 0 else 1.0
        self._step_samples = 0
        self._work_per_step = work if self._work_per_step == 0 else 0.7 * self._work_per_step + 0.3 * work
        self._local_step += 1
        self._inner_steps_total += 1
        self._uncommitted_steps += 1
        for f in self.fragments:
            f.work += work
        self._pace_work += work
        finished = False
        if self._pending is not None and self._local_step >= self.overlap:
            self._finish_round()
            finished = True
        if self._pending is None and self._round_due():
            self._begin_round()
            if self.overlap == 0:
                self._finish_round()
                finished = True
        elif not finished:
            self._publish_pace()
        self.blocked_s = time.perf_counter() - now
        # The next interval holds whatever the loop does after an outer step (an eval, a checkpoint).
        self._last_step_end = None if finished else now
        return loss

    # -- pacing ------------------------------------------------------------------------------
    def _own_pace(self, ready: bool = False) -> Pace:
        rate = self._work_per_step / self._step_s if self._step_s > 0 else 0.0
        return Pace(work=self._pace_work, rate=rate, per_step=self._work_per_step, time=time.time(), ready=ready)

    def _round_due(self) -> bool:
        gap = self._gap(self._outer_step)
        if self.pace == "fixed":
            return self._local_step >= gap
        # Timing-based: the ranks of a multi-process worker take their leader's decision.
        return self.communicator.shared_decision(
            time.monotonic() >= self._retry_at
            and round_due(self._own_pace(), self.communicator.peer_paces(self._outer_step), gap,
                          own_step_s=self._step_s, local_step=self._local_step))

    def _seconds_to_round(self) -> float | None:
        """When this worker expects to enter its next round; None until its step time is measured."""
        if self._step_s <= 0:
            return None
        event = self._next_round()
        gap = self._gap(event)
        fixed = max(0, gap - self._local_step) * self._step_s
        if self.pace == "fixed":
            return fixed
        eta = seconds_to_target(self._own_pace(), self.communicator.peer_paces(event), gap)
        return eta if math.isfinite(eta) else fixed

    def _publish_pace(self, ready: bool = False) -> None:
        """Tells the swarm how far this worker is in its round and when it expects to enter it."""
        self.communicator.report_progress(**self._pace_fields(ready))

    def _pace_fields(self, ready: bool = False) -> dict:
        pace = self._own_pace()
        return dict(round_work=pace.work, work_rate=pace.rate, work_per_step=pace.per_step, ready=ready,
                    next_round=self._next_round(), ready_in=0.0 if ready else self._seconds_to_round(),
                    steps_per_s=1 / self._step_s if self._step_s > 0 else 0.0,
                    contributed_steps=self._contributed_steps, dropped_steps=self._dropped_steps)

    # -- the outer step ----------------------------------------------------------------------
    def finish(self) -> SyncReport | None:
        """Applies a streamed round still in flight now, instead of ``overlap`` steps later (at the
        end of a run, before its final eval and checkpoint). None if there is none."""
        return self._finish_round() if self._pending is not None else None

    def sync(self) -> SyncReport:
        """Starts the next round now and waits for it (a round still in flight is finished first)."""
        if self._pending is not None:
            self._finish_round()
        self._begin_round()
        return self._finish_round()

    def _begin_round(self) -> None:
        """Snapshots this worker's pseudo-gradient of the event's fragment and starts its round."""
        began = time.perf_counter()
        event = self._outer_step
        fragment = self.fragments[fragment_of(event, self.num_fragments)]
        self._publish_pace(ready=True)  # peers pacing themselves stop counting on our work growing
        round_ = _Round(RoundKey(event, fragment.index), fragment, steps=self._local_step, began=began)
        contribution, result = fragment.buffers()
        n = fragment.size
        weight = fragment.work if self.weight_by_samples else 1.0
        if self.overlap > 0 and fragment.on_cuda():
            # The training thread only queues a device-side snapshot and its copy to pinned host
            # memory on a side stream; the subtraction and the round start once the copy has landed.
            self._snapshot = self._snapshot or DeviceSnapshot()
            ready = self._snapshot.capture(fragment.tensors()[0], contribution.views[:n])
            buffers = [b.detach().clone() for b in self.outer.buffers] if fragment.carries_buffers else []

            def prepare():
                ready()
                round_.weight, round_.own_finite = self._finish_contribution(
                    fragment, contribution, weight, from_snapshot=True, buffer_values=buffers)
                round_.work = self._start(round_, contribution, result)

            round_.prepared = self._snapshot.executor.submit(prepare)
        else:
            self.outer.pseudo_gradient_into(contribution.views[:n], fragment.indices)
            if fragment.carries_buffers:
                self.outer.buffer_values_into(contribution.views[n:])
            round_.weight, round_.own_finite = self._finish_contribution(fragment, contribution, weight)
            try:
                round_.work = self._start(round_, contribution, result)
            except AveragingError as e:
                round_.work = CompletedWork(error=e)
        round_.blocked_s = time.perf_counter() - began
        self._pending = round_
        self._local_step = 0
        self._pace_work = 0.0

    def _start(self, round_: _Round, contribution: FlatBuffer, result: FlatBuffer) -> Work:
        """Hands the contribution to the communicator (with error feedback, where its error goes); with a
        subset format, the round's subset of the pseudo-gradient and the buffers whole."""
        error_out = round_.fragment.residuals()[1] if self.error_feedback else None
        if self.subset is not None:
            return start_subset(self.communicator, self.subset, contribution.flat, head=round_.fragment.param_numel(),
                                weight=round_.weight, key=round_.key, fragments=self.num_fragments,
                                out=result.flat, error_out=error_out)
        extra = {} if error_out is None else {"error_out": error_out}
        return self.communicator.start(contribution.flat, weight=round_.weight, key=round_.key, out=result.flat,
                                       **extra)

    def _finish_round(self) -> SyncReport:
        """Waits for the round in flight and applies it to its fragment (or handles its failure)."""
        # ``_pending`` stays set until the round has landed or failed: a joiner served state in the
        # meantime must know that this round has started here.
        round_ = self._pending
        began = time.perf_counter()
        fragment = round_.fragment
        contribution, _ = fragment.buffers()
        try:
            result = round_.wait()
            communicator_s = time.perf_counter() - round_.began
            averaged = result.flat
            if averaged.numel() != contribution.numel or averaged.dtype != torch.float32:
                raise AveragingError(f"the averaged vector has {averaged.numel()} {averaged.dtype} values, "
                                     f"expected {contribution.numel} float32")
            if not all_finite(averaged):
                raise AveragingError("the averaged pseudo-gradient is not finite; refused")
        except BehindError as e:
            self._pending = None
            report = self._catch_up(e, time.perf_counter() - round_.began, round_.own_finite)
        except AveragingError as e:
            self._pending = None
            report = self._round_failed(str(e), time.perf_counter() - round_.began, round_.own_finite)
            if isinstance(e, SplitHold):
                report.extra["held"] = True
        else:
            n = fragment.size
            views = unflatten(averaged, contribution.views)
            with self._state_lock:
                # A subset or top-k round: the values it did not send keep their local work (owed to later
                # rounds in the weights: owed in the residual, a value's displacement would be redone from
                # the same θ_global every round it waits, and overshoot when it is sent).
                sent = work = None
                keeps_local = self.subset is not None or (self.topk is not None and self.error_decay is None)
                if round_.own_finite and keeps_local:
                    if round_.weight <= 0:  # nothing of it was counted: all of its work stays local
                        sent = torch.empty(0, dtype=torch.long)
                    elif self.topk is not None:  # the values the round sent: those it did not owe whole
                        head = fragment.param_numel()
                        sent = torch.ne(contribution.flat[:head], fragment.residuals()[1][:head]).nonzero().squeeze(1)
                    work = self._unsent_work(fragment)
                    if sent is None:
                        sent = self.subset.indices(round_.key, work.numel(), self.num_fragments)
                self.outer.apply(views[:n], views[n:] if fragment.carries_buffers else None, fragment.indices,
                                 mix=self.mix)
                if work is not None:  # the averaged buffer is free once applied
                    carry_unsent(*fragment.tensors(), work, sent, scratch=averaged[: work.numel()])
                self._outer_step += 1
                self._pending = None
            report = SyncReport(self._outer_step, True, group_size=result.group_size, peers=result.peers,
                                allreduce_s=communicator_s, contributed_steps=self._uncommitted_steps,
                                extra=result.extra)
            self._contributed_steps += self._uncommitted_steps
            self._uncommitted_steps = 0
            fragment.work = 0.0
            if self.error_feedback and round_.own_finite and round_.weight > 0:  # its loss is owed to the next one
                fragment.settle_residuals()
                if self.topk is not None and sent is not None:  # what it did not send is owed in the weights now
                    owed = fragment.residuals()[0]
                    kept = owed[sent].clone()
                    owed[: fragment.param_numel()].zero_()
                    owed[sent] = kept
            elif work is not None and self.error_feedback:  # a round of weight 0: what it owed is in the weights now
                fragment.residuals()[0][: fragment.param_numel()].zero_()
            elif self.error_decay is not None and round_.own_finite:  # weight 0, θ_local reset: all of it is owed
                m = fragment.param_numel()
                fragment.residuals()[0][:m].copy_(contribution.flat[:m])
            self._global_changed(fragment)  # publishes the fresh pace with the new outer step
            report.global_hash = self.global_hash()
        if not report.ok:
            self._publish_pace()
        report.steps, report.weight, report.fragment = round_.steps, round_.weight, fragment.index
        report.seconds = round_.blocked_s + time.perf_counter() - began
        self.last_sync = report
        return report

    def _unsent_work(self, fragment: Fragment) -> torch.Tensor:
        """θ_global − θ_local + what the contribution owed, per value of the fragment's parameters, written
        into its contribution buffer (free once its round is done): what a value not sent owes."""
        contribution, _ = fragment.buffers()
        self.outer.pseudo_gradient_into(contribution.views[: fragment.size], fragment.indices)
        work = contribution.flat[: fragment.param_numel()]
        if self.error_feedback:
            work.add_(fragment.residuals()[0][: work.numel()])
        return work

    # -- contributions -------------------------------------------------------------------------
    def error_residual(self, fragment: int = 0) -> torch.Tensor | None:
        """Error feedback: what the wire format has lost so far of this fragment's contributions, owed
        to its next one (flat, parameters then buffers; None before the fragment's first round)."""
        return self.fragments[fragment].residual

    def _finish_contribution(self, fragment: Fragment, contribution: FlatBuffer, weight: float, *,
                             from_snapshot: bool = False, buffer_values=()) -> tuple[float, bool]:
        """Completes the contribution in place (Δ from a snapshot, buffers) and refuses a non-finite one:
        zeros with weight 0 go out instead. Returns (weight, own_finite)."""
        n = fragment.size
        if from_snapshot:  # the views hold θ_local: Δ = θ_global − θ_local, in place
            for view, g in zip(contribution.views[:n], fragment.tensors()[1]):
                torch.sub(g.detach(), view, out=view)
            for view, b in zip(contribution.views[n:], buffer_values):
                view.copy_(b.reshape(view.shape))
        flat = contribution.flat
        own_finite = all_finite(flat)
        if not own_finite:
            log.warning("outer step %d: own pseudo-gradient is not finite; contributing zeros with weight 0",
                        self._outer_step)
            flat.zero_()
            weight = 0.0
        elif self.error_feedback:  # buffers are values, not updates: no feedback for them
            m = fragment.param_numel()
            flat[:m].add_(fragment.residuals()[0][:m], alpha=1.0 if self.error_decay is None else self.error_decay)
        return weight, own_finite

    def _round_failed(self, reason: str, seconds: float, own_finite: bool) -> SyncReport:
        """θ_global stays; the local work stays too (the next round's pseudo-gradient holds it),
        unless it is not finite."""
        log.warning("outer step %d failed, θ_global kept: %s", self._outer_step, reason)
        self._failed_in_a_row += 1
        self._retry_at = time.monotonic() + retry_delay(self._failed_in_a_row)
        dropped = 0
        if not own_finite:
            self.outer.reset_local()  # local weights are poisoned: start over from θ_global
            dropped = self._drop_local_work()
        return SyncReport(self._outer_step, False, allreduce_s=seconds, global_hash=self.global_hash(),
                          reason=reason, dropped_steps=dropped)

    def _drop_local_work(self) -> int:
        dropped, self._uncommitted_steps = self._uncommitted_steps, 0
        self._dropped_steps += dropped
        self._clear_fragment_work()
        return dropped

    def _clear_fragment_work(self) -> None:
        for f in self.fragments:
            f.work = 0.0

    def _catch_up(self, err: BehindError, seconds: float, own_finite: bool = True) -> SyncReport:
        log.warning("outer step %d: %s; loading state from a peer", self._outer_step, err)
        majority = err.expected_hash  # what the run confirmed (None: "left out", the download finds it)
        if isinstance(err, RoundCounted):
            return self._adopt_counted(err, seconds, own_finite)
        try:
            timeout = min(self.catch_up_timeout, err.timeout or self.catch_up_timeout)
            state = self.communicator.download_state(
                timeout, min_outer_step=err.group_outer_step, max_bytes=self.shareable_state_bound(),
                majority_hash=majority)
            if state is None:
                raise AveragingError("no live peer to download state from")
            # Under pace="swarm" a worker that was only late keeps its local work: θ_local restarts
            # from the new θ_global minus its own pseudo-gradient, which the next round then carries.
            # Drifted or non-finite local work is never carried.
            drift = isinstance(err, DriftError)
            # Δ afresh, over the whole model: it holds every local step since θ_global last moved,
            # those taken while a streamed round was in flight included.
            keep = self.outer.pseudo_gradients() if self.pace == "swarm" and not drift and own_finite else None
            carry = keep is not None and all(all_finite(d) for d in keep)
            keep = keep if carry else None
            # The communicator names the hash the run confirmed for the state it got (the run may have
            # moved on a round while it asked); a communicator that does not, the one the error named.
            self.load_shareable_state(state, min_outer_step=err.group_outer_step,
                                      expected_hash=state.get("confirmed_hash") or majority,
                                      keep_local=keep)
        except LocalRankFailure:  # the worker's own processes lost one another: not a peer's defect
            raise
        except Exception as e:  # a peer's state is input from the network: any defect is a failed catch-up
            return self._round_failed(f"{err}; could not catch up: {type(e).__name__}: {e}", seconds, own_finite)
        dropped = 0 if carry else self._drop_local_work()
        reason = "healed drift from a peer" if drift else "caught up from a peer"
        if carry:
            reason += f", local work of {self._uncommitted_steps} step(s) carried into the next round"
        return SyncReport(self._outer_step, False, allreduce_s=seconds, global_hash=self.global_hash(),
                          reason=reason, dropped_steps=dropped, extra={"caught_up": True, "carried": carry})

    def _adopt_counted(self, err: RoundCounted, seconds: float, own_finite: bool) -> SyncReport:
        """The round failed here, but the group completed it without this worker (or may have): its work of
        the round is in the group's average, so it is neither applied nor carried; θ_global becomes the
        group's. Steps taken since the round began (overlap) are in no average and are dropped with the
        local weights. The round's steps count as contributed when a member said it completed the round
        (and they were finite: else zeros went out), as dropped when nobody could say."""
        later = min(self._local_step, self._uncommitted_steps)  # taken after the round's snapshot
        in_round = self._uncommitted_steps - later
        contributed = in_round if err.completed and own_finite else 0
        dropped = self._uncommitted_steps - contributed
        step = self._outer_step
        try:
            state = self.communicator.download_state(
                min(self.catch_up_timeout, err.timeout or self.catch_up_timeout), min_outer_step=err.group_outer_step,
                max_bytes=self.shareable_state_bound())
            if state is None:
                raise AveragingError("no live peer to download state from")
            self.load_shareable_state(state, min_outer_step=err.group_outer_step)
            failure = None
        except LocalRankFailure:
            raise
        except Exception as e:  # a peer's state is input from the network: any defect is a failed download
            failure = f"{type(e).__name__}: {e}"
            with self._state_lock:  # the local weights hold work the group has (or may have) counted
                self.outer.reset_local()
        self._uncommitted_steps = 0
        self._clear_fragment_work()
        self._contributed_steps += contributed
        self._dropped_steps += dropped
        outcome = "completed round" if err.completed else "may have completed round"
        reason = (f"the group {outcome} {step} without this worker's confirmation; "
                  + (f"adopted its state (local work of {contributed + dropped} step(s) not applied again: "
                     f"{contributed} contributed, {dropped} dropped)" if failure is None else
                     f"its local work is dropped ({contributed} step(s) contributed, {dropped} dropped); could not "
                     f"download the group's state: {failure}"))
        log.warning("outer step %d: %s", step, reason)
        return SyncReport(self._outer_step, False, allreduce_s=seconds, global_hash=self.global_hash(),
                          reason=reason, contributed_steps=contributed, dropped_steps=dropped,
                          extra={"caught_up": failure is None, "carried": False, "counted": True,
                                 "completed": err.completed})

    # -- state for joiners -------------------------------------------------------------------
    def shareable_state(self) -> dict:
        """What a late joiner needs: θ_global, outer optimizer state, counters; with ``warm_start``, this
        worker's Adam moments (copied while it may be stepping: at most a step apart).

        ``inner_steps_total`` is the count at the last outer step, the point θ_global stands for:
        a joiner then takes exactly ``local_steps`` inner steps before its first outer step.
        """
        with self._state_lock:  # copies, so that serving it later never races an outer step
            base, local = joiner_position(self._inner_steps_total, self._local_step, self._gap(self._outer_step),
                                          in_flight=self._pending is not None, fixed=self.pace == "fixed")
            state = {
                "outer": copy.deepcopy(self.outer.state_dict()),
                "outer_step": self._outer_step,
                "inner_steps_total": base,
                "local_step": local,
                "buffers": self.outer.buffer_values(),
            }
        inner = self._inner_state_to_share()
        if inner is not None:
            state["inner"] = inner
        return state

    def _adam_betas(self) -> tuple[float, float] | None:
        """The inner optimizer's betas if it is Adam (or AdamW) with one setting for all groups, else None."""
        if not isinstance(self.inner, torch.optim.Adam | torch.optim.AdamW):
            return None
        betas = {tuple(g["betas"]) for g in self.inner.param_groups}
        return betas.pop() if len(betas) == 1 else None

    def _inner_params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def _inner_state_to_share(self) -> dict | None:
        if not self.warm_start or self._adam_betas() is None:
            return None
        index = {id(p): i for i, p in enumerate(self._inner_params())}
        try:
            entries = list(self.inner.state.items())  # the training thread may add entries (its first step)
        except RuntimeError:
            return None
        shared = {}
        for param, entry in entries:
            if id(param) not in index or not ADAM_ENTRIES <= entry.keys():  # not yet stepped (or being set up)
                continue
            shared[index[id(param)]] = {
                name: (torch.tensor(float(value), dtype=torch.float32) if name == "step"
                       else value.detach().to("cpu", torch.float32, copy=True))
                for name, value in list(entry.items()) if name == "step" or isinstance(value, torch.Tensor)}
        return shared or None

    def shareable_state_bound(self) -> int:
        """The most bytes a peer's ``shareable_state`` may take: θ_global, up to three outer-optimizer
        tensors per parameter, up to three Adam tensors per parameter (a donor's warm start), the buffers,
        and 16 MiB of framing. A larger download is refused."""
        values = sum(g.numel() for g in self.outer.global_params)
        buffers = sum(b.numel() for b in self.outer.buffers)
        inner = sum(p.numel() for p in self._inner_params()) if self._adam_betas() is not None else 0
        return 4 * (4 * values + 3 * inner + buffers) + (16 << 20)

    def _takes_inner(self) -> bool:
        """Whether this worker would start its inner optimizer from a donor's (a joiner's, with ``warm_start``)."""
        return self.warm_start and not self.inner.state and self._adam_betas() is not None

    def _reference(self, take_inner: bool = False) -> Reference:
        """What a peer's state must fit: this worker's model, outer optimizer settings and schedule (and its
        inner optimizer's parameters and settings, when it would take the donor's inner state)."""
        return Reference(global_params=self.outer.global_params,
                         buffers=[torch.empty(b.shape, dtype=torch.float32, device="meta") for b in self.outer.buffers],
                         param_groups=reference_groups(self.outer.optimizer, self.outer.global_params),
                         fragments=[f.params for f in self.fragments], local_steps=self.local_steps, pace=self.pace,
                         inner_params=self._inner_params(),
                         inner_betas=self._adam_betas() if take_inner else None,
                         inner_amsgrad=any(g.get("amsgrad", False) for g in self.inner.param_groups))

    def check_shareable_state(self, state: dict, min_outer_step: int | None = None,
                              expected_hash: str | None = None) -> None:
        """Raises ``StateRefused`` (a ``ValueError`` naming the donor) for a peer's state that
        ``load_shareable_state`` would refuse; changes nothing. What is checked: ``opendiloco.state_check``."""
        check_state(state, self._reference(self._takes_inner()), min_outer_step=min_outer_step,
                    expected_hash=expected_hash)

    @torch.no_grad()
    def load_shareable_state(self, state: dict, *, min_outer_step: int | None = None,
                             expected_hash: str | None = None, keep_local: list[torch.Tensor] | None = None) -> None:
        """Adopts a peer's θ_global and outer state; local weights restart from θ_global.

        Everything is checked before anything changes (``opendiloco.state_check``): θ_global's shapes,
        dtypes and fingerprint (against ``expected_hash``, or the ``confirmed_hash`` a download names),
        the outer optimizer's settings (they must be this worker's own, which stay) and per-parameter
        state (finite, bounded), the buffers, and the counters (at least ``min_outer_step``, and
        consistent with this worker's ``local_steps`` and pace). A refused state raises
        ``StateRefused``, a ``ValueError`` naming the donor.

        ``keep_local``: this worker's own pseudo-gradient; local weights restart from the new
        θ_global minus it (the work is carried, not lost), and this worker's counters stay its own.
        Under ``pace="fixed"`` a worker takes the peer's position in the round (its ``local_step``),
        so that it reaches the next outer step together with the group instead of holding it up.
        """
        # A download names the hash the run confirmed (``confirmed_hash``, set by the receiver, never the donor).
        expected_hash = expected_hash if expected_hash is not None else (
            state.get("confirmed_hash") if isinstance(state, dict) else None)
        reference = self._reference(take_inner=keep_local is None and self._takes_inner())
        check_state(state, reference, min_outer_step=min_outer_step, expected_hash=expected_hash)
        outer = {"global_params": state["outer"]["global_params"],
                 "optimizer": adoptable_optimizer_state(state, reference)}
        buffers = state.get("buffers", [])
        peer_local = state.get("local_step", 0)
        self._wait_pending()
        with self._state_lock:
            self.outer.load_state_dict(outer)
            for b, src in zip(self.outer.buffers, buffers):
                b.copy_(src)
            self._outer_step = state["outer_step"]
            self._local_step = 0
            if keep_local is not None:
                self.outer.restart_local(keep_local)
            else:
                self.outer.reset_local()
                self._clear_fragment_work()
                gap = self._gap(self._outer_step)
                self._local_step = min(peer_local, gap - 1) if self.pace == "fixed" else 0
                self._inner_steps_total = state["inner_steps_total"] + self._local_step
            self._pace_work = 0.0
            self._reset_residuals()  # owed against the θ_global this worker no longer holds
            if reference.inner_betas is not None and state.get("inner"):
                self._warm_start_from(state["inner"])
        self._global_changed()

    def _warm_start_from(self, inner: dict) -> None:
        """Takes a donor's (checked) Adam moments; this worker's own groups (lr, betas, ...) stay."""
        self.inner.load_state_dict({"state": inner, "param_groups": self.inner.state_dict()["param_groups"]})
        self.param_groups = self.inner.param_groups  # torch's load_state_dict rebuilds them: keep sharing
        self.state = self.inner.state
        self.warm_started = True
        log.info("warm start: the inner optimizer starts from the donor's moments (%d parameters)", len(inner))

    # -- checkpoints (the format and its checks: ``opendiloco.optimizer_state``) ------------------
    def state_dict(self) -> dict:
        """Inner and outer state, counters and the streaming schedule. A round still in flight is
        saved as this worker's contribution to it, and started again (same key) on load."""
        pending = self._saved_round()
        return {
            "inner": self.inner.state_dict(),
            "outer": self.outer.state_dict(),
            "local_step": self._local_step,
            "outer_step": self._outer_step,
            "inner_steps_total": self._inner_steps_total,
            **settings_of(self),
            "fragments": [list(f.params) for f in self.fragments],
            "pending": None if pending is None else pending.to_dict(),
            "fragment_work": [f.work for f in self.fragments],
            "pace_work": self._pace_work,
            "uncommitted_steps": self._uncommitted_steps,
            "contributed_steps": self._contributed_steps,
            "dropped_steps": self._dropped_steps,
            "error_feedback": {f.index: f.residual.clone() for f in self.fragments if f.residual is not None},
        }

    def _saved_round(self) -> SavedRound | None:
        r = self._pending
        if r is None:
            return None
        try:
            if r.prepared is not None:
                r.prepared.result()  # its contribution must be complete before it is copied
        except Exception as e:  # it failed to start: nothing to restart on load
            log.debug("round %s did not start: %s", r.key, e)
            return None
        return SavedRound(r.key.outer_step, r.fragment.index, r.steps, r.weight, r.own_finite,
                          r.fragment.buffers()[0].flat.clone())

    def load_state_dict(self, state_dict: dict) -> None:
        # Checked before anything changes, so a refused state dict leaves this optimizer as it was.
        checked = check_checkpoint(state_dict, settings=settings_of(self), global_params=self.outer.global_params,
                                   fragments=self.fragments)
        pending = checked.pending
        self._wait_pending()
        inner_backup = self.inner.state_dict()
        self.inner.load_state_dict(state_dict["inner"])
        try:
            self.outer.load_state_dict(state_dict["outer"])
        except Exception:
            self.inner.load_state_dict(inner_backup)
            raise
        finally:
            # torch's load_state_dict rebuilds param_groups: keep sharing them.
            self.param_groups = self.inner.param_groups
            self.state = self.inner.state
        for name, value in checked.counters.items():
            setattr(self, f"_{name}", value)
        for f, work in zip(self.fragments, checked.fragment_work):
            f.work = work
        self._reset_residuals()
        if self.error_feedback:
            for f, owed in checked.residuals.items():
                self.fragments[f].residuals()[0].copy_(owed)
        self._global_changed()  # θ_global was replaced: drop the cached hash
        if pending is not None:  # the round that was in flight starts again, under the same key
            fragment = self.fragments[pending.fragment]
            contribution, result = fragment.buffers()
            contribution.flat.copy_(pending.contribution)
            round_ = _Round(RoundKey(pending.outer_step, fragment.index), fragment, steps=pending.steps,
                            began=time.perf_counter(), weight=pending.weight, own_finite=pending.own_finite)
            try:
                round_.work = self._start(round_, contribution, result)
            except AveragingError as e:
                round_.work = CompletedWork(error=e)
            self._pending = round_

    def _reset_residuals(self) -> None:
        for f in self.fragments:
            f.reset_residual()

    def _wait_pending(self) -> None:
        """Lets a round in flight end (its outcome discarded) before state is replaced under it: its
        thread writes into this optimizer's buffers until then."""
        if self._pending is not None:
            try:
                self._pending.wait()
            except LocalRankFailure:
                self._pending = None
                raise
            except Exception as e:  # discarded anyway
                log.debug("discarded round %s: %s", self._pending.key, e)
            self._pending = None

    def __repr__(self) -> str:
        streaming = (f", fragments={self.num_fragments}, overlap={self.overlap}, mix={self.mix}"
                     if self.num_fragments > 1 or self.overlap else "")
        return (f"DiLoCoOptimizer(local_steps={self.local_steps}{streaming}, inner={type(self.inner).__name__}, "
                f"outer={type(self.outer.optimizer).__name__}, communicator={type(self.communicator).__name__})")
