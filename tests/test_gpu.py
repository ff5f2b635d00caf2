"""The optimizer and the trainer on CUDA (skipped without it; CI has no GPU)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from opendiloco import DiLoCoOptimizer, SingleWorker
from tests.test_train_loop import small_config
from tests.toy_training import batch, mlp

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


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL inside a worker needs 2 GPUs")
def test_a_worker_of_two_gpu_processes_over_nccl(tmp_path):
    """torchrun with 2 ranks on 2 GPUs (DDP over NCCL, the hand-off over gloo): both processes hold the
    same θ_global at every outer step, and the run matches a one-process worker of the same batch."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_train_loop import SMALL

    root = Path(__file__).resolve().parents[1]
    common = [*SMALL, "--train.device", "cuda", "--train.precision", "fp32", "--train.total-steps", "12",
              "--train.eval-every", "4"]
    two, one = tmp_path / "two", tmp_path / "one"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    for run_dir, head in ((two, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2"]), (one, [sys.executable])):
        proc = subprocess.run([*head, "-m", "opendiloco", "train", *common, "--run.dir", str(run_dir)], cwd=root,
                              capture_output=True, text=True, timeout=500, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def records(path, event):
        return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]

    leader = [(r["outer_step"], r["global_hash"]) for r in records(two / "metrics.jsonl", "outer_step")]
    assert [s for s, _ in leader] == [1, 2, 3]
    assert leader == [(r["outer_step"], r["global_hash"]) for r in records(two / "metrics.rank1.jsonl", "outer_step")]
    for a, b in zip(records(two / "metrics.jsonl", "eval"), records(one / "metrics.jsonl", "eval")):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-3)
