"""Test helper: a small regression model that replicas train, each on its own data, and checks that two
ways of training it end bit for bit the same."""

from __future__ import annotations

import functools
import io
import threading

import torch
from torch import nn

SGD1 = functools.partial(torch.optim.SGD, lr=1.0)  # outer SGD, lr 1, no momentum: θ_global := mean(θ_local)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


INIT_LOCK = threading.Lock()  # replicas build their models in threads; the global RNG is shared


def mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    with INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)


def batch(seed: int, step: int, dtype=torch.float32, n: int = 16):
    """Deterministic regression data; each ``seed`` (replica) sees a different distribution."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(n, 4, generator=g) + seed
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])) * (1 + seed) + 0.1 * torch.randn(n, 1, generator=g)
    return x.to(dtype), y.to(dtype)


def train_step(model, opt, x, y, scaler=None) -> float:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.item()


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_resume_is_bit_exact(make, total: int, cut: int, look_into=lambda opt_state: None) -> None:
    """Training ``make()`` for ``total`` steps, and training it ``cut`` steps, then a checkpoint (through
    torch.save and torch.load) into ``make(seed=5)`` and the rest, give the same losses, weights and θ_global
    hash. ``look_into`` sees the checkpoint's optimizer state before it is loaded."""
    model, opt = make()
    ref_losses = [train_step(model, opt, *batch(0, s)) for s in range(total)]
    ref = (params(model), opt.global_hash())

    model, opt = make()
    losses = [train_step(model, opt, *batch(0, s)) for s in range(cut)]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    look_into(ckpt["opt"])
    model, opt = make(seed=5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    losses += [train_step(model, opt, *batch(0, s)) for s in range(cut, total)]
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(ref[0], model.parameters())) and opt.global_hash() == ref[1]


def round_hashes(model, opt, rank: int, steps: int, group_size: int) -> list[str]:
    """Trains replica ``rank`` for ``steps`` inner steps on its own data; the θ_global hash after each
    outer step, every one of which must have averaged with the whole group of ``group_size``."""
    hashes = []
    for step in range(steps):
        train_step(model, opt, *batch(rank, step))
        if opt.last_sync is not None and len(hashes) < opt.outer_step:
            assert opt.last_sync.ok and opt.last_sync.group_size == group_size
            hashes.append(opt.global_hash())
    return hashes
