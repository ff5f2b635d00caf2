"""The optimizer and the trainer on CUDA (skipped without it; CI has no GPU)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from opendiloco import DiLoCoOptimizer, SingleWorker
from tests.test_optimizer import batch, mlp
from tests.test_train_loop import small_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _run(device: str, steps: int = 9, H: int = 3):
    model = mlp().to(device)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=H, inner_optimizer=ADAMW, communicator=SingleWorker("none"))
    for s in range(steps):
        x, y = batch(0, s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return opt, [p.detach().cpu() for p in model.parameters()]


def test_the_optimizer_on_cuda_matches_the_cpu_reference():
    cpu, cpu_params = _run("cpu")
    gpu, gpu_params = _run("cuda")
    assert gpu.outer_step == cpu.outer_step == 3
    assert all(g.device.type == "cpu" and g.dtype == torch.float32 for g in gpu.outer.global_params)
    for a, b in zip(cpu.outer.global_params, gpu.outer.global_params):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # kernels differ; the math must not
    for a, b in zip(cpu_params, gpu_params):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_gradscaler_skipped_steps_do_not_count_on_cuda():
    model = mlp().cuda()  # fp32 weights, fp16 autocast: what GradScaler is for
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=ADAMW)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    counted = []
    for it in range(4):
        x, y = batch(0, it)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x.cuda()).float(), y.cuda())
        scaler.scale(loss).backward()
        if it == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        counted.append((opt.local_step, opt.outer_step))
    assert counted == [(1, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_trainer_trains_on_cuda_and_resumes(tmp_path, precision):
    """Bit-exactness is a CPU promise: CUDA's embedding backward sums with atomics, in any order."""
    from opendiloco.train.trainer import train

    extra = ["--train.device", "cuda", "--train.precision", precision, "--train.total-steps", "8"]
    whole = train(small_config(tmp_path / "whole", *extra))
    cfg = small_config(tmp_path / "split", *extra)
    first = train(cfg, stop_after=5)
    second = train(cfg, resume=True)
    assert whole.outer_steps == 2 and len(first.losses + second.losses) == len(whole.losses)
    torch.testing.assert_close(first.losses + second.losses, whole.losses, rtol=1e-2, atol=1e-3)
