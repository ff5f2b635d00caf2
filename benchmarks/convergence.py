"""DiLoCo against data-parallel and one AdamW worker as outer steps grow: a sweep over H and outer lr.

    python -m benchmarks.convergence --results docs/bench_convergence.json [--jobs 2]

The sweep runs in-process. ``InProcessGroup`` averages the replicas' pseudo-gradients with the
same codec as the swarm (fp16), and each replica is the trainer's own model, data shard and inner
step (``Trainer.train_step``). So a point costs compute, not daemons. The model is a 0.2M-parameter
Llama (hidden 64, 2 layers, seq 64), batch 8 per worker, 4 workers.

Every run uses the same inner lr schedule: linear warmup, then constant. The held-out loss at
inner step s is then comparable across runs of any length. A point (H, outer lr, k outer steps)
is DiLoCo's held-out loss after k·H inner steps, divided by:
- the loss of data-parallel after the same inner steps: one model with the 4 workers' batches
  averaged in every step, which is what ``benchmarks.baseline`` does over gloo;
- the loss of one AdamW worker (batch 8).

One-worker DiLoCo (``SingleWorker``) is measured against one AdamW worker too. Each
configuration is a separate process; ``--jobs`` run at once.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

from .report import save_results

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model.hidden-size", "64", "--model.num-layers", "2", "--model.num-heads", "4",
         "--model.intermediate-size", "256", "--data.seq-len", "64"]
"""A Llama small enough for a sweep of ~130k forward/backward passes on 2 CPU cores."""


def config(run_dir: Path, worker: str, *, h: int, outer_lr: float, batch: int, warmup: int, total: int,
           eval_batches: int):
    from opendiloco.train.config import load_config

    return load_config(ROOT / "configs" / "tiny.toml", [
        *MODEL, "--train.batch-size", str(batch), "--train.threads", "1", "--train.device", "cpu",
        "--train.eval-batches", str(eval_batches), "--train.total-steps", str(total),
        "--optim.local-steps", str(h), "--optim.outer-lr", str(outer_lr), "--optim.warmup-steps", str(warmup),
        "--optim.min-lr-ratio", "1.0", "--optim.pace", "fixed", "--run.worker", worker,
        "--run.dir", str(run_dir / worker), "--run.progress", "false", "--swarm.compression", "fp16"])


def trainers(n: int, run_dir: Path, communicators, **kw):
    from opendiloco.train.metrics import MetricsWriter
    from opendiloco.train.trainer import Trainer

    out = []
    for r in range(n):
        t = Trainer(config(run_dir, f"worker-{r}", **kw))
        t.build(communicators[r])
        t.metrics = MetricsWriter(run_dir / f"worker-{r}" / "metrics.jsonl")
        out.append(t)
    return out


def in_threads(fn, items) -> None:
    """``fn(item)`` for every item at once, one thread each (replicas of an ``InProcessGroup`` wait on
    one another); re-raises the first error."""
    import threading

    errors = []

    def run(item):
        try:
            fn(item)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def job(spec: dict) -> dict:
    """One configuration: returns {inner step: held-out loss} at ``spec["at"]``."""
    import torch

    from opendiloco import InProcessGroup, SingleWorker

    torch.set_num_threads(1)
    run_dir = Path(spec["work"]) / spec["name"]
    at = sorted(spec["at"])
    common = dict(batch=spec["batch"], warmup=spec["warmup"], total=at[-1], eval_batches=spec["eval_batches"])
    losses: dict[int, float] = {}
    began = time.perf_counter()
    if spec["method"] == "diloco":
        n = spec["workers"]
        group = InProcessGroup(n, compression="fp16", timeout=600)
        ts = trainers(n, run_dir, group.members, h=spec["H"], outer_lr=spec["outer_lr"], **common)

        def replica(t):
            for step in range(1, at[-1] + 1):
                t.train_step()
                if t is ts[0] and step in at:  # after the outer step: every replica holds θ_global
                    assert t.opt.local_step == 0 and t.opt.last_sync.ok
                    losses[step] = t.evaluate()

        in_threads(replica, ts)
        hashes = {t.opt.global_hash() for t in ts}
        assert len(hashes) == 1, "replicas disagree"
    else:  # "single" or "data-parallel": plain AdamW, the trainer's model and inner hyperparameters
        n = spec["workers"] if spec["method"] == "data-parallel" else 1
        ts = trainers(n, run_dir, [SingleWorker("none") for _ in range(n)], h=10**9, outer_lr=1.0, **common)
        lead = ts[0]
        params = [p for p in lead.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lead.cfg.optim.lr, betas=tuple(lead.cfg.optim.betas),
                                eps=lead.cfg.optim.eps, weight_decay=lead.cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lead.scheduler.lr_lambdas[0])
        for step in range(1, at[-1] + 1):
            for t in ts:  # rank r's batch, as data-parallel rank r would see it; the mean of the gradients
                batch = t.stream.next_batch(t.cfg.train.batch_size)
                (lead.forward(input_ids=batch, labels=batch).loss / n).backward()
            torch.nn.utils.clip_grad_norm_(params, lead.cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            scheduler.step()
            if step in at:
                losses[step] = lead.evaluate()
    return {**spec, "losses": {str(k): v for k, v in losses.items()}, "seconds": time.perf_counter() - began}


def plan(args) -> list[dict]:
    base = dict(work=str(args.work), batch=args.batch, warmup=args.warmup, workers=args.workers,
                eval_batches=args.eval_batches)
    specs, needed = [], set()
    for h in args.hs:
        ks = [k for k in args.outer_steps if k * h <= args.max_inner_steps]
        at = [k * h for k in ks]
        needed |= set(at)
        for lr in args.outer_lrs:
            specs.append({**base, "name": f"diloco-H{h}-lr{lr:g}", "method": "diloco", "H": h, "outer_lr": lr,
                          "at": at})
            if h in args.one_worker_hs:
                specs.append({**base, "name": f"diloco1-H{h}-lr{lr:g}", "method": "diloco", "H": h,
                              "outer_lr": lr, "at": at, "workers": 1})
    order = sorted(needed)
    specs.insert(0, {**base, "name": "single", "method": "single", "at": order})
    specs.insert(0, {**base, "name": "data-parallel", "method": "data-parallel", "at": order})
    return specs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/convergence"))
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--hs", type=lambda s: [int(x) for x in s.split(",")], default=[10, 30, 100])
    p.add_argument("--outer-lrs", type=lambda s: [float(x) for x in s.split(",")], default=[0.4, 0.7, 1.0])
    p.add_argument("--outer-steps", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128])
    p.add_argument("--max-inner-steps", type=int, default=3840, help="points beyond this many inner steps are left out")
    p.add_argument("--one-worker-hs", type=lambda s: [int(x) for x in s.split(",")], default=[30])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--report-only", type=Path, default=None, metavar="RESULTS")
    args = p.parse_args(argv)
    if args.role == "job":
        print(json.dumps(job(json.loads(sys.stdin.read()))))
        return 0
    if args.report_only:
        print(table(json.loads(args.report_only.read_text())))
        return 0
    specs = plan(args)
    started = time.monotonic()
    results = {}

    def run(spec):
        out = subprocess.run([sys.executable, "-m", "benchmarks.convergence", "--role", "job"], input=json.dumps(spec),
                             capture_output=True, text=True, cwd=ROOT, timeout=6 * 3600)
        if out.returncode:
            raise RuntimeError(f"{spec['name']} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(run, specs):
            results[result["name"]] = result
            print(f"[{time.strftime('%H:%M:%S')}] {result['name']}: {result['seconds']:.0f} s", flush=True)
    out = {"command": " ".join(["python -m benchmarks.convergence", *(argv or sys.argv[1:])]),
           "runs": results, "minutes": (time.monotonic() - started) / 60}
    save_results(out, args.results or args.work / "results.json")
    print(table(out))
    return 0


def table(out: dict) -> str:
    runs = out["runs"]
    dp, single = runs["data-parallel"]["losses"], runs["single"]["losses"]
    lines = ["| workers | H | outer lr | outer steps | inner steps | held-out loss | / data-parallel | / one AdamW |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs.values():
        if r["method"] != "diloco":
            continue
        for step, loss in sorted(r["losses"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {r['workers']} | {r['H']} | {r['outer_lr']:g} | {int(step) // r['H']} | {step} "
                         f"| {loss:.4f} | {loss / dp[step]:.3f} | {loss / single[step]:.3f} |")
    lines += ["", "| baseline | inner steps | held-out loss |", "|---|---|---|"]
    for name in ("data-parallel", "single"):
        for step, loss in sorted(runs[name]["losses"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {name} | {step} | {loss:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
