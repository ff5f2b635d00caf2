"""A ``DiLoCoOptimizer``'s state: what it saves in a checkpoint, what it serves joiners, and how it
adopts a peer's.

A checkpoint holds the inner and outer optimizers' state, the counters, the schedule it was saved
under, the round that was in flight (as this worker's contribution to it, started again on load)
and error feedback's residuals. Loading checks everything first, so a refused checkpoint leaves the
optimizer as it was, and says in one line what does not fit. What a joiner gets from a peer is a
different, smaller state (θ_global, the outer state, counters), checked by ``opendiloco.state_check``
before anything is adopted. ``Checkpointing`` and ``StateExchange`` are the optimizer's methods for
these, mixed into ``DiLoCoOptimizer`` (they use its counters and settings).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .comm.base import CompletedWork, RoundKey
from .comm.buffers import all_finite
from .errors import AveragingError, BehindError, DriftError, LocalRankFailure, RoundCounted
from .fragment import Fragment, Round, SyncReport
from .outer import validate_tensors
from .state_check import ADAM_ENTRIES, Reference, adoptable_optimizer_state, check_state, reference_groups

log = logging.getLogger(__name__)

SETTINGS = ("local_steps", "pace", "overlap", "mix", "inner_kind")
"""Settings a checkpoint must share with the optimizer that loads it: its counters and its round in
flight only mean something under the same schedule, and its inner state only for the same inner
optimizer."""

REQUIRED = frozenset({"inner", "outer", "local_step", "outer_step", "inner_steps_total"})


@dataclass(frozen=True)
class SavedRound:
    """The round that was in flight when a checkpoint was saved: this worker's contribution to it."""

    outer_step: int
    fragment: int
    steps: int
    weight: float
    own_finite: bool
    contribution: torch.Tensor

    def to_dict(self) -> dict:
        return {"outer_step": self.outer_step, "fragment": self.fragment, "steps": self.steps,
                "weight": self.weight, "own_finite": self.own_finite, "contribution": self.contribution}


def settings_of(optimizer) -> dict:
    return {name: getattr(optimizer, name) for name in SETTINGS}


@dataclass(frozen=True)
class Checked:
    """What a checked state dict restores besides the optimizers' own state."""

    pending: SavedRound | None
    residuals: dict[int, torch.Tensor]
    counters: dict
    fragment_work: list[float]


def check_checkpoint(state_dict: dict, *, settings: dict, global_params: Sequence[torch.Tensor],
                     fragments: Sequence[Fragment]) -> Checked:
    """Raises ``ValueError`` (one line) for a state dict that does not fit an optimizer with these
    ``settings``, parameters and fragments; returns what it restores besides the optimizers, checked."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"DiLoCoOptimizer state_dict must be a dict, got {type(state_dict).__name__}")
    missing = REQUIRED - state_dict.keys()
    if missing:
        raise ValueError(f"DiLoCoOptimizer state_dict is missing {sorted(missing)}")
    outer = state_dict["outer"]
    if not isinstance(outer, dict) or not {"global_params", "optimizer"} <= outer.keys():
        raise ValueError("DiLoCoOptimizer state_dict['outer'] needs 'global_params' and 'optimizer'")
    validate_tensors(outer["global_params"], global_params, "outer.global_params")
    differ = [f"{name} {state_dict[name]!r} (this optimizer: {settings[name]!r})"
              for name in SETTINGS if name in state_dict and state_dict[name] != settings[name]]
    if differ:
        raise ValueError("the state dict was saved with other settings: " + ", ".join(differ)
                         + "; resume with the same ones")
    saved = state_dict.get("fragments", [list(range(len(global_params)))])
    if saved != [f.params for f in fragments]:
        raise ValueError(f"the state dict was saved with {len(saved)} fragment(s) cut differently; this optimizer "
                         f"has {len(fragments)}: resume with the same fragments")
    pending = _saved_round(state_dict.get("pending"), fragments)
    residuals = state_dict.get("error_feedback") or {}
    if not isinstance(residuals, dict) or not all(
            isinstance(f, int) and 0 <= f < len(fragments) for f in residuals):
        raise ValueError("DiLoCoOptimizer state_dict['error_feedback'] must map fragments to residuals")
    for f, owed in residuals.items():
        validate_tensors([owed], [fragments[f].buffers()[0].flat], f"error_feedback[{f}]")
    try:
        restored = counters(state_dict)
        work = fragment_work(state_dict, len(fragments))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"DiLoCoOptimizer state_dict has a malformed counter: {e}") from None
    if len(work) != len(fragments) or not all(math.isfinite(w) and w >= 0 for w in work):
        raise ValueError(f"DiLoCoOptimizer state_dict['fragment_work'] must hold {len(fragments)} finite, "
                         "non-negative numbers")
    if any(v < 0 for v in restored.values()) or not math.isfinite(restored["pace_work"]):
        raise ValueError("DiLoCoOptimizer state_dict has a negative or non-finite counter")
    return Checked(pending, residuals, restored, work)


def _saved_round(pending, fragments: Sequence[Fragment]) -> SavedRound | None:
    if pending is None:
        return None
    try:
        fragment = int(pending["fragment"])
        if not 0 <= fragment < len(fragments):
            raise ValueError(f"fragment {fragment} of {len(fragments)}")
        saved = SavedRound(int(pending["outer_step"]), fragment, int(pending["steps"]), float(pending["weight"]),
                           bool(pending["own_finite"]), pending["contribution"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"DiLoCoOptimizer state_dict['pending'] is malformed: {e}") from None
    validate_tensors([saved.contribution], [fragments[fragment].buffers()[0].flat], "pending contribution")
    return saved


def counters(state_dict: dict) -> dict:
    """The counters a state dict restores; older checkpoints lack the later ones, which start from its
    ``local_step`` (all work since the last outer step is uncommitted) or from zero."""
    local = int(state_dict["local_step"])
    return {
        "local_step": local,
        "outer_step": int(state_dict["outer_step"]),
        "inner_steps_total": int(state_dict["inner_steps_total"]),
        "pace_work": float(state_dict.get("pace_work", local)),
        "uncommitted_steps": int(state_dict.get("uncommitted_steps", local)),
        "contributed_steps": int(state_dict.get("contributed_steps", 0)),
        "dropped_steps": int(state_dict.get("dropped_steps", 0)),
    }


def fragment_work(state_dict: dict, num_fragments: int) -> list[float]:
    work = state_dict.get("fragment_work", [float(state_dict["local_step"])] * num_fragments)
    return [float(w) for w in work]


def joiner_position(inner_steps_total: int, local_step: int, gap: int, *, in_flight: bool,
                    fixed: bool) -> tuple[int, int]:
    """(inner steps at the last outer step, position in the round) that a joiner is served.

    θ_global stands for the last outer step, so a joiner then takes exactly ``local_steps`` inner steps
    before its first outer step. While a round has started here and not landed, the joiner holds
    θ_global without it: it is placed one step before that round's start, to take part in it if the
    group is still forming. Under ``pace="fixed"`` a state read between the inner step that makes a
    round due and the round's start is placed just before it too.
    """
    base, local = inner_steps_total - local_step, local_step
    if in_flight:
        base, local = base - gap, gap - 1
    elif fixed:
        local = min(local, gap - 1)
    return max(0, base), local


class Checkpointing:
    """``DiLoCoOptimizer.state_dict`` and ``load_state_dict``: the format above, checked before it is loaded."""

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
            fragment.buffers()[0].flat.copy_(pending.contribution)
            round_ = Round(RoundKey(pending.outer_step, fragment.index), fragment, steps=pending.steps,
                           began=time.perf_counter(), weight=pending.weight, own_finite=pending.own_finite)
            try:
                round_.work = fragment.start_round(self._rules, round_)
            except AveragingError as e:
                round_.work = CompletedWork(error=e)
            self._pending = round_

    def _reset_residuals(self) -> None:
        for f in self.fragments:
            f.reset_residual()


class StateExchange:
    """``DiLoCoOptimizer``'s side of state transfer: what it serves a joiner (θ_global, the outer state,
    counters; with ``warm_start`` its Adam moments), the checks a peer's state passes before it is
    adopted, and how a worker that a round left behind catches up from a peer."""

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

    # -- catching up after a round --------------------------------------------------------------
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
