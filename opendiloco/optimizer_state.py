"""What a ``DiLoCoOptimizer`` saves in a checkpoint, and the checks a saved one passes before it is loaded.

A checkpoint holds the inner and outer optimizers' state, the counters, the schedule it was saved
under, the round that was in flight (as this worker's contribution to it, started again on load)
and error feedback's residuals. Loading checks everything first, so a refused checkpoint leaves the
optimizer as it was, and says in one line what does not fit. What a joiner gets from a peer is a
different, smaller state, checked by ``opendiloco.state_check``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .fragment import Fragment
from .outer import validate_tensors

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
