"""A two-worker closed run and one insider's extra key while a worker restarts (``partners.py``,
``docs/trust.md``): the worker left alone counts its own word only while its partner is away, and the
restarted worker remembers its partner from its run dir. Records go through a real DHT node; the rule
applied is the one a worker's presence applies (``confirmed_ahead`` of its partners' records)."""

from __future__ import annotations

import pytest

from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.partners import Partners
from opendiloco.swarm.presence import PARTNERS_GRACE_TTLS
from opendiloco.swarm.quorum import Claim, confirmed_ahead
from opendiloco.swarm.records import RunRecords, WorkerRecord
from opendiloco.swarm.signing import Identity

from .attack_restart import claim

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

RUN = Membership("restart", RunSecret(b"the secret of the restarted run, long enough", "test"))
TTL, STEP, HASH = 30.0, 4, "honest"


@pytest.fixture
def dht():
    node = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def _worker(dht) -> RunRecords:
    return RunRecords(dht, RUN, Identity.fresh())


def _publish(book: RunRecords, left: bool = False) -> None:
    now = book.clock.now()
    book.store(book.workers_key(), WorkerRecord(peer_id=book.identity.peer_id, outer_step=STEP, global_hash=HASH,
                                                time=now, left=left).to_value(), now + TTL)


def test_one_sybil_record_cannot_pull_a_two_worker_run_while_one_worker_restarts(dht, tmp_path):
    a, b = _worker(dht), _worker(dht)
    ids = a.identity.peer_id, b.identity.peer_id
    now = [0.0]
    partners = {}
    for book, name in ((a, "a"), (b, "b")):
        (tmp_path / name).mkdir()
        partners[name] = Partners(book.identity.peer_id, absent_grace=PARTNERS_GRACE_TTLS * TTL,
                                  clock=lambda: now[0])
        partners[name].keep_in(str(tmp_path / name / "partners.txt"))
        partners[name].add(ids)  # they completed a round together
        _publish(book)
    _publish(b, left=True)  # b stops to restart: its record says it left
    sybil = claim(a, STEP + 1, "poisoned", TTL)
    workers = a.read_workers()
    assert set(workers) == {ids[0], sybil}
    mine = Claim(STEP, HASH)
    assert confirmed_ahead(workers, ids[0], mine) == Claim(STEP + 1, "poisoned")  # every record a vote: 1 of 2
    now[0] += TTL  # b is away for a record's lifetime
    assert confirmed_ahead(partners["a"].voters(workers), ids[0], mine) is None  # before: Claim(5, 'poisoned')
    # b restarts in its run dir: it remembers a, and the sybil's word does not count for it either.
    restarted = Partners(ids[1], absent_grace=PARTNERS_GRACE_TTLS * TTL, clock=lambda: now[0])
    restarted.keep_in(str(tmp_path / "b" / "partners.txt"))
    _publish(b)
    workers = b.read_workers()
    assert set(workers) == {*ids, sybil}
    assert ids[0] in restarted and set(restarted.voters(workers)) == set(ids)  # before: all three
    # A partner away for longer than the grace: the run went on without it, and is followed again.
    now[0] += PARTNERS_GRACE_TTLS * TTL
    assert sybil in partners["a"].vouched({ids[0], sybil})
