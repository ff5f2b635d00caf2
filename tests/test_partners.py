"""Votes that cost something: once a worker has completed a round with peers, fresh identities
neither vote it ahead, nor stall its rounds with a ready time, nor leave it behind with a group of
their own (``opendiloco/swarm/partners.py``). Matchmakers run over an in-memory record table."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from opendiloco.comm.base import RoundKey
from opendiloco.swarm.match_rule import MatchView, Peer, published_group, wait_until
from opendiloco.swarm.matchmaking import Matchmaker
from opendiloco.swarm.partners import Partners
from opendiloco.swarm.quorum import Claim, confirmed_ahead, drifted
from opendiloco.swarm.records import WorkerRecord
from tests.conftest import run_in_threads
from tests.test_matchmaking_gone import SETTINGS, Presence, Table, Writer

pytestmark = pytest.mark.fast


def test_everyone_counts_until_the_first_partner_then_only_partners_and_me():
    partners = Partners("me")
    assert partners.vouched({"me", "a", "f"}) == {"me", "a", "f"}  # a newcomer trusts the run, as a joiner
    partners.add(["me", "a"])
    assert "a" in partners and "me" not in partners and len(partners) == 1
    assert partners.vouched({"me", "a", "f"}) == {"me", "a"}
    workers = {p: WorkerRecord(p, outer_step=3) for p in ("me", "a", "f")}
    assert set(partners.voters(workers)) == {"me", "a"}
    # Its partners all gone: itself alone for a grace (one may be restarting), then a newcomer again (else it
    # could never follow a run that went on without it).
    now = [0.0]
    partners = Partners("me", absent_grace=10.0, clock=lambda: now[0])
    partners.add(["a"])
    now[0] = 9.0
    assert partners.vouched({"me", "f", "g"}) == {"me"}
    now[0] = 10.0
    assert partners.vouched({"me", "f", "g"}) == {"me", "f", "g"}


def test_partners_are_bounded_and_the_oldest_is_forgotten_first():
    partners = Partners("me", limit=3)
    partners.add(["a", "b", "c"])
    partners.add(["a"])  # seen again: now the newest
    partners.add(["d"])
    assert "b" not in partners and {"a", "c", "d"} == {p for p in "abcd" if p in partners}


def test_fresh_identities_claiming_the_run_is_ahead_do_not_outvote_a_partner():
    workers = {"me": WorkerRecord("me", outer_step=5, global_hash="h"),
               "a": WorkerRecord("a", outer_step=5, global_hash="h"),
               "f1": WorkerRecord("f1", outer_step=6, global_hash="poison"),
               "f2": WorkerRecord("f2", outer_step=6, global_hash="poison")}
    mine = Claim(5, "h")
    assert confirmed_ahead(workers, "me", mine) == Claim(6, "poison")  # every record a vote: 2 of 4
    partners = Partners("me")
    partners.add(["a"])
    assert confirmed_ahead(partners.voters(workers), "me", mine) is None
    # Nor can they pull it back to a state of theirs at its own step.
    workers.update({p: WorkerRecord(p, outer_step=5, global_hash="0poison") for p in ("f1", "f2", "f3")})
    assert drifted(workers, "me", mine) == Claim(5, "0poison")
    assert drifted(partners.voters(workers), "me", mine) is None
    # A partner that moved on with the run is followed.
    workers["a"] = WorkerRecord("a", outer_step=6, global_hash="next")
    assert confirmed_ahead(partners.voters(workers), "me", mine) == Claim(6, "next")


def _matchmaker(table: Table, me: str, workers: dict, settings=SETTINGS, partners=(), joiners=()) -> Matchmaker:
    presence = Presence(me, lambda: workers)
    presence.partners.add(partners)
    return Matchmaker(Writer(table, me), presence, settings, "fp16", threading.Event(),
                      joiners=lambda step: set(joiners))


# A fresh identity that first asks a member for its state counts there as a joiner: before, a joiner's ready
# time was believed in full, so one such identity per round held every round until max_wait (16.2 s
# between rounds in the issue's run, the harness's max_wait; 600 s with the CLI's defaults).
@pytest.mark.parametrize("joined", [False, True], ids=["fresh", "joiner"])
def test_a_fresh_identity_that_promises_to_be_ready_in_an_hour_costs_partners_only_the_grace(joined):
    settings = dataclasses.replace(SETTINGS, max_wait=60.0)
    table, key = Table(), RoundKey(1)
    now = table.clock.now()
    workers = {p: WorkerRecord(p, outer_step=1, time=now) for p in ("b", "c")}
    # Heading for round 1, "ready in an hour": a new identity every round would cost max_wait each time.
    workers["f"] = WorkerRecord("f", outer_step=1, next_round=1, ready_at=now + 3600, time=now)
    results: dict[str, object] = {}

    def member(me: str) -> None:
        mm = _matchmaker(table, me, workers, settings, partners={"b", "c"}, joiners={"f"} if joined else ())
        results[me] = mm.form_group(key, 0, 10)[0].members

    began = time.monotonic()
    run_in_threads([lambda m=m: member(m) for m in ("b", "c")], timeout=settings.max_wait / 2)
    assert results == {"b": ("b", "c"), "c": ("b", "c")}, results
    assert time.monotonic() - began < settings.max_wait / 2
    # Only f is missing, and none of the missing are partners: still not believed (the partners b and c are
    # live, so b is no newcomer).
    assert _matchmaker(table, "b", workers, settings, partners={"c"}).presence.partners.vouched(
        set(workers)) == {"b", "c"}
    # Its promise would be believed from a partner (the same record, another standing).
    vouched = _matchmaker(table, "b", workers, settings, partners={"c", "f"}).presence.partners.vouched(workers)
    assert "f" in vouched
    assert wait_until(workers["f"].ready_at, now, settings.straggler_wait, settings.max_wait,
                      vouched=True) == now + settings.max_wait


def _published(table: Table, key: RoundKey, me: str, live: set[str], announced: set[str], partners=()):
    """``match_rule.published_group`` of the groups in ``table``, as ``me`` sees them."""
    matchmaker = _matchmaker(table, me, {}, partners=partners)
    workers = {p: Peer(key.outer_step, key.outer_step) for p in live - {me}}
    view = MatchView(me=me, key=key, attempt=0, numel=10, codec="fp16", now=0.0, began=0.0, workers=workers,
                     announcements={}, trust=matchmaker.presence.partners.trust(live | announced),
                     published=table.values[table.group_key(key, 0)])
    return published_group(view, announced, {})


def test_a_group_of_fresh_identities_does_not_leave_a_partner_behind():
    table, key = Table(), RoundKey(4)
    table.values[table.group_key(key, 0)] = {"f1": ["f1", "f2"]}
    live = {"b", "c", "f1", "f2"}
    # Without partners: two of four went on, so the run did.
    assert _published(table, key, "b", live, {"f1", "f2"}) == (None, {"f1", "f2"}, True)
    # With one: their business, not waited for.
    assert _published(table, key, "b", live, {"f1", "f2"}, partners={"c"}) == (None, {"f1", "f2"}, False)
    # The same group with a partner in it is the run moving on.
    table.values[table.group_key(key, 0)] = {"c": ["c", "f1"]}
    assert _published(table, key, "b", live, {"c", "f1", "f2"}, partners={"c"}) == (None, {"c", "f1"}, True)


def test_a_ready_time_from_a_peer_whose_word_does_not_count_is_believed_for_one_grace_at_most():
    began, grace, most = 1000.0, 5.0, 600.0
    assert wait_until(1120.0, began, grace, most, vouched=True) == 1125.0
    assert wait_until(1120.0, began, grace, most, vouched=False) == 1010.0
    assert wait_until(1003.0, began, grace, most, vouched=False) == 1008.0
    assert wait_until(None, began, grace, most, vouched=False) == 1005.0
