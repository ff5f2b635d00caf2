"""Error feedback: what a wire format loses of a contribution is owed to the next one, exactly.

Real codecs and real averaging (``SingleWorker`` / ``InProcessGroup``); the pseudo-gradients are
read from the inner optimizer's step hook, independently of the optimizer's own bookkeeping.
"""

from __future__ import annotations

import functools

import pytest
import torch

from opendiloco import AverageResult, DiLoCoOptimizer, InProcessGroup, SingleWorker
from opendiloco.comm.base import CompletedWork
from opendiloco.errors import AveragingError
from tests.toy_training import ADAMW, assert_resume_is_bit_exact, batch, mlp, round_hashes, train_step

SGD1 = functools.partial(torch.optim.SGD, lr=1.0)  # θ_global := θ_global − average: the sum is observable


class SentRecorder(SingleWorker):
    """A lone worker that also keeps what the group averaged (for one worker: what it sent)."""

    def __init__(self, compression):
        super().__init__(compression)
        self.sent: list[torch.Tensor] = []

    def start(self, flat, *, weight, key, out=None, error_out=None):
        work = super().start(flat, weight=weight, key=key, out=out, error_out=error_out)
        self.sent.append(work.wait().flat.clone())
        return work


def _lone_run(compression, error_feedback, rounds=16, H=2):
    model, comm = mlp(), SentRecorder(compression)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, outer_optimizer=SGD1,
                          communicator=comm, error_feedback=error_feedback)
    meant = []

    def hook(*_):
        if opt.local_step + 1 >= H:  # the pseudo-gradient this round is meant to send
            meant.append(torch.cat([d.reshape(-1) for d in opt.outer.pseudo_gradients()]))

    opt.inner.register_step_post_hook(hook)
    for step in range(H * rounds):
        train_step(model, opt, *batch(0, step))
    assert opt.outer_step == rounds and all(r.ok for r in [opt.last_sync])
    return opt, torch.stack(meant).sum(0), torch.stack(comm.sent).sum(0)


@pytest.mark.parametrize("compression", ["int8", "int4", "e2m1", "e3m0"])
def test_what_was_sent_plus_the_residual_is_what_was_meant(compression):
    opt, meant, sent = _lone_run(compression, error_feedback=True)
    residual = opt.error_residual()
    assert torch.allclose(sent + residual, meant, rtol=0, atol=1e-6 * meant.abs().max())
    assert residual.abs().max() > 0  # the format really lost something
    # Without feedback the losses pile up instead of staying within one round's error.
    _, meant_plain, sent_plain = _lone_run(compression, error_feedback=False)
    assert (sent - meant).norm() < 0.5 * (sent_plain - meant_plain).norm()


def test_a_lossless_format_owes_nothing():
    opt, meant, sent = _lone_run("none", error_feedback=True, rounds=3)
    assert torch.equal(opt.error_residual(), torch.zeros_like(opt.error_residual()))
    assert torch.allclose(sent, meant)


class FailingAfter(SingleWorker):
    """Rounds succeed until ``ok_rounds`` have, then every round fails (after writing its error)."""

    def __init__(self, compression, ok_rounds):
        super().__init__(compression)
        self.ok_rounds = ok_rounds

    def start(self, flat, *, weight, key, out=None, error_out=None):
        if self.ok_rounds == 0:
            if error_out is not None:
                error_out.fill_(123.0)  # a round may fail after its error was written
            return CompletedWork(error=AveragingError("the group fell apart"))
        self.ok_rounds -= 1
        return super().start(flat, weight=weight, key=key, out=out, error_out=error_out)


def test_a_failed_round_keeps_what_is_owed():
    model = mlp()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=ADAMW,
                          communicator=FailingAfter("int4", ok_rounds=2), error_feedback=True)
    for step in range(4):
        train_step(model, opt, *batch(0, step))
    owed = opt.error_residual().clone()
    assert owed.abs().max() > 0
    for step in range(4, 8):
        train_step(model, opt, *batch(0, step))
    assert opt.last_sync is not None and not opt.last_sync.ok
    assert torch.equal(opt.error_residual(), owed)


def _make(seed=0, H=3, fragments=1):
    model = mlp(seed)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                          communicator=SingleWorker("int4"), error_feedback=True, fragments=fragments)
    return model, opt


@pytest.mark.parametrize("fragments", [1, 3])
def test_the_residual_is_checkpointed_and_resume_is_bit_exact(fragments):
    def residual_saved(opt_state):
        assert set(opt_state["error_feedback"]) == set(range(fragments))
        assert all(r.abs().max() > 0 for r in opt_state["error_feedback"].values())

    assert_resume_is_bit_exact(functools.partial(_make, fragments=fragments), total=13, cut=7,
                               look_into=residual_saved)


def test_the_residual_is_never_shared_and_is_reset_by_a_download():
    model, opt = _make()
    for s in range(6):
        train_step(model, opt, *batch(0, s))
    owed = opt.error_residual().clone()
    assert owed.abs().max() > 0
    shared = opt.shareable_state()
    assert "error_feedback" not in shared

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    assert not any(t.numel() == owed.numel() and torch.equal(t.reshape(-1), owed) for t in tensors(shared))
    joiner_model, joiner = _make(seed=9)
    for s in range(3):
        train_step(joiner_model, joiner, *batch(1, s))
    assert joiner.error_residual().abs().max() > 0
    joiner.load_shareable_state(shared)  # a joiner / a worker that catches up starts owing nothing
    assert torch.equal(joiner.error_residual(), torch.zeros_like(owed))


def test_a_residual_of_the_wrong_shape_is_refused():
    model, opt = _make()
    for s in range(3):
        train_step(model, opt, *batch(0, s))
    state = opt.state_dict()
    state["error_feedback"] = {0: torch.zeros(5)}
    with pytest.raises(ValueError, match="error_feedback"):
        opt.load_state_dict(state)
    state["error_feedback"] = {7: torch.zeros(5)}
    with pytest.raises(ValueError, match="error_feedback"):
        opt.load_state_dict(state)


@pytest.mark.parametrize("compression,result", [("int4", None), ("e2m1", "int8"), ("e3m0", None)])
@pytest.mark.parametrize("fragments", [1, 2])
def test_replicas_with_feedback_stay_bit_identical(run_replicas, compression, result, fragments):
    group, H, rounds = InProcessGroup(3, compression=compression, result_compression=result), 4, 3
    out = {}

    def worker(rank):
        model = mlp()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW,
                              communicator=group.members[rank], error_feedback=True, fragments=fragments)
        hashes = round_hashes(model, opt, rank, H * rounds, group_size=3)
        out[rank] = (hashes, [opt.error_residual(f).clone() for f in range(fragments)])

    run_replicas(worker, 3)
    assert out[0][0] == out[1][0] == out[2][0] and len(out[0][0]) == rounds * fragments
    for f in range(fragments):  # each worker owes its own error: residuals are never averaged
        assert not torch.equal(out[0][1][f], out[1][1][f])


def test_average_result_type_is_unchanged():
    work = SingleWorker("int4").start(torch.ones(100), weight=1.0, key=__import__("opendiloco").RoundKey(0))
    assert isinstance(work.wait(), AverageResult)
