"""CUDA models: pseudo-gradients reach the host through one pinned flat buffer (skipped without CUDA)."""

from __future__ import annotations

import functools

import pytest
import torch

from opendiloco import DiLoCoOptimizer, InProcessGroup

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
    flat, weight, finite = opt._contribution()
    assert finite and weight == 1.0 and flat.is_pinned()
    assert torch.equal(flat, expected)


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
