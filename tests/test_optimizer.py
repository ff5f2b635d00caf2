"""DiLoCoOptimizer against the invariants of docs/invariants.md, with real averaging (no mocks of the math).

Replicas run in threads and average through ``InProcessGroup``; every replica starts from the
same initial weights (as DiLoCo requires) and trains on its own data.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from torch import nn

from opendiloco import AverageResult, Communicator, DiLoCoOptimizer, InProcessGroup, SingleWorker
from opendiloco.comm.base import CompletedWork
from opendiloco.errors import RoundCounted
from opendiloco.outer import tensors_hash
from tests.toy_training import ADAMW, INIT_LOCK, SGD1, batch, mlp, params, train_step


def bnnet(seed: int = 0) -> BNNet:
    with INIT_LOCK:
        torch.manual_seed(seed)
        return BNNet()


def snapshot_before_sync(opt: DiLoCoOptimizer, into: dict, key=lambda opt: opt.outer_step):
    """Records the local weights after each inner step that will trigger an outer step."""

    def hook(_inner, _args, _kwargs):
        if opt.local_step + 1 >= opt.local_steps:  # step() increments after the inner step, then syncs
            into[key(opt)] = [p.detach().clone() for p in opt.outer.params]

    opt.inner.register_step_post_hook(hook)


# -- invariant 1: sign ------------------------------------------------------------------------


def test_outer_sgd_lr1_gives_mean_of_local_weights(run_replicas):
    group, H = InProcessGroup(2), 3
    local, models, opts = {}, {}, {}

    def worker(rank):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                              communicator=group.members[rank])
        snapshot_before_sync(opt, local.setdefault(rank, {}))
        for step in range(H):
            train_step(model, opt, *batch(rank, step))
        models[rank], opts[rank] = model, opt

    run_replicas(worker, 2)
    a, b = local[0][0], local[1][0]
    assert not any(torch.equal(x, y) for x, y in zip(a, b)), "replicas must have drifted apart"
    for rank in (0, 1):
        assert opts[rank].outer_step == 1 and opts[rank].last_sync.ok
        for p, g, x, y in zip(models[rank].parameters(), opts[rank].outer.global_params, a, b):
            mean = (x.double() + y.double()) / 2
            torch.testing.assert_close(g.double(), mean, rtol=0, atol=1e-6)
            assert torch.equal(p.detach(), g.detach())  # θ_local := θ_global
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)  # bit for bit
    assert group.rounds == 1  # invariant 6: one exchange per outer step


def test_one_worker_with_outer_sgd_lr1_and_no_momentum_is_plain_adamw():
    """Nothing in the outer machinery changes one worker's training: with θ_global := θ_local it
    follows AdamW (inner state, schedule and all) across outer steps, to fp32 rounding of g − (g − l)."""
    plain_model, diloco_model = mlp(), mlp()
    plain = ADAMW(plain_model.parameters())
    diloco = DiLoCoOptimizer(diloco_model.parameters(), local_steps=4, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                             communicator=SingleWorker("none"))
    for step in range(20):
        for model, opt in ((plain_model, plain), (diloco_model, diloco)):
            train_step(model, opt, *batch(0, step))
    assert diloco.outer_step == 5
    for a, b in zip(plain_model.parameters(), diloco_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


class FlippedSignSGD(torch.optim.SGD):
    """SGD that steps *along* the pseudo-gradient: what a sign slip (θ_local − θ_global) does."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.neg_()
        return super().step(closure)


def _convex_run(run_replicas, outer_factory, outer_steps=4, H=5):
    """Linear least squares (convex), two replicas; returns the full-data loss after each outer step."""
    group = InProcessGroup(2)
    torch.manual_seed(1)
    w_true = torch.randn(4, 1)
    xs = [torch.randn(64, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    ys = [x @ w_true for x in xs]
    losses: dict[int, list[float]] = {}

    def full_loss(model):
        with torch.no_grad():
            return sum(nn.functional.mse_loss(model(x), y).item() for x, y in zip(xs, ys)) / 2

    def worker(rank):
        model = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, outer_optimizer=outer_factory,
                              inner_optimizer=functools.partial(torch.optim.SGD, lr=0.05),
                              communicator=group.members[rank])
        out = [full_loss(model)]
        for _ in range(outer_steps * H):
            train_step(model, opt, xs[rank], ys[rank])
            if opt.local_step == 0:
                out.append(full_loss(model))
        losses[rank] = out

    run_replicas(worker, 2)
    assert losses[0] == losses[1]
    return losses[0]


def test_convex_loss_goes_down_across_outer_steps(run_replicas):
    losses = _convex_run(run_replicas, functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
    assert losses[1] < losses[0]
    assert losses[-1] < 0.2 * losses[0], losses


def test_a_sign_slip_would_be_detected(run_replicas):
    """The loss check above has teeth: with the pseudo-gradient's sign flipped, the loss goes up."""
    losses = _convex_run(run_replicas, functools.partial(FlippedSignSGD, lr=0.7, momentum=0.9, nesterov=True))
    assert losses[-1] > losses[0], losses


# -- default outer optimizer: Nesterov, checked against a hand-written reference -----------------


def test_default_nesterov_matches_hand_reference(run_replicas):
    group, H, outer_steps = InProcessGroup(2), 2, 3
    local, globals_after = {0: {}, 1: {}}, {0: {}, 1: {}}

    def worker(rank):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                              communicator=group.members[rank])  # default outer: SGD(0.4, 0.9, nesterov)
        snapshot_before_sync(opt, local[rank])
        for step in range(H * outer_steps):
            train_step(model, opt, *batch(rank, step))
            if opt.local_step == 0:
                globals_after[rank][opt.outer_step] = [g.detach().clone() for g in opt.outer.global_params]

    run_replicas(worker, 2)
    lr, m = 0.4, 0.9
    theta = [p.detach().clone() for p in mlp().parameters()]
    buf = None
    for k in range(outer_steps):
        g = [((t - a) + (t - b)) / 2 for t, a, b in zip(theta, local[0][k], local[1][k])]
        buf = [gi.clone() for gi in g] if buf is None else [m * bi + gi for bi, gi in zip(buf, g)]
        update = [gi + m * bi for gi, bi in zip(g, buf)]
        theta = [t - lr * u for t, u in zip(theta, update)]
        for rank in (0, 1):
            for got, want in zip(globals_after[rank][k + 1], theta):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain_sgd = [t - lr * gi for t, gi in zip(globals_after[0][2], g)]  # momentum must have mattered
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(plain_sgd, theta))


# -- invariant 2: H counts steps really taken -----------------------------------------------------


def test_step_skipped_by_gradscaler_does_not_count():
    H = 3
    model = mlp()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    poisoned = {1, 3}  # iterations whose gradient we force to inf
    history = []
    for it in range(5):
        x, y = batch(0, it)
        before = params(model)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if it in poisoned:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        history.append((opt.local_step, opt.outer_step, opt.inner_steps_total))
        if it in poisoned:
            assert scaler.get_scale() < scale  # the scaler saw the inf and skipped
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # taken steps at iterations 0, 2, 4: the outer step comes after the third *taken* step
    assert history == [(1, 0, 1), (1, 0, 1), (2, 0, 2), (2, 0, 2), (0, 1, 3)]


def test_gradscaler_gives_the_same_result_as_no_scaler():
    """Power-of-two loss scaling is exact in fp32, so a scaled run must match an unscaled one bit for bit."""
    runs = []
    for use_scaler in (False, True):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=3, inner_optimizer=ADAMW,
                              communicator=SingleWorker("fp16"))
        scaler = torch.amp.GradScaler("cpu") if use_scaler else None
        losses = [train_step(model, opt, *batch(0, s), scaler=scaler) for s in range(7)]
        runs.append((losses, params(model), opt.global_hash(), opt.outer_step))
    assert runs[0][3] == 2
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_local_steps_validation():
    model = mlp()
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="local_steps"):
            DiLoCoOptimizer(model.parameters(), local_steps=bad)
    with pytest.raises(ValueError, match="empty"):
        DiLoCoOptimizer([], local_steps=1)


# -- invariant 3: what gets the outer update ----------------------------------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.frozen(x))))


def test_only_trainable_floating_params_and_float_buffers_are_synced(run_replicas):
    group, H = InProcessGroup(2), 3
    local_bufs, results = {}, {}

    def worker(rank):
        model = bnnet()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                              communicator=group.members[rank], module=model)
        with torch.no_grad():  # a local edit of a frozen parameter must survive the outer step
            model.frozen.bias.add_(float(rank))

        def hook(*_):
            if opt.local_step + 1 >= H:
                local_bufs[rank] = (model.bn.running_mean.clone(), model.bn.running_var.clone())

        opt.inner.register_step_post_hook(hook)
        for step in range(H):
            train_step(model, opt, *batch(rank, step))
        results[rank] = (model, opt)

    run_replicas(worker, 2)
    fresh = bnnet()
    trainable = [p for p in fresh.parameters() if p.requires_grad]
    for rank in (0, 1):
        model, opt = results[rank]
        assert opt.outer_step == 1
        assert [tuple(g.shape) for g in opt.outer.global_params] == [tuple(p.shape) for p in trainable]
        assert [b.dtype for b in opt.outer.buffers] == [torch.float32, torch.float32]  # not num_batches_tracked
        # frozen: exactly as this replica left it
        assert torch.equal(model.frozen.weight, fresh.frozen.weight)
        assert torch.equal(model.frozen.bias, fresh.frozen.bias + rank)
        # integer buffer: local, untouched
        assert model.bn.num_batches_tracked.item() == H
        # floating buffers: the plain mean of the replicas' local values
        for i, buf in enumerate((model.bn.running_mean, model.bn.running_var)):
            mean = (local_bufs[0][i] + local_bufs[1][i]) / 2
            torch.testing.assert_close(buf, mean, rtol=0, atol=1e-6)
        assert (model.bn.running_var > 0).all()
    assert not torch.allclose(local_bufs[0][0], local_bufs[1][0])  # the replicas' statistics differed
    m0, m1 = results[0][0], results[1][0]
    for name in ("bn.weight", "bn.bias", "head.weight", "head.bias", "bn.running_mean", "bn.running_var"):
        assert torch.equal(m0.get_parameter(name) if "running" not in name else m0.get_buffer(name),
                           m1.get_parameter(name) if "running" not in name else m1.get_buffer(name)), name


class RotaryNet(BNNet):
    """BNNet with a non-persistent floating buffer, as a rotary embedding keeps its ``inv_freq``."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)


def test_module_averages_persistent_buffers_only_so_constants_are_never_rounded(run_replicas):
    """``module=`` averages BatchNorm's statistics (persistent), not a constant the module derived
    itself (non-persistent: not in its state_dict), which an fp16 wire would round."""
    group = InProcessGroup(2, compression="fp16")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # values fp16 rounds
    assert not torch.equal(inv_freq.half().float(), inv_freq)
    results = {}

    def worker(rank):
        with INIT_LOCK:
            torch.manual_seed(0)
            model = RotaryNet(inv_freq.clone() + rank)  # unlike every other buffer, each replica's own
        opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                              communicator=group.members[rank], module=model)
        for step in range(2):
            train_step(model, opt, *batch(rank, step))
        results[rank] = (model, opt)

    run_replicas(worker, 2)
    for rank, (model, opt) in results.items():
        assert opt.outer_step == 1
        assert [b.data_ptr() for b in opt.outer.buffers] == [model.bn.running_mean.data_ptr(),
                                                             model.bn.running_var.data_ptr()]
        assert torch.equal(model.inv_freq, inv_freq + rank)  # bit for bit what this replica computed
    assert torch.equal(results[0][0].bn.running_mean, results[1][0].bn.running_mean)  # averaged alike


def test_a_hugging_face_models_rotary_frequencies_are_not_averaged():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    assert any(name.endswith("inv_freq") for name, _ in model.named_buffers())
    opt = DiLoCoOptimizer(model.parameters(), local_steps=1, module=model)
    assert opt.outer.buffers == []


# -- invariant 4: inner state is local -----------------------------------------------------------


class RecordingWorker(SingleWorker):
    """A real single-worker communicator that also records what it was asked to average."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[list[torch.Tensor]] = []

    def start(self, flat, *, weight, key, out=None):
        self.sent.append(flat.clone())
        return super().start(flat, weight=weight, key=key, out=out)


def test_inner_state_is_local_and_survives_outer_step():
    model, comm = mlp(), RecordingWorker()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=3, inner_optimizer=ADAMW, communicator=comm)
    snap = {}

    def hook(*_):
        if opt.local_step + 1 >= opt.local_steps:
            snap["state"] = [{k: v.clone() for k, v in opt.inner.state[p].items()} for p in model.parameters()]

    opt.inner.register_step_post_hook(hook)
    for s in range(3):
        train_step(model, opt, *batch(0, s))
    assert opt.outer_step == 1
    assert opt.state is opt.inner.state and opt.param_groups is opt.inner.param_groups
    for i, p in enumerate(model.parameters()):
        before, after = snap["state"][i], opt.inner.state[p]
        assert set(after) == {"step", "exp_avg", "exp_avg_sq"}
        for k in after:
            assert torch.equal(before[k], after[k]), k
    # only the pseudo-gradients travelled: one tensor per parameter, nothing else
    assert len(comm.sent) == 1
    assert comm.sent[0].shape == (sum(p.numel() for p in model.parameters()),)
    # and the next inner step keeps using that state (step counter keeps growing)
    train_step(model, opt, *batch(0, 3))
    assert all(opt.inner.state[p]["step"].item() == 4 for p in model.parameters())


# -- invariant 5: offload, fp32 on CPU ----------------------------------------------------------


def test_global_weights_and_outer_state_are_fp32_cpu_for_bf16_model():
    model = mlp(dtype=torch.bfloat16)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=ADAMW)
    init = [p.detach().clone() for p in model.parameters()]
    for g, p in zip(opt.outer.global_params, init):
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        assert torch.equal(g, p.float())
    for s in range(4):
        train_step(model, opt, *batch(0, s, dtype=torch.bfloat16))
    assert opt.outer_step == 2
    for g in opt.outer.global_params:
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        buf = opt.outer.optimizer.state[g]["momentum_buffer"]
        assert buf.dtype == torch.float32 and buf.device.type == "cpu"
    for p, g in zip(model.parameters(), opt.outer.global_params):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), g.detach().to(torch.bfloat16))  # copy back respects the model dtype
    # fp32 θ_global keeps precision that bf16 weights cannot hold
    assert any(not torch.equal(g, g.to(torch.bfloat16).float()) for g in opt.outer.global_params)
    for d in opt.outer.pseudo_gradients():
        assert d.dtype == torch.float32


# -- invariant 7: replicas agree, also with lossy compression ------------------------------------


@pytest.mark.parametrize("compression", ["none", "fp16", "int8"])
def test_replicas_hold_identical_global_weights(run_replicas, compression):
    group, H, outer_steps = InProcessGroup(2, compression=compression), 2, 3
    hashes, deltas = {0: [], 1: []}, {0: [], 1: []}

    def worker(rank):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                              communicator=group.members[rank])

        def hook(*_):
            if opt.local_step + 1 >= H:
                deltas[rank].append(opt.outer.pseudo_gradients())

        opt.inner.register_step_post_hook(hook)
        for step in range(H * outer_steps):
            train_step(model, opt, *batch(rank, step))
            if opt.local_step == 0:
                assert opt.last_sync.ok and opt.last_sync.group_size == 2
                hashes[rank].append((opt.global_hash(), opt.last_sync.global_hash, params(model)))

    run_replicas(worker, 2)
    assert len(hashes[0]) == outer_steps == group.rounds
    for k in range(outer_steps):
        assert not all(torch.equal(a, b) for a, b in zip(deltas[0][k], deltas[1][k]))
        (h0, r0, p0), (h1, r1, p1) = hashes[0][k], hashes[1][k]
        assert h0 == h1 == r0 == r1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert len({h for h, _, _ in hashes[0]}) == outer_steps  # θ_global really moved each time


# -- checkpoints -------------------------------------------------------------------------------


def _make(seed=0, H=5):
    model = mlp(seed)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                          communicator=SingleWorker("fp16"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def _steps(model, opt, sched, start, stop):
    losses = []
    for s in range(start, stop):
        losses.append(train_step(model, opt, *batch(0, s)))
        sched.step()
    return losses


def test_state_dict_mid_round_resumes_bit_for_bit():
    total, cut = 17, 3  # cut at local_step 3 of H=5; three outer steps follow
    model, opt, sched = _make()
    ref_losses = _steps(model, opt, sched, 0, total)
    ref = (params(model), opt.global_hash(), opt.outer_step, opt.param_groups[0]["lr"])
    assert opt.outer_step == 3

    model, opt, sched = _make()
    losses = _steps(model, opt, sched, 0, cut)
    assert opt.local_step == 3 and opt.outer_step == 0
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    _steps(model, opt, sched, cut, cut + 4)  # keep training the old one: the checkpoint must not alias it
    del model, opt, sched

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt, sched = _make(seed=123)  # different init: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    assert opt.local_step == 3 and opt.outer_step == 0
    assert opt.global_hash() == tensors_hash(ckpt["opt"]["outer"]["global_params"])  # not a stale cached hash
    assert opt.param_groups is opt.inner.param_groups and opt.state is opt.inner.state
    losses += _steps(model, opt, sched, cut, total)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(ref[0], model.parameters()))
    assert (opt.global_hash(), opt.outer_step, opt.param_groups[0]["lr"]) == ref[1:]


def test_bad_state_dicts_are_refused_and_leave_the_optimizer_alone():
    model, opt, sched = _make()
    _steps(model, opt, sched, 0, 7)
    good = opt.state_dict()
    other_model, other_opt, _ = _make()
    before = io.BytesIO()
    torch.save(other_opt.state_dict(), before)

    bad_missing = {k: v for k, v in good.items() if k != "outer"}
    wrong_shape = copy.deepcopy(good)
    wrong_shape["outer"]["global_params"][0] = torch.zeros(3, 3)
    wrong_shape["inner"]["state"][0]["exp_avg"] = torch.zeros(3, 3)
    nan = copy.deepcopy(good)
    nan["outer"]["global_params"][1][0] = float("nan")
    too_few = copy.deepcopy(good)
    too_few["outer"]["global_params"] = too_few["outer"]["global_params"][:-1]
    outer_groups = copy.deepcopy(good)  # fails late, in the outer optimizer's own load_state_dict
    outer_groups["outer"]["optimizer"]["param_groups"].append(dict(outer_groups["outer"]["optimizer"]["param_groups"][0]))
    other_schedule = {**good, "local_steps": good["local_steps"] + 1, "pace": "swarm"}  # saved by another config
    contribution = torch.zeros(sum(p.numel() for p in model.parameters()))
    in_flight = {"outer_step": 1, "fragment": 0, "steps": 3, "weight": 1.0, "own_finite": True}
    no_such_fragment = {**good, "pending": {**in_flight, "fragment": 1, "contribution": contribution}}
    round_without_contribution = {**good, "pending": in_flight}
    short_contribution = {**good, "pending": {**in_flight, "contribution": contribution[:-1]}}
    cases = ((bad_missing, "missing"), (wrong_shape, "shape"), (nan, "NaN"), (too_few, "expected 4"),
             (outer_groups, "parameter groups"),
             (other_schedule, r"other settings: local_steps \d+ \(this optimizer: \d+\), pace 'swarm'"),
             (no_such_fragment, r"pending.*fragment 1 of 1"), (round_without_contribution, r"pending.*contribution"),
             (short_contribution, "pending contribution.*shape"))
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            other_opt.load_state_dict(bad)
        after = io.BytesIO()
        torch.save(other_opt.state_dict(), after)
        assert after.getvalue() == before.getvalue(), f"a refused state dict ({msg}) changed the optimizer"
    other_opt.load_state_dict(good)  # and the good one still loads
    assert other_opt.global_hash() == opt.global_hash()


def test_lambdalr_drives_the_inner_lr():
    model, opt, sched = _make()
    base = 1e-2
    for s in range(6):
        assert opt.param_groups[0]["lr"] == pytest.approx(base / (1 + 0.1 * s))
        assert opt.inner.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        train_step(model, opt, *batch(0, s))
        sched.step()
    assert opt.outer_step == 1
    assert opt.outer.optimizer.param_groups[0]["lr"] == 0.4  # the scheduler leaves the outer lr alone
    # lr 0 freezes the inner optimizer (weight decay is multiplied by lr too): proof the lr is the one used
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = params(model)
    train_step(model, opt, *batch(0, 6))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- non-finite pseudo-gradients -----------------------------------------------------------------


def test_non_finite_own_pseudo_gradient_contributes_nothing(run_replicas):
    group, H = InProcessGroup(2), 2
    local, out = {0: {}, 1: {}}, {}

    def worker(rank):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                              communicator=group.members[rank])
        theta0 = [g.detach().clone() for g in opt.outer.global_params]

        def hook(*_):
            if opt.local_step + 1 >= H:
                if rank == 0:
                    with torch.no_grad():
                        next(model.parameters()).view(-1)[0] = float("nan")
                local[rank] = [p.detach().clone() for p in model.parameters()]

        opt.inner.register_step_post_hook(hook)
        for step in range(H):
            train_step(model, opt, *batch(rank, step))
        out[rank] = (model, opt, theta0)

    run_replicas(worker, 2)
    (m0, o0, theta0), (m1, o1, _) = out[0], out[1]
    assert o0.last_sync.ok and o1.last_sync.ok and o0.outer_step == o1.outer_step == 1
    assert o0.global_hash() == o1.global_hash()
    for g, t, x in zip(o1.outer.global_params, theta0, local[1]):
        delta1 = t - x  # replica 1's own pseudo-gradient is the whole average
        assert torch.equal(g.detach(), t - delta1)
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert torch.isfinite(p).all() and torch.equal(p, q)  # the poisoned replica recovered


class NaNGroup(Communicator):
    """A communicator whose group hands back a non-finite average (e.g. a broken peer)."""

    peer_id = "nan"

    def start(self, flat, *, weight, key, out=None):
        return CompletedWork(AverageResult(torch.full_like(flat, float("nan")), ("nan",), 1.0))


def test_non_finite_average_is_refused():
    model = mlp()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=ADAMW, communicator=NaNGroup())
    h0 = opt.global_hash()
    for s in range(2):
        train_step(model, opt, *batch(0, s))
    assert not opt.last_sync.ok and "not finite" in opt.last_sync.reason
    assert opt.global_hash() == h0 and opt.outer_step == 0 and opt.local_step == 0
    assert not opt.outer.optimizer.state  # the outer optimizer never stepped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_all_members_non_finite_round_fails_and_resets_local(run_replicas):
    group = InProcessGroup(2)
    out = {}

    def worker(rank):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=1, inner_optimizer=ADAMW,
                              communicator=group.members[rank])
        h0 = opt.global_hash()
        opt.inner.register_step_post_hook(
            lambda *_: next(model.parameters()).data.view(-1).__setitem__(0, float("inf")))
        train_step(model, opt, *batch(rank, 0))
        out[rank] = (opt, h0, model)

    run_replicas(worker, 2)
    for opt, h0, model in out.values():
        assert not opt.last_sync.ok and "weight 0" in opt.last_sync.reason
        assert opt.global_hash() == h0 and opt.outer_step == 0
        for p, g in zip(model.parameters(), opt.outer.global_params):
            assert torch.equal(p.detach(), g.detach())  # poisoned local weights replaced by θ_global


def test_shareable_state_carries_global_weights_not_inner_state():
    model, opt, sched = _make()
    _steps(model, opt, sched, 0, 12)  # two outer steps, two inner steps into the third round
    state = opt.shareable_state()
    # The step count θ_global stands for (the last outer step) and the peer's position in the round:
    # a joiner takes the group's position, so it reaches the next outer step with the group (3 more
    # inner steps here) instead of making it wait for a whole round of its own.
    assert "inner" not in state and state["outer_step"] == 2 and state["inner_steps_total"] == 10
    assert state["local_step"] == 2
    joiner_model, joiner, _ = _make(seed=7)
    joiner.load_shareable_state(copy.deepcopy(state))
    assert joiner.global_hash() == opt.global_hash() and joiner.outer_step == 2 and joiner.local_step == 2
    assert joiner.inner_steps_total == 12
    assert not joiner.inner.state  # a joiner starts its inner optimizer fresh
    for p, g in zip(joiner_model.parameters(), opt.outer.global_params):
        assert torch.equal(p.detach(), g.detach())
    with pytest.raises(ValueError, match="missing"):
        joiner.load_shareable_state({"outer": state["outer"]})


def _poisoned(state, how):
    bad = copy.deepcopy(state)
    if how == "scalar-momentum":
        for entry in bad["outer"]["optimizer"]["state"].values():
            entry["momentum_buffer"] = torch.tensor(1.0)
    elif how == "no-outer-fields":
        bad["outer"] = {}
    elif how == "string-in-state":
        next(iter(bad["outer"]["optimizer"]["state"].values()))["momentum_buffer"] = "x"
    elif how == "nan-weights":
        bad["outer"]["global_params"][0] = torch.full_like(bad["outer"]["global_params"][0], float("nan"))
    return bad


@pytest.mark.parametrize("how", ["scalar-momentum", "no-outer-fields", "string-in-state", "nan-weights"])
def test_a_poisoned_peer_state_is_refused_and_changes_nothing(how):
    model, opt, sched = _make()
    _steps(model, opt, sched, 0, 12)
    state = opt.shareable_state()
    joiner_model, joiner, _ = _make(seed=7)
    before = (joiner.global_hash(), joiner.outer_step, [p.detach().clone() for p in joiner_model.parameters()])
    with pytest.raises((ValueError, KeyError, TypeError)):
        joiner.load_shareable_state(_poisoned(state, how))
    assert (joiner.global_hash(), joiner.outer_step) == before[:2]
    assert all(torch.equal(p.detach(), q) for p, q in zip(joiner_model.parameters(), before[2]))


def test_peer_state_behind_the_group_or_with_another_hash_is_refused():
    model, opt, sched = _make()
    _steps(model, opt, sched, 0, 12)  # outer step 2
    state = opt.shareable_state()
    _, joiner, _ = _make(seed=7)
    with pytest.raises(ValueError, match="not yet 3"):
        joiner.load_shareable_state(copy.deepcopy(state), min_outer_step=3)
    with pytest.raises(ValueError, match="the run confirmed"):
        joiner.load_shareable_state(copy.deepcopy(state), expected_hash="0" * 16)
    joiner.load_shareable_state(copy.deepcopy(state), min_outer_step=2, expected_hash=opt.global_hash())
    assert joiner.global_hash() == opt.global_hash()


class PoisonDonor(SingleWorker):
    """A communicator whose group is ahead and whose only donor serves a broken state."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def start(self, flat, *, weight, key, out=None):
        from opendiloco.errors import BehindError

        return CompletedWork(error=BehindError("peers are ahead", group_outer_step=0))

    def download_state(self, timeout, **bounds):
        return self.state


def test_catching_up_from_a_broken_state_is_a_failed_round_not_a_crash():
    model, opt, sched = _make()
    _steps(model, opt, sched, 0, 12)
    bad = _poisoned(opt.shareable_state(), "no-outer-fields")
    model2 = mlp()
    victim = DiLoCoOptimizer(model2.parameters(), local_steps=2, inner_optimizer=ADAMW, communicator=PoisonDonor(bad))
    h0 = victim.global_hash()
    report = victim.sync()
    assert not report.ok and "could not catch up" in report.reason and victim.global_hash() == h0


class CountedRound(SingleWorker):
    """A group that completed this worker's round ``at`` without it (or may have: ``completed``); the state
    it reached is ``state`` (None: nobody serves one)."""

    def __init__(self, state, at, completed=True):
        super().__init__()
        self.state, self.at, self.completed = state, at, completed
        self.asked = []

    def start(self, flat, *, weight, key, out=None, error_out=None):
        if key.outer_step == self.at:
            return CompletedWork(error=RoundCounted("the group completed it", group_outer_step=key.outer_step + 1,
                                                    completed=self.completed))
        return super().start(flat, weight=weight, key=key, out=out, error_out=error_out)

    def download_state(self, timeout, min_outer_step=None, max_bytes=None, majority_hash=None):
        self.asked.append(min_outer_step)
        return copy.deepcopy(self.state)


def _donor(pace, H, steps, **kw):
    model = mlp(0)
    donor = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, communicator=SingleWorker(),
                            pace=pace, **kw)
    for s in range(steps):
        train_step(model, donor, *batch(1, s))
    return donor


@pytest.mark.parametrize("pace", ["fixed", "swarm"])
@pytest.mark.parametrize("completed", [True, False], ids=["completed", "unknown"])
def test_a_round_the_group_counted_is_adopted_never_applied_or_carried_again(pace, completed):
    """A worker whose round failed here but which its group completed (its contribution is in the group's
    average) takes the group's state; under pace="swarm" too, it does not carry the work into its next
    round (a worker only left out does). Its steps were contributed, or dropped if nobody could say."""
    H = 5
    donor = _donor(pace, H, 2 * H)  # at outer step 2
    model = mlp(0)
    comm = CountedRound(donor.shareable_state(), at=1, completed=completed)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, communicator=comm, pace=pace)
    for s in range(2 * H):
        train_step(model, opt, *batch(0, s))
    report = opt.last_sync
    assert not report.ok and report.extra["counted"] and not report.extra["carried"], report
    assert comm.asked == [2]  # the state after the round it took part in
    assert opt.outer_step == 2 and opt.global_hash() == donor.global_hash()
    assert all(torch.equal(p.detach(), g) for p, g in zip(model.parameters(), opt.outer.global_params))
    assert (report.contributed_steps, report.dropped_steps) == ((H, 0) if completed else (0, H))
    assert (opt.contributed_steps, opt.dropped_steps) == ((2 * H, 0) if completed else (H, H))
    assert ("the group completed round 1" in report.reason) == completed, report.reason


def test_a_counted_round_whose_state_cannot_be_downloaded_still_never_carries_its_work():
    H = 5
    model = mlp(0)
    comm = CountedRound(None, at=1)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, communicator=comm, pace="swarm")
    for s in range(2 * H):
        train_step(model, opt, *batch(0, s))
    report = opt.last_sync
    assert not report.ok and "could not download" in report.reason, report.reason
    assert opt.outer_step == 1  # θ_global stays; the local weights restart from it: the work is not carried
    assert all(torch.equal(p.detach(), g) for p, g in zip(model.parameters(), opt.outer.global_params))
    assert (opt.contributed_steps, opt.dropped_steps) == (2 * H, 0)


def test_a_streamed_round_the_group_counted_drops_only_the_steps_taken_since_it_began():
    """fragments=2, overlap=1: event 0's round lands at step 3 (steps 1-3 counted), event 1's starts at
    step 4 and lands at step 5, which is in no average: step 4 was contributed, step 5 is dropped."""
    H = 4
    donor = _donor("fixed", H, 3 * 2 + 1, fragments=2, overlap=1)  # events 0, 1, 2 landed: outer step 3
    model = mlp(0)
    comm = CountedRound(donor.shareable_state(), at=1)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, communicator=comm,
                          fragments=2, overlap=1)
    for s in range(5):
        train_step(model, opt, *batch(0, s))
    report = opt.last_sync
    assert report.extra["counted"] and comm.asked == [2] and opt.outer_step == 3, report
    assert (report.contributed_steps, report.dropped_steps) == (1, 1)
    assert (opt.contributed_steps, opt.dropped_steps) == (4, 1)
