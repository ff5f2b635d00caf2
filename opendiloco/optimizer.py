"""DiLoCoOptimizer: the inner and the outer optimizer in one drop-in replacement for AdamW."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time

import torch

from .comm.base import AverageResult, Communicator, RoundKey, SharedState
from .comm.compression import NoCompression
from .comm.local import SingleWorker
from .errors import AveragingError, BehindError, LocalRankFailure, SplitHold
from .fragment import Fragment, Round, RoundRules, SyncReport, check_average, check_wire_format, make_fragments
from .optimizer_state import Checkpointing, StateExchange
from .outer import OptimizerFactory, OuterState, averaged_buffers, fragmented_hash
from .pacing import PACES, Pace, retry_delay, round_due, seconds_to_target
from .staging import DeviceSnapshot
from .streaming import cut_fragments, event_gap, event_start, fragment_of

__all__ = ["DiLoCoOptimizer", "SyncReport", "default_inner_optimizer", "default_outer_optimizer"]

log = logging.getLogger(__name__)

default_inner_optimizer = functools.partial(torch.optim.AdamW, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
default_outer_optimizer = functools.partial(torch.optim.SGD, lr=0.4, momentum=0.9, nesterov=True)


class DiLoCoOptimizer(Checkpointing, StateExchange, torch.optim.Optimizer):
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
        trainable = self._build_optimizers(params, inner_optimizer, outer_optimizer, module)
        self.fragments: list[Fragment] = make_fragments(cut_fragments(trainable, fragments, local_steps, overlap, mix),
                                                        self.outer)
        self.local_steps, self.overlap, self.mix, self.pace = local_steps, overlap, float(mix), pace
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.warm_started = False
        """Whether this worker's inner optimizer started from a donor's state (``warm_start``)."""
        self.communicator = communicator if communicator is not None else SingleWorker()
        codec = self.communicator.wire_format or NoCompression()
        check_wire_format(codec, error_feedback=self.error_feedback, buffers=bool(self.outer.buffers),
                          error_decay=error_decay)
        self.error_decay = error_decay
        """SparseLoCo's rule (top-k): the unsent owed in a residual decayed by this, θ_local reset; None: in
        the weights."""
        self._wire_format = codec
        self.weight_by_samples = weight_by_samples or pace == "swarm"
        self.catch_up_timeout = catch_up_timeout
        # Held while θ_global changes, so state served to a joiner from another thread is never torn.
        self._state_lock = threading.RLock()
        self._start_counters()
        # The communicator serves our state, and bounds and checks what it downloads for us (so that it can
        # go on to another donor when one serves a state we would refuse).
        self.communicator.attach_state_provider(SharedState(self.shareable_state, self.shareable_state_bound(),
                                                            self.check_shareable_state))
        self._global_changed()  # the swarm learns our outer step (and θ_global hash) at once

    def _build_optimizers(self, params, inner_optimizer: OptimizerFactory, outer_optimizer: OptimizerFactory,
                          module: torch.nn.Module | None) -> list[torch.Tensor]:
        """The inner optimizer (whose groups and state this one shares) and the outer state over the
        trainable parameters (returned) and the module's averaged buffers."""
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
        self.outer = OuterState(trainable, averaged_buffers(module) if module is not None else [], outer_optimizer)
        return trainable

    @property
    def _rules(self) -> RoundRules:
        """What this optimizer's rounds follow (read when one starts or lands: the communicator may be replaced)."""
        return RoundRules(self.communicator, self._wire_format, self.error_feedback, self.error_decay, self.mix,
                          self.num_fragments)

    def _start_counters(self) -> None:
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
        self._pending: Round | None = None
        self._snapshot: DeviceSnapshot | None = None
        self._schedule_high = 0
        self.blocked_s = 0.0
        """Seconds the last ``step()`` spent on outer-step work (starting or landing a round, waiting
        for one) after the inner step: what a loop should count as time not training."""

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
        """Starts the round of the event's fragment (its contribution: this worker's pseudo-gradient)."""
        began = time.perf_counter()
        event = self._outer_step
        fragment = self.fragments[fragment_of(event, self.num_fragments)]
        self._publish_pace(ready=True)  # peers pacing themselves stop counting on our work growing
        round_ = Round(RoundKey(event, fragment.index), fragment, steps=self._local_step, began=began)
        snapshot = None
        if self.overlap > 0 and fragment.on_cuda():
            snapshot = self._snapshot = self._snapshot or DeviceSnapshot()
        fragment.prepare_sync(self._rules, round_, fragment.work if self.weight_by_samples else 1.0, snapshot)
        round_.blocked_s = time.perf_counter() - began
        self._pending = round_
        self._local_step = 0
        self._pace_work = 0.0

    def _finish_round(self) -> SyncReport:
        """Waits for the round in flight and applies it to its fragment (or handles its failure)."""
        # ``_pending`` stays set until the round has landed or failed: a joiner served state in the
        # meantime must know that this round has started here.
        round_ = self._pending
        began = time.perf_counter()
        try:
            result = round_.wait()
            communicator_s = time.perf_counter() - round_.began  # the round itself, not the checks after it
            check_average(result.flat, round_.fragment.buffers()[0].numel)
        except BehindError as e:
            self._pending = None
            report = self._catch_up(e, time.perf_counter() - round_.began, round_.own_finite)
        except AveragingError as e:
            self._pending = None
            report = self._round_failed(str(e), time.perf_counter() - round_.began, round_.own_finite)
            if isinstance(e, SplitHold):
                report.extra["held"] = True
        else:
            report = self._land(round_, result, communicator_s=communicator_s)
        if not report.ok:
            self._publish_pace()
        report.steps, report.weight, report.fragment = round_.steps, round_.weight, round_.fragment.index
        report.seconds = round_.blocked_s + time.perf_counter() - began
        self.last_sync = report
        return report

    def _land(self, round_: Round, result: AverageResult, communicator_s: float) -> SyncReport:
        """The round succeeded: its fragment takes the group's average, and the outer step moves on."""
        with self._state_lock:
            round_.fragment.perform_sync(self._rules, round_, result.flat)
            self._outer_step += 1
            self._pending = None
        report = SyncReport(self._outer_step, True, group_size=result.group_size, peers=result.peers,
                            allreduce_s=communicator_s, contributed_steps=self._uncommitted_steps, extra=result.extra)
        self._contributed_steps += self._uncommitted_steps
        self._uncommitted_steps = 0
        self._global_changed(round_.fragment)  # publishes the fresh pace with the new outer step
        report.global_hash = self.global_hash()
        return report

    # -- contributions -------------------------------------------------------------------------
    def error_residual(self, fragment: int = 0) -> torch.Tensor | None:
        """Error feedback: what the wire format has lost so far of this fragment's contributions, owed
        to its next one (flat, parameters then buffers; None before the fragment's first round)."""
        return self.fragments[fragment].residual

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
