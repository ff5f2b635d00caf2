"""A worker's download of the state the run confirms (``quorum.py``): a joiner's, or one catching up.

Which state: the run's confirmed θ_global hash and outer step (a majority the caller names, or what the
live workers' records confirm now). From whom: the live peers whose records hold it, first in parts
from several of them at once (``multi_donor.py``, the donors fast last time first), then from one at a
time. Each state is checked by the worker's own ``state_check`` against the confirmed hash before it is
handed over, so that a refused donor is followed by the next (``transfer.py``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from ...errors import AveragingError, Interrupted
from ..matchmaking import Matchmaker
from ..presence import Presence
from ..quorum import confirmed
from ..streams import P2PStreams
from .multi_donor import MAX_DONORS, DonorsAhead, Download, fetch_from_donors, tell_done
from .transfer import StateServer, download_bound, fetch_state, own_check

log = logging.getLogger(__name__)


class StateDownload:
    """Downloads the run's confirmed state for one worker (``SwarmCommunicator.download_state``).

    ``call(coro, timeout, interruptible=)`` runs a coroutine on the communicator's event loop and waits
    for it; ``interrupted`` is set when the worker stops (every wait here gives up then)."""

    def __init__(self, peer_id: str, presence: Presence, server: StateServer, streams: P2PStreams,
                 matchmaker: Matchmaker, call: Callable, interrupted: threading.Event):
        self.peer_id, self.presence, self.server, self.streams = peer_id, presence, server, streams
        self.matchmaker, self.call, self.interrupted = matchmaker, call, interrupted
        self.donor_rates: dict[str, float] = {}
        """Bytes per second each donor served this worker's last state download at (fast ones are asked first)."""

    def run(self, timeout: float, min_outer_step: int | None = None, max_bytes: int | None = None,
            majority_hash: str | None = None) -> dict | None:
        """The state the run confirms, from a live peer that holds it; None if the run has no other live
        worker. The returned state names that hash (``confirmed_hash``, set here, never by the donor)."""
        # This worker's own state (the optimizer's) bounds and checks what it downloads: a donor that
        # serves a state it would refuse is named, and the next donor is asked.
        max_bytes = download_bound(max_bytes, self.server.provider)
        check = own_check(self.server.provider)
        deadline = time.monotonic() + timeout
        errors: dict[str, str] = {}
        tried_parts = False
        while True:
            self._raise_if_interrupted()
            workers = self.presence.live_workers()
            others = [r for p, r in workers.items() if p != self.peer_id and r.outer_step >= 0]
            if not others and min_outer_step is None:
                if errors:  # the donors failed and left (died mid-download): not the same as "nobody there"
                    raise AveragingError(f"the peers serving state failed and left: {errors}")
                return None
            wanted, wanted_step = self._wanted(workers, others, min_outer_step, majority_hash)
            candidates = [r for r in others
                          if wanted is not None and (r.global_hash, r.outer_step) == (wanted, wanted_step)
                          and (min_outer_step is None or r.outer_step >= min_outer_step)]
            if candidates and not tried_parts:  # once per download: its manifests take a turn of each donor's
                tried_parts = True
                state = self._in_parts(candidates, wanted, wanted_step, min_outer_step, max_bytes, check,
                                       deadline, errors)
                if state is not None:
                    return state
            state = self._one_donor_at_a_time(candidates, wanted, min_outer_step, max_bytes, check, deadline, errors)
            if state is not None:
                return state
            if time.monotonic() >= deadline:
                raise AveragingError(f"no peer served the state the run confirms within {timeout:.0f}s"
                                     + (f": {errors}" if errors else ""))
            left = self.matchmaker.left_out
            if left is not None and min_outer_step == left.key.outer_step + 1:
                why = self.matchmaker.left_out_for_nothing(left)
                if why:  # no state of that step is coming: back to the round, where the others wait
                    raise AveragingError(why)
            self.interrupted.wait(0.5)

    def _wanted(self, workers: dict, others: list, min_outer_step: int | None,
                majority_hash: str | None) -> tuple[str | None, int | None]:
        """The θ_global hash and outer step to download: the majority's where a live peer holds it, else
        what the run confirms now (it may have moved past the state an error named); (None, None): none."""
        if majority_hash is not None and any(r.global_hash == majority_hash for r in others):
            # The step most of its holders say it is at: a record that pairs the hash with another
            # step (10**6, say) is no donor.
            steps = collections.Counter(r.outer_step for r in others if r.global_hash == majority_hash)
            return majority_hash, max(steps, key=lambda k: (steps[k], -k))
        # Catching up (a step to reach) weighs this worker's own state; joining does not.
        mine = None if min_outer_step is None else self.presence.my_claim(self.presence.get("outer_step", -1))
        claim = confirmed(self._voters(workers, mine), self.peer_id, mine, min_outer_step)
        return (None, None) if claim is None else (claim.global_hash, claim.outer_step)

    def _one_donor_at_a_time(self, candidates: list, wanted: str | None, min_outer_step: int | None,
                             max_bytes: int, check, deadline: float, errors: dict[str, str]) -> dict | None:
        """The state from the first of ``candidates`` that serves it (donors of older versions, or a run that
        moved on); None (each donor's reason in ``errors``) if none did before ``deadline``."""
        for rec in candidates:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            t0 = time.perf_counter()
            try:
                state = self.call(fetch_state(self.streams, rec.peer_id, min_outer_step, max_bytes, check),
                                  remaining, interruptible=True)
                confirmed_hash = self._served_hash(state, rec, wanted, min_outer_step, deadline)
                if check is not None:  # θ_global itself, against the hash the run confirms
                    check(state, min_outer_step, expected_hash=confirmed_hash)
            except Interrupted:
                raise
            except Exception as e:
                errors[rec.peer_id[-8:]] = str(e) or type(e).__name__
                continue
            state["confirmed_hash"] = confirmed_hash
            log.info("downloaded state of outer step %s from %s in %.2fs", state.get("outer_step"),
                     rec.peer_id[-8:], time.perf_counter() - t0)
            return state
        return None

    def _served_hash(self, state: dict, rec, wanted: str | None, min_outer_step: int | None,
                     deadline: float) -> str:
        """The hash the run confirms for the state ``rec``'s writer served: ``wanted`` at the step its
        record names, or the run's word on a newer step; ``AveragingError`` for any other step."""
        served = state.get("outer_step")
        if served == rec.outer_step:
            return wanted
        if type(served) is not int or served < rec.outer_step:
            raise AveragingError(f"served outer step {served!r}, its record says {rec.outer_step}")
        # The donor applied a round while we asked (a busy run moves on every few seconds): its newer
        # state is taken once the run confirms it, never on its word.
        confirmed_hash = self._confirmed_hash_at(served, min_outer_step is not None,
                                                 min(10.0, max(0.0, deadline - time.monotonic())))
        if confirmed_hash is None:
            raise AveragingError(f"served outer step {served}, which the run did not confirm "
                                 f"(its record said {rec.outer_step})")
        return confirmed_hash

    def _in_parts(self, candidates: list, wanted_hash: str, wanted_step: int, min_outer_step: int | None,
                  max_bytes: int, check, deadline: float, errors: dict[str, str]) -> dict | None:
        """The state of ``wanted_step`` in parts from up to ``MAX_DONORS`` of ``candidates`` (those fast last
        time first), checked against ``wanted_hash``; None (the reason in ``errors``) if that failed."""
        donors = sorted((r.peer_id for r in candidates), key=lambda p: -self.donor_rates.get(p, 0.0))[:MAX_DONORS]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        t0 = time.perf_counter()

        def fetch(step: int) -> Download:
            return self.call(fetch_from_donors(self.streams, donors, step, max_bytes, check, min_outer_step),
                             max(1.0, deadline - time.monotonic()), interruptible=True)

        try:
            try:
                got = fetch(wanted_step)
            except DonorsAhead as ahead:  # the run moved on while we read its records: its next state, once confirmed
                wanted_hash = self._confirmed_hash_at(ahead.outer_step, min_outer_step is not None,
                                                      min(10.0, max(0.0, deadline - time.monotonic())))
                if wanted_hash is None:
                    raise
                wanted_step = ahead.outer_step
                got = fetch(wanted_step)
            if check is not None:  # θ_global itself, against the hash the run confirms
                check(got.state, min_outer_step, expected_hash=wanted_hash)
        except Interrupted:
            raise
        except Exception as e:
            errors["in parts"] = str(e) or type(e).__name__
            log.info("state of outer step %s in parts failed (%s); asking donors one at a time", wanted_step,
                     errors["in parts"])
            return None
        self.donor_rates.update(got.rates)
        self.call(tell_done(self.streams, got.donors, wanted_step), 10)
        got.state["confirmed_hash"] = wanted_hash
        log.info("downloaded state of outer step %s in parts from %d of %d donor(s) in %.2fs", wanted_step,
                 len(got.rates), len(donors), time.perf_counter() - t0)
        return got.state

    def _voters(self, workers: dict, mine) -> dict:
        """The records that vote on a state to download: a joiner's (``mine`` None) counts every worker,
        a worker catching up only those whose word counts here (``partners.py``)."""
        return workers if mine is None else self.presence.partners.voters(workers)

    def _confirmed_hash_at(self, outer_step: int, catching_up: bool, timeout: float) -> str | None:
        """The θ_global hash the run confirms at ``outer_step`` once its records say so (within
        ``timeout``); None if the run confirms another state there, or moves past it first."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self.presence.live_workers()
            mine = self.presence.my_claim(self.presence.get("outer_step", -1)) if catching_up else None
            claim = confirmed(self._voters(workers, mine), self.peer_id, mine, outer_step)
            if claim is not None and claim.outer_step == outer_step:
                return claim.global_hash
            if claim is not None or time.monotonic() >= deadline:
                return None
            self._raise_if_interrupted()
            self.interrupted.wait(0.2)

    def _raise_if_interrupted(self) -> None:
        if self.interrupted.is_set():
            raise Interrupted("the worker is stopping: state download abandoned")
