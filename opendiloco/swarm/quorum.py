"""Which θ_global the run confirms: one vote per live worker's signed progress record.

A worker's record says "I hold θ_global of hash h at outer step s". Records are signed and bound
to their writer (``signing.py``), so a peer has one vote, however many records it writes. The
rules, the same for every worker:

- **catching up**: a worker downloads a state ahead of its own only if that state's claim has
  at least half of the votes of the run's live workers (its own vote included), and no fewer
  than any other claim ahead (ties go to the lower outer step). One peer claiming to be ahead
  of two or more others therefore triggers nothing;
- **joining**: a worker with no state of its own takes the claim with the most votes, ties to
  the lower outer step, so an outlier claiming to be far ahead never wins a tie;
- **drift** (``drifted``): a claim with more votes than this worker's own, and at least half of
  them, at its outer step or behind it, wins (a worker that went on alone goes back); of claims
  tied at its own outer step, the smallest hash wins, on every worker alike.

Callers pass only the records whose word counts (``partners.py``): once a worker has completed a
round with peers, only theirs; before that, every live worker's.

In a run of two each worker is half the run: there, as in any run whose live workers are half
attackers, no vote can tell who is honest. Signatures stop impersonation, not Sybils: in an open
run anyone may start many workers; in a closed run only holders of the secret can.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Claim:
    outer_step: int
    global_hash: str


def _votes(workers: Mapping, me: str | None, mine: Claim | None) -> collections.Counter:
    votes: collections.Counter = collections.Counter()
    for peer, rec in workers.items():
        if peer != me and rec.outer_step >= 0 and rec.global_hash:
            votes[Claim(rec.outer_step, rec.global_hash)] += 1
    if mine is not None:
        votes[mine] += 1
    return votes


def _best(votes: collections.Counter, candidates) -> tuple[Claim, int] | None:
    """The candidate with the most votes; of equals, the lowest outer step (then hash, for determinism)."""
    ranked = sorted(candidates, key=lambda c: (-votes[c], c.outer_step, c.global_hash))
    return (ranked[0], votes[ranked[0]]) if ranked else None


def confirmed_ahead(workers: Mapping, me: str, mine: Claim) -> Claim | None:
    """The state ahead of ``mine`` that the run confirms, if any (the catching-up rule)."""
    votes = _votes(workers, me, mine)
    best = _best(votes, [c for c in votes if c.outer_step > mine.outer_step])
    if best is None:
        return None
    claim, count = best
    return claim if 2 * count >= sum(votes.values()) else None


def confirmed(workers: Mapping, me: str | None = None, mine: Claim | None = None,
              min_outer_step: int | None = None) -> Claim | None:
    """The state a worker should download (the joining rule), at ``min_outer_step`` or later.

    A worker with a state of its own (``mine``) downloads only what ``confirmed_ahead`` allows.
    """
    if mine is not None:
        claim = confirmed_ahead(workers, me, mine)
        return claim if claim is not None and (min_outer_step is None or claim.outer_step >= min_outer_step) else None
    votes = _votes(workers, me, None)
    best = _best(votes, [c for c in votes if min_outer_step is None or c.outer_step >= min_outer_step])
    return None if best is None else best[0]


def drifted(workers: Mapping, me: str, mine: Claim, in_flight=frozenset()) -> Claim | None:
    """The state the run confirms instead of ``mine`` at our outer step or behind it, if any (drift).

    Behind it: a worker that went on alone is the one that drifted, and goes back to the run's
    state. Peers ``in_flight`` (members of our last round) that are behind us count for our
    state: they hold it and have not yet published that they do (a group that went on together
    is not pulled back by a claim with as many votes as it has).
    """
    counts: collections.Counter = collections.Counter({mine: 1})
    for peer, rec in workers.items():
        if peer == me or rec.outer_step < 0 or not rec.global_hash:
            continue
        if rec.outer_step < mine.outer_step and peer in in_flight:
            counts[mine] += 1  # it applied our last round with us and is on its way to our state
            continue
        counts[Claim(rec.outer_step, rec.global_hash)] += 1
    best, votes = max(counts.items(), key=lambda kv: (kv[1], -kv[0].outer_step, kv[0] == mine))
    if best != mine and best.outer_step <= mine.outer_step and votes > counts[mine] \
            and 2 * votes >= sum(counts.values()):
        return best
    # A tie at our own outer step (two groups went on apart, e.g. two workers of a run of two): the
    # smallest hash among the most held wins, the same choice on every worker, so the run heals.
    same = {c: n for c, n in counts.items() if c.outer_step == mine.outer_step}
    tied = sorted(c.global_hash for c, n in same.items() if n == counts[mine])
    if max(same.values()) == counts[mine] and tied[0] != mine.global_hash:
        return Claim(mine.outer_step, tied[0])
    return None
