"""The round runner's protocol over in-memory streams: no DHT, no daemon, every refusal exercised.

Honest peers are ``RoundRunner``s; each attack is a small attacker script that speaks the wire
format by hand (``ByteStream.send`` or raw bytes) as member ``b`` of a two-member group.
"""

from __future__ import annotations

import asyncio
import functools
import struct

import msgpack
import pytest
import torch

from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.base import RoundKey
from opendiloco.comm.formats import get_codec
from opendiloco.comm.group import Group, part_bounds, shard_bounds, shard_bounds_for
from opendiloco.comm.outcome import Answer, ask_outcome, resolve
from opendiloco.comm.reducer import ShardReducer
from opendiloco.comm.runner import RoundRunner
from opendiloco.comm.wire import PREFIX, ByteStream, Code, Refused, memory_pipe
from opendiloco.errors import AveragingError, InDoubt, PeerFailure, ProtocolError, RoundCounted, Unreachable
from opendiloco.fingerprint import new_hasher
from opendiloco.testing.memory import MemoryNetwork

pytestmark = pytest.mark.timeout(60)

FP16_LABEL = f"fp16|{Aggregation().label}"  # what an opening frame names: formats and aggregation
PART = 1000  # values per part: small, so that every test vector has several parts


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def reference(flats, weights, codec_name, result_name=None):
    """The owner's computation, shard by shard and part by part: what every member must end with."""
    codec = get_codec(codec_name)
    result_codec = get_codec(result_name or codec_name)
    n, total = flats[0].numel(), sum(weights)
    out = torch.empty(n)
    for a, b in shard_bounds(n, len(flats)):
        for pa, pb in part_bounds(b - a, PART):
            acc = torch.zeros(pb - pa)
            for f, w in zip(flats, weights):
                if w:
                    acc.add_(codec.roundtrip(f[a + pa : a + pb]), alpha=w / total)
            out[a + pa : a + pb] = result_codec.roundtrip(acc)
    return out


async def honest_round(members, flats, weights, codec="fp16", net=None, group_id="g1", result=None, errors=None,
                       relayed=frozenset(), **kw):
    net = net or MemoryNetwork()
    for m in members:
        if m not in net.rounds:
            net.add(m)
    group = Group(group_id, tuple(members), RoundKey(3), frozenset(relayed))
    errors = errors or [None] * len(members)
    runners = [RoundRunner(group, m, f, w, get_codec(codec), part_numel=PART,
                           result_codec=get_codec(result) if result else None, error_out=e, **kw)
               for m, f, w, e in zip(members, flats, weights, errors)]
    for m, r in zip(members, runners):
        await net.rounds[m].register(r)
    try:
        return await asyncio.gather(*[r.run(net.connector(m)) for m, r in zip(members, runners)],
                                    return_exceptions=True)
    finally:
        for m in members:
            net.rounds[m].finish(group_id)


@pytest.mark.parametrize("codec", ["none", "fp16", "scaled-fp16", "int8", "int4", "e2m1", "e3m0", "int4/int8",
                                   "e2m1/fp16"])
@pytest.mark.parametrize("size", [3, 4])
def test_members_end_bit_identical_with_the_owners_average(codec, size):
    codec, _, result = codec.partition("/")
    n = 10_007
    g = torch.Generator().manual_seed(size)
    flats = [torch.randn(n, generator=g) * (i + 1) for i in range(size)]
    weights = [1.0, 3.0, 0.0, 2.0][:size]
    members = [f"peer-{i}" for i in range(size)]
    errors = [torch.full((n,), float("nan")) for _ in range(size)]
    outcomes = run(honest_round(members, flats, weights, codec, result=result or None, errors=errors))
    want = reference(flats, weights, codec, result or None)
    c = get_codec(codec)
    for f, e in zip(flats, errors):  # each member learns exactly what its contribution lost on the wire
        sent = torch.cat([c.roundtrip(f[a + pa : a + pb]) for a, b in shard_bounds(n, size)
                          for pa, pb in part_bounds(b - a, PART)])
        assert torch.equal(e, f - sent)
    for o in outcomes:
        assert not isinstance(o, Exception), o
        assert torch.equal(o.flat, want)
        assert o.digest == outcomes[0].digest and o.total_weight == sum(weights)
        assert len(o.confirmed_by) == size - 1 and not o.missing_confirmations
    # a weighted average really happened (not just one member's values)
    assert not torch.equal(want, get_codec(codec).roundtrip(flats[1]))


@pytest.mark.parametrize("relayed", [{"peer-1"}, {"peer-1", "peer-2"}, {"peer-0", "peer-1", "peer-2", "peer-3"}])
def test_members_behind_nat_own_no_shard_and_end_bit_identical(relayed):
    """A member reached only through a relay owns an empty shard: the others send it nothing but the
    round's small frames, the owners average everything, and every member ends with the same bits
    (audited too). If every member is relayed, the shards are equal as usual."""
    n, size = 12_000, 4
    members = [f"peer-{i}" for i in range(size)]
    g = torch.Generator().manual_seed(7)
    flats = [torch.randn(n, generator=g) for _ in range(size)]
    outcomes = run(honest_round(members, flats, [1.0] * size, "fp16", relayed=relayed, audit_chunks=4))
    for o in outcomes:
        assert not isinstance(o, Exception), o
    bounds = shard_bounds_for(n, members, frozenset(relayed))
    owners = [m for m, (a, b) in zip(members, bounds) if b > a]
    assert owners == ([m for m in members if m not in relayed] or members)
    mean = sum(get_codec("fp16").roundtrip(f) for f in flats) / size
    for o in outcomes:
        assert torch.equal(o.flat, outcomes[0].flat) and o.digest == outcomes[0].digest
        assert torch.allclose(o.flat, mean, atol=2e-3)
    for m, o in zip(members, outcomes):
        a, b = bounds[members.index(m)]
        # fp16 both ways (audit answers come on top): its contribution to every other owner's shard, and
        # its own shard's result to every other member; a member that owns nothing sends all it has
        assert o.bytes_sent >= 2 * (n - (b - a)) + 2 * (b - a) * (size - 1)
        if m in relayed and len(owners) < size:
            assert a == b and o.bytes_sent >= 2 * n


def test_an_empty_shard_is_not_audited():
    """A vector with fewer values than the group has members leaves some shards empty; auditing one
    asked for values that do not exist (and failed the round on an empty answer)."""
    members = ["p0", "p1", "p2"]
    outcomes = run(honest_round(members, [torch.randn(2) for _ in members], [1.0] * 3, "fp16", audit_chunks=4))
    for o in outcomes:
        assert not isinstance(o, Exception), o
        assert o.digest == outcomes[0].digest


def test_bytes_sent_are_bandwidth_optimal():
    n, size = 12_000, 4  # shards of 3000 values
    flats = [torch.randn(n) for _ in range(size)]
    outcomes = run(honest_round([f"p{i}" for i in range(size)], flats, [1.0] * size, "fp16"))
    for o in outcomes:
        assert o.bytes_sent == 2 * (size - 1) / size * n * 2  # reduce-scatter + all-gather, fp16


@pytest.mark.parametrize("codec,result", [("int4", None), ("int4", "int8"), ("e2m1", "fp16")])
def test_bytes_sent_follow_both_wire_formats(codec, result):
    n, size = 12_800, 4  # shards of 3200 values: whole 64-value blocks, parts of 1000 pad
    flats = [torch.randn(n) for _ in range(size)]
    outcomes = run(honest_round([f"p{i}" for i in range(size)], flats, [1.0] * size, codec, result=result))
    c, r = get_codec(codec), get_codec(result or codec)
    parts = part_bounds(n // size, PART)
    # a member sends its contributions to the others' shards and its shard's averages to them
    want = (size - 1) * sum(c.wire_bytes(b - a) + r.wire_bytes(b - a) for a, b in parts)
    for o in outcomes:
        assert o.bytes_sent == want


def test_members_disagreeing_on_the_result_format_are_refused():
    n = 4 * PART
    flats = [torch.randn(n), torch.randn(n)]
    net = MemoryNetwork(wait_for_group=0.5)
    for m in ("a", "b"):
        net.add(m)
    group = Group("g", ("a", "b"), RoundKey(0))

    async def scenario():
        runners = [RoundRunner(group, "a", flats[0], 1.0, get_codec("int4"), part_numel=PART, timeout=2,
                               result_codec=get_codec("int8")),
                   RoundRunner(group, "b", flats[1], 1.0, get_codec("int4"), part_numel=PART, timeout=2)]
        for m, r in zip("ab", runners):
            await net.rounds[m].register(r)
        return await asyncio.gather(*[r.run(net.connector(m)) for m, r in zip("ab", runners)],
                                    return_exceptions=True)

    outcomes = run(scenario())
    assert all(isinstance(o, AveragingError) for o in outcomes), outcomes
    assert any("int4/int8.v2" in str(o) for o in outcomes)


def test_owner_streams_averaged_parts_before_the_last_contribution_arrives():
    """Pipelining: the owner answers part 0 while the contributor still holds back part 1."""
    n = 4 * PART  # 2 shards of 2 parts
    flat_a, flat_b = torch.randn(n), torch.randn(n)
    codec = get_codec("fp16")
    seen = []

    async def scenario():
        net = MemoryNetwork()
        net.add("a")
        net.add("b", handler=lambda s: asyncio.sleep(0))  # b never serves: only a's shard matters here
        group = Group("g", ("a", "b"), RoundKey(0))
        runner = RoundRunner(group, "a", flat_a, 1.0, codec, part_numel=PART, timeout=5)
        await net.rounds["a"].register(runner)
        task = asyncio.create_task(runner.run(net.connector("a")))
        stream = await net.connector("b")("a")
        await stream.send(Code.CONTRIBUTE, {"group_id": "g", "sender": "b", "weight": 1.0, "numel": 2 * PART,
                                            "parts": 2, "codec": FP16_LABEL})
        await stream.send(Code.PART, {"i": 0}, codec.to_bytes(flat_b[:PART]))
        seen.append(await stream.recv(max_payload=0, expect=Code.RESULT))
        seen.append(await stream.recv(max_payload=2 * PART, expect=Code.RESULT_PART))  # before part 1 was sent
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(scenario())
    assert seen[0].meta["total_weight"] == 2.0 and seen[1].meta["i"] == 0
    want = codec.roundtrip(codec.roundtrip(flat_a[:PART]) * 0.5 + codec.roundtrip(flat_b[:PART]) * 0.5)
    assert torch.equal(codec.from_bytes(seen[1].payload, PART), want)


# -- attacks: member b is an attacker script; a is honest -----------------------------------------

N = 4 * PART
OPENING = {"group_id": "g", "sender": "b", "weight": 1.0, "numel": 2 * PART, "parts": 2, "codec": FP16_LABEL}


def attack(script, *, group_id="g", timeout=1.0, b_serves=None, codec="fp16"):
    """Runs honest a against ``script(stream_to_a)``; returns (a's exception or outcome, script's result)."""
    codec = get_codec(codec)

    async def scenario():
        net = MemoryNetwork(wait_for_group=0.5)
        net.add("a")

        async def b_handler(stream):  # a's contribution to b's shard: b just reads it, then sits
            if b_serves is not None:
                await b_serves(stream)
                return
            await read_refusal(stream)  # reads until the stream ends, whatever comes

        net.add("b", handler=b_handler)
        group = Group(group_id, ("a", "b"), RoundKey(0))
        runner = RoundRunner(group, "a", torch.randn(N), 1.0, codec, part_numel=PART, timeout=timeout,
                             confirm_timeout=2.0)
        await net.rounds["a"].register(runner)
        task = asyncio.create_task(runner.run(net.connector("a")))
        stream = await net.connector("b")("a")
        try:
            got = await script(stream)
        except ProtocolError as e:
            got = e
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        await net.drain()
        return outcome, got

    return run(scenario())


async def read_refusal(stream: ByteStream) -> Refused | None:
    """Reads a stream to its end: the refusal that ended it, or None."""
    try:
        while True:
            await stream.recv(max_payload=1 << 20)
    except Refused as e:
        return e
    except ProtocolError:
        return None


def test_spoofed_sender_is_refused():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, {**OPENING, "sender": "a"})  # claims to be the owner itself
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and "authenticated peer id" in str(refusal)
    assert isinstance(outcome, PeerFailure) and "b" in outcome.peers  # a's round fails, naming b


def test_foreign_group_id_is_refused():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, {**OPENING, "group_id": "not-a-round-of-a"})
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and "unknown group" in str(refusal)
    assert isinstance(outcome, PeerFailure)


@pytest.mark.parametrize("raw", [
    PREFIX.pack(99, 0, 0),  # unknown message code
    PREFIX.pack(int(Code.CONTRIBUTE), 5, 0) + b"\xc1\xc1\xc1\xc1\xc1",  # meta that is not msgpack
    PREFIX.pack(int(Code.CONTRIBUTE), 3, 0) + msgpack.packb([1, 2]),  # meta that is not a map
    PREFIX.pack(int(Code.CONTRIBUTE), 1 << 30, 0),  # a gigabyte of meta announced
    PREFIX.pack(int(Code.PART), 0, 0),  # a part before any opening
], ids=["unknown-code", "garbage-meta", "meta-not-a-map", "huge-meta", "part-first"])
def test_wrong_header_is_refused(raw):
    async def script(stream):
        stream.writer.write(raw)
        await stream.writer.drain()
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused)
    assert isinstance(outcome, PeerFailure)


@pytest.mark.parametrize("change,expected", [
    ({"numel": 2 * PART + 1}, "this shard has"),
    ({"parts": 3}, "this shard has"),
    ({"codec": "int8"}, "codec"),
    ({"weight": float("nan")}, "invalid weight"),
    ({"weight": -1.0}, "invalid weight"),
    ({"weight": 1e300}, "invalid weight"),
    ({"weight": "1"}, "wrong type"),
], ids=["numel", "parts", "codec", "nan-weight", "negative-weight", "huge-weight", "string-weight"])
def test_opening_that_does_not_fit_the_round_is_refused(change, expected):
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, {**OPENING, **change})
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and expected in str(refusal)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


def test_short_payload_is_refused():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, OPENING)
        await stream.send(Code.PART, {"i": 0}, b"\x00" * (2 * PART - 2))  # one fp16 value short
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and "payload of" in str(refusal)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


def test_stream_closed_mid_frame_fails_the_round_naming_the_sender():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, OPENING)
        stream.writer.write(PREFIX.pack(int(Code.PART), 0, 2 * PART) + b"\x00" * 10)  # then hangs up
        stream.close()

    outcome, _ = attack(script)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


def test_oversized_payload_is_refused_before_it_is_read():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, OPENING)
        stream.writer.write(PREFIX.pack(int(Code.PART), len(msgpack.packb({"i": 0})), 1 << 31)
                            + msgpack.packb({"i": 0}))  # announces 2 GiB, sends none of it
        await stream.writer.drain()
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and "at most" in str(refusal)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_are_refused(bad):
    async def script(stream):
        values = torch.zeros(PART)
        values[17] = bad
        await stream.send(Code.CONTRIBUTE, OPENING)
        await stream.send(Code.PART, {"i": 0}, values.half().numpy().tobytes())
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and "non-finite" in str(refusal)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 3.0e38])
def test_a_forged_block_scale_is_refused(scale):
    """4-bit values are always finite; a scale is where an attacker can put NaN, inf, or a value
    that overflows once multiplied by the largest code."""

    async def script(stream):
        c = get_codec("int4")
        fields = c.encode(torch.randn(PART))
        fields["scale"][3] = scale
        fields["values"][3 * 32 : 4 * 32] = c.encode(torch.ones(64))["values"][0]  # the largest value, twice
        payload = fields["scale"].numpy().tobytes() + fields["values"].numpy().tobytes()
        await stream.send(Code.CONTRIBUTE, {**OPENING, "codec": f"int4|{Aggregation().label}"})
        await stream.send(Code.PART, {"i": 0}, payload)
        return await read_refusal(stream)

    outcome, refusal = attack(script, codec="int4")
    assert isinstance(refusal, Refused) and "non-finite" in str(refusal)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


def test_duplicate_or_out_of_order_part_is_refused():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, OPENING)
        await stream.send(Code.PART, {"i": 0}, torch.zeros(PART).half().numpy().tobytes())
        await stream.send(Code.PART, {"i": 0}, torch.zeros(PART).half().numpy().tobytes())  # replayed
        return await read_refusal(stream)

    outcome, refusal = attack(script)
    assert isinstance(refusal, Refused) and "expected part 1" in str(refusal)
    assert isinstance(outcome, PeerFailure)


def _owner_answer(digest_of=None, total=2.0, values=None, cut=None):
    """b as the owner of shard 1: reads a's contribution, answers with chosen results."""

    async def serve(stream):
        opening = await stream.recv(max_payload=0, expect=Code.CONTRIBUTE)
        n = opening.meta["numel"]
        for _ in range(opening.meta["parts"]):
            await stream.recv(max_payload=1 << 20, expect=Code.PART)
        await stream.send(Code.RESULT, {"total_weight": total})
        h = new_hasher()
        for i, (a, b) in enumerate(part_bounds(n, PART)):
            payload = (values if values is not None else torch.zeros(b - a)).half().numpy().tobytes()
            h.update(payload)
            await stream.send(Code.RESULT_PART, {"i": i}, payload)
        await stream.send(Code.RESULT_END, {"digest": digest_of or h.hexdigest(), "clipped": [], "capped": [],
                                            **(cut or {})})
        try:
            await stream.recv(max_payload=0)
        except ProtocolError:
            pass

    return serve


async def _contribute_honestly(stream):
    codec = get_codec("fp16")
    await stream.send(Code.CONTRIBUTE, OPENING)
    for i in range(2):
        await stream.send(Code.PART, {"i": i}, codec.to_bytes(torch.zeros(PART)))
    return await read_refusal(stream)


def test_digest_mismatch_from_an_owner_fails_the_round():
    outcome, _ = attack(_contribute_honestly, b_serves=_owner_answer(digest_of="0" * 64))
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"} and "digest" in str(outcome)


@pytest.mark.parametrize("cut", [{"clipped": ["mallory"]}, {"capped": ["a"] * 3}, {"clipped": [{"x": 1}]},
                                 {"capped": "a"}], ids=["non-member", "too-many", "not-a-name", "not-a-list"])
def test_an_owner_naming_whom_it_cut_is_checked(cut):
    """The list of members an owner clipped or capped reaches every outer_step record: it may only
    name members of the round, no more names than members, or the round fails naming the owner."""
    outcome, _ = attack(_contribute_honestly, b_serves=_owner_answer(total=1.0, cut=cut))
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}, outcome


def test_non_finite_average_from_an_owner_is_refused():
    values = torch.zeros(PART)
    values[3] = float("inf")
    outcome, _ = attack(_contribute_honestly, b_serves=_owner_answer(values=values))
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"} and "not finite" in str(outcome)


def test_owner_reporting_another_total_weight_fails_the_round():
    outcome, _ = attack(_contribute_honestly, b_serves=_owner_answer(total=5.0))
    assert isinstance(outcome, AveragingError) and "total weight" in str(outcome)


def test_a_member_confirming_another_average_makes_the_round_refused():
    async def script(stream):
        codec = get_codec("fp16")
        await stream.send(Code.CONTRIBUTE, OPENING)
        for i in range(2):
            await stream.send(Code.PART, {"i": i}, codec.to_bytes(torch.zeros(PART)))
        await stream.recv(max_payload=0, expect=Code.RESULT)
        for _ in range(2):
            await stream.recv(max_payload=2 * PART, expect=Code.RESULT_PART)
        await stream.recv(max_payload=0, expect=Code.RESULT_END)
        await stream.send(Code.CONFIRM, {"digest": "something else"})

    outcome, _ = attack(script, b_serves=_owner_answer())
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"} and "different average" in str(outcome)


def test_replayed_message_of_an_earlier_round_is_refused():
    """b records its opening of a finished round and replays it: refused at once."""

    async def scenario():
        net = MemoryNetwork(wait_for_group=5.0)
        flats = [torch.randn(N), torch.randn(N)]
        first = await honest_round(["a", "b"], flats, [1.0, 1.0], net=net, group_id="round-1")
        assert all(not isinstance(o, Exception) for o in first)
        stream = await net.connector("b")("a")
        await stream.send(Code.CONTRIBUTE, {**OPENING, "group_id": "round-1"})
        return await read_refusal(stream)

    refusal = run(scenario())
    assert isinstance(refusal, Refused) and "already finished" in str(refusal)


def test_silent_member_costs_one_timeout_and_is_named():
    async def script(stream):
        await stream.send(Code.CONTRIBUTE, OPENING)
        await asyncio.sleep(2)  # never sends its parts

    outcome, _ = attack(script, timeout=0.5)
    assert isinstance(outcome, PeerFailure) and "b" in outcome.peers and "no answer" in str(outcome)


# -- the pieces on their own -------------------------------------------------------------------------

def test_frames_refuse_payloads_over_the_receivers_limit():
    async def scenario():
        a, b = memory_pipe("a", "b")
        await a.send(Code.PART, {"i": 0}, b"x" * 100)
        with pytest.raises(ProtocolError, match="at most 99"):
            await b.recv(max_payload=99)

    run(scenario())


def test_reducer_refuses_non_members_and_double_contributions():
    r = ShardReducer(get_codec("fp16"), 10, ["a", "b"], PART)
    r.begin("a", 1.0)
    with pytest.raises(ProtocolError, match="not a member"):
        r.begin("mallory", 1.0)
    with pytest.raises(ProtocolError, match="twice"):
        r.begin("a", 1.0)
    with pytest.raises(ProtocolError, match="before opening"):
        r.add_part("b", 0, b"\x00" * 20)


def test_all_zero_weights_fail_instead_of_dividing_by_zero():
    outcomes = run(honest_round(["a", "b"], [torch.ones(N), torch.ones(N)], [0.0, 0.0]))
    assert all(isinstance(o, AveragingError) for o in outcomes)


def test_prefix_layout_is_fixed():
    assert PREFIX.size == 9 and PREFIX.format == struct.Struct("!BII").format


@pytest.mark.parametrize("codec", ["none", "fp16", "scaled-fp16", "int8", "int4"])
def test_an_averaged_part_keeps_its_bytes_while_later_parts_are_reduced(codec):
    """The transport may read a payload after later parts were reduced: results must never share memory."""
    c = get_codec(codec)
    r = ShardReducer(c, 5 * PART, ["a", "b"], PART)
    r.begin("a", 1.0)
    r.begin("b", 1.0)
    first_seen = {}
    for i in range(5):
        for member in ("a", "b"):
            payload = bytes(c.to_bytes(torch.randn(PART)))
            for done in r.add_part(member, i, payload):
                first_seen[done] = bytes(r.results[done])
    assert sorted(first_seen) == list(range(5))
    assert all(bytes(r.results[i]) == first_seen[i] for i in range(5))


def test_an_outsider_naming_the_round_is_refused_and_cannot_break_it():
    """z knows the group id (it can be computed from public records) and contributes: refused, round unharmed."""

    async def scenario():
        net = MemoryNetwork(wait_for_group=5.0)
        for m in ("a", "b"):
            net.add(m)
        group = Group("g", ("a", "b"), RoundKey(0))
        codec = get_codec("fp16")
        runners = [RoundRunner(group, m, torch.randn(N), 1.0, codec, part_numel=PART, timeout=10) for m in "ab"]
        for m, r in zip("ab", runners):
            await net.rounds[m].register(r)
        intruder = await net.connector("z")("a")
        await intruder.send(Code.CONTRIBUTE, {**OPENING, "sender": "z"})
        refusal = await read_refusal(intruder)
        outcomes = await asyncio.gather(*[r.run(net.connector(m)) for m, r in zip("ab", runners)],
                                        return_exceptions=True)
        return refusal, outcomes

    refusal, outcomes = run(scenario())
    assert isinstance(refusal, Refused) and "not a member" in str(refusal)
    assert all(not isinstance(o, Exception) for o in outcomes), outcomes
    assert torch.equal(outcomes[0].flat, outcomes[1].flat)


def test_a_flood_of_streams_naming_unknown_rounds_is_bounded():
    """An outsider opens 40 streams naming rounds nobody knows: 4 wait for their round (it might still
    be registered), the rest are refused at once, and a real round alongside is not held up."""
    n = 4 * PART
    flats = [torch.randn(n), torch.randn(n)]

    async def scenario():
        net = MemoryNetwork(wait_for_group=1.0)
        for m in ("a", "b", "m"):
            net.add(m)

        async def flood(i):
            stream = await net.connector("m")("a")
            await stream.send(Code.CONTRIBUTE, {**OPENING, "sender": "m", "group_id": f"nobody-{i}"})
            return await read_refusal(stream)

        group = Group("g", ("a", "b"), RoundKey(0))
        runners = [RoundRunner(group, m, f, 1.0, get_codec("fp16"), part_numel=PART, timeout=5)
                   for m, f in zip("ab", flats)]
        for m, r in zip("ab", runners):
            await net.rounds[m].register(r)
        refusals = await asyncio.gather(*[flood(i) for i in range(40)])
        outcomes = await asyncio.gather(*[r.run(net.connector(m)) for m, r in zip("ab", runners)])
        await net.drain()
        return refusals, outcomes, net.rounds["a"]._waiting

    refusals, outcomes, waiting = run(scenario())
    reasons = [str(r) for r in refusals]
    assert sum("too many streams waiting" in r for r in reasons) == 36, reasons
    assert sum("unknown group" in r for r in reasons) == 4  # those waited out wait_for_group
    assert torch.equal(outcomes[0].flat, outcomes[1].flat)
    assert not waiting  # every waiting slot was given back


def test_a_contribution_to_another_group_of_a_round_this_worker_completed_is_refused_at_once():
    """A peer that saw this worker's announcement of a round, but not yet that it completed the round in
    another group, groups with it: its contribution is refused at once, not after ``wait_for_group`` (in
    a 200 ms world scenario a joiner that was one round behind lost 15 s to that wait, round after round)."""

    async def scenario():
        net = MemoryNetwork(wait_for_group=30.0)
        for m in ("a", "m"):
            net.add(m)
        net.rounds["a"].completed(str(RoundKey(4)), "the-group-it-was-in")

        async def contribute(round_key: str, group_id: str):
            stream = await net.connector("m")("a")
            await stream.send(Code.CONTRIBUTE, {**OPENING, "sender": "m", "group_id": group_id, "round": round_key})
            return await asyncio.wait_for(read_refusal(stream), 5.0)

        late = await contribute(str(RoundKey(4)), "another-group")
        other = asyncio.create_task(contribute(str(RoundKey(5)), "a-group-of-round-5"))  # may still come: waits
        await asyncio.sleep(0.5)
        waiting = not other.done()
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        await net.drain()
        return late, waiting

    late, waiting = run(scenario())
    assert isinstance(late, Refused) and "completed round 4.0 in another group" in str(late), late
    assert waiting


def _three_members():
    """"a", "m" and "c" on one in-memory network; "a"'s streams wait for their group 30 s at most."""
    net = MemoryNetwork(wait_for_group=30.0)
    for m in ("a", "m", "c"):
        net.add(m)
    return net


async def _contribute(net, key: str, group_id: str, attempt):
    """What "a" answers "m" streaming to it a contribution to ``group_id`` at ``attempt`` of round ``key``."""
    stream = await net.connector("m")("a")
    await stream.send(Code.CONTRIBUTE, {**OPENING, "sender": "m", "group_id": group_id, "round": key,
                                        "attempt": attempt})
    return await asyncio.wait_for(read_refusal(stream), 5.0)


def test_a_contribution_to_another_group_of_an_attempt_this_worker_is_grouped_in_is_refused_at_once():
    """Two leaders each published a group of the same attempt holding a member (each left out a peer the
    other waited for): the member takes one, and the other's members streamed to it and waited
    ``wait_for_group`` for nothing (15 s of a member in ``natpeer.toml``, then taken for cut off). A
    member in a group of an attempt never joins another of that attempt or of an earlier one: such a
    stream is refused at once, also one that was already waiting when the member took its group. One
    for a later attempt may still come, and waits."""

    async def scenario():
        net, key = _three_members(), str(RoundKey(51))
        contribute = functools.partial(_contribute, net, key)

        early = asyncio.create_task(contribute("m-leads-attempt-2", 2))  # before a took its group: waits
        await asyncio.sleep(0.3)
        waited = not early.done()
        mine = Group("c-leads-attempt-2", ("a", "c"), RoundKey(51), attempt=2)
        await net.rounds["a"].register(RoundRunner(mine, "a", torch.zeros(8), 1.0, get_codec("fp16")))
        refused_then = await early
        at_once = await contribute("m-leads-attempt-1", 1)
        later = asyncio.create_task(contribute("m-leads-attempt-3", 3))  # a may yet be in attempt 3
        unknown = asyncio.create_task(contribute("an-older-peer", -1))  # no attempt said: as before
        await asyncio.sleep(0.5)
        still = not later.done() and not unknown.done()
        for task in (later, unknown):
            task.cancel()
        await asyncio.gather(later, unknown, return_exceptions=True)
        net.rounds["a"].finish(mine.group_id)
        await net.drain()
        return waited, refused_then, at_once, still

    waited, refused_then, at_once, still = run(scenario())
    assert waited
    for refusal in (refused_then, at_once):
        assert isinstance(refusal, Refused) and "in another group of round 51.0 (attempt 2)" in str(refusal), refusal
    assert still


def test_a_contribution_to_another_group_of_an_attempt_this_worker_failed_is_refused_at_once():
    """As above, once this worker's group of the attempt has failed: it goes on to later attempts only, so
    a stream for another group of that attempt (or an earlier one) is refused at once. In the long world
    scenario the members of a group that another leader's members never took streamed to them while
    those had failed theirs, and waited ``wait_for_group`` for nothing. One for a later attempt waits."""

    async def scenario():
        net, key = _three_members(), str(RoundKey(52))
        contribute = functools.partial(_contribute, net, key)

        mine = Group("c-leads-attempt-0", ("a", "c"), RoundKey(52), attempt=0)
        await net.rounds["a"].register(RoundRunner(mine, "a", torch.zeros(8), 1.0, get_codec("fp16")))
        net.rounds["a"].finish(mine.group_id)  # it failed: "a" is back in matchmaking, for attempt 1
        at_once = await contribute("m-leads-attempt-0", 0)
        later = asyncio.create_task(contribute("m-leads-attempt-1", 1))
        await asyncio.sleep(0.5)
        still = not later.done()
        later.cancel()
        await asyncio.gather(later, return_exceptions=True)
        net.rounds["a"].reopen(key)  # the round begun anew: nothing of the old attempts stands
        again = asyncio.create_task(contribute("m-leads-attempt-0-again", 0))
        await asyncio.sleep(0.5)
        waits_again = not again.done()
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)
        await net.drain()
        return at_once, still, waits_again

    at_once, still, waits_again = run(scenario())
    assert isinstance(at_once, Refused) and "was in another group of round 52.0 at attempt 0" in str(at_once), at_once
    assert still and waits_again


def test_a_round_that_failed_while_a_step_was_under_way_fails_with_its_own_error():
    """The long scenario logged "failed here (KeyError: 0)": a member gave up on another as the audit
    began, which closed the members' streams (``_fail``), and the audit tripped on the missing one. The
    round's failure is what the round ends with, not what it left a step to trip on."""

    async def scenario():
        runner = RoundRunner(Group("g", ("a", "b"), RoundKey(1)), "a", torch.zeros(8), 1.0, get_codec("fp16"))

        async def trips():
            await runner._fail(PeerFailure("b left the run's records", {"b"}))
            raise KeyError(0)

        with pytest.raises(PeerFailure, match="b left the run's records") as caught:
            await runner._unless_failed(trips())
        return caught.value.peers

    assert run(scenario()) == {"b"}


def test_a_round_this_worker_starts_again_is_open_to_contributions_again():
    """A worker that went back to the run's state (its side of a partition was the smaller) does rounds it
    completed before again, in new groups: the communicator reopens a round when it starts it. In the long
    world scenario the healed workers did not, and once the two sides met again every attempt of the round
    failed ("this worker completed round 76.0 in another group") until the run ended, 3.5 minutes later."""

    async def scenario():
        net = MemoryNetwork(wait_for_group=30.0)
        for m in ("a", "m"):
            net.add(m)
        net.rounds["a"].completed(str(RoundKey(4)), "the-group-of-the-smaller-side")
        net.rounds["a"].reopen(str(RoundKey(4)))
        stream = await net.connector("m")("a")
        await stream.send(Code.CONTRIBUTE, {**OPENING, "sender": "m", "group_id": "the-run-s-group", "round": "4.0"})
        waiting = asyncio.create_task(read_refusal(stream))
        await asyncio.sleep(0.5)
        still_waiting = not waiting.done()  # for its round to be registered, as for any round not known yet
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await net.drain()
        return still_waiting

    assert run(scenario())


# -- a member cut off mid round ends with its group's outcome ---------------------------------------------
#
# Members apply a round once they hold every shard, even if a member's CONFIRM never came. A member
# whose own attempt failed must therefore never retry (and apply its work alone, or carry it) a
# round that another member applied: it asks them (``resolve``) and ends with the group's outcome.

MEMBERS = ("a", "b", "c")
CUT_N = 6 * PART + 7  # shards of 2003 and 2002 values: 3 parts each


class Tap:
    """The victim's end of a stream: frames pass through, and ``CutNetwork`` sees each of them."""

    def __init__(self, stream: ByteStream, net: CutNetwork):
        self.stream, self.net, self.remote = stream, net, stream.remote
        self.parts = None

    async def send(self, code, meta=None, payload=b""):
        if self.net.frozen:
            return  # into the void
        self.net.seen("send", code, self, meta, before=True)
        await self.stream.send(code, meta, payload)
        self.net.seen("send", code, self, meta)

    async def recv(self, **kw):
        while True:
            if self.net.frozen:
                await asyncio.Event().wait()  # nothing reaches the victim any more (until cancelled)
            frame = await self.stream.recv(**kw)
            if frame.code not in self.net.drop:
                break
        self.net.seen("recv", frame.code, self, frame.meta)
        return frame

    async def refuse(self, reason):
        await self.stream.refuse(reason)

    def close(self):
        self.stream.close()


class CutNetwork(MemoryNetwork):
    """The victim's round streams, cut (both ends closed) or frozen (nothing in or out, silently) at one
    point of the protocol; ``drop``: frames the victim never receives. Streams opened after it are whole,
    unless the victim died there (``dead``: cut, and ``on_death`` called; nobody reaches it any more)."""

    def __init__(self, victim: str, at: str, *, freeze: bool = False, dead: bool = False, drop=(),
                 undialled: bool = False, **kw):
        super().__init__(**kw)
        self.undialled = undialled
        self.victim, self.at, self.freeze, self.dead, self.drop = victim, at, freeze, dead, frozenset(drop)
        self.on_death = None
        self.pipes: list[tuple[ByteStream, ByteStream]] = []
        self.counts: dict[str, int] = {}
        self.done = self.frozen = False

    def connector(self, me):
        async def connect(peer):
            if peer not in self.handlers:
                if self.undialled:  # as the swarm's streams say it (a killed worker's address refuses)
                    raise Unreachable(f"could not dial {peer}: failed to dial: connection refused", {peer})
                raise ConnectionRefusedError(f"no peer {peer}")
            mine, theirs = memory_pipe(me, peer)
            if self.victim in (me, peer) and not self.done:
                self.pipes.append((mine, theirs))
                if me == self.victim:
                    mine = Tap(mine, self)
                else:
                    theirs = Tap(theirs, self)
            task = asyncio.create_task(self.handlers[peer](theirs))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return mine

        return connect

    def seen(self, way, code, tap, meta, before=False):
        if self.done:
            return
        name = f"{way}-{code.name}" + ("-before" if before else "")
        self.counts[name] = self.counts.get(name, 0) + 1
        if code == Code.CONTRIBUTE and way == "send" and not before:
            tap.parts = meta["parts"]
        if code == Code.PART and way == "send" and not before and meta["i"] == tap.parts - 1:
            self.counts["parts-out"] = self.counts.get("parts-out", 0) + 1
        others = len(MEMBERS) - 1
        trigger = {
            "before-contribute": self.counts.get("send-CONTRIBUTE-before") == 1,
            "mid-parts": self.counts.get("send-PART") == 1,
            "after-parts": self.counts.get("parts-out") == others,
            "mid-results": self.counts.get("recv-RESULT_PART") == 1,
            "after-results": self.counts.get("send-CONFIRM-before") == 1,
            "after-confirm": self.counts.get("send-CONFIRM") == others,
            "owner-mid-results": self.counts.get("send-RESULT_END") == 1,
            "owner-after-results": self.counts.get("send-RESULT_END") == others,
            "all-out": self.counts.get("send-RESULT_END") == others and self.counts.get("parts-out") == others,
        }[self.at]
        if trigger:
            self.done = True
            if self.freeze:
                self.frozen = True
                return
            for a, b in self.pipes:
                a.close()
                b.close()
            if self.dead:
                del self.handlers[self.victim]
                self.on_death()


def cut_round(victim: str, at: str, *, timeout=5.0, confirm_timeout=2.0, record_lives=False, **cut):
    """Runs a round of three members with ``victim``'s streams cut at ``at``; each member whose attempt
    failed in doubt asks the others, as the swarm does. Returns ({member: (what it does, its outcome or
    error)}, the flats, whether the cut happened, the runners). What a member does: "applied" (its own
    round), "adopted" (the average it held, which the group completed), "counted" (``RoundCounted``: adopt
    the group's state), "retry" (nobody can have applied the round), or "dead" (the victim, killed).
    ``record_lives``: a killed victim's record outlives it (nobody learns from the run's records that it
    is gone, only that no dial reaches it)."""
    g = torch.Generator().manual_seed(len(at))
    flats = [torch.randn(CUT_N, generator=g) for _ in MEMBERS]

    async def scenario():
        net = CutNetwork(victim, at, wait_for_group=2.0, **cut)
        for m in MEMBERS:
            net.add(m)
        group = Group("g", MEMBERS, RoundKey(4))
        runners = {m: RoundRunner(group, m, f, 1.0, get_codec("fp16"), part_numel=PART, timeout=timeout,
                                  confirm_timeout=confirm_timeout) for m, f in zip(MEMBERS, flats)}
        for m, r in runners.items():
            await net.rounds[m].register(r)

        async def member(m):
            try:
                try:
                    return "applied", await runners[m].run(net.connector(m))
                finally:
                    net.rounds[m].finish("g")
            except InDoubt as doubt:
                try:
                    outcome = await resolve(doubt, net.connector(m), group.key, timeout + confirm_timeout,
                                            net.rounds[m],
                                            gone=lambda peer: not record_lives and peer not in net.handlers)
                except RoundCounted as e:
                    return "counted", e
                return ("adopted", outcome) if outcome is not None else ("retry", doubt)
            except AveragingError as e:
                return "retry", e

        tasks = [asyncio.create_task(member(m)) for m in MEMBERS]
        net.on_death = tasks[MEMBERS.index(victim)].cancel
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await net.drain()
        results = [("dead", None) if isinstance(r, asyncio.CancelledError) else r for r in results]
        return dict(zip(MEMBERS, results)), net.done, runners

    results, happened, runners = run(scenario(), timeout=60)
    return results, flats, happened, runners


def assert_one_outcome(results, flats):
    """Everyone ends with the round's one outcome: if any member applied it, every member applied the
    same average (every contribution in it once) or adopts the group's state; else all retry."""
    want = reference(flats, [1.0] * len(flats), "fp16")
    applied = {m: o for m, (what, o) in results.items() if what in ("applied", "adopted")}
    for m, o in applied.items():
        assert torch.equal(o.flat, want), m
    if applied:
        for m, (what, o) in results.items():
            assert what != "retry", f"{m} would retry (and apply or carry its work again) a round others applied: {o}"
            if what == "counted":
                assert o.completed and o.group_outer_step == 5, o
    else:
        assert all(what == "retry" for what, _ in results.values()), results
    return applied


CUTS = ["before-contribute", "mid-parts", "after-parts", "mid-results", "after-results", "after-confirm",
        "owner-mid-results", "owner-after-results"]


@pytest.mark.parametrize("at", CUTS)
@pytest.mark.parametrize("victim", ["a", "c"])
@pytest.mark.parametrize("lost", [False, True], ids=["confirms-kept", "confirms-lost"])
def test_a_member_cut_at_any_step_ends_with_its_groups_outcome(victim, at, lost):
    """``lost``: the others' CONFIRMs never reach the victim, so it never completes before the cut."""
    results, flats, happened, _ = cut_round(victim, at, drop={Code.CONFIRM} if lost else ())
    assert happened
    assert_one_outcome(results, flats)


@pytest.mark.parametrize("at", CUTS)
@pytest.mark.parametrize("victim", ["a", "c"])
def test_a_member_killed_at_any_step_leaves_the_others_with_one_outcome(victim, at):
    """The victim dies at the cut: nobody can ask it any more, and it has left the run (had it completed
    the round, its state left with it). The survivors end alike, and never wait for it or drop their work
    for it: if neither applied the round, both retry."""
    results, flats, happened, _ = cut_round(victim, at, dead=True)
    assert happened
    survivors = [m for m in MEMBERS if m != victim]
    if results[victim][0] == "dead":
        results = {m: results[m] for m in survivors}
    assert_one_outcome(results, flats)


@pytest.mark.parametrize("at", ["owner-mid-results", "owner-after-results"])
def test_a_killed_member_that_no_dial_reaches_is_not_waited_for_until_its_record_expires(at):
    """The victim dies where the survivors may think it completed the round, so they ask it; its record
    lives on (8 s in the swarm), but every dial to it fails at once: after ``UNDIALLED_GONE_S`` it is taken
    for gone, and they retry (before, they waited out their question's bound, here 12 s, and then dropped
    their work as possibly counted)."""
    results, flats, happened, _ = cut_round("c", at, dead=True, undialled=True, record_lives=True, timeout=10.0)
    assert happened
    survivors = {m: results[m] for m in ("a", "b")}
    assert_one_outcome(survivors, flats)
    # Nobody dropped its work for a question left unanswered ("counted" without a completed round).
    assert all(what in ("retry", "applied", "adopted") for what, _ in survivors.values()), survivors
    assert any(isinstance(o, InDoubt) for _, o in survivors.values()), survivors  # and one did ask it
    # Whoever took it for gone leaves it out of what the retry waits for (``InDoubt.gone``: suspects).
    doubts = [o for _, o in survivors.values() if isinstance(o, InDoubt)]
    assert all(o.gone <= {"c"} for o in doubts) and any(o.gone == {"c"} for o in doubts), [o.gone for o in doubts]


def test_members_that_said_they_failed_too_are_not_blamed_for_the_retry():
    """A survivor's attempt fails on whichever stream it saw close first, often the other survivor's (it
    failed on the victim a moment sooner). Asked, that survivor says it failed too: alive, so not a
    suspect to leave out of the retry (``InDoubt.failed_too``), while the dead victim stays one."""
    in_doubt = []
    for at in CUTS:
        results, _, happened, _ = cut_round("c", at, dead=True)
        assert happened
        in_doubt += [(m, o) for m, (what, o) in results.items() if what == "retry" and isinstance(o, InDoubt)]
    assert in_doubt  # some cut leaves a survivor in doubt, asking
    for m, doubt in in_doubt:
        assert doubt.failed_too <= {"a", "b"} - {m}, (m, doubt.failed_too)
    assert any(doubt.failed_too for _, doubt in in_doubt), in_doubt  # and one asked the other, and heard it failed


@pytest.mark.parametrize("at", ["all-out", "after-confirm"])
def test_a_frozen_member_ends_with_its_groups_outcome(at):
    """The victim goes silent instead (its streams hang): the others wait out the confirmations, the victim
    its round's timeout."""
    results, flats, happened, _ = cut_round("c", at, freeze=True, timeout=4.0, confirm_timeout=0.5)
    assert happened
    applied = assert_one_outcome(results, flats)
    assert set(applied) >= {"a", "b"}, results  # the others held every shard and applied without c's word
    what, outcome = results["c"]
    if at == "all-out":  # c's parts and shard reached them, their shards never reached c
        assert what == "counted" and outcome.completed, results
    else:
        assert what in ("adopted", "applied"), results


def test_a_member_whose_confirmations_were_lost_applies_the_average_the_group_applied():
    """The reported case: c's CONFIRMs reach a and b, theirs never reach c, then c's streams close ("stream
    closed ... after 0 bytes"). a and b apply; c must not retry (and count its contribution twice): it
    holds the very average they applied, and applies it."""
    results, flats, happened, _ = cut_round("c", "after-confirm", drop={Code.CONFIRM})
    assert happened
    assert results["a"][0] == results["b"][0] == "applied"
    what, outcome = results["c"]
    assert what == "adopted", results
    assert outcome.digest == results["a"][1].digest and torch.equal(outcome.flat, results["a"][1].flat)
    assert_one_outcome(results, flats)


@pytest.mark.parametrize("at", ["before-contribute", "mid-parts"])
@pytest.mark.parametrize("victim", ["a", "c"])
def test_a_member_cut_before_its_parts_went_out_leaves_nobody_in_doubt(victim, at):
    """No shard completes without every member's parts: every member retries at once, asking nobody."""
    results, _, happened, _ = cut_round(victim, at)
    assert happened
    for what, error in results.values():
        assert what == "retry" and not isinstance(error, InDoubt), error


# -- asking a member whether it completed a round -----------------------------------------------------------

def _runner(group, me, digest=None, sent_to=()):
    r = RoundRunner(group, me, torch.zeros(N), 1.0, get_codec("fp16"), part_numel=PART, timeout=5)
    r._results_out.update(sent_to)
    if digest is not None:
        r.finished, r.digest = True, digest
        r.ended.set()
    return r


def _doubt(ask, members=("a", "b", "d"), held=None):
    return InDoubt("cut", set(ask), group_id="g", me="a", members=members, ask=ask, held=held)


def test_a_round_given_up_on_a_member_ends_at_once_with_its_stream_still_hung():
    """A member whose address changed mid-exchange neither answers nor closes its streams. Once the
    others give up on it (its record expired: ``SwarmCommunicator``) their round ends then, not when a
    task blocked on its stream times out: in the long scenario it ended 30 s after they gave up."""
    timeout = 30.0
    g = torch.Generator().manual_seed(7)
    flats = [torch.randn(CUT_N, generator=g) for _ in MEMBERS]

    async def scenario():
        net = CutNetwork("c", "before-contribute", freeze=True, wait_for_group=2.0)
        for m in MEMBERS:
            net.add(m)
        group = Group("g", MEMBERS, RoundKey(4))
        runners = {m: RoundRunner(group, m, f, 1.0, get_codec("fp16"), part_numel=PART, timeout=timeout)
                   for m, f in zip(MEMBERS, flats)}
        for m, r in runners.items():
            await net.rounds[m].register(r)
        began = asyncio.get_running_loop().time()
        tasks = {m: asyncio.ensure_future(runners[m].run(net.connector(m))) for m in ("a", "b")}
        frozen = asyncio.ensure_future(runners["c"].run(net.connector("c")))
        while not net.frozen:
            await asyncio.sleep(0.01)
        for m in ("a", "b"):
            await runners[m].give_up_on("c", "left the run's records")
        ended = await asyncio.gather(*tasks.values(), return_exceptions=True)
        held = asyncio.get_running_loop().time() - began
        frozen.cancel()
        await asyncio.gather(frozen, return_exceptions=True)
        await net.drain()
        return ended, held

    ended, held = run(scenario(), timeout=60)
    for e in ended:
        assert isinstance(e, AveragingError) and "c left the run's records" in str(e), e
    assert held < timeout / 2, held


def test_a_member_whose_audit_answers_are_still_to_come_is_waited_on():
    """``waits_on`` (what a member that left the run's records is given up on for, ``SwarmCommunicator``)
    covers the audit too: in the long scenario a member froze once every part and shard was in, and
    eight others waited out their audit of it, 36 s, until it thawed."""
    group = Group("g", ("a", "b"), RoundKey(0))

    class Frozen:
        remote = "b"

        async def send(self, code, meta=None, payload=b""):
            pass

        async def recv(self, **kw):
            await asyncio.sleep(3600)

    async def scenario():
        runner = _runner(group, "a")
        runner._shard_digests[1] = "0" * 64  # b's shard and parts are in
        runner.reducer._next_part["b"] = len(runner.reducer.parts)
        assert not runner.waits_on("b")
        asking = asyncio.ensure_future(runner._ask(1, Frozen(), [[1, 0, 0]]))
        await asyncio.sleep(0.05)
        assert runner.waits_on("b")  # its audit answers are owed
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        assert not runner.waits_on("b")

    asyncio.run(scenario())


def test_a_member_answers_once_its_round_has_ended():
    group = Group("g", ("a", "b"), RoundKey(0))

    async def scenario():
        net = MemoryNetwork()
        net.add("a")
        runner = _runner(group, "a", sent_to=["b"])
        runner._shard_digests[1] = "0" * 64  # it holds all that b sends: it may still complete (in _verify)
        runner.reducer._next_part["b"] = len(runner.reducer.parts)
        await net.rounds["a"].register(runner)
        asked = asyncio.create_task(ask_outcome(net.connector("b"), "a", "g", group.members))
        await asyncio.sleep(0.05)
        pending = not asked.done()
        runner.finished, runner.digest = True, "ab" * 16
        runner.ended.set()
        answer = await asked
        net.rounds["a"].finish("g")
        after = await ask_outcome(net.connector("b"), "a", "g", group.members)
        unknown = await ask_outcome(net.connector("b"), "a", "another-round", group.members)
        return pending, answer, after, unknown

    pending, answer, after, unknown = run(scenario())
    assert pending  # no answer while the round still runs there
    assert answer == after == Answer("done", "ab" * 16, frozenset({"b"}))
    assert unknown == Answer("unknown")


def test_a_round_still_waiting_for_the_asker_fails_at_once():
    """b asks, so its attempt failed: a's round, still waiting for b's parts, will never get them. It fails
    now (naming b) and answers "failed", instead of holding b until a's round times out."""
    group = Group("g", ("a", "b"), RoundKey(0))

    async def scenario():
        net = MemoryNetwork()
        net.add("a")

        async def b_sits(stream):  # b reads a's contribution to its shard, and sends nothing of its own
            await read_refusal(stream)  # reads until the stream ends, whatever comes

        net.add("b", handler=b_sits)
        runner = RoundRunner(group, "a", torch.randn(N), 1.0, get_codec("fp16"), part_numel=PART, timeout=600)
        await net.rounds["a"].register(runner)
        task = asyncio.create_task(runner.run(net.connector("a")))
        await asyncio.sleep(0.05)
        answer = await ask_outcome(net.connector("b"), "a", "g", group.members)
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        return answer, outcome

    answer, outcome = run(scenario())
    assert answer.state == "failed"
    assert isinstance(outcome, PeerFailure) and not isinstance(outcome, InDoubt) and outcome.peers == {"b"}


def test_an_outsider_asking_about_a_round_is_refused():
    group = Group("g", ("a", "b"), RoundKey(0))

    async def scenario():
        net = MemoryNetwork()
        net.add("a")
        await net.rounds["a"].register(_runner(group, "a", digest="cd" * 16))
        net.rounds["a"].finish("g")
        with pytest.raises(Refused, match="not a member"):
            await ask_outcome(net.connector("z"), "a", "g", group.members)
        return await ask_outcome(net.connector("b"), "a", "g", group.members)

    assert run(scenario()).digest == "cd" * 16


@pytest.mark.parametrize("answer", [
    {"group_id": "g", "state": "maybe", "digest": "", "sent_to": []},
    {"group_id": "g", "state": "done", "digest": "x" * 10, "sent_to": []},
    {"group_id": "g", "state": "done", "digest": "a" * 10_000, "sent_to": []},
    {"group_id": "other", "state": "failed", "digest": "", "sent_to": []},
    {"group_id": "g", "state": 1, "digest": "", "sent_to": []},
    {"group_id": "g", "state": "failed", "digest": ""},
    {"group_id": "g", "state": "failed", "digest": "", "sent_to": ["mallory"]},
    {"group_id": "g", "state": "failed", "digest": "", "sent_to": ["a"] * 4},
], ids=["unknown-state", "digest-not-hex", "huge-digest", "another-round", "state-not-a-string", "no-sent-to",
        "sent-to-outsider", "sent-to-too-long"])
def test_an_answer_out_of_form_is_no_answer_and_silence_counts_the_work(answer):
    """A member that answers nothing that fits (or nothing at all) may have completed the round: the asker
    does not retry; it adopts the run's state and drops the work (``RoundCounted``, not completed)."""

    async def scenario():
        net = MemoryNetwork()

        async def b_answers(stream):
            await stream.recv(max_payload=0, expect=Code.ASK_OUTCOME)
            await stream.send(Code.OUTCOME, answer)
            stream.close()

        net.add("b", handler=b_answers)
        with pytest.raises(RoundCounted) as caught:
            await resolve(_doubt(("b",), members=("a", "b")), net.connector("a"), RoundKey(6), timeout=0.5)
        return caught.value

    error = run(scenario())
    assert not error.completed and error.group_outer_step == 7


def test_one_done_is_enough_and_silence_counts_the_work():
    async def scenario():
        net = MemoryNetwork()
        net.add("b")
        group = Group("g", ("a", "b", "d"), RoundKey(2))
        await net.rounds["b"].register(_runner(group, "b", digest="ef" * 16, sent_to=["a", "d"]))
        net.rounds["b"].finish("g")
        with pytest.raises(RoundCounted) as silent:  # d is unreachable, and b sent d its shard: d may be done
            await resolve(_doubt(("d",)), net.connector("a"), group.key, timeout=0.3)
        with pytest.raises(RoundCounted) as done:  # b's "done" ends it at once
            await resolve(_doubt(("b", "d")), net.connector("a"), group.key, timeout=30)
        return silent.value, done.value

    silent, done = run(scenario())
    assert not silent.completed and done.completed and done.group_outer_step == 3


def test_an_unreachable_member_that_lacked_a_shard_is_ruled_out():
    """d is gone; b failed the round and never began sending d its shard: d cannot have completed it, so
    a retries at once instead of waiting out d and dropping its work."""

    async def scenario():
        net = MemoryNetwork()
        net.add("b")
        group = Group("g", ("a", "b", "d"), RoundKey(2))
        await net.rounds["b"].register(_runner(group, "b", sent_to=["a"]))
        net.rounds["b"].finish("g")
        return await resolve(_doubt(("b", "d")), net.connector("a"), group.key, timeout=30)

    assert run(scenario()) is None


def test_a_done_from_a_member_that_cannot_have_completed_is_not_believed():
    """b never got a's shard (it is not in ``ask``): its "done" is impossible, and changes nothing."""

    async def scenario():
        net = MemoryNetwork()
        net.add("b")
        net.add("d")
        group = Group("g", ("a", "b", "d"), RoundKey(2))
        await net.rounds["b"].register(_runner(group, "b", digest="ef" * 16))
        await net.rounds["d"].register(_runner(group, "d"))
        for m in ("b", "d"):
            net.rounds[m].finish("g")
        return await resolve(_doubt(("d",)), net.connector("a"), group.key, timeout=30)

    assert run(scenario()) is None


def test_a_member_that_left_the_run_while_its_dial_hangs_is_not_waited_for():
    """d is cut off (a partition): a dial to it neither answers nor fails for as long as the daemon tries,
    and its record expires meanwhile. It used to be asked until the settle's whole bound, and then, silent,
    made every member drop its work ("may have completed"); 31 s of every worker in the long world scenario's
    second partition. Gone from the run's records, it is not waited for: b failed, so the members retry."""

    async def scenario():
        net = MemoryNetwork()
        net.add("b")
        group = Group("g", ("a", "b", "d"), RoundKey(2))
        await net.rounds["b"].register(_runner(group, "b", sent_to=["a", "d"]))
        net.rounds["b"].finish("g")
        base = net.connector("a")

        async def connect(peer):
            if peer == "d":
                await asyncio.Event().wait()  # no answer, no error
            return await base(peer)

        return await resolve(_doubt(("b", "d")), connect, group.key, timeout=20, gone=lambda peer: peer == "d")

    assert run(scenario()) is None


def test_a_late_stream_of_a_failed_round_is_refused_naming_its_culprits_and_one_elsewhere_as_stale():
    """A member whose attempt failed because of x refuses the late streams of that round saying so, so that
    their senders do not take it for the attempt's breaker (``blame.py``); a stream for a group this worker
    never knew is refused as stale, which names nobody (an honest member in a matchmaking race)."""

    async def scenario():
        net = MemoryNetwork(wait_for_group=0.3)
        for m in ("a", "b"):
            net.add(m)
        group = Group("g", ("a", "b", "x"), RoundKey(0))
        runner = RoundRunner(group, "a", torch.randn(N), 1.0, get_codec("fp16"), part_numel=PART, timeout=2)
        await net.rounds["a"].register(runner)
        await runner.give_up_on("x", blame=frozenset())
        net.rounds["a"].finish("g")
        late = await net.connector("b")("a")
        await late.send(Code.CONTRIBUTE, {**OPENING, "group_id": "g", "sender": "b"})
        finished = await read_refusal(late)
        elsewhere = await net.connector("b")("a")
        await elsewhere.send(Code.CONTRIBUTE, {**OPENING, "group_id": "other", "sender": "b"})
        stale = await read_refusal(elsewhere)
        await net.drain()
        return runner, finished, stale

    runner, finished, stale = run(scenario())
    assert runner.breakers == {"x"}  # it asked (gave up) blaming nobody
    assert finished is not None and finished.blame == {"x"} and not finished.stale, finished
    assert stale is not None and stale.stale and not stale.blame, stale
