"""What a worker checks before it adopts a peer's state (``DiLoCoOptimizer.load_shareable_state``).

A downloaded state is one donor's word. Everything a joiner takes from it is either confirmed by
the run or checked against the joiner's own configuration, and the state is refused as a whole
(``StateRefused``, naming the donor) before anything changes:

- **θ_global**: this model's shapes and dtypes, finite, and its fingerprint the hash the run
  confirmed (``expected_hash``: set by the receiver from the run's votes, never by the donor).
- **The outer optimizer's settings**: every ``param_groups`` setting (lr, momentum, dampening,
  nesterov, weight_decay, maximize, betas, ...) must equal this worker's own, and the groups must
  hold the same parameters. Switches that pick an implementation, not the arithmetic
  (``IMPLEMENTATION_SETTINGS``), are not compared. Either way the groups loaded are this worker's own.
- **The outer optimizer's per-parameter state**: entries for this worker's parameters only;
  tensors of the parameter's shape and dtype, finite; a ``step`` count a whole number between 0
  and the outer step (an outer optimizer steps each parameter at most once per outer step); a
  momentum buffer whose reach, ``lr · momentum · max|buffer|`` (how far it alone moves a weight in
  the next outer step), is at most ``MOMENTUM_REACH`` times θ_global's largest weight.
- **The module's buffers**: shapes, dtypes, finite.
- **The counters**: ``outer_step`` at least ``min_outer_step``; ``inner_steps_total`` within
  ``MAX_STEPS_RATIO`` of the steps the run's schedule takes to reach that outer step (and under
  ``pace="fixed"`` at least those, less one round); ``local_step`` (the donor's position in its
  round, which a ``pace="fixed"`` joiner takes) below the round's gap.

- **The inner optimizer's state** (a warm start, optional): served only by donors that share it and
  taken only by a joiner whose inner optimizer has no state yet. Adam's per-parameter state alone
  (``step``, ``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` exactly when the joiner uses amsgrad),
  complete, for this worker's parameters, of their shapes, finite; ``step`` a whole number from 1
  within the bound on ``inner_steps_total``; second moments not negative (``max_exp_avg_sq`` not below
  them); and first moments within ``ADAM_REACH`` of what Adam's own averages allow against the second
  after that many steps (``adam_moment_ratio``), so that a served moment moves no weight in one step
  much farther than an honest one could. A second moment too large is not refused: it slows the
  joiner's own first steps only.

What this does not decide: which state the run confirms (``swarm/quorum.py``), and whether a
momentum within the bound is the run's (see docs/trust.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .outer import fragmented_hash, validate_optimizer_state, validate_tensors
from .streaming import event_gap, event_start

IMPLEMENTATION_SETTINGS = frozenset({"foreach", "fused", "differentiable", "capturable"})
"""Optimizer settings that choose a kernel, not a result: a donor's may differ from ours."""

MOMENTUM_REACH = 10.0
"""How far, in units of θ_global's largest weight, a downloaded momentum buffer may move a weight on
its own in the next outer step. An honest run stays below 1: an outer step that moved weights by more
than the largest of them would be a diverging run. Measured: at most 0.034 over the first 8 outer
steps of configs/tiny.toml, 0.46 for the swarm tests' MLP at inner lr 3e-2, H = 50, outer lr 0.7.
1e30 is refused; a poisoned momentum below this bound is not (docs/trust.md, "Not yet defended")."""

MAX_STEPS_RATIO = 16
"""A donor's ``inner_steps_total`` may be at most this many times the steps the run's schedule takes
to reach its outer step (plus one round). Honest surplus comes from failed rounds (``pace="fixed"``:
each adds one round of steps) and from workers faster than the group (``pace="swarm"``)."""


ADAM_ENTRIES = frozenset({"step", "exp_avg", "exp_avg_sq"})
"""The per-parameter entries of ``torch.optim.Adam``/``AdamW`` (``max_exp_avg_sq`` too with amsgrad): the
only inner state a joiner takes, and only complete."""

ADAM_REACH = 2.0
"""Margin over ``adam_moment_ratio`` for a served first moment (a donor copies its moments while it
steps, so the two may be a step apart)."""


def adam_moment_ratio(beta1: float, beta2: float, steps: int | None = None) -> float:
    """The largest |m| / sqrt(v) Adam's averages allow after ``steps`` updates (None: any number), for
    any gradients. With m = (1-β1) Σ_k<t β1^k g_k and v = (1-β2) Σ_k<t β2^k g_k², Cauchy-Schwarz gives
    |m| <= (1-β1) / sqrt(1-β2) · sqrt(Σ_k<t q^k) · sqrt(v), q = β1²/β2: 1 after one step (the update
    Adam makes then is lr·sign(g)), 1.17 in the limit for (0.9, 0.95). Bias correction scales m and v
    alike for a given step, so a state within this bound makes an update no larger than an honest one."""
    q = beta1 * beta1 / beta2
    if steps is None:
        if q >= 1:
            return math.inf
        total = 1 / (1 - q)
    else:
        total = float(steps) if q == 1 else (1 - q ** steps) / (1 - q)
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(total)


class StateRefused(ValueError):
    """A peer's state that this worker will not adopt; the message names the donor when known."""


@dataclass(frozen=True)
class Reference:
    """This worker's own side of the check: what a state must fit."""

    global_params: Sequence[torch.Tensor]
    """θ_global's tensors (shapes and dtypes)."""
    buffers: Sequence[torch.Tensor]
    """The module's buffers as they travel (fp32; meta tensors will do)."""
    param_groups: list[dict]
    """The outer optimizer's groups as in its ``state_dict`` (``params`` as indices into θ_global)."""
    fragments: Sequence[Sequence[int]]
    local_steps: int
    pace: str
    inner_params: Sequence[torch.Tensor] = ()
    """The inner optimizer's parameters, in its ``state_dict`` order (empty: no inner state is taken)."""
    inner_betas: tuple[float, float] | None = None
    """The inner optimizer's Adam betas (None: no inner state is taken: it is no Adam, or it is not a
    joiner's that would take one)."""
    inner_amsgrad: bool = False


def reference_groups(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[dict]:
    """``optimizer``'s groups with parameters as indices into ``params``, as ``state_dict`` packs them
    (built without ``state_dict``: it reads the state, which another thread may be stepping)."""
    index = {id(p): i for i, p in enumerate(params)}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


def _donor_name(state) -> str:
    donor = state.get("donor") if isinstance(state, dict) else None
    return f"donor {donor[-8:]}" if isinstance(donor, str) and donor else "the peer"


def check_state(state, ref: Reference, *, min_outer_step: int | None = None,
                expected_hash: str | None = None) -> None:
    """Raises ``StateRefused`` (naming the donor) unless ``state`` may be adopted as it is."""
    try:
        _check(state, ref, min_outer_step, expected_hash)
    except StateRefused:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # malformed in a way a check did not name
        raise _refuse(state, f"malformed: {type(e).__name__}: {e}") from None


def adoptable_optimizer_state(state: dict, ref: Reference) -> dict:
    """The outer optimizer state to load from a checked ``state``: the donor's per-parameter state,
    this worker's own groups."""
    return {"state": state["outer"]["optimizer"]["state"], "param_groups": [dict(g) for g in ref.param_groups]}


def _refuse(state, reason: str) -> StateRefused:
    return StateRefused(f"refused the state of {_donor_name(state)}: {reason}")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check(state, ref: Reference, min_outer_step, expected_hash) -> None:
    if not isinstance(state, dict) or not {"outer", "outer_step", "inner_steps_total"} <= state.keys():
        raise _refuse(state, "peer state is missing required fields")
    outer_step, total = state["outer_step"], state["inner_steps_total"]
    if not (_count(outer_step) and _count(total)):
        raise _refuse(state, "peer state has invalid step counters")
    if min_outer_step is not None and outer_step < min_outer_step:
        raise _refuse(state, f"peer state is at outer step {outer_step}, not yet {min_outer_step}")
    outer = state["outer"]
    if not isinstance(outer, dict) or not {"global_params", "optimizer"} <= outer.keys():
        raise _refuse(state, "peer state's outer part needs 'global_params' and 'optimizer'")
    _tensors(state, outer["global_params"], ref.global_params, "global_params")
    if expected_hash is not None and fragmented_hash(outer["global_params"], ref.fragments) != expected_hash:
        raise _refuse(state, f"peer state's θ_global is not the one the run confirmed ({expected_hash})")
    _tensors(state, state.get("buffers", []), ref.buffers, "buffers")
    _counters(state, ref, outer_step, total)
    _settings(state, outer["optimizer"], ref)
    _per_parameter(state, outer["optimizer"], ref, outer["global_params"], outer_step)
    if state.get("inner") is not None and ref.inner_betas is not None:
        _inner(state, state["inner"], ref, _most_steps(ref, outer_step))


def _most_steps(ref: Reference, outer_step: int) -> int:
    """The most inner steps a worker may credibly have taken by ``outer_step`` (and in the round after it)."""
    scheduled = event_start(outer_step - 1, ref.local_steps, len(ref.fragments))  # steps the run takes to get there
    return MAX_STEPS_RATIO * (scheduled + ref.local_steps)


def _inner(state, inner, ref: Reference, most: int) -> None:
    """A served inner optimizer state: Adam's entries, complete, for this worker's parameters, bounded."""
    if not isinstance(inner, dict):
        raise _refuse(state, "the inner optimizer state is not a mapping")
    beta1, beta2 = ref.inner_betas
    expected = ADAM_ENTRIES | ({"max_exp_avg_sq"} if ref.inner_amsgrad else set())
    for index, entry in inner.items():
        if not (isinstance(index, int) and 0 <= index < len(ref.inner_params)) or not isinstance(entry, dict):
            raise _refuse(state, f"the inner optimizer state has an unexpected entry {index!r}")
        if entry.keys() != expected:  # a partial entry would crash the joiner's first step
            raise _refuse(state, f"inner optimizer state[{index}] has {sorted(map(str, entry))}, not Adam's "
                                 f"{sorted(expected)}")
        where = f"inner optimizer state[{index}]"
        value = entry["step"]
        step = float(value) if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool) and (
            not isinstance(value, torch.Tensor) or value.numel() == 1) else math.nan
        if not (math.isfinite(step) and step == int(step) and 1 <= step <= most):
            raise _refuse(state, f"{where}.step is {step}: between 1 and {most} (the run's schedule) accepted")
        like = torch.empty(ref.inner_params[index].shape, dtype=torch.float32, device="meta")
        for name in sorted(expected - {"step"}):
            _tensors(state, [entry[name]], [like], f"{where}.{name}")
        first, second = entry["exp_avg"], entry["exp_avg_sq"]
        if float(second.min()) < 0:
            raise _refuse(state, f"{where}.exp_avg_sq is negative")
        if "max_exp_avg_sq" in entry and bool((entry["max_exp_avg_sq"] < second).any()):
            raise _refuse(state, f"{where}.max_exp_avg_sq is below exp_avg_sq")
        ratio = ADAM_REACH * adam_moment_ratio(beta1, beta2, int(step))
        # |m| <= ratio * sqrt(v), with a floor for values at fp32's resolution
        if float((first.abs() - ratio * second.sqrt() - 1e-30).max()) > 0:
            raise _refuse(state, f"{where}.exp_avg is larger than Adam's averages allow against exp_avg_sq after "
                                 f"{int(step)} steps (|m| <= {ratio:.3g} sqrt(v))")


def _tensors(state, incoming, expected, what: str) -> None:
    try:
        validate_tensors(incoming, expected, what)
    except ValueError as e:
        raise _refuse(state, str(e)) from None


def _counters(state, ref: Reference, outer_step: int, total: int) -> None:
    fragments = len(ref.fragments)
    scheduled = event_start(outer_step - 1, ref.local_steps, fragments)  # steps the run takes to get there
    most = _most_steps(ref, outer_step)
    if total > most:
        raise _refuse(state, f"inner_steps_total {total} at outer step {outer_step}: the run's schedule takes "
                             f"{scheduled}, at most {most} accepted")
    # A donor reads its counters while it steps (one step apart at most): a round's slack below.
    if ref.pace == "fixed" and total < scheduled - ref.local_steps:
        raise _refuse(state, f"inner_steps_total {total} at outer step {outer_step}: the run's schedule takes "
                             f"{scheduled}, at least {scheduled - ref.local_steps} accepted")
    local = state.get("local_step", 0)
    if not _count(local):
        raise _refuse(state, "peer state has an invalid local_step")
    gap = event_gap(outer_step, ref.local_steps, fragments)
    if ref.pace == "fixed" and local >= gap:
        raise _refuse(state, f"local_step {local} is not below the round's {gap} steps")


def _largest(t: torch.Tensor) -> float:
    """max |t| without a copy of t."""
    lo, hi = torch.aminmax(t.detach())
    return max(-float(lo), float(hi))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _settings(state, optimizer, ref: Reference) -> None:
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("param_groups"), list):
        raise _refuse(state, "the outer optimizer state has no param_groups")
    groups = optimizer["param_groups"]
    if len(groups) != len(ref.param_groups):
        raise _refuse(state, f"the outer optimizer has {len(groups)} param group(s), this worker "
                             f"{len(ref.param_groups)}")
    for i, (theirs, mine) in enumerate(zip(groups, ref.param_groups)):
        if not isinstance(theirs, dict) or theirs.get("params") != mine["params"]:
            raise _refuse(state, f"the outer optimizer's param group {i} holds other parameters")
        names = (theirs.keys() | mine.keys()) - IMPLEMENTATION_SETTINGS - {"params"}
        for name in sorted(names, key=str):
            if name not in theirs or name not in mine or not _same(theirs[name], mine[name]):
                raise _refuse(state, f"outer optimizer setting {name!r} is {theirs.get(name, 'missing')!r}, this "
                                     f"worker's is {mine.get(name, 'missing')!r}")


def _per_parameter(state, optimizer, ref: Reference, global_params, outer_step: int) -> None:
    try:
        validate_optimizer_state(optimizer, ref.global_params)  # known entries, shapes, dtypes, finite
    except ValueError as e:
        raise _refuse(state, str(e)) from None
    group_of = {i: g for g in ref.param_groups for i in g["params"]}
    largest = max((_largest(g) for g in global_params if g.numel()), default=0.0)
    for index, entry in optimizer["state"].items():
        group = group_of.get(index)
        if group is None:
            raise _refuse(state, f"outer optimizer state for parameter {index}, which no group of this worker holds")
        for name, value in entry.items():
            where = f"outer optimizer state[{index}].{name}"
            if name == "step":
                step = float(value)
                if not (math.isfinite(step) and step == int(step) and 0 <= step <= outer_step):
                    raise _refuse(state, f"{where} is {step}: an outer optimizer steps at most once per outer step "
                                         f"({outer_step})")
            elif name == "momentum_buffer" and isinstance(value, torch.Tensor) and value.numel():
                reach = abs(float(group.get("lr", 0.0))) * abs(float(group.get("momentum", 0.0))) \
                    * _largest(value)
                if not reach <= MOMENTUM_REACH * largest:
                    raise _refuse(state, f"{where} would move a weight by {reach:.3g} in one outer step, more than "
                                         f"{MOMENTUM_REACH:g} times θ_global's largest weight ({largest:.3g})")
