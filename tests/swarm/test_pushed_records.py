"""Matchmaking records pushed over p2p streams (``swarm/pushed_records.py``): a round's announcements and
groups travel to the peers that need them, beside the DHT, and count only if they would count when read
from the DHT.

At a 200 ms round trip a round used to cost some 12 round trips of matchmaking, most of them DHT reads
and stores made one after another (``docs/benchmarks.md``): the pushes make the DHT a fallback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

from opendiloco.comm.base import RoundKey
from opendiloco.swarm.membership import Membership, RunSecret
from opendiloco.swarm.pushed_records import (
    MAX_KEYS,
    MAX_PUSH_RECORDS,
    PushedRecord,
    RecordView,
    decode_push,
    encode_push,
)
from opendiloco.swarm.records import RunRecords
from opendiloco.swarm.signing import Identity

from .test_retries import together, workers  # noqa: F401  (a fixture)

HERE = Path(__file__).parent
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(150)]


def _writer(run: Membership, identity: Identity | None = None) -> RunRecords:
    return RunRecords(None, run, identity or Identity.fresh())


def _signed(book: RunRecords, key: str, value, expiration: float) -> PushedRecord:
    return PushedRecord(key, book.identity.peer_id, expiration, book._envelope(key, value, expiration))


def test_a_pushed_record_counts_only_if_it_would_count_when_read_from_the_dht():
    run = Membership.open("push")
    reader, writer, other = _writer(run), _writer(run), _writer(run)
    now = reader.clock.now()
    key = reader.round_key("3.0")
    good = _signed(writer, key, {"attempt": 0}, now + 60)
    forged = PushedRecord(key, other.identity.peer_id, now + 60, good.envelope)  # signed by writer, names other
    redated = PushedRecord(key, writer.identity.peer_id, now + 90, good.envelope)
    moved = PushedRecord(reader.group_key("3.0", 0), writer.identity.peer_id, now + 60, good.envelope)
    assert reader.accept_pushed([forged, redated, moved]) == 0
    assert reader.accept_pushed([_signed(writer, reader.workers_key(), {"outer_step": 10**6}, now + 60)]) == 0
    assert reader.accept_pushed([_signed(writer, "another-run.round.3.0", {"attempt": 0}, now + 60)]) == 0
    assert reader.accept_pushed([_signed(writer, key, {"attempt": 0}, now - 1)]) == 0  # expired
    assert reader.subkey_values(key, 3600, fresh=False) == {}
    assert reader.accept_pushed([good]) == 1
    assert reader.subkey_values(key, 3600, fresh=False) == {writer.identity.peer_id: {"attempt": 0}}
    # A reader bounds how long a record may claim to live, as for a record read from the DHT.
    assert reader.subkey_values(key, 30, fresh=False) == {}
    # The same writer's later record replaces its earlier one; an earlier one never replaces a later one.
    assert reader.accept_pushed([_signed(writer, key, {"attempt": 1}, now + 70)]) == 1
    assert reader.accept_pushed([good]) == 0
    assert reader.subkey_values(key, 3600, fresh=False) == {writer.identity.peer_id: {"attempt": 1}}


def test_a_closed_run_keeps_only_records_sealed_with_its_secret():
    run = Membership("push", RunSecret(b"the secret of this run, long enough", "test"))
    guess = Membership("push", RunSecret(b"a guess at that secret, long enough", "test"))
    reader = _writer(run)
    now = reader.clock.now()
    key = reader.round_key("1.0")
    identity = Identity.fresh()
    unsealed = _signed(_writer(Membership.open(run.namespace), identity), key, {"attempt": 0}, now + 60)
    wrong = _signed(_writer(guess, identity), key, {"attempt": 0}, now + 60)
    right = _signed(_writer(run, identity), key, {"attempt": 0}, now + 60)
    assert reader.accept_pushed([unsealed, wrong]) == 0
    assert reader.accept_pushed([right]) == 1


def test_what_a_push_carries_and_what_a_view_keeps_are_bounded():
    run = Membership.open("push")
    writer = _writer(run)
    now = writer.clock.now()
    record = _signed(writer, writer.round_key("1.0"), {"attempt": 0}, now + 60)
    assert decode_push(encode_push([record])) == [record]
    assert len(decode_push(encode_push([record] * (MAX_PUSH_RECORDS + 5)))) == MAX_PUSH_RECORDS  # sent capped
    with pytest.raises(ValueError):
        decode_push(msgpack.packb([record.to_wire()] * (MAX_PUSH_RECORDS + 1), use_bin_type=True))
    for garbage in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb(7)):
        with pytest.raises(ValueError):
            decode_push(garbage)
    odd = [[1, 2, 3, 4], ["k", "s", float("nan"), b""], ["k", "s", True, b""], ["k" * 300, "s", 1.0, b""], "x"]
    assert decode_push(msgpack.packb(odd + [record.to_wire()], use_bin_type=True)) == [record]

    view = RecordView(max_keys=3, max_subkeys=2)
    for i in range(5):
        view.put(PushedRecord(f"k{i}", "a", now + 60, b""), i)
    assert len(view) == 3 and view.values("k0", now, now + 99) == {} and view.values("k4", now, now + 99) == {"a": 4}
    view.values("k2", now, now + 99)  # a key being read is the last to go
    view.put(PushedRecord("k5", "a", now + 60, b""), 5)
    assert view.values("k2", now, now + 99) == {"a": 2} and view.values("k3", now, now + 99) == {}
    assert view.put(PushedRecord("k5", "b", now + 60, b""), 6)
    assert not view.put(PushedRecord("k5", "c", now + 60, b""), 7)  # a third writer of one key
    assert view.values("k5", now, now + 99) == {"a": 5, "b": 6}


def _never_answer_round_reads(comm) -> None:
    """The DHT node of ``comm`` answers no read of a round's announcements or groups (stores still go in):
    what a worker reads there, it reads from pushes or not at all."""
    dht, get = comm.records.dht, comm.records.dht.get

    def get_without_rounds(key, *args, **kwargs):
        if ".round." in key or ".group." in key:
            import concurrent.futures
            return concurrent.futures.Future()  # never answered
        return get(key, *args, **kwargs)

    dht.get = get_without_rounds


def test_a_group_forms_from_pushes_while_the_dht_answers_no_round_read(workers):  # noqa: F811
    """Before the pushes, every worker read the announcements from the DHT before it could group: with
    those reads unanswered, the round failed ("the DHT did not answer a get within 30s")."""
    trio = workers(3)
    for comm in trio:  # as a trainer does before its first round: each says where it heads
        comm.report_progress(outer_step=0)
    deadline = time.monotonic() + 60
    while not all(all(r.outer_step == 0 for r in comm.live_workers().values()) for comm in trio):
        assert time.monotonic() < deadline, "the workers never saw each other at outer step 0"
        time.sleep(0.2)
    for comm in trio:
        _never_answer_round_reads(comm)
    for step in (0, 1, 2):
        results = together(trio, RoundKey(step))
        assert all(not isinstance(r, Exception) for r in results), results
        for r in results:
            assert sorted(r.peers) == sorted(c.peer_id for c in trio)
            assert torch.allclose(r.flat, torch.full((64,), 2.0))
        assert len({r.extra["group_id"] for r in results}) == 1


def test_records_an_attacker_pushes_are_checked_before_they_are_kept(workers, tmp_path):  # noqa: F811
    pair = workers(2)
    victim = pair[0]
    peers = tmp_path / "peers.txt"
    peers.write_text("\n".join(str(m) for m in victim.dht.get_visible_maddrs()))
    out = tmp_path / "push.json"
    subprocess.run([sys.executable, str(HERE / "attack_push.py"), "--peers-file", str(peers), "--out", str(out),
                    "--run-id", victim.settings.run_id, "--target", victim.peer_id], timeout=120, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    # (The worker may close the stream of an oversized push before the attacker has written it all.)
    assert all(v == "sent" for k, v in report["sent"].items() if k != "oversized"), report
    assert report["flood"] and all(v == "sent" for v in report["flood"]), report
    view, now = victim.records.view, victim.records.clock.now()
    # Its own announcement is kept as it signed it: not the re-dated copy, not the one set to live ten days.
    kept = view.records(report["round_key"], [report["peer_id"], victim.peer_id], now)
    assert [(r.subkey, r.expiration_time) for r in kept] == [(report["peer_id"], report["expiration_time"])]
    assert victim.records.subkey_values(report["round_key"], 3600, fresh=False) == {
        report["peer_id"]: report["announcement"]}
    # Nothing under the target's name, the run's workers key or another run's key; the flood is bounded.
    assert view.values(victim.records.workers_key(), now, now + 1e9) == {}
    assert view.values("another-run.round.7.0", now, now + 1e9) == {}
    assert len(view) <= MAX_KEYS
    # And the run goes on, the attacker in no group.
    results = together(pair, RoundKey(0))
    assert all(not isinstance(r, Exception) and sorted(r.peers) == sorted(c.peer_id for c in pair)
               for r in results), results
    deadline = time.monotonic() + 10
    while report["peer_id"] in victim.live_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
