"""The baselines DiLoCo is compared with: one worker with AdamW, and synchronous data-parallel.

    python -m benchmarks.baseline --config configs/tiny.toml [--world-size N --rank R --master HOST:PORT]
        [config overrides, e.g. --run.worker worker-0 --run.dir DIR]

With ``--world-size 1`` this is plain AdamW on one worker. With N > 1, N processes (one per
rank) average their gradients with ``torch.distributed`` gloo after every backward pass, in one
flat fp32 bucket, as DistributedDataParallel would: the same as one worker with N times the
batch. Model, data and held-out batches come from the same code as ``opendiloco train``
(``Trainer.build_model_and_data``), so rank r sees exactly the rows that DiLoCo worker
``--run.worker`` would. Metrics go to ``<run dir>/metrics.jsonl`` in the trainer's format
(``start``, ``train``, ``eval``, ``end``), with ``comm_s`` (time in the all-reduce) added.

Device and precision are the trainer's (``--train.device``, ``--train.precision``): the batch goes
to the model's device, the forward pass runs under the same autocast as DiLoCo's inner step, and
fp16 uses a GradScaler. The gradient bucket is all-reduced on the host (gloo), so several ranks may
share one GPU.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from opendiloco.comm.buffers import flatten, unflatten
from opendiloco.outer import tensors_hash
from opendiloco.train.config import ConfigError, load_config
from opendiloco.train.metrics import MetricsWriter
from opendiloco.train.model import count_parameters
from opendiloco.train.trainer import Trainer, lr_lambda


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", default=None, help="TOML config (default: built-in defaults)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--master", default="127.0.0.1:29500", help="HOST:PORT of rank 0 (world size > 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait")
    args, overrides = p.parse_known_args(argv)
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        p.error(f"need 0 <= rank < world size, got rank {args.rank}, world size {args.world_size}")
    return args, overrides


class GradientAverager:
    """All-reduces every gradient (and the step's loss) in one flat fp32 bucket, then divides by N."""

    def __init__(self, params: list[torch.nn.Parameter], world_size: int):
        self.params, self.world_size = params, world_size
        self.numel = sum(p.numel() for p in params)
        self.seconds = 0.0
        """Seconds spent in ``all_reduce`` so far."""

    def __call__(self, loss: float) -> tuple[float, float]:
        """Averages the gradients in place; returns (the mean loss, seconds this all-reduce took)."""
        grads = [p.grad for p in self.params]
        bucket = flatten([*(g.to("cpu", torch.float32) for g in grads), torch.tensor([loss])])
        start = time.perf_counter()
        dist.all_reduce(bucket)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        bucket.div_(self.world_size)
        for grad, averaged in zip(grads, unflatten(bucket[:-1], grads)):
            grad.copy_(averaged)
        return float(bucket[-1]), seconds


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg)
    trainer.build_model_and_data()
    model, stream, tc, o = trainer.model, trainer.stream, cfg.train, cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if args.world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                                world_size=args.world_size, timeout=timedelta(seconds=args.timeout))
    averager = GradientAverager(params, args.world_size) if args.world_size > 1 else None
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scaler = trainer.placement.grad_scaler()
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(lr_lambda, warmup=o.warmup_steps, total=tc.total_steps, min_ratio=o.min_lr_ratio))
    lead = args.rank == 0
    metrics = MetricsWriter(cfg.run_dir / "metrics.jsonl")
    metrics.write("start", worker=cfg.worker, method="data-parallel" if args.world_size > 1 else "single",
                  device=str(trainer.device), precision=trainer.precision,
                  world_size=args.world_size, rank=args.rank, parameters=count_parameters(model), inner_step=0,
                  config=cfg.model_dump())

    def evaluate(step: int) -> float | None:
        loss = trainer.evaluate() if lead else None
        if loss is not None:
            metrics.write("eval", inner_step=step, eval_loss=loss, perplexity=math.exp(min(loss, 50)))
        return loss

    compute_s, losses, start = 0.0, [], time.perf_counter()
    for step in range(1, tc.total_steps + 1):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for _ in range(tc.grad_accum):
            batch = stream.next_batch(tc.batch_size).to(trainer.device, non_blocking=True)
            with trainer.autocast():
                loss = trainer.forward(input_ids=batch, labels=batch).loss / tc.grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += float(loss.detach())
        comm = 0.0
        if averager:
            loss_sum, comm = averager(loss_sum)
        if scaler is not None:
            scaler.unscale_(opt)
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        compute_s += time.perf_counter() - t0 - comm
        losses.append(loss_sum)
        if step % cfg.run.log_every == 0 and lead:
            window = losses[-cfg.run.log_every:]
            metrics.write("train", inner_step=step, loss=sum(window) / len(window), lr=opt.param_groups[0]["lr"])
        if tc.eval_every and step % tc.eval_every == 0 and step != tc.total_steps:
            evaluate(step)
    loop_s = time.perf_counter() - start
    eval_loss = evaluate(tc.total_steps)
    comm_s = averager.seconds if averager else 0.0
    metrics.write("end", inner_step=tc.total_steps, eval_loss=eval_loss, loop_s=loop_s, compute_s=compute_s,
                  comm_s=comm_s, utilisation=compute_s / loop_s, params_hash=tensors_hash(params),
                  bucket_bytes=4 * (averager.numel + 1) if averager else 0)
    metrics.close()
    if args.world_size > 1:
        dist.barrier()  # nobody leaves while rank 0 still evaluates: a departed peer would look like a failure
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    return run(args, overrides)


if __name__ == "__main__":
    sys.exit(main())
