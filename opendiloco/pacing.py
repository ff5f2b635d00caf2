"""When a worker's round is due: a fixed ``H``, or the swarm's pace.

Two policies, chosen with ``DiLoCoOptimizer(pace=...)``:

- ``fixed``: every worker takes exactly ``local_steps`` inner steps per round. Reproducible (a
  run's result depends only on its seeds and its group), and what a lone worker always does.
- ``swarm``: a round closes when the *group* has done the work of ``local_steps`` inner steps per
  member, counted in samples: target = ``local_steps`` x (sum of the members' samples per step).
  A fast worker takes more inner steps, a slow one fewer; everyone stops near the same moment
  and every member's work enters the average, weighted by its samples (hivemind's
  ``target_batch_size``, applied to a whole DiLoCo round).

Each worker publishes its ``Pace`` (work so far this round, rate, samples per step); the others
extrapolate it from the time it was published. This module is pure arithmetic on those figures:
no clocks, no I/O, so the rule is tested against hand-worked numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .timeouts import PACE_RETRY_MAX_S as RETRY_MAX_S
from .timeouts import PACE_RETRY_S as RETRY_S

PACES = ("fixed", "swarm")
EXTRAPOLATE_S = 10.0
"""How far ahead of a peer's last published figures its work is extrapolated (several heartbeats)."""


@dataclass(frozen=True)
class Pace:
    """What one worker has done in the current round, as it published it."""

    work: float
    """Samples (or inner steps, for a loop that does not count samples) since its last round."""
    rate: float
    """Work per second while training; 0 when not known yet (a worker that just joined)."""
    per_step: float
    """Work one inner step adds."""
    time: float
    """When these figures were true (the clock every worker shares: the DHT's)."""
    ready: bool = False
    """It has stopped training and waits for the round: its work will not grow."""

    @property
    def counted(self) -> bool:
        """A member of the round's target: its pace is known (or it is already waiting)."""
        return self.ready or (self.rate > 0 and self.per_step > 0)

    def work_at(self, t: float) -> float:
        """Its work at time ``t``, extrapolated at its rate, for at most ``EXTRAPOLATE_S`` seconds: a
        peer whose figures stopped moving (a long eval, a stall) is not assumed to train on for ever."""
        if self.ready:
            return self.work
        return self.work + self.rate * min(EXTRAPOLATE_S, max(0.0, t - self.time))


def target_work(members: Sequence[Pace], local_steps: int) -> float:
    """The group's work for one round: ``local_steps`` inner steps of every member."""
    return local_steps * sum(p.per_step for p in members)


def group_work(members: Sequence[Pace], t: float) -> float:
    return sum(p.work_at(t) for p in members)


def round_due(own: Pace, others: Sequence[Pace], local_steps: int, *, own_step_s: float, local_step: int) -> bool:
    """Whether this worker should stop and enter the round now (it has just finished a step).

    Stops at the step boundary nearest to the moment the group's work reaches its target: now, if
    the work half a step from now will have reached it. Also due when every other member is
    already waiting (they idle until we come), and never later than ``local_steps`` times the
    group's size (everyone else has stalled).
    """
    if local_step < 1:
        return False
    members = [p for p in others if p.counted]
    if not members:  # alone, or the others have not published a pace yet: exact H
        return local_step >= local_steps
    if all(p.ready for p in members):
        return True
    if local_step >= local_steps * (len(members) + 1):
        return True
    target = target_work([own, *members], local_steps)
    return group_work([own, *members], own.time + own_step_s / 2) >= target


def seconds_to_target(own: Pace, others: Sequence[Pace], local_steps: int) -> float:
    """When (from ``own.time``) the group's work will reach the round's target, at today's rates."""
    members = [own, *(p for p in others if p.counted)]
    missing = target_work(members, local_steps) - group_work(members, own.time)
    if missing <= 0:
        return 0.0
    rate = sum(p.rate for p in members if not p.ready)
    return missing / rate if rate > 0 else math.inf


def retry_delay(failed_in_a_row: int) -> float:
    """Seconds before a worker whose last ``failed_in_a_row`` rounds failed (θ_global kept) enters the
    next one under pace "swarm": 0 after a round that moved θ_global, then 0.5, 1, 2, 4, 8 s at most.

    The pace rule alone makes such a worker due again at once (its peers are still in their round, all
    "ready"). A worker that is left out of every group (its links to a member broke) then failed a round
    every inner step, each attempt announced to every live worker, for minutes: in the long scenario,
    two workers behind NAT made 88 such attempts. The run goes on meanwhile, and a worker that finds it
    behind catches up at its next try."""
    if failed_in_a_row <= 0:
        return 0.0
    # The exponent is bounded: 2 ** 1024 is no float, and a worker kept apart for hours gets that far.
    return min(RETRY_MAX_S, RETRY_S * 2 ** min(failed_in_a_row - 1, 64))
