"""The seams of the round (time through its event loop, the network through ``connect(peer) -> ByteStream``),
proved by a whole swarm in one process: 8 workers on the round's real code and the real matchmaking rule, over
in-memory streams, on a loop under virtual time (``testing/sim.py``, ``testing/virtual_time.py``)."""

from __future__ import annotations

import collections
import time

import pytest

from opendiloco.testing import virtual_time
from opendiloco.testing.sim import Death, SimSettings, Swarm

pytestmark = pytest.mark.timeout(60)


def test_eight_workers_in_virtual_time_lose_a_member_and_retry_without_it():
    """w5 dies as it sends its first part of round 1; its streams stop (nothing closes) and its record lives
    ``record_ttl`` more. The survivors give up on it once its record is gone, and their retry is a group of
    the seven; every group applies one average, bit for bit, on every member."""
    settings = SimSettings(workers=8, rounds=3, deaths=(Death("w5", outer_step=1),))
    began = time.perf_counter()
    report = virtual_time.run(Swarm(settings).run())
    wall = time.perf_counter() - began
    print(f"\n8 workers, 3 rounds, one death: {report.virtual_s:.1f} s of virtual time in {wall:.2f} s of wall time")

    groups = collections.defaultdict(list)
    for a in report.applied:
        groups[a.outer_step, a.attempt, a.members].append(a)
    for (step, attempt, members), applied in groups.items():
        assert len({(a.digest, a.value_hash) for a in applied}) == 1, (step, attempt)
        assert {a.peer for a in applied} == set(members), (step, attempt)  # nobody in it was left without it

    survivors = {f"w{i}" for i in range(8)} - {"w5"}
    assert set(report.died) == {"w5"}
    lost = [f for f in report.failed if f.outer_step == 1 and f.attempt == 0]
    assert {f.peer for f in lost} == survivors and all("w5" in f.members for f in lost)
    assert all(f.suspects == {"w5"} for f in lost), [f.suspects for f in lost]
    retry = [g for g in groups if g[0] == 1]
    assert retry == [(1, 1, tuple(sorted(survivors)))], retry
    assert [g for g in groups if g[0] == 2] == [(2, 0, tuple(sorted(survivors)))]
    assert not [f for f in report.failed if f not in lost], report.failed

    # The survivors waited, in virtual time, for the dead member's record to go before they gave up on it.
    retried_at = min(a.at for a in report.applied if a.outer_step == 1)
    assert retried_at - report.died["w5"] >= settings.record_ttl
    assert report.virtual_s > settings.rounds * settings.compute > settings.allreduce_timeout
