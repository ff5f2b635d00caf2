"""CUDA models: pseudo-gradients reach the host through one pinned flat buffer (skipped without CUDA)."""

from __future__ import annotations

import functools

import pytest
import torch

from opendiloco import DiLoCoOptimizer, InProcessGroup, SingleWorker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_contribution_buffer_is_pinned_and_matches_the_cpu_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).cuda()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=3,
                          inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    expected = torch.cat([(g - p.detach().cpu()).reshape(-1) for g, p in zip(opt.outer.global_params,
                                                                              model.parameters())])
    contribution, _ = opt.fragments[0].buffers()
    opt.outer.pseudo_gradient_into(contribution.views[:opt.outer.num_params])
    assert contribution.flat.is_pinned()
    assert torch.equal(contribution.flat, expected)


def test_cuda_replicas_stay_bit_identical_through_the_in_process_group(run_replicas):
    group = InProcessGroup(2, compression="fp16")

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1).cuda()
        opt = DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=group.members[rank],
                              inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
        gen = torch.Generator().manual_seed(rank)
        for _ in range(4):
            x = torch.randn(8, 16, generator=gen).cuda()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return opt.global_hash(), [p.detach().cpu() for p in model.parameters()]

    (h0, p0), (h1, p1) = run_replicas(worker, 2)
    assert h0 == h1 and all(torch.equal(a, b) for a, b in zip(p0, p1))


class _Capturing(SingleWorker):
    def __init__(self):
        super().__init__(compression="fp16")
        self.sent = []

    def start(self, flat, *, weight, key, out=None):
        self.sent.append((key, flat.clone()))
        return super().start(flat, weight=weight, key=key, out=out)


def test_streamed_cuda_fragment_is_snapshotted_on_a_side_stream_and_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).cuda()
    comm = _Capturing()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=8, fragments=4, overlap=1, communicator=comm,
                          inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    x = torch.randn(16, 64, device="cuda")
    for step in range(1, 9):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:  # event 0 (fragment 0) has just started in the background
            assert opt._snapshot is not None and opt._pending.prepared is not None
            expected = torch.cat([(opt.outer.global_params[i] - p.detach().float().cpu()).reshape(-1)
                                  for i, p in zip(opt.fragments[0].params, [model[0].weight, model[0].bias])])
            opt._pending.prepared.result()
            key, sent = comm.sent[-1]
            assert key.fragment == 0 and torch.equal(sent, expected)  # the weights of step 2, not of step 3
        if step == 3:  # it has landed: fragment 0's local weights are θ_global (mix 0), the others trained on
            assert opt.outer_step == 1 and opt.last_sync.ok and opt.last_sync.fragment == 0
            for i, p in enumerate(model.parameters()):
                same = torch.equal(p.detach().float().cpu(), opt.outer.global_params[i].detach())
                assert same == (i in opt.fragments[0].params), i
    assert opt.outer_step == 3 and opt.last_sync.ok
