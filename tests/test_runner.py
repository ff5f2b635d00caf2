"""The round runner's protocol over in-memory streams: no DHT, no daemon, every refusal exercised.

Honest peers are ``RoundRunner``s; each attack is a small attacker script that speaks the wire
format by hand (``ByteStream.send`` or raw bytes) as member ``b`` of a two-member group.
"""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
import torch

from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.base import RoundKey
from opendiloco.comm.compression import get_codec
from opendiloco.comm.runner import Group, RoundRunner, ShardReducer, part_bounds, shard_bounds
from opendiloco.comm.wire import PREFIX, ByteStream, Code, Refused, memory_pipe
from opendiloco.errors import AveragingError, PeerFailure, ProtocolError
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
                       **kw):
    net = net or MemoryNetwork()
    for m in members:
        if m not in net.rounds:
            net.add(m)
    group = Group(group_id, tuple(members), RoundKey(3))
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
            try:
                while True:
                    await stream.recv(max_payload=1 << 20)
            except ProtocolError:
                pass

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
