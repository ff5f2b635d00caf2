"""Shared-seed random subsets (``subset32+int4``): the same values everywhere, every value in turn, and
what is not sent owed to later rounds. Real codecs, real averaging (``SingleWorker``, ``InProcessGroup``,
the round runner over in-memory streams)."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys

import pytest
import torch
from torch import nn

from opendiloco import DiLoCoOptimizer, InProcessGroup, SingleWorker
from opendiloco.comm.aggregation import Aggregation
from opendiloco.comm.base import RoundKey
from opendiloco.comm.codec import codec_label
from opendiloco.comm.formats import get_codec
from opendiloco.comm.group import Group, group_label
from opendiloco.comm.runner import RoundRunner
from opendiloco.comm.subset import BLOCK, Subset, start_subset
from opendiloco.errors import AveragingError
from opendiloco.testing.memory import MemoryNetwork
from opendiloco.train.config import ConfigError, load_config
from tests.toy_training import ADAMW, INIT_LOCK, assert_resume_is_bit_exact, batch, round_hashes, train_step

SGD1 = functools.partial(torch.optim.SGD, lr=1.0)


def wide(seed: int = 0, bn: bool = False) -> nn.Module:
    """3073 trainable values (13 blocks, the last of one value); with ``bn``, 4097 and 1024 buffer values."""
    with INIT_LOCK:
        torch.manual_seed(seed)
        layers = [nn.Linear(4, 512), nn.Tanh()] + ([nn.BatchNorm1d(512)] if bn else []) + [nn.Linear(512, 1)]
        return nn.Sequential(*layers)


# -- choosing the values --------------------------------------------------------------------------

def test_names():
    assert get_codec("subset32+int4").values.label == "int4"
    assert codec_label(get_codec("subset32+int4")) == "subset32+int4"
    assert codec_label(get_codec("subset32+int4"), get_codec("int8")) == "subset32+int4/int8.v2"
    assert codec_label(get_codec("subset32+int4"), get_codec("int4")) == "subset32+int4"
    assert get_codec("subset32+int4").subset == Subset(32) and get_codec("int4").subset is None
    for bad in ("subset1+int4", "subset+int4", "subset032+int4", "subset32", "subset32+zip", "subset32+subset2+int4",
                "subset4096+int8"):
        with pytest.raises(ValueError) as e:
            get_codec(bad)
        assert len(str(e.value).splitlines()) == 1 and bad in str(e.value)
    with pytest.raises(ValueError, match="takes no subset"):
        codec_label(get_codec("int4"), get_codec("subset4+int8"))


_OTHER_PROCESS = """
import sys
from opendiloco.comm.base import RoundKey
from opendiloco.comm.subset import Subset
every, numel = int(sys.argv[1]), int(sys.argv[2])
for step in range(6):
    print(Subset(every).indices(RoundKey(step, 1), numel, fragments=2).tolist())
"""


def test_every_process_selects_the_same_values():
    """What every member relies on: the round key, the size and the format decide, in any interpreter."""
    every, numel = 8, 100_003
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(every), str(numel)], capture_output=True,
                         text=True, timeout=120, check=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    here = [str(Subset(every).indices(RoundKey(step, 1), numel, fragments=2).tolist()) for step in range(6)]
    assert out.stdout.split("\n")[:6] == here


def test_the_selection_changes_with_the_round_the_fragment_and_the_size():
    s = Subset(8)
    base = s.indices(RoundKey(3, 0), 100_000)
    assert torch.equal(base, s.indices(RoundKey(3, 0), 100_000))  # the same key: the same values
    for other in (s.indices(RoundKey(4, 0), 100_000), s.indices(RoundKey(3, 1), 100_000),
                  s.indices(RoundKey(3, 0), 100_001), Subset(16).indices(RoundKey(3, 0), 100_000)):
        assert not torch.equal(base[:1000], other[:1000])
    assert torch.equal(base, base.sort().values) and base.unique().numel() == base.numel()


@pytest.mark.parametrize("every,numel,fragments", [(4, 18 * BLOCK, 1), (8, 100_003, 1), (32, 5 * BLOCK + 7, 1),
                                                   (8, 40_000, 3)])
def test_every_value_is_sent_once_per_cycle(every, numel, fragments):
    s, f = Subset(every), fragments - 1  # the last fragment: its rounds are outer steps f, f + P, f + 2P, ...
    blocks = -(-numel // BLOCK)
    per_round = -(-blocks // every)
    for cycle in range(3):
        counts = torch.zeros(numel, dtype=torch.int64)
        for slot in range(every):
            idx = s.indices(RoundKey(f + fragments * (cycle * every + slot), f), numel, fragments)
            assert idx.numel() <= per_round * BLOCK and idx.unique().numel() == idx.numel()
            counts[idx] += 1
        assert counts.min() >= 1  # nothing is owed for longer than two cycles
        if blocks % every == 0:
            assert counts.max() == 1  # an exact partition of the fragment
        else:  # the last slice wraps round: a few blocks go twice (more when there are fewer blocks than N)
            assert counts.max() <= -(-per_round * every // blocks)


# -- a round ---------------------------------------------------------------------------------------

def test_a_subset_round_sends_the_selected_values_and_the_buffers_whole():
    head, tail, key = 20 * BLOCK + 5, 300, RoundKey(2)
    flat = torch.randn(head + tail)
    out, error = torch.full_like(flat, float("nan")), torch.full_like(flat, float("nan"))
    comm = SingleWorker("subset4+none")
    result = start_subset(comm, comm.subset, flat, head=head, weight=1.0, key=key, fragments=1, out=out,
                          error_out=error).wait()
    idx = Subset(4).indices(key, head)
    sent = torch.zeros(head, dtype=torch.bool)
    sent[idx] = True
    assert result.flat is out and result.extra["subset_values"] == idx.numel() in (6 * BLOCK, 5 * BLOCK + 5)
    assert torch.equal(out[:head][sent], flat[:head][sent]) and torch.equal(out[head:], flat[head:])
    assert torch.equal(out[:head][~sent], torch.zeros(int((~sent).sum())))  # exactly zero, not sent
    assert torch.equal(error, torch.zeros_like(error))  # fp32 loses nothing; the unsent are the caller's to owe


def test_a_worker_with_another_subset_or_none_never_averages_with_this_one():
    """The subset is part of the group label (matchmaking groups only equal labels) and an opening frame
    that names another is refused: a whole-vector member and a subset member of equal size never mix."""
    labels = {name: group_label(get_codec(name), None, Aggregation(), 4)
              for name in ("int4", "subset32+int4", "subset16+int4", "subset32+int8")}
    assert len(set(labels.values())) == len(labels)
    n, part = 4000, 1000
    net = MemoryNetwork(wait_for_group=0.5)
    for m in "ab":
        net.add(m)
    group = Group("g", ("a", "b"), RoundKey(0))

    async def scenario():
        runners = [RoundRunner(group, "a", torch.randn(n), 1.0, get_codec("subset32+int4"), part_numel=part, timeout=2),
                   RoundRunner(group, "b", torch.randn(n), 1.0, get_codec("int4"), part_numel=part, timeout=2)]
        for m, r in zip("ab", runners):
            await net.rounds[m].register(r)
        return await asyncio.gather(*[r.run(net.connector(m)) for m, r in zip("ab", runners)], return_exceptions=True)

    outcomes = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert all(isinstance(o, AveragingError) for o in outcomes), outcomes
    assert any("subset32+int4" in str(o) for o in outcomes)


def test_error_feedback_is_required():
    with pytest.raises(ValueError, match="needs error_feedback=True"):
        DiLoCoOptimizer(wide().parameters(), local_steps=2, communicator=SingleWorker("subset8+int4"))


@pytest.mark.parametrize("codec", ["none", "int4"])
def test_with_a_constant_pseudo_gradient_what_is_sent_adds_up_to_what_was_owed(codec):
    """k rounds of the same Δ: everything sent plus what is still owed (an unsent value's whole
    contribution, a sent one's codec error) is k·Δ, and nothing is owed for longer than two cycles."""
    every, head = 8, 40 * BLOCK
    comm = SingleWorker(f"subset{every}+{codec}")
    delta = torch.randint(-8, 9, (head,)).float() / 4  # exact in fp32: sums of a few are exact too
    owed, sent_total = torch.zeros(head), torch.zeros(head)
    for r in range(3 * every + 3):
        out, error, contribution = torch.empty(head), torch.empty(head), delta + owed
        start_subset(comm, comm.subset, contribution, head=head, weight=1.0, key=RoundKey(r), fragments=1,
                     out=out, error_out=error).wait()
        sent_total += out
        unsent = torch.ones(head, dtype=torch.bool)
        unsent[Subset(every).indices(RoundKey(r), head)] = False
        owed = torch.where(unsent, contribution, error)  # the optimizer owes the unsent in the local weights
        k = r + 1
        tol = 0 if codec == "none" else 1e-5 * k
        assert torch.allclose(sent_total + owed, k * delta, rtol=0, atol=tol)
        assert owed.abs().max() <= 2 * every * delta.abs().max() + tol
    if codec == "none":
        assert torch.equal(sent_total + owed, k * delta)


def _lone_subset_run(compression, rounds=12, H=2):
    """One worker: the work its inner steps did (each round's Δ less what the previous round left
    owed in the local weights), what it sent (scattered), and what is owed in the weights at the end."""
    model = wide()
    numel = sum(p.numel() for p in model.parameters())
    subset, sent, compact = get_codec(compression).subset, [], []

    class Recorder(SingleWorker):
        def start(self, flat, *, key, **kw):
            work = super().start(flat, key=key, **kw)
            idx = subset.indices(key, numel)
            compact.append(flat)
            sent.append(torch.zeros(numel).index_copy_(0, idx, work.wait().flat[: idx.numel()]))
            return work

    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                          communicator=Recorder(compression), error_feedback=True)
    work = []

    def delta():
        return torch.cat([d.reshape(-1) for d in opt.outer.pseudo_gradients()])

    carried = torch.zeros(numel)

    def hook(*_):
        if opt.local_step + 1 >= H:
            work.append(delta() - carried)

    opt.inner.register_step_post_hook(hook)
    for step in range(H * rounds):
        before = opt.outer_step
        train_step(model, opt, *batch(0, step))
        if opt.outer_step > before:
            carried = delta()  # θ_global − θ_local right after the outer step: the unsent work
    return opt, torch.stack(work).sum(0), torch.stack(sent).sum(0), compact, carried


def test_the_optimizer_sends_what_it_owes():
    opt, work, sent, compact, carried = _lone_subset_run("subset4+int4")
    residual = opt.error_residual()
    assert torch.allclose(sent + residual + carried, work, rtol=0, atol=1e-5 * work.abs().max())
    last = Subset(4).indices(RoundKey(opt.outer_step - 1), work.numel())
    assert torch.equal(carried[last], torch.zeros(last.numel()))  # sent values: θ_local restarts from θ_global
    assert carried.abs().max() > 0 and residual.abs().max() > 0  # unsent work and codec error are owed
    assert {c.numel() for c in compact} == {4 * BLOCK, 3 * BLOCK + 1}  # 4 of 13 blocks a round (one of 1 value)


@pytest.mark.parametrize("compression,fragments", [("subset4+int4", 1), ("subset4+int4", 2), ("subset8+e2m1", 1)])
def test_replicas_stay_bit_identical(run_replicas, compression, fragments):
    group, H, rounds = InProcessGroup(3, compression=compression), 4, 3
    out = {}

    def worker(rank):
        model = wide(bn=True)
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                              communicator=group.members[rank],
                              module=model, error_feedback=True, fragments=fragments)
        hashes = round_hashes(model, opt, rank, H * rounds, group_size=3)
        out[rank] = (hashes, [b.clone() for b in opt.outer.buffers], opt.error_residual(0).clone())

    run_replicas(worker, 3)
    assert out[0][0] == out[1][0] == out[2][0] and len(out[0][0]) == rounds * fragments
    assert all(torch.equal(a, b) for r in (1, 2) for a, b in zip(out[0][1], out[r][1]))
    assert not torch.equal(out[0][2], out[1][2])  # each worker owes its own


def test_buffers_are_averaged_whole(run_replicas):
    """Buffers are values, not updates: every one of them is averaged every round, never subsetted."""
    group, H = InProcessGroup(3, compression="subset8+none"), 3
    sent, out = {}, {}

    def worker(rank):
        model = wide(bn=True)
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                              communicator=group.members[rank],
                              module=model, error_feedback=True)

        def hook(*_):
            if opt.local_step + 1 >= H:
                sent[rank] = [b.clone() for b in opt.outer.buffers]

        opt.inner.register_step_post_hook(hook)
        for step in range(H):
            train_step(model, opt, *batch(rank, step))
        assert opt.outer_step == 1
        out[rank] = [b.clone() for b in opt.outer.buffers]

    run_replicas(worker, 3)
    for i in range(2):  # running mean and variance: exactly the group's average, in the group's order
        want = torch.zeros_like(sent[0][i])
        for r in range(3):
            want.add_(sent[r][i], alpha=1 / 3)
        assert all(torch.equal(out[r][i], want) for r in range(3))
        assert not torch.equal(want, sent[0][i])


def test_unselected_values_of_the_global_weights_do_not_move_and_local_work_is_kept():
    model = wide()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                          communicator=SingleWorker("subset8+none"), error_feedback=True)
    start = torch.cat([g.reshape(-1) for g in opt.outer.global_params]).clone()
    train_step(model, opt, *batch(0, 0))
    trained = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    opt.inner.register_step_post_hook(lambda *_: trained.copy_(torch.cat([p.detach().reshape(-1)
                                                                           for p in model.parameters()])))
    train_step(model, opt, *batch(0, 1))
    assert opt.outer_step == 1
    now = torch.cat([g.reshape(-1) for g in opt.outer.global_params])
    moved = (now != start).nonzero().reshape(-1)
    sent = Subset(8).indices(RoundKey(0), start.numel())
    assert set(moved.tolist()) <= set(sent.tolist()) and moved.numel() > 0.9 * sent.numel()
    # θ_local: the sent values restart from θ_global, the others keep their local progress (owed)
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    unsent = torch.ones(start.numel(), dtype=torch.bool)
    unsent[sent] = False
    assert torch.equal(local[sent], now[sent])
    assert torch.allclose(local[unsent], trained[unsent], rtol=0, atol=1e-6) and not torch.equal(local, now)


def _make(seed=0, H=4, fragments=2, overlap=1):
    model = wide(seed)
    return model, DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, fragments=fragments,
                                  overlap=overlap, communicator=SingleWorker("subset4+int4"), error_feedback=True)


@pytest.mark.parametrize("cut", [6, 7])  # 6: a streamed round in flight, saved and started again on load
def test_resume_with_a_round_in_flight_is_bit_exact(cut):
    def round_in_flight_saved(opt_state):
        assert (opt_state["pending"] is not None) == (cut == 6)

    assert_resume_is_bit_exact(_make, total=13, cut=cut, look_into=round_in_flight_saved)


# -- the config -------------------------------------------------------------------------------------

def test_the_config_takes_subset_formats_and_turns_error_feedback_on():
    cfg = load_config(None, ["--swarm.compression", "subset32+int4"])
    assert cfg.swarm.uses_error_feedback
    assert load_config(None, ["--swarm.compression", "subset8+fp16", "--swarm.error-feedback", "true"])


@pytest.mark.parametrize("override, fragment", [
    (["--swarm.compression", "subset1+int4"], "swarm.compression: bad format 'subset1+int4'"),
    (["--swarm.compression", "subset32int4"], "swarm.compression: bad format 'subset32int4'"),
    (["--swarm.compression", "subset32+fp4"], "swarm.compression: unknown format 'subset32+fp4'"),
    (["--swarm.result-compression", "subset4+int8"], "swarm.result_compression: 'subset4+int8'"),
    (["--swarm.compression", "subset32+int4", "--swarm.error-feedback", "false"],
     "swarm.error_feedback: subset32+int4 owes"),
])
def test_bad_subset_settings_are_refused_in_one_line(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert str(e.value).startswith(fragment) and len(str(e.value).splitlines()) == 1
