"""No single member decides a shard: owners commit to what they combined, members audit random
chunks of every other owner's result (``opendiloco/comm/audit.py``). Rounds over in-memory streams;
each dishonest owner or member is a small subclass of the honest runner."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from opendiloco.comm import audit
from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.base import RoundKey
from opendiloco.comm.formats import get_codec
from opendiloco.comm.group import Group
from opendiloco.comm.reducer import ShardReducer
from opendiloco.comm.runner import RoundRunner
from opendiloco.errors import PeerFailure, ProtocolError
from tests.test_runner import PART, honest_round, reference, run

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("numel", [1, 127, 128, 129, 1000, 5 * 128 + 3, 300_000])
def test_every_chunk_is_proven_against_the_root_and_nothing_else_is(numel):
    values = torch.randn(numel)
    tree = audit.MerkleTree(values)
    count = audit.chunk_count(numel)
    assert count <= audit.LEAVES_PER_PART + 1
    for c in {0, count // 2, count - 1}:
        a, b = audit.chunk_range(numel, c)
        chunk = values[a:b].clone()
        assert audit.path_ok(chunk, c, tree.path(c), tree.root, numel)
        if count > 1:
            assert not audit.path_ok(chunk, (c + 1) % count, tree.path(c), tree.root, numel)
        chunk[0] += 1e-6
        assert not audit.path_ok(chunk, c, tree.path(c), tree.root, numel)
    assert not audit.path_ok(values[:1], 0, ["zz"], tree.root, numel)
    assert not audit.path_ok(values[:1], 0, "not a list", tree.root, numel)


def _flats(size: int, n: int = 10_007):
    g = torch.Generator().manual_seed(size)
    return [torch.randn(n, generator=g) * (i + 1) for i in range(size)]


@pytest.mark.parametrize("codec", ["fp16", "none", "int8", "int4/fp16", "e3m0", "scaled-fp16"])
@pytest.mark.parametrize("size", [2, 4])
def test_honest_owners_pass_every_audit_and_results_are_unchanged(codec, size):
    codec, _, result = codec.partition("/")
    flats, weights = _flats(size), [1.0, 3.0, 0.5, 2.0][:size]
    members = [f"peer-{i}" for i in range(size)]
    outcomes = run(honest_round(members, flats, weights, codec, result=result or None, audit_chunks=4))
    want = reference(flats, weights, codec, result or None)
    for o in outcomes:
        assert not isinstance(o, Exception), o
        assert torch.equal(o.flat, want) and o.digest == outcomes[0].digest


def test_honest_owners_pass_the_audit_under_centered_clip_and_clipping():
    flats = _flats(4)
    flats[2] = flats[2] * 50  # clipped by the norm bound
    members = [f"peer-{i}" for i in range(4)]
    for aggregation in (Aggregation("centered-clip"), Aggregation()):
        outcomes = run(honest_round(members, flats, [1.0] * 4, "fp16", audit_chunks=8, aggregation=aggregation))
        assert all(not isinstance(o, Exception) for o in outcomes), outcomes
        assert all(torch.equal(o.flat, outcomes[0].flat) for o in outcomes)


def dishonest(monkeypatch, member: str, turn) -> dict[str, RoundRunner]:
    """Every runner made from now on, by member; ``turn(runner)`` is applied to ``member``'s."""
    real, runners = RoundRunner.__init__, {}

    def init(self, group, me, *args, **kw):
        real(self, group, me, *args, **kw)
        runners[me] = self
        if me == member:
            turn(self)

    monkeypatch.setattr(RoundRunner, "__init__", init)
    return runners


@dataclasses.dataclass(frozen=True)
class Sets(Aggregation):
    """An owner that decides its shard's result: 60000 everywhere, or -4x the true mean."""

    mode: str = "60000"

    def combine(self, parts, weights, norms=None):
        acc, clipped = super().combine(parts, weights, norms)
        return (torch.full_like(acc, 60000.0) if self.mode == "60000" else -acc if self.mode == "-1x" else acc * -4), \
            clipped


@pytest.mark.parametrize("mode", ["60000", "-4x"])
@pytest.mark.parametrize("aggregation", ["mean", "centered-clip"])
def test_an_owner_that_decides_its_shard_is_named_by_every_member_in_that_round(monkeypatch, mode, aggregation):
    members = [f"peer-{i}" for i in range(4)]
    liar = members[1]
    runners = dishonest(monkeypatch, liar, lambda r: setattr(r.reducer, "aggregation", Sets(aggregation, mode=mode)))
    outcomes = run(honest_round(members, _flats(4), [1.0] * 4, "fp16", audit_chunks=4,
                                aggregation=Aggregation(aggregation)))
    for m, o in zip(members, outcomes):
        assert isinstance(o, Exception), o  # nobody applies the round
        if m != liar:  # each member names it (its communicator leaves it out of the next groups): by the bound
            # on the whole result's size as it arrives, or by the audit of its chunks
            assert liar in o.peers, o
            assert "failed this worker's audit" in str(o) or "larger than its members" in str(o), o
            assert set(runners[m].malformed) == {liar}, runners[m].malformed
    # Without the audit every member would have applied it (what the issue saw: every round "ok").
    unaudited = run(honest_round(members, _flats(4), [1.0] * 4, "fp16", group_id="g2",
                                 aggregation=Aggregation(aggregation)))
    assert all(not isinstance(o, Exception) for o in unaudited)


class MisreportsB(ShardReducer):
    def _commitment(self, member, index, values):
        root, norm = super()._commitment(member, index, values)
        return (root, norm * 0.5) if member == "peer-2" else (root, norm)


def test_an_owner_that_misreports_a_members_input_is_named_by_that_member(monkeypatch):
    members = [f"peer-{i}" for i in range(3)]
    runners = dishonest(monkeypatch, "peer-0", lambda r: setattr(r.reducer, "__class__", MisreportsB))
    outcomes = run(honest_round(members, _flats(3), [1.0] * 3, "fp16", audit_chunks=2))
    assert isinstance(outcomes[2], Exception) and "peer-0" in outcomes[2].peers, outcomes[2]
    assert "misreports this worker's part" in str(outcomes[2]) and set(runners["peer-2"].malformed) == {"peer-0"}
    assert all(isinstance(o, Exception) for o in outcomes)


class AnswersWrong(RoundRunner):
    async def _answer_audit(self, stream, sender, meta):
        real = self._own_chunk
        self._own_chunk = lambda j, i, c: real(j, i, c) + 1.0
        try:
            await super()._answer_audit(stream, sender, meta)
        finally:
            self._own_chunk = real


def test_a_member_that_answers_an_audit_with_other_values_breaks_the_round_but_frames_nobody(monkeypatch):
    members = [f"peer-{i}" for i in range(3)]
    runners = dishonest(monkeypatch, "peer-1", lambda r: setattr(r, "__class__", AnswersWrong))
    outcomes = run(honest_round(members, _flats(3), [1.0] * 3, "fp16", audit_chunks=2))
    for m in (0, 2):
        o = outcomes[m]
        assert isinstance(o, PeerFailure) and "peer-1" in o.peers and "do not match" in str(o), o
        assert not runners[members[m]].malformed  # it could be the owner's commitment: nobody is blamed


class Sent:
    def __init__(self):
        self.frames = []

    async def send(self, code, meta=None, payload=b""):
        self.frames.append((code, meta, bytes(payload)))


def test_audit_requests_are_bounded_and_checked_before_any_work():
    group = Group("g", ("a", "b", "c"), RoundKey(0))
    with pytest.raises(ValueError):
        RoundRunner(group, "a", torch.zeros(8), 1.0, get_codec("fp16"), audit_chunks=audit.MAX_AUDIT_CHUNKS + 1)
    runner = RoundRunner(group, "a", torch.randn(3000), 1.0, get_codec("fp16"), part_numel=PART, audit_chunks=2)
    for j, (a, _) in enumerate(runner.bounds):  # as if its parts had gone out
        runner._commit(j, 0, runner._encode(a, a + PART), PART)
    for bad in ([[1, 0, 0]],  # the asker's own shard
                [[0, 5, 0]], [[0, 0, 99]], [[3, 0, 0]],  # no such part, chunk, owner
                [[0, 0, 0]] * 7,  # more than audit_chunks per owner
                [["0", 0, 0]], [[0, 0]], "everything"):
        with pytest.raises(ProtocolError):
            run(runner._answer_audit(Sent(), "b", {"chunks": bad}))
    sent = Sent()
    run(runner._answer_audit(sent, "b", {"chunks": [[0, 0, 1], [2, 0, 0]]}))
    (_, meta, payload), _ = sent.frames
    chunk = torch.frombuffer(bytearray(payload), dtype=runner.codec.view_dtype)  # fp16: as decoded
    assert audit.path_ok(chunk, 1, meta["path"], runner._trees[(0, 0)].root, PART)


@pytest.mark.parametrize("scale", [1e-7, 1e-5, 3e4])
@pytest.mark.parametrize("codec", ["fp16", "scaled-fp16", "int4/fp16", "e3m0"])
def test_honest_owners_pass_an_audit_of_every_chunk_at_the_codecs_edges(monkeypatch, scale, codec):
    """Values in fp16's subnormal range (2**-24 apart), near its saturation, and zeros: rounding
    there is what an honest owner's result differs by, and must never name it."""
    monkeypatch.setattr(audit, "AUDIT_BYTES_SHARE", 1e6)  # audit every chunk
    codec, _, result = codec.partition("/")
    flats = _flats(3)
    flats = [f * scale for f in flats]
    flats[0][:500] = 0.0
    members = [f"peer-{i}" for i in range(3)]
    outcomes = run(honest_round(members, flats, [1.0, 2.0, 1.0], codec, result=result or None,
                                audit_chunks=audit.MAX_AUDIT_CHUNKS))
    assert all(not isinstance(o, Exception) for o in outcomes), outcomes


class SilentBeforeTheAudit(RoundRunner):
    async def _answer_audit(self, stream, sender, meta):
        await asyncio.Event().wait()  # its shard is out; it never answers


def test_a_member_silent_before_it_answers_the_audit_fails_the_round_for_everyone(monkeypatch):
    """Its result cannot be checked (its own values are part of it): nobody applies it; the others
    name it, without blame, and retry without it (an owner that goes quiet once its result is out
    must not pass)."""
    members = [f"peer-{i}" for i in range(3)]
    dishonest(monkeypatch, "peer-2", lambda r: setattr(r, "__class__", SilentBeforeTheAudit))
    outcomes = run(honest_round(members, _flats(3), [1.0] * 3, "fp16", audit_chunks=2, timeout=2))
    for o in outcomes[:2]:
        assert isinstance(o, PeerFailure) and "peer-2" in o.peers, o


# -- the whole result's size (every value, not only the audited chunks) -------------------------------

def _bounded(method: str, codec: str, result: str, clip: float = 4.0) -> bool:
    """Whether an owner's result part passes ``result_norm_bound``: ``result`` is "honest" (the round's
    own rule), "-1x" (minus it: the same size), "60000" (everywhere) or "2x"."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(4096, generator=g) * s for s in (1.0, 0.5, 2.0, 40.0)]  # one member far larger
    c = get_codec(codec)
    decoded = [c.roundtrip(p) for p in parts]
    aggregation = Aggregation(method, clip_ratio=clip)
    declared = [1.0, 2.0, 1.0, 9.0]
    weights, _ = aggregation.weights(declared)
    norms = [audit.norm_of(d) for d in decoded]
    acc, _ = aggregation.combine(decoded, weights, norms)
    poisoned = {"honest": acc, "-1x": -acc, "60000": torch.full_like(acc, 60000.0), "2x": 2 * acc}[result]
    sent = c.averages.roundtrip(poisoned)
    return audit.norm_of(sent) <= audit.result_norm_bound(aggregation, declared, norms, c.averages, sent.numel())


@pytest.mark.parametrize("method,codec,result,passes", [
    ("mean", "fp16", "honest", True),
    ("mean", "none", "honest", True),
    ("mean", "e2m1", "honest", True),
    ("mean", "int4", "honest", True),
    ("mean", "int8", "honest", True),
    ("centered-clip", "fp16", "honest", True),
    ("centered-clip", "e2m1", "honest", True),
    ("mean", "fp16", "-1x", True),   # the same size: only the audit of its chunks can tell
    ("mean", "fp16", "60000", False),
    ("mean", "e2m1", "60000", False),
    ("centered-clip", "fp16", "60000", False),
    ("mean", "fp16", "2x", False),  # the members' parts point the same way enough here
])
def test_an_owners_whole_result_is_bounded_by_what_its_members_committed_to(method, codec, result, passes):
    assert _bounded(method, codec, result) is passes


def test_the_bound_takes_the_clip_and_the_weight_cap_into_account():
    """The far larger member is clipped to 4x the median norm and its claim of 9 capped: without the clip
    its own size would let a poisoned result through."""
    assert _bounded("mean", "fp16", "honest", clip=4.0)
    assert _bounded("mean", "fp16", "honest", clip=float("inf"))


# -- an owner that keeps its result from the audit ----------------------------------------------------

async def _hangs(*args, **kw):
    await asyncio.sleep(3600)


@pytest.mark.parametrize("mode", ["-1x", "60000"])
def test_an_owner_that_leaves_its_audit_unanswered_has_its_result_applied_nowhere(monkeypatch, mode):
    """Before, members whose audit stalled failed "in doubt", heard "done" from the owner when they asked,
    and applied the average they held (2e13 in the first poisoned round). Now a member applies a round
    only where its own audit passed, names the silent owner, and does not believe its "done"."""
    from opendiloco.comm.outcome import resolve
    from opendiloco.errors import InDoubt, Malformed, RoundCounted
    from opendiloco.testing.memory import MemoryNetwork

    members = [f"peer-{i}" for i in range(4)]
    liar = members[1]

    def silent(r):
        r.reducer.aggregation = Sets("mean", mode=mode if mode == "60000" else "-1x")
        r._answer_audit = _hangs

    runners = dishonest(monkeypatch, liar, silent)
    flats = _flats(4)

    async def scenario():
        net = MemoryNetwork()
        for m in members:
            net.add(m)
        outcomes = await honest_round(members, flats, [1.0] * 4, "fp16", net=net, audit_chunks=4,
                                      confirm_timeout=1.0)
        settled = {}
        for m, o in zip(members, outcomes):
            if m != liar and isinstance(o, InDoubt):
                assert o.held is None, m  # nothing to apply without its own audit
                try:
                    settled[m] = await resolve(o, net.connector(m), RoundKey(3), 5.0, net.rounds[m])
                except RoundCounted as e:
                    settled[m] = e
        return outcomes, settled

    outcomes, settled = run(scenario(), timeout=60)
    for m, o in zip(members, outcomes):
        if m == liar:
            continue
        assert isinstance(o, (Malformed, InDoubt)), o  # nobody applies the round
        assert liar in runners[m].malformed, (m, runners[m].malformed)
        why = runners[m].malformed[liar]
        assert "left this worker's audit unanswered" in why or "larger than its members" in why, why
    # Whoever settled an attempt in doubt retries: nobody it believes completed the round.
    assert all(v is None for v in settled.values()), settled

