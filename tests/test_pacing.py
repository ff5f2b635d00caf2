"""The pacing rule against hand-worked numbers, and the optimizer's swarm pace where it can be checked alone."""

import copy
import math
import time

import pytest
import torch

from opendiloco import AveragingError, DiLoCoOptimizer
from opendiloco.comm import SingleWorker
from opendiloco.pacing import (
    EXTRAPOLATE_S,
    Pace,
    group_work,
    retry_delay,
    round_due,
    seconds_to_target,
    target_work,
)
from tests.toy_training import ADAMW, batch, mlp, params, train_step

H = 10
# A worker stepping every 0.1 s (10 samples/s, 1 sample per step) and a 4x slower peer (2.5/s) whose
# record is one second old: at t=100 the peer stands at 2 + 2.5 = 4.5.
SLOW = Pace(work=2, rate=2.5, per_step=1, time=99.0)


def own(work, t=100.0):
    return Pace(work=work, rate=10.0, per_step=1, time=t)


def test_target_is_h_steps_of_every_member_and_work_is_extrapolated():
    assert target_work([own(0), SLOW], H) == 20
    assert group_work([own(6), SLOW], 100.0) == 6 + 4.5
    assert Pace(work=3, rate=2.5, per_step=1, time=99.0, ready=True).work_at(200.0) == 3  # waiting: frozen


def test_due_at_the_step_boundary_nearest_the_target():
    # Half a step from now (t=100.05): own 14 + 0.5, peer 2 + 2.5 * 1.05 = 4.625; 19.125 < 20.
    assert not round_due(own(14), [SLOW], H, own_step_s=0.1, local_step=14)
    # One step later: 15.5 + 4.625 = 20.125 >= 20. The fast worker took 15 steps, more than H...
    assert round_due(own(15), [SLOW], H, own_step_s=0.1, local_step=15)
    # ...and the slow one, seen from its side at the same moment, is due too with fewer than H.
    fast_seen = Pace(work=15, rate=10.0, per_step=1, time=100.0)
    slow_now = Pace(work=4.5, rate=2.5, per_step=1, time=100.0)
    assert round_due(slow_now, [fast_seen], H, own_step_s=0.4, local_step=4)


def test_seconds_to_target():
    # Missing 20 - 10.5 = 9.5 samples at 12.5 samples/s together.
    assert seconds_to_target(own(6), [SLOW], H) == pytest.approx(0.76)
    assert seconds_to_target(own(30), [SLOW], H) == 0.0
    stalled = [Pace(work=1, rate=0.0, per_step=1, time=99.0, ready=True)]
    assert seconds_to_target(Pace(work=1, rate=0.0, per_step=1, time=100.0), stalled, H) == math.inf


def test_everyone_else_waiting_means_due_now():
    waiting = Pace(work=3, rate=2.5, per_step=1, time=99.0, ready=True)
    assert round_due(own(1), [waiting], H, own_step_s=0.1, local_step=1)
    assert not round_due(own(0), [waiting], H, own_step_s=0.1, local_step=0)  # not before its first step


def test_a_peer_without_a_pace_is_not_counted_and_alone_means_exactly_h():
    joiner = Pace(work=0, rate=0.0, per_step=0, time=99.0)
    for others in ([], [joiner]):
        assert not round_due(own(H - 1), others, H, own_step_s=0.1, local_step=H - 1)
        assert round_due(own(H), others, H, own_step_s=0.1, local_step=H)


def test_never_later_than_h_times_the_group_size():
    stuck = Pace(work=0, rate=1e-9, per_step=1, time=0.0)  # published, then made no progress
    assert not round_due(own(2 * H - 1), [stuck], H, own_step_s=0.1, local_step=2 * H - 1)
    assert round_due(own(2 * H), [stuck], H, own_step_s=0.1, local_step=2 * H)


def _run(pace, steps=23):
    model = mlp(0)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=5, inner_optimizer=ADAMW, communicator=SingleWorker("fp16"),
                          pace=pace)
    losses = [train_step(model, opt, *batch(0, s)) for s in range(steps)]
    return model, opt, losses


def test_swarm_pace_alone_is_fixed_h_bit_for_bit():
    fixed_model, fixed, fixed_losses = _run("fixed")
    swarm_model, swarm, swarm_losses = _run("swarm")
    assert fixed_losses == swarm_losses and fixed.global_hash() == swarm.global_hash()
    assert all(torch.equal(a, b) for a, b in zip(params(fixed_model), params(swarm_model)))
    assert swarm.outer_step == 4 and swarm.schedule_step == 4 * 5 + 3 == fixed.schedule_step
    assert _run("swarm", steps=24)[1].schedule_step == 24
    assert swarm.contributed_steps == 20 and swarm.dropped_steps == 0
    assert swarm.last_sync.steps == 5 and swarm.last_sync.weight == 5.0  # weighted by its work


def test_carried_work_restarts_from_the_new_global_minus_the_old_pseudo_gradient():
    donor_model, donor, _ = _run("swarm", steps=10)
    model, opt, _ = _run("swarm", steps=3)
    pseudo = [g - p.detach() for g, p in zip(opt.outer.global_params, model.parameters())]
    opt.load_shareable_state(copy.deepcopy(donor.shareable_state()), keep_local=[d.clone() for d in pseudo])
    assert opt.global_hash() == donor.global_hash() and opt.outer_step == 2
    for p, g, d in zip(model.parameters(), donor.outer.global_params, pseudo):
        assert torch.equal(p.detach(), g - d)
    assert opt.inner_steps_total == 3 and opt.dropped_steps == 0  # its own counters, nothing thrown away


def test_pace_is_validated():
    with pytest.raises(ValueError, match="pace"):
        DiLoCoOptimizer(mlp(0).parameters(), local_steps=5, pace="fast")


def test_schedule_step_never_goes_back_after_a_failed_round():
    class Failing(SingleWorker):
        def start(self, flat, *, weight, key, out=None):
            from opendiloco.comm.base import CompletedWork

            return CompletedWork(error=AveragingError("no quorum"))

    model = mlp(0)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=5, inner_optimizer=ADAMW, communicator=Failing(),
                          pace="swarm")
    seen = []
    for s in range(12):
        train_step(model, opt, *batch(0, s))
        seen.append(opt.schedule_step)
    assert seen == sorted(seen) and opt.outer_step == 0 and seen[-1] == 4  # stuck below the round's end


def test_a_far_stale_peer_is_not_extrapolated_for_ever():
    stale = Pace(work=2, rate=2.5, per_step=1, time=0.0)
    assert stale.work_at(1e6) == 2 + 2.5 * EXTRAPOLATE_S


def test_retry_delay_doubles_from_half_a_second_to_eight():
    assert [retry_delay(n) for n in range(7)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    # A worker whose rounds failed for hours (2 ** 1024 overflowed a float: the worker crashed).
    assert retry_delay(1100) == retry_delay(10 ** 6) == 8.0


class _Clock:
    """``time`` as the optimizer sees it, with a monotonic clock the test moves."""

    def __init__(self):
        self.t = 1000.0

    def monotonic(self):
        return self.t

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_worker_whose_rounds_fail_tries_again_later_and_later(monkeypatch):
    """Under pace "swarm" a failed round kept the worker due at once (its peers, in their round, are all
    ready): a worker left out of every group announced a round every inner step. Now it waits
    ``retry_delay``, and a round that moves θ_global starts the count again."""
    from opendiloco import optimizer as optimizer_module
    from opendiloco.comm.base import CompletedWork

    clock = _Clock()
    monkeypatch.setattr(optimizer_module, "time", clock)
    tries, fail = [], [True]

    class Flaky(SingleWorker):
        def start(self, flat, *, weight, key, out=None):
            tries.append(clock.t)
            if fail[0]:
                return CompletedWork(error=AveragingError("left out of the group"))
            return super().start(flat, weight=weight, key=key, out=out)

    model = mlp(0)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=5, inner_optimizer=ADAMW, communicator=Flaky(),
                          pace="swarm")
    for s in range(100):  # an inner step every 0.1 s: exact H (5 steps) alone would try every 0.5 s
        train_step(model, opt, *batch(0, s))
        clock.t += 0.1
    gaps = [round(b - a, 1) for a, b in zip(tries, tries[1:])]
    assert gaps == [0.5, 1.0, 2.0, 4.0] and opt.outer_step == 0, gaps
    fail[0] = False
    for s in range(100, 200):
        train_step(model, opt, *batch(0, s))
        clock.t += 0.1
    assert opt.outer_step >= 2  # the first round that went through started the count again
    assert [round(b - a, 1) for a, b in zip(tries[4:], tries[5:])][1:] == [0.5] * (len(tries) - 6)
