"""Top-k contributions (``topkN+F``): the largest 1/N of every chunk with their indices, the rest owed
by error feedback; averages travel back dense in F; a payload with forged indices names its sender."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from opendiloco import DiLoCoOptimizer, InProcessGroup
from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.codec import codec_label
from opendiloco.comm.formats import get_codec
from opendiloco.comm.topk import CHUNK, index_bytes, pack_indices, unpack_indices
from opendiloco.comm.wire import Code, Refused
from opendiloco.errors import PeerFailure, ProtocolError
from opendiloco.fingerprint import new_hasher
from opendiloco.train.config import SwarmConfig
from tests.conftest import run_in_threads
from tests.test_runner import OPENING, PART, attack, honest_round, read_refusal

NAME = "topk64+e2m1"


def test_a_payload_holds_the_largest_of_each_chunk_in_the_value_format_and_zeros_elsewhere():
    codec, values = get_codec(NAME), get_codec("e2m1")
    x = torch.randn(3 * CHUNK + 1000, generator=torch.Generator().manual_seed(0))
    got = codec.from_bytes(codec.to_bytes(x), x.numel())
    for a in range(0, x.numel(), CHUNK):
        chunk, kept = x[a : a + CHUNK], got[a : a + CHUNK] != 0
        assert int(kept.sum()) == max(1, chunk.numel() // 64)
        assert chunk.abs()[kept].min() >= chunk.abs()[~kept].max()
    positions = got.nonzero().squeeze(1)
    torch.testing.assert_close(got[positions], values.roundtrip(x[positions]), rtol=0, atol=0)
    # per 64 values: an 8-bit index, a 4-bit value and its share of the value format's scales: 1/82 of
    # fp16's bytes, 1/164 of fp32's
    assert codec.wire_bytes(1 << 20) == pytest.approx(4 * (1 << 20) / 164, rel=0.01)


def test_what_is_not_sent_is_owed_exactly_and_error_feedback_adds_up_over_rounds():
    codec = get_codec(NAME)
    g = torch.Generator().manual_seed(1)
    residual, sent_total, meant_total = torch.zeros(2 * CHUNK), torch.zeros(2 * CHUNK), torch.zeros(2 * CHUNK)
    for _ in range(20):
        delta = torch.randn(2 * CHUNK, generator=g)
        contribution = delta + residual
        error = torch.empty_like(contribution)
        sent = codec.from_bytes(codec.to_bytes_with_error(contribution, error), contribution.numel())
        assert torch.equal(sent + error, contribution)  # the residual is exactly what did not go out
        residual = error
        sent_total += sent
        meant_total += delta
    torch.testing.assert_close(sent_total + residual, meant_total, rtol=0, atol=1e-4)
    assert residual.abs().max() < meant_total.abs().max()  # owed, then sent: it does not pile up


def forged(kind: str) -> bytes:
    """A top-k payload of one full chunk and a tail of 100 values (one entry), its indices forged."""
    codec, numel = get_codec(NAME), CHUNK + 100
    fields = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(2)))
    index = unpack_indices(fields["index"], numel, 64)
    if kind == "outside":
        index[-1] = 100  # past the tail chunk
    elif kind == "repeated":
        index[5] = index[4]  # one value counted twice
    elif kind == "unsorted":  # two in one high bucket (their low bits out of order): all the code can say
        index[:4] = torch.tensor([1, 130, 129, 200])
    fields["index"] = pack_indices(index, numel, 64)
    if kind == "padding":  # the tail's high part holds 3 bits in its byte: the others must be zero
        fields["index"][-1] |= 0x80
    elif kind == "count":  # a 65th entry in the full chunk's high part (its bitmap's first zero set)
        high = fields["index"][48:64]
        zero = int((((high.to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1).view(-1) == 0).nonzero()[0])
        high[zero // 8] |= 1 << (zero % 8)
    return b"".join(fields[n].numpy().tobytes() for n in sorted(fields))


def test_indices_are_elias_fano_coded_in_log2_n_plus_2_bits_and_back():
    for every, bits in ((64, 8), (32, 7), (8, 5)):
        numel = 5 * CHUNK + 1000
        index = torch.cat([torch.randperm(CHUNK, generator=torch.Generator().manual_seed(c))[: CHUNK // every].sort()
                           .values for c in range(5)] + [torch.tensor(sorted(
                               torch.randperm(1000, generator=torch.Generator().manual_seed(9))[: 1000 // every]
                               .tolist()))])
        packed = pack_indices(index, numel, every)
        assert packed.dtype == torch.uint8 and packed.numel() == index_bytes(numel, every)
        assert index_bytes(CHUNK, every) * 8 == bits * (CHUNK // every)
        assert torch.equal(unpack_indices(packed, numel, every), index)
    edges = torch.tensor([0, 1, 2047, 4095])  # topk1024: four per chunk
    assert torch.equal(unpack_indices(pack_indices(edges, CHUNK, 1024), CHUNK, 1024), edges)


@pytest.mark.parametrize("kind", ["outside", "repeated", "unsorted", "padding", "count"])
def test_forged_indices_are_refused(kind):
    with pytest.raises(ProtocolError, match="top-k ind"):
        get_codec(NAME).from_bytes(forged(kind), CHUNK + 100)


def test_a_member_that_sends_forged_indices_is_refused_and_named():
    """An attacker script as member b: a top-k part whose indices repeat a value."""
    name = "topk8+e2m1"
    codec = get_codec(name)

    async def script(stream):
        fields = codec.encode(torch.randn(PART))
        index = unpack_indices(fields["index"], PART, 8)
        index[7] = index[6]
        fields["index"] = pack_indices(index, PART, 8)
        await stream.send(Code.CONTRIBUTE, {**OPENING, "codec": f"{codec_label(codec, codec.averages)}|"
                                                               f"{Aggregation().label}"})
        await stream.send(Code.PART, {"i": 0}, b"".join(fields[n].numpy().tobytes() for n in sorted(fields)))
        return await read_refusal(stream)

    outcome, refusal = attack(script, codec=name)
    assert isinstance(refusal, Refused) and "top-k indices" in str(refusal)
    assert isinstance(outcome, PeerFailure) and outcome.peers == {"b"}


def test_a_round_in_the_runner_ends_with_the_same_average_on_every_member():
    flats = [torch.randn(4 * PART, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    outcomes = asyncio_run(honest_round(["a", "b", "c"], flats, [1.0, 1.0, 1.0], codec="topk8+e2m1"))
    digests = {o.digest for o in outcomes}
    assert len(digests) == 1, outcomes
    average = outcomes[0].flat
    # The union of the members' entries: more values than one member sent, fewer than all.
    assert 4 * PART // 8 < int((average != 0).sum()) < 4 * PART


def asyncio_run(coro):
    import asyncio

    return asyncio.run(asyncio.wait_for(coro, 30))


def test_every_machine_decodes_the_same_bytes_to_the_same_values():
    payload = get_codec(NAME).to_bytes(torch.randn(2 * CHUNK + 77, generator=torch.Generator().manual_seed(3)))
    here = new_hasher()
    here.update(get_codec(NAME).from_bytes(payload, 2 * CHUNK + 77).numpy().tobytes())
    code = ("import sys, torch; from opendiloco.comm.formats import get_codec; "
            "from opendiloco.fingerprint import new_hasher; p = sys.stdin.buffer.read(); h = new_hasher(); "
            f"h.update(get_codec({NAME!r}).from_bytes(p, {2 * CHUNK + 77}).numpy().tobytes()); print(h.hexdigest())")
    there = subprocess.run([sys.executable, "-c", code], input=bytes(payload), capture_output=True, timeout=120)
    assert there.stdout.decode().strip() == here.hexdigest(), there.stderr.decode()[-2000:]


def test_top_k_formats_are_named_apart_and_their_averages_travel_dense():
    codec = get_codec(NAME)
    assert codec.averages.label == "e2m1"
    labels = {codec_label(get_codec(n), get_codec(n).averages) for n in (NAME, "topk32+e2m1", "topk64+int4", "e2m1")}
    assert len(labels) == 4  # workers with other top-k settings never average together
    assert (get_codec("topk64+e2m1").every, get_codec("topk64+e2m1").values.label) == (64, "e2m1")
    for bad in ("topk3+e2m1", "topk8192+e2m1"):
        with pytest.raises(ValueError, match="must divide 4096"):
            get_codec(bad)
    with pytest.raises(ValueError, match="do not combine"):
        get_codec("subset8+topk64+e2m1")


def test_the_config_takes_top_k_with_error_feedback_only():
    assert SwarmConfig(compression=NAME).uses_error_feedback
    with pytest.raises(ValueError, match="needs error feedback"):
        SwarmConfig(compression=NAME, error_feedback=False)
    with pytest.raises(ValueError, match="averages are dense"):
        SwarmConfig(result_compression=NAME)
    with pytest.raises(ValueError, match="unknown format"):
        SwarmConfig(compression="topk64+nope")


def test_the_optimizer_refuses_top_k_without_error_feedback_or_with_module_buffers():
    model = torch.nn.Linear(4, 4)
    group = InProcessGroup(1, compression=NAME)
    with pytest.raises(ValueError, match="needs error_feedback=True"):
        DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=group.members[0])
    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="averages updates, not values"):
        DiLoCoOptimizer(bn.parameters(), local_steps=2, communicator=InProcessGroup(1, compression=NAME).members[0],
                        module=bn, error_feedback=True)


def test_replicas_training_through_top_k_stay_bit_identical():
    n = 3
    group = InProcessGroup(n, compression="topk16+e2m1")
    models = [torch.nn.Linear(256, 64) for _ in range(n)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [DiLoCoOptimizer(m.parameters(), local_steps=3, communicator=c, error_feedback=True)
            for m, c in zip(models, group.members)]

    def train(rank):
        g = torch.Generator().manual_seed(rank)
        for _ in range(9):
            models[rank](torch.randn(8, 256, generator=g)).pow(2).mean().backward()
            opts[rank].step()
            opts[rank].zero_grad()

    run_in_threads([lambda r=r: train(r) for r in range(n)], timeout=60)
    assert len({o.global_hash() for o in opts}) == 1
    assert opts[0].outer_step == 3


def test_what_a_round_did_not_send_is_owed_in_the_weights_not_the_residual():
    """After a top-k round's outer step, a value it sent restarts from θ_global (its rounding owed in
    the residual); a value it did not send keeps its local progress (θ_local = θ_global - its whole
    contribution) and owes nothing in the residual, so its displacement is not redone every round."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=InProcessGroup(1, compression="topk16+e2m1")
                          .members[0], error_feedback=True, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    start = model.weight.detach().clone().reshape(-1)
    for _ in range(2):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.outer_step == 1
    local = model.weight.detach().reshape(-1)
    global_ = opt.outer.global_params[0].detach().reshape(-1)
    residual = opt.error_residual()
    moved = global_ != start  # the values the round sent (one worker: the average is its own)
    assert 0 < int(moved.sum()) < local.numel() // 8
    assert torch.equal(local[moved], global_[moved])
    assert bool((local[~moved] != global_[~moved]).all())  # their local work, kept
    assert torch.equal(residual[: local.numel()][~moved], torch.zeros(int((~moved).sum())))


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_with_error_decay_every_value_restarts_from_global_and_the_unsent_is_owed_decayed(decay):
    """SparseLoCo's rule (``error_decay``): after a round θ_local is θ_global for every value, and the
    residual holds what was not sent (and the rounding of what was); the next contribution adds it
    decayed. With decay 1, what was sent plus what is owed is all the work done."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    # fp32 averages: θ_global then moves by exactly what was sent (e2m1 averages round it once more)
    group = InProcessGroup(1, compression="topk16+e2m1", result_compression="none")
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=group.members[0], error_feedback=True,
                          error_decay=decay,
                          outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    local = []  # θ_local after each inner step
    opt.inner.register_step_post_hook(lambda *_: local.append(model.weight.detach().clone().reshape(-1)))
    owed = torch.zeros(64 * 64)
    work = torch.zeros(64 * 64)
    start = opt.outer.global_params[0].detach().clone().reshape(-1)
    for _ in range(4):
        before = opt.outer.global_params[0].detach().clone().reshape(-1)
        for _ in range(2):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        after = opt.outer.global_params[0].detach().reshape(-1)
        sent = before - after  # one worker, outer SGD at lr 1: θ_global moves by what it sent
        contribution = before - local[-1] + decay * owed
        assert 0 < int((sent != 0).sum()) <= 64 * 64 // 16
        assert torch.equal(model.weight.detach().reshape(-1), after)  # every value restarts from θ_global
        owed = opt.error_residual()[: 64 * 64].clone()
        torch.testing.assert_close(sent + owed, contribution, rtol=0, atol=1e-6)
        work += before - local[-1]
    if decay == 1.0:  # all that was sent, and what is still owed: the work of the four rounds
        torch.testing.assert_close(start - opt.outer.global_params[0].detach().reshape(-1) + owed, work,
                                   rtol=0, atol=1e-5)


def test_error_decay_is_for_top_k_formats_only():
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="error_decay"):
        DiLoCoOptimizer(model.parameters(), local_steps=2, error_feedback=True, error_decay=0.9,
                        communicator=InProcessGroup(1, compression="e2m1").members[0])
    with pytest.raises(ValueError, match="error_decay"):
        SwarmConfig(compression="e2m1", error_decay=0.9)
    with pytest.raises(ValueError):
        SwarmConfig(compression="topk64+e2m1", error_decay=1.5)
    assert SwarmConfig(compression="topk64+e2m1", error_decay=0.95).error_decay == 0.95


@pytest.mark.parametrize("decay", [None, 0.9])
def test_a_round_of_weight_zero_keeps_all_its_work_local_and_owes_nothing_twice(decay):
    """A worker that syncs again with no steps since its last round (weight 0 under ``weight_by_samples``)
    still holds carried work: none of it was counted, so all of it stays in its weights and none in its
    residual (before, the carried values were owed in both). With ``error_decay`` every value restarts
    from θ_global, so all of it is owed in the residual instead, once."""
    torch.manual_seed(0)
    group = InProcessGroup(2, compression="topk16+e2m1")
    models = [torch.nn.Linear(64, 64, bias=False) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [DiLoCoOptimizer(m.parameters(), local_steps=100, communicator=c, error_feedback=True, error_decay=decay,
                            weight_by_samples=True, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
            for m, c in zip(models, group.members)]

    def both(steps):
        reports = [None, None]

        def run(rank):
            for _ in range(steps[rank]):
                models[rank](torch.randn(8, 64)).pow(2).mean().backward()
                opts[rank].step()
                opts[rank].zero_grad()
            reports[rank] = opts[rank].sync()

        run_in_threads([lambda r=r: run(r) for r in range(2)], timeout=60)
        return reports

    assert all(r.ok for r in both([3, 3]))
    work_before = (opts[0].outer.global_params[0] - models[0].weight).detach().reshape(-1).clone()
    owed_before = opts[0].error_residual()[: work_before.numel()].clone()
    first = both([0, 2])
    assert all(r.ok for r in first) and first[0].weight == 0
    local, global_ = models[0].weight.detach().reshape(-1), opts[0].outer.global_params[0].detach().reshape(-1)
    if decay is not None:  # all of it owed in the residual, none in the weights
        assert torch.equal(local, global_)
        torch.testing.assert_close(opts[0].error_residual()[: local.numel()], work_before + decay * owed_before,
                                   rtol=0, atol=1e-6)
        return
    torch.testing.assert_close(global_ - local, work_before + owed_before, rtol=0, atol=1e-6)  # all of it, local
    assert not opts[0].error_residual()[: local.numel()].any()  # and owed once only
