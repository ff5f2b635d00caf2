"""DiLoCoOptimizer: the inner and the outer optimizer in one drop-in replacement for AdamW."""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from .comm.base import Communicator, RoundKey
from .comm.buffers import FlatBuffer, all_finite, unflatten
from .comm.local import SingleWorker
from .errors import AveragingError, BehindError, DriftError
from .outer import OptimizerFactory, OuterState, tensors_hash, validate_tensors

log = logging.getLogger(__name__)

default_inner_optimizer = functools.partial(torch.optim.AdamW, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
default_outer_optimizer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


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
    extra: dict = field(default_factory=dict)


class DiLoCoOptimizer(torch.optim.Optimizer):
    """Inner optimizer every step, outer optimizer every ``local_steps`` inner steps.

    Use it where ``torch.optim.AdamW`` was: ``param_groups`` are the inner optimizer's, so lr
    schedulers drive the inner lr, and ``GradScaler`` can skip a step (a skipped step does not
    count towards ``local_steps``). Pass ``module=`` to also average the module's floating
    buffers (e.g. BatchNorm running statistics) at each outer step.
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
    ):
        if not isinstance(local_steps, int) or isinstance(local_steps, bool) or local_steps < 1:
            raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}")
        params = list(params) if not isinstance(params, torch.Tensor) else [params]
        if not params:
            raise ValueError("DiLoCoOptimizer got an empty parameter list")
        self.inner = inner_optimizer(params)
        super().__init__(self.inner.param_groups, dict(self.inner.defaults))
        # Share, not copy: schedulers and GradScaler act on the inner optimizer's groups and state.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad and p.is_floating_point()]
        buffers = [b for b in module.buffers() if b.is_floating_point()] if module is not None else []
        self.outer = OuterState(trainable, buffers, outer_optimizer)
        self.local_steps = local_steps
        self.communicator = communicator if communicator is not None else SingleWorker()
        self.weight_by_samples = weight_by_samples
        self.catch_up_timeout = catch_up_timeout
        # Held while θ_global changes, so state served to a joiner from another thread is never torn.
        self._state_lock = threading.RLock()
        self._hash: str | None = None
        self._local_step = 0
        self._outer_step = 0
        self._inner_steps_total = 0
        self._samples_since_sync = 0
        self.last_sync: SyncReport | None = None
        self._buffer: FlatBuffer | None = None
        """This worker's contribution: [pseudo-gradients, buffers], flat fp32 (pinned for CUDA models)."""
        self._result: FlatBuffer | None = None
        """The group's average lands here."""
        self.communicator.attach_state_provider(self.shareable_state)
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
    def inner_steps_total(self) -> int:
        return self._inner_steps_total

    def count_samples(self, n: int) -> None:
        """Tells the optimizer how many samples the last inner step saw (for weighted averaging)."""
        self._samples_since_sync += int(n)

    def global_hash(self) -> str:
        """Short hash of θ_global's exact bytes (cached; recomputed after each change)."""
        if self._hash is None:
            with self._state_lock:
                self._hash = self.outer.global_hash()
        return self._hash

    def _global_changed(self) -> None:
        self._hash = None
        self.communicator.report_progress(outer_step=self._outer_step, global_hash=self.global_hash())

    # -- the torch.optim.Optimizer surface ---------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.inner.step(closure)
        self._local_step += 1
        self._inner_steps_total += 1
        if self._local_step >= self.local_steps:
            self.sync()
        return loss

    # -- the outer step ----------------------------------------------------------------------
    def sync(self) -> SyncReport:
        """Averages pseudo-gradients with the group and applies one outer step (called by ``step``)."""
        began = time.perf_counter()
        flat, weight, own_finite = self._contribution()
        start = time.perf_counter()
        try:
            result = self.communicator.start(flat, weight=weight, key=RoundKey(self._outer_step),
                                             out=self._result.flat).wait()
            communicator_s = time.perf_counter() - start
            averaged = result.flat
            if averaged.numel() != flat.numel() or averaged.dtype != torch.float32:
                raise AveragingError(f"the averaged vector has {averaged.numel()} {averaged.dtype} values, "
                                     f"expected {flat.numel()} float32")
            if not all_finite(averaged):
                raise AveragingError("the averaged pseudo-gradient is not finite; refused")
        except BehindError as e:
            report = self._catch_up(e, time.perf_counter() - start)
        except AveragingError as e:
            report = self._round_failed(str(e), time.perf_counter() - start, own_finite)
        else:
            n = self.outer.num_params
            views = unflatten(averaged, self._buffer.views)
            with self._state_lock:
                self.outer.apply(views[:n], views[n:])
                self._outer_step += 1
            self._global_changed()
            report = SyncReport(self._outer_step, True, group_size=result.group_size, peers=result.peers,
                                allreduce_s=communicator_s, global_hash=self.global_hash(),
                                extra=result.extra)
        self._local_step = 0
        self._samples_since_sync = 0
        report.seconds = time.perf_counter() - began
        self.last_sync = report
        return report

    def _contribution(self) -> tuple[torch.Tensor, float, bool]:
        """This worker's flat [pseudo-gradients, buffers] in a reused fp32 buffer, its weight, and finiteness."""
        if self._buffer is None:  # allocated once: later rounds write into pages already in memory
            like = self.outer.params + self.outer.buffers
            self._buffer = FlatBuffer(like)  # pinned when the model is on CUDA
            self._result = FlatBuffer(like, pin=False)
        n = self.outer.num_params
        self.outer.pseudo_gradient_into(self._buffer.views[:n])
        self.outer.buffer_values_into(self._buffer.views[n:])
        flat = self._buffer.flat
        weight = float(self._samples_since_sync) if self.weight_by_samples else 1.0
        own_finite = all_finite(flat)
        if not own_finite:
            log.warning("outer step %d: own pseudo-gradient is not finite; contributing zeros with weight 0",
                        self._outer_step)
            flat.zero_()
            weight = 0.0
        return flat, weight, own_finite

    def _round_failed(self, reason: str, seconds: float, own_finite: bool) -> SyncReport:
        log.warning("outer step %d failed, θ_global kept: %s", self._outer_step, reason)
        if not own_finite:
            self.outer.reset_local()  # local weights are poisoned: start over from θ_global
        return SyncReport(self._outer_step, False, allreduce_s=seconds, global_hash=self.global_hash(),
                          reason=reason)

    def _catch_up(self, err: BehindError, seconds: float) -> SyncReport:
        log.warning("outer step %d: %s; loading state from a peer", self._outer_step, err)
        majority = err.majority_hash if isinstance(err, DriftError) else None
        try:
            timeout = min(self.catch_up_timeout, err.timeout or self.catch_up_timeout)
            state = self.communicator.download_state(
                timeout, min_outer_step=err.group_outer_step, max_bytes=self.shareable_state_bound(),
                majority_hash=majority)
            if state is None:
                raise AveragingError("no live peer to download state from")
            self.load_shareable_state(state, min_outer_step=err.group_outer_step, expected_hash=majority)
        except Exception as e:  # a peer's state is input from the network: any defect is a failed catch-up
            return self._round_failed(f"{err}; could not catch up: {type(e).__name__}: {e}", seconds, True)
        drift = isinstance(err, DriftError)
        return SyncReport(self._outer_step, False, allreduce_s=seconds, global_hash=self.global_hash(),
                          reason="healed drift from a peer" if drift else "caught up from a peer",
                          extra={"caught_up": True})

    # -- state for joiners -------------------------------------------------------------------
    def shareable_state(self) -> dict:
        """What a late joiner needs: θ_global, outer optimizer state, counters. Never inner state.

        ``inner_steps_total`` is the count at the last outer step, the point θ_global stands for:
        a joiner then takes exactly ``local_steps`` inner steps before its first outer step.
        """
        with self._state_lock:  # copies, so that serving it later never races an outer step
            return {
                "outer": copy.deepcopy(self.outer.state_dict()),
                "outer_step": self._outer_step,
                "inner_steps_total": self._inner_steps_total - self._local_step,
                "buffers": self.outer.buffer_values(),
            }

    def shareable_state_bound(self) -> int:
        """The most bytes a peer's ``shareable_state`` may take: θ_global, up to three outer-optimizer
        tensors per parameter, the buffers, and 16 MiB of framing. A larger download is refused."""
        values = sum(g.numel() for g in self.outer.global_params)
        buffers = sum(b.numel() for b in self.outer.buffers)
        return 4 * (4 * values + buffers) + (16 << 20)

    @torch.no_grad()
    def load_shareable_state(self, state: dict, *, min_outer_step: int | None = None,
                             expected_hash: str | None = None) -> None:
        """Adopts a peer's θ_global and outer state; local weights restart from θ_global.

        Everything is checked before anything changes: fields, counters (at least
        ``min_outer_step``), shapes and dtypes, and θ_global's fingerprint if ``expected_hash``.
        """
        if not isinstance(state, dict) or not {"outer", "outer_step", "inner_steps_total"} <= state.keys():
            raise ValueError("peer state is missing required fields")
        if not all(isinstance(state[k], int) and state[k] >= 0 for k in ("outer_step", "inner_steps_total")):
            raise ValueError("peer state has invalid step counters")
        if min_outer_step is not None and state["outer_step"] < min_outer_step:
            raise ValueError(f"peer state is at outer step {state['outer_step']}, not yet {min_outer_step}")
        outer = state["outer"]
        if not isinstance(outer, dict) or not {"global_params", "optimizer"} <= outer.keys():
            raise ValueError("peer state's outer part needs 'global_params' and 'optimizer'")
        validate_tensors(outer["global_params"], self.outer.global_params, "global_params")
        if expected_hash is not None and tensors_hash(outer["global_params"]) != expected_hash:
            raise ValueError(f"peer state's θ_global is not the majority's {expected_hash}")
        buffers = state.get("buffers", [])
        validate_tensors(buffers, self.outer.buffer_values(), "buffers")
        with self._state_lock:
            self.outer.load_state_dict(state["outer"])
            for b, src in zip(self.outer.buffers, buffers):
                b.copy_(src)
            self._outer_step = state["outer_step"]
            self._inner_steps_total = state["inner_steps_total"]
            self._local_step = 0
            self._samples_since_sync = 0
            self.outer.reset_local()
        self._global_changed()

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "inner": self.inner.state_dict(),
            "outer": self.outer.state_dict(),
            "local_step": self._local_step,
            "outer_step": self._outer_step,
            "inner_steps_total": self._inner_steps_total,
            "samples_since_sync": self._samples_since_sync,
            "local_steps": self.local_steps,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"inner", "outer", "local_step", "outer_step", "inner_steps_total"} - state_dict.keys()
        if missing:
            raise ValueError(f"DiLoCoOptimizer state_dict is missing {sorted(missing)}")
        outer = state_dict["outer"]
        if not isinstance(outer, dict) or not {"global_params", "optimizer"} <= outer.keys():
            raise ValueError("DiLoCoOptimizer state_dict['outer'] needs 'global_params' and 'optimizer'")
        # Validate before touching anything, so a refused state dict leaves this optimizer as it was.
        validate_tensors(outer["global_params"], self.outer.global_params, "outer.global_params")
        inner_backup = self.inner.state_dict()
        self.inner.load_state_dict(state_dict["inner"])
        try:
            self.outer.load_state_dict(outer)
        except Exception:
            self.inner.load_state_dict(inner_backup)
            raise
        finally:
            # torch's load_state_dict rebuilds param_groups: keep sharing them.
            self.param_groups = self.inner.param_groups
            self.state = self.inner.state
        self._local_step = int(state_dict["local_step"])
        self._outer_step = int(state_dict["outer_step"])
        self._inner_steps_total = int(state_dict["inner_steps_total"])
        self._samples_since_sync = int(state_dict.get("samples_since_sync", 0))
        self._global_changed()  # θ_global was replaced: drop the cached hash

    def __repr__(self) -> str:
        return (f"DiLoCoOptimizer(local_steps={self.local_steps}, inner={type(self.inner).__name__}, "
                f"outer={type(self.outer.optimizer).__name__}, communicator={type(self.communicator).__name__})")
