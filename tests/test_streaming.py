"""Streaming DiLoCo: the fragment schedule against a hand-written reference, the fragment math
(sign, mixing), overlap, failure, resume, and replicas in step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opendiloco import AveragingError, DiLoCoOptimizer, InProcessGroup, SingleWorker
from opendiloco.comm.base import CompletedWork
from opendiloco.streaming import check_schedule, event_start, split_evenly
from tests.toy_training import ADAMW, INIT_LOCK, SGD1, params, train_step


class Recording(SingleWorker):
    """A real single worker (fp16 round trip) that notes which round started at which inner step."""

    def __init__(self, fail_fragment: int | None = None):
        super().__init__(compression="fp16")
        self.started, self.opt, self.fail_fragment = [], None, fail_fragment

    def start(self, flat, *, weight, key, out=None):
        self.started.append((self.opt.inner_steps_total, key.outer_step, key.fragment, flat.numel()))
        if key.fragment == self.fail_fragment:
            return CompletedWork(error=AveragingError("injected: this fragment's round failed"))
        return super().start(flat, weight=weight, key=key, out=out)


def layers(seed=0, width=6, depth=4) -> nn.Module:
    """Equal-sized layers, so that fragments split evenly by layer."""
    with INIT_LOCK:  # replicas build their models in threads; the global RNG is shared
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])


def layer_batch(step, width=6):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, width, generator=g)
    return x, x.flip(1) * 0.5


def run(opt, model, steps, start=0, on_sync=None):
    for s in range(start, start + steps):
        before = opt.last_sync
        train_step(model, opt, *layer_batch(s))
        if on_sync is not None and opt.last_sync is not before:
            on_sync(opt.inner_steps_total, opt.last_sync)


def make(comm, *, H=8, P=4, overlap=1, mix=0.0, outer=SGD1, seed=0):
    model = layers(seed)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, outer_optimizer=outer,
                          communicator=comm, fragments=P, overlap=overlap, mix=mix)
    if isinstance(comm, Recording):
        comm.opt = opt
    return model, opt


@pytest.mark.parametrize("H, P, overlap", [(8, 4, 1), (10, 4, 1), (6, 1, 2), (9, 3, 2)])
def test_schedule_matches_a_hand_written_reference(H, P, overlap):
    # Reference, written out longhand: event e starts at floor((e+1)·H/P), carries fragment e mod P,
    # and lands `overlap` steps later. Each fragment syncs every H steps.
    reference_starts = {(8, 4): [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24],
                        (10, 4): [2, 5, 7, 10, 12, 15, 17, 20, 22, 25],
                        (6, 1): [6, 12, 18, 24],
                        (9, 3): [3, 6, 9, 12, 15, 18, 21, 24]}[(H, P)]
    comm = Recording()
    model, opt = make(comm, H=H, P=P, overlap=overlap)
    applied = []
    run(opt, model, 25, on_sync=lambda step, rep: applied.append((step, rep.fragment, rep.outer_step)))
    starts = [s for s in reference_starts if s <= 25]
    assert [(step, e, frag) for step, e, frag, _ in comm.started] == [(s, e, e % P) for e, s in enumerate(starts)]
    landed = [(s + overlap, e % P, e + 1) for e, s in enumerate(starts) if s + overlap <= 25]
    assert applied == landed
    assert [event_start(e, H, P) for e in range(len(starts))] == starts
    for f in range(P):  # every fragment every H steps
        mine = [s for e, s in enumerate(starts) if e % P == f]
        assert all(b - a == H for a, b in zip(mine, mine[1:]))


def test_each_event_sends_one_fragment_so_the_peak_is_a_quarter():
    comm = Recording()
    model, opt = make(comm, H=8, P=4)
    run(opt, model, 16)
    total = sum(p.numel() for p in model.parameters())
    assert {numel for *_, numel in comm.started} == {total // 4}
    plain = Recording()
    m2, o2 = make(plain, H=8, P=1, overlap=0)
    run(o2, m2, 16)
    assert {numel for *_, numel in plain.started} == {total}


@pytest.mark.parametrize("mix", [0.0, 0.5])
def test_fragment_update_sign_and_other_fragments_untouched(mix):
    # Outer SGD with lr 1 and no momentum: θ_global_f := θ_global_f − avg Δ_f = θ_local_f at the event
    # (up to the fp16 round trip). Other fragments' θ_global must not move at all.
    comm = Recording()
    model, opt = make(comm, H=8, P=4, overlap=1, mix=mix)
    run(opt, model, 2)  # step 2 starts the round of fragment 0 (layer 0)
    at_event = params(model)
    global_before = [g.detach().clone() for g in opt.outer.global_params]
    assert opt.outer_step == 0 and opt._pending is not None  # in flight: nothing applied yet
    run(opt, model, 1, start=2)  # step 3: training went on, and now the round lands
    assert opt.outer_step == 1 and opt.last_sync.ok and opt.last_sync.fragment == 0
    new_global = [g.detach() for g in opt.outer.global_params]
    # sign: θ_global moved to where the local weights were at the event, not away from them
    torch.testing.assert_close(new_global[0], at_event[0], rtol=2e-3, atol=2e-3)
    assert not torch.allclose(global_before[0], at_event[0], atol=1e-3)
    for i in (1, 2, 3):
        assert torch.equal(new_global[i], global_before[i])
    assert torch.equal(params(model)[0], new_global[0]) == (mix == 0.0)  # mix 0 takes the global


def test_mix_is_a_lerp_towards_the_global():
    comm = Recording()
    model, opt = make(comm, H=8, P=4, overlap=1, mix=0.25)
    seen = {}
    # Capture θ_local right after the inner step that lands event 0 (step 3), before the merge.
    original = opt.outer.reset_local

    def spy(indices=None, mix=0.0):
        seen["before"] = [model[i].weight.detach().clone() for i in range(4)]
        original(indices, mix)

    opt.outer.reset_local = spy
    run(opt, model, 3)
    g = opt.outer.global_params[0].detach()
    want = 0.25 * seen["before"][0] + 0.75 * g
    torch.testing.assert_close(model[0].weight.detach(), want, rtol=0, atol=1e-6)
    for i in (1, 2, 3):
        assert torch.equal(model[i].weight.detach(), seen["before"][i])


def test_a_failed_background_round_leaves_that_fragment_and_training_alone():
    comm = Recording(fail_fragment=1)
    model, opt = make(comm, H=8, P=4, overlap=1)
    reports = []
    run(opt, model, 12, on_sync=lambda step, rep: reports.append(rep))
    # events 0 (ok) and 1 (fragment 1: fails, outer step not advanced), then fragment 1 again...
    assert reports[0].ok and reports[0].fragment == 0
    assert not reports[1].ok and reports[1].fragment == 1 and "injected" in reports[1].reason
    assert opt.outer_step == 1  # fragment 1 keeps failing: the run stays at that event
    assert all(not r.ok and r.fragment == 1 for r in reports[1:])
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in model.parameters()])).all()


def test_resume_mid_flight_is_exact():
    H, P, overlap, total, cut = 12, 4, 2, 30, 12  # event 3 starts at step 12 and lands at 14
    model, opt = make(SingleWorker("fp16"), H=H, P=P, overlap=overlap)
    run(opt, model, total)
    reference = (params(model), opt.global_hash(), opt.outer_step)

    model, opt = make(SingleWorker("fp16"), H=H, P=P, overlap=overlap)
    run(opt, model, cut)
    assert opt._pending is not None  # a round is in flight at the cut
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["pending"]["outer_step"] == 3 and saved_opt["fragments"] == [f.params for f in opt.fragments]

    model, opt = make(SingleWorker("fp16"), H=H, P=P, overlap=overlap, seed=9)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    run(opt, model, total - cut, start=cut)
    assert (params(model), opt.global_hash(), opt.outer_step)[1:] == reference[1:]
    assert all(torch.equal(a, b) for a, b in zip(params(model), reference[0]))


def test_a_state_dict_of_other_fragments_is_refused():
    model, opt = make(SingleWorker("fp16"), H=8, P=4)
    run(opt, model, 3)
    _, other = make(SingleWorker("fp16"), H=8, P=2)
    with pytest.raises(ValueError, match="fragment"):
        other.load_state_dict(opt.state_dict())


def test_replicas_stay_bit_identical_per_fragment(run_replicas):
    group, H, P, steps = InProcessGroup(3, compression="fp16"), 8, 4, 26
    hashes = {r: [] for r in range(3)}

    def worker(rank):
        model = layers(0)
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                              communicator=group.members[rank], fragments=P, overlap=1, mix=0.5)
        for s in range(steps):
            before = opt.last_sync
            train_step(model, opt, *batch_for(rank, s))
            if opt.last_sync is not before:
                assert opt.last_sync.ok and opt.last_sync.group_size == 3, opt.last_sync
                hashes[rank].append((opt.outer_step, opt.last_sync.fragment, opt.global_hash()))

    run_replicas(worker, 3, timeout=60)
    assert len(hashes[0]) == 12  # events start at 2, 4, ..., 24 and land one step later
    assert hashes[0] == hashes[1] == hashes[2]
    assert len({h for *_, h in hashes[0]}) == 12


def batch_for(rank, step):
    x, y = layer_batch(1000 * rank + step)
    return x + rank, y * (1 + rank)


def test_schedules_that_cannot_run_are_refused():
    for args, match in [((8, 4, 2, 0.0), "overlap"), ((3, 4, 0, 0.0), "local_steps"), ((8, 2, 0, 1.5), "mix"),
                        ((8, 0, 0, 0.0), "fragments"), ((8, 2, -1, 0.0), "overlap")]:
        with pytest.raises(ValueError, match=match):
            check_schedule(*args)
    with pytest.raises(ValueError, match="fragment"):
        DiLoCoOptimizer(layers().parameters(), local_steps=8, fragments=9)


def test_explicit_fragments_must_cover_every_parameter_once():
    model = layers()
    blocks = [[model[0].weight, model[1].weight], [model[2].weight, model[3].weight]]
    opt = DiLoCoOptimizer(model.parameters(), local_steps=8, fragments=blocks)
    assert [f.params for f in opt.fragments] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="no fragment"):
        DiLoCoOptimizer(model.parameters(), local_steps=8, fragments=[[model[0].weight]])
    with pytest.raises(ValueError, match="not one of"):
        DiLoCoOptimizer(model.parameters(), local_steps=8, fragments=[[layers()[0].weight]])
    m = layers()
    with pytest.raises(ValueError, match="more than one"):
        DiLoCoOptimizer(m.parameters(), local_steps=8, fragments=[[m[0].weight, m[1].weight], [m[1].weight,
                                                                  m[2].weight, m[3].weight]])


def test_split_evenly_is_contiguous_and_balanced():
    sizes = [100, 100, 100, 100, 100, 100, 100, 100]
    assert split_evenly([torch.zeros(n) for n in sizes], 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_evenly([torch.zeros(n) for n in [1000, 10, 10, 10, 10]], 4) == [[0], [1], [2], [3, 4]]
    assert split_evenly([torch.zeros(n) for n in [10, 10, 10, 1000]], 2) == [[0, 1, 2], [3]]
