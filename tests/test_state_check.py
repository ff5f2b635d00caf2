"""A peer's state is checked in full before a joiner adopts it (opendiloco/state_check.py).

The poisoned states are the ones the swarm's insider serves (tests/swarm/bad_donor.py, ``POISONS``):
θ_global is the run's, so only the checks against the joiner's own configuration stop them.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from torch import nn

from opendiloco import DiLoCoOptimizer, SingleWorker
from opendiloco.comm.base import SharedState
from opendiloco.state_check import MAX_STEPS_RATIO, MOMENTUM_REACH, StateRefused
from tests.swarm.bad_donor import POISONS, poison

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
DONOR = "12D3KooWPoisonedDonorPeerIdABCDEFGH"  # as the receiver names it (``fetch_state`` sets ``donor``)
H = 5


class Keeps(SingleWorker):
    """A lone worker's communicator that keeps the state provider the optimizer attaches."""

    provider = None

    def attach_state_provider(self, provider) -> None:
        self.provider = provider


def make(seed: int = 0, pace: str = "fixed", outer=None):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    kw = {} if outer is None else {"outer_optimizer": outer}
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, module=model,
                          communicator=Keeps(), pace=pace, **kw)
    return model, opt


def train(model, opt, steps: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).tanh())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@pytest.fixture(scope="module")
def donor():
    """A worker at outer step 2 (2 * H inner steps), two steps into its third round."""
    model, opt = make()
    train(model, opt, 2 * H + 2)
    assert opt.outer_step == 2 and opt.outer.optimizer.state  # momentum buffers exist
    return opt


def served(donor, **changes) -> dict:
    state = copy.deepcopy(donor.shareable_state())
    state["donor"] = DONOR
    state.update(changes)
    return state


def unchanged(model, opt):
    return (opt.global_hash(), opt.outer_step, opt.inner_steps_total, copy.deepcopy(model.state_dict()),
            copy.deepcopy(opt.outer.optimizer.state_dict()))


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


NAMED = {"inner_steps_total": "inner_steps_total 1000000000", "local_step": "local_step 1000000000000",
         "lr": "setting 'lr'", "maximize": "setting 'maximize'", "momentum": "setting 'momentum'",
         "momentum_buffer": "momentum_buffer would move a weight", "buffers": "buffers[0]: contains NaN or Inf"}


@pytest.mark.parametrize("field", sorted(POISONS))
def test_a_poisoned_field_is_refused_naming_the_donor_and_nothing_changes(donor, field):
    model, joiner = make(seed=7)
    before = unchanged(model, joiner)
    bad = poison(served(donor), field)
    pattern = f"^refused the state of donor ABCDEFGH: .*{re.escape(NAMED[field])}"
    with pytest.raises(StateRefused, match=pattern) as refused:
        joiner.load_shareable_state(bad, expected_hash=donor.global_hash())
    assert "\n" not in str(refused.value)  # one line
    assert same(unchanged(model, joiner), before)
    # The check a transport runs before handing a download over says the same, and changes nothing either.
    with pytest.raises(StateRefused, match=re.escape(NAMED[field])):
        joiner.communicator.provider.check(poison(served(donor), field), None)
    # The honest state is adopted, and the next outer step keeps θ_global finite and of its scale.
    joiner.load_shareable_state(served(donor), expected_hash=donor.global_hash())
    assert joiner.global_hash() == donor.global_hash() and joiner.inner_steps_total == 2 * H + 2
    train(model, joiner, H)
    assert joiner.outer_step == 3 and all(torch.isfinite(g).all() and g.abs().max() < 100
                                          for g in joiner.outer.global_params)


def test_the_poisoned_momentum_would_have_blown_theta_up(donor):
    """What the check stops: the state adopted as it is, one outer step later (the bug report's 7e31)."""
    model, victim = make(seed=7)
    bad = poison(served(donor), "momentum_buffer")
    victim.outer.load_state_dict(bad["outer"])  # past every check, as load_shareable_state once did
    victim.outer.reset_local()
    train(model, victim, H - bad["local_step"] + H)
    assert max(g.abs().max() for g in victim.outer.global_params) > 1e29


def test_implementation_switches_may_differ_and_the_joiners_own_settings_stay(donor):
    state = served(donor)
    for group in state["outer"]["optimizer"]["param_groups"]:
        group["foreach"], group["differentiable"] = True, True
    _, joiner = make(seed=7)
    joiner.load_shareable_state(state)
    assert joiner.global_hash() == donor.global_hash()
    group = joiner.outer.optimizer.param_groups[0]
    assert group["foreach"] is None and group["differentiable"] is False


def test_a_setting_missing_or_extra_is_refused(donor):
    _, joiner = make(seed=7)
    state = served(donor)
    del state["outer"]["optimizer"]["param_groups"][0]["nesterov"]
    with pytest.raises(StateRefused, match="'nesterov' is 'missing'"):
        joiner.load_shareable_state(state)
    state = served(donor)
    state["outer"]["optimizer"]["param_groups"][0]["lookahead"] = 5
    with pytest.raises(StateRefused, match="'lookahead'"):
        joiner.load_shareable_state(state)


def test_inner_steps_total_within_the_slack_of_the_runs_schedule(donor):
    """At outer step 2 the schedule takes 2 * H steps: a donor whose rounds failed took more (accepted up
    to ``MAX_STEPS_RATIO`` times that plus a round); under pace="fixed" never fewer, but for a round of
    slack (a donor reads its counters while it steps)."""
    most = MAX_STEPS_RATIO * (2 * H + H)
    for total in (H, 2 * H, 2 * H + 3 * H, most):
        _, joiner = make(seed=7)
        joiner.load_shareable_state(served(donor, inner_steps_total=total))
        assert joiner.inner_steps_total == total + 2  # its local_step (2) on top
    for total in (most + 1, H - 1):
        _, joiner = make(seed=7)
        with pytest.raises(StateRefused, match=f"inner_steps_total {total} at outer step 2"):
            joiner.load_shareable_state(served(donor, inner_steps_total=total))
    _, slow = make(seed=7, pace="swarm")  # under pace="swarm" a slow worker takes fewer steps than H
    slow.load_shareable_state(served(donor, inner_steps_total=3))
    assert slow.inner_steps_total == 3 and slow.outer_step == 2


def test_local_step_below_the_rounds_gap(donor):
    _, joiner = make(seed=7)
    joiner.load_shareable_state(served(donor, local_step=H - 1))
    assert joiner.local_step == H - 1
    _, joiner = make(seed=7)
    with pytest.raises(StateRefused, match=f"local_step {H} is not below the round's {H} steps"):
        joiner.load_shareable_state(served(donor, local_step=H))
    _, fast = make(seed=7, pace="swarm")  # its position is not taken under pace="swarm" (a fast peer's may exceed H)
    fast.load_shareable_state(served(donor, local_step=3 * H))
    assert fast.local_step == 0


def test_a_momentum_buffer_is_bounded_by_its_reach_against_theta_global(donor):
    state = served(donor)
    largest = max(g.abs().max().item() for g in state["outer"]["global_params"])
    group = state["outer"]["optimizer"]["param_groups"][0]
    limit = MOMENTUM_REACH * largest / (group["lr"] * group["momentum"])  # the largest |buffer| accepted
    for factor, ok in ((0.99, True), (1.01, False)):
        state = served(donor)
        next(iter(state["outer"]["optimizer"]["state"].values()))["momentum_buffer"].view(-1)[0] = factor * limit
        _, joiner = make(seed=7)
        if ok:
            joiner.load_shareable_state(state)
        else:
            with pytest.raises(StateRefused, match="would move a weight by"):
                joiner.load_shareable_state(state)


def test_an_outer_optimizers_step_count_is_at_most_the_outer_step():
    adam = functools.partial(torch.optim.Adam, lr=0.1, betas=(0.9, 0.99))
    model, opt = make(outer=adam)
    train(model, opt, 2 * H)
    for step, ok in ((2.0, True), (3.0, False), (1.5, False), (-1.0, False)):
        state = served(opt)
        for entry in state["outer"]["optimizer"]["state"].values():
            entry["step"] = torch.tensor(step)
        _, joiner = make(seed=7, outer=adam)
        if ok:
            joiner.load_shareable_state(state)
            assert joiner.global_hash() == opt.global_hash()
        else:
            with pytest.raises(StateRefused, match=r"\.step is"):
                joiner.load_shareable_state(state)
    state = served(opt)
    state["outer"]["optimizer"]["param_groups"][0]["betas"] = (0.9, 0.5)
    _, joiner = make(seed=7, outer=adam)
    with pytest.raises(StateRefused, match="'betas'"):
        joiner.load_shareable_state(state)


def test_the_provider_a_transport_gets_bounds_and_checks_downloads(donor):
    _, opt = make(seed=7)
    provider = opt.communicator.provider
    assert isinstance(provider, SharedState) and provider.max_bytes == opt.shareable_state_bound()
    assert provider()["outer_step"] == 0  # it serves this worker's state
    provider.check(served(donor), 2)  # an honest state passes
    with pytest.raises(StateRefused, match="not yet 3"):
        provider.check(served(donor), 3)


def test_a_state_without_a_donor_name_is_refused_all_the_same(donor):
    _, joiner = make(seed=7)
    state = poison(served(donor), "maximize")
    del state["donor"]
    with pytest.raises(StateRefused, match="^refused the state of the peer: "):
        joiner.load_shareable_state(state)


# -- a warm start: the donor's Adam moments ------------------------------------------------------

def make_warm(seed: int = 0, warm_start: bool = True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, module=model,
                          communicator=Keeps(), warm_start=warm_start)
    return model, opt


@pytest.fixture(scope="module")
def warm_donor():
    model, opt = make_warm()
    train(model, opt, 2 * H + 2)
    assert opt.shareable_state()["inner"]  # it serves its moments
    return opt


def _entries(state):
    return list(state["inner"].values())


INNER_POISONS = {
    "exp_avg": (lambda s: [e["exp_avg"].fill_(1e3) for e in _entries(s)], "larger than Adam's averages allow"),
    "exp_avg_sq": (lambda s: [e["exp_avg_sq"].fill_(-1.0) for e in _entries(s)], "exp_avg_sq is negative"),
    "nan": (lambda s: [e["exp_avg_sq"].fill_(float("nan")) for e in _entries(s)], "NaN or Inf"),
    "step": (lambda s: [e.update(step=torch.tensor(1e9)) for e in _entries(s)], "step is 1000000000.0: between 1 and"),
    "shape": (lambda s: [e.update(exp_avg=torch.zeros(3)) for e in _entries(s)], "shape (3,)"),
    "entry": (lambda s: [e.update(momentum_buffer=torch.zeros(1)) for e in _entries(s)], "not Adam's"),
    "partial": (lambda s: [e.pop("exp_avg") for e in _entries(s)], "not Adam's"),  # would crash its first step
    "step0": (lambda s: [e.update(step=torch.tensor(0.0)) for e in _entries(s)], "step is 0.0: between 1"),
    # A first moment Adam cannot reach after one step (|m| <= sqrt(v) then): 4.8x lr in the joiner's first step.
    "reach": (lambda s: [e.update(step=torch.tensor(1.0), exp_avg=2.3 * e["exp_avg_sq"].sqrt() + 1e-3)
                         for e in _entries(s)], "after 1 steps"),
    "index": (lambda s: s["inner"].update({10**6: {}}), "unexpected entry 1000000"),
}


@pytest.mark.parametrize("field", sorted(INNER_POISONS))
def test_a_poisoned_inner_state_is_refused_naming_the_donor_and_nothing_changes(warm_donor, field):
    model, joiner = make_warm(seed=7)
    before = unchanged(model, joiner)
    bad = served(warm_donor)
    corrupt, message = INNER_POISONS[field]
    corrupt(bad)
    with pytest.raises(StateRefused, match=f"^refused the state of donor ABCDEFGH: .*{re.escape(message)}"):
        joiner.load_shareable_state(bad, expected_hash=warm_donor.global_hash())
    assert same(unchanged(model, joiner), before) and not joiner.inner.state and not joiner.warm_started


def test_a_warm_start_takes_the_donors_moments_and_trains_on(warm_donor):
    model, joiner = make_warm(seed=7)
    joiner.load_shareable_state(served(warm_donor), expected_hash=warm_donor.global_hash())
    assert joiner.warm_started
    theirs = warm_donor.inner.state_dict()["state"]
    mine = joiner.inner.state_dict()["state"]
    assert mine.keys() == theirs.keys() and all(
        torch.equal(mine[i][k], theirs[i][k].float()) for i in theirs for k in ("exp_avg", "exp_avg_sq"))
    assert joiner.param_groups is joiner.inner.param_groups and joiner.param_groups[0]["lr"] == 1e-2
    train(model, joiner, H)
    assert joiner.outer_step == 3 and all(torch.isfinite(g).all() for g in joiner.outer.global_params)
    # Without warm_start the donor's moments are not taken, and a worker with moments of its own keeps them.
    _, cold = make_warm(seed=7, warm_start=False)
    cold.load_shareable_state(served(warm_donor), expected_hash=warm_donor.global_hash())
    assert not cold.inner.state and not cold.warm_started
    model, trained = make_warm(seed=7)
    train(model, trained, 2)
    own = copy.deepcopy(trained.inner.state_dict()["state"])
    trained.load_shareable_state(served(warm_donor), expected_hash=warm_donor.global_hash())
    assert not trained.warm_started and same(trained.inner.state_dict()["state"], own)


def test_a_donor_without_warm_start_serves_no_moments_and_the_bound_covers_them(warm_donor):
    _, cold = make_warm(warm_start=False)
    assert "inner" not in cold.shareable_state()
    import io

    buf = io.BytesIO()
    torch.save(warm_donor.shareable_state(), buf)
    assert len(buf.getvalue()) <= cold.shareable_state_bound()  # a joiner without it still downloads it


def test_adams_first_moment_stays_within_the_bound_the_check_uses():
    """The bound is Adam's own: over many steps of gradients of any scale and sign pattern, |m| / sqrt(v)
    never exceeds ``adam_moment_ratio``, and a constant gradient comes close to it."""
    from opendiloco.state_check import adam_moment_ratio

    for betas in ((0.9, 0.95), (0.9, 0.999), (0.8, 0.99)):
        p = nn.Parameter(torch.zeros(4096))
        opt = torch.optim.Adam([p], lr=1e-3, betas=betas)
        g = torch.Generator().manual_seed(0)
        worst = 0.0
        for step in range(300):
            scale = 10 ** torch.randint(-3, 3, (4096,), generator=g).float()
            p.grad = torch.randn(4096, generator=g) * scale if step % 50 else torch.full((4096,), 5.0)
            opt.step()
            state = opt.state[p]
            ratio = float((state["exp_avg"].abs() / state["exp_avg_sq"].sqrt()).max())
            assert ratio <= adam_moment_ratio(*betas, steps=step + 1) * (1 + 1e-5), (betas, step, ratio)
            worst = max(worst, ratio)
        assert worst <= adam_moment_ratio(*betas) * (1 + 1e-5), (betas, worst)
        assert worst > 0.5 * adam_moment_ratio(*betas) or betas[1] == 0.999, (betas, worst)
