"""A plain PyTorch training loop that becomes a DiLoCo worker by changing one line.

A tiny character-level model learns to predict the next byte of Python's own standard
library source (text every Python installation has; nothing is downloaded).

    .venv/bin/python scripts/example_plain_loop.py                # plain AdamW
    .venv/bin/python scripts/example_plain_loop.py --diloco       # DiLoCo, one worker
    .venv/bin/python scripts/example_plain_loop.py --replicas 2   # DiLoCo, 2 workers in threads, averaging for real

Everything except the optimizer construction is the same code in all three modes.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import threading
import time

import torch
from torch import nn

from opendiloco import DiLoCoOptimizer, InProcessGroup

CONTEXT = 16
INNER = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def stdlib_text() -> torch.Tensor:
    """A few stdlib modules' sources as bytes, in a fixed order."""
    import argparse as a
    import dataclasses as d
    import textwrap as t

    data = b"".join(pathlib.Path(m.__file__).read_bytes() for m in (a, d, t))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class CharMLP(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32, hidden: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.net = nn.Sequential(nn.Linear(CONTEXT * dim, hidden), nn.GELU(), nn.Linear(hidden, vocab))

    def forward(self, x):
        return self.net(self.emb(x).flatten(1))


def batches(data: torch.Tensor, batch_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, data.numel() - CONTEXT - 1, (batch_size,), generator=g)
        x = torch.stack([data[i : i + CONTEXT] for i in idx.tolist()])
        yield x, data[idx + CONTEXT]


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor) -> float:
    x, y = next(batches(data, 2048, seed=12345))
    return nn.functional.cross_entropy(model(x), y).item()


def train(args, train_data, val_data, rank: int = 0, communicator=None) -> float:
    torch.manual_seed(0)  # every worker starts from the same weights
    model = CharMLP()

    # The one line that differs between a plain loop and a DiLoCo worker:
    #   plain:  opt = INNER(model.parameters())
    #   DiLoCo: opt = DiLoCoOptimizer(model.parameters(), local_steps=..., inner_optimizer=INNER, communicator=...)
    if args.diloco:
        opt = DiLoCoOptimizer(model.parameters(), local_steps=args.local_steps, inner_optimizer=INNER,
                              communicator=communicator)
    else:
        opt = INNER(model.parameters())

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    for step, (x, y) in zip(range(args.steps), batches(train_data, args.batch_size, seed=rank)):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and (step + 1) % args.log_every == 0:
            extra = f" outer_step {opt.outer_step}" if args.diloco else ""
            print(f"step {step + 1:4d} loss {loss.item():.3f}{extra}", flush=True)
    return evaluate(model, val_data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--diloco", action="store_true", help="use DiLoCoOptimizer instead of AdamW")
    p.add_argument("--replicas", type=int, default=1, help="DiLoCo workers in threads (implies --diloco)")
    p.add_argument("--local-steps", type=int, default=50)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()
    args.diloco = args.diloco or args.replicas > 1

    data = stdlib_text()
    split = int(0.9 * data.numel())
    train_data, val_data = data[:split], data[split:]
    start = time.perf_counter()
    if args.replicas == 1:
        val = [train(args, train_data, val_data)]
    else:
        group = InProcessGroup(args.replicas, compression="fp16")
        val = [0.0] * args.replicas

        def worker(rank):
            val[rank] = train(args, train_data, val_data, rank, group.members[rank])

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(args.replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    mode = f"DiLoCo x{args.replicas} (H={args.local_steps})" if args.diloco else "plain AdamW"
    print(f"{mode}: validation loss {val[0]:.3f} after {args.steps} steps ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
