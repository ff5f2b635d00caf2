"""DiLoCo against data-parallel and one AdamW worker as outer steps grow: a sweep over H and outer lr.

    python -m benchmarks.convergence --results docs/bench_convergence.json [--jobs 2]

The sweep runs in-process. ``InProcessGroup`` averages the replicas' pseudo-gradients with the
same codec as the swarm (fp16; ``--compressions`` adds other wire formats, e.g. ``subset32+int4``),
and each replica is the trainer's own model, data shard and inner step (``Trainer.train_step``).
So a point costs compute, not daemons. The model is a 0.2M-parameter Llama (hidden 64, 2 layers,
seq 64), batch 8 per worker, 4 workers.

Every run uses the same inner lr schedule: linear warmup, then constant. The held-out loss at
inner step s is then comparable across runs of any length. A point (H, outer lr, k outer steps)
is DiLoCo's held-out loss after k·H inner steps, divided by:
- the loss of data-parallel after the same inner steps: one model with the 4 workers' batches
  averaged in every step, which is what ``benchmarks.baseline`` does over gloo;
- the loss of one AdamW worker (batch 8).

One-worker DiLoCo is measured against one AdamW worker too, as ``opendiloco train`` runs a worker
without a swarm: a ``SingleWorker`` and the outer step of ``[optim] solo_outer_lr`` and
``solo_outer_momentum`` (``--solo-outers`` sweeps them). Each configuration is a separate process;
``--jobs`` run at once.
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
           eval_batches: int, inner: str = "adamw", seed: int = 0, compression: str = "fp16",
           outer_momentum: float | None = None, solo: bool = False):
    from opendiloco.train.config import load_config

    outer = "solo-outer" if solo else "outer"  # a lone worker's outer step has keys of its own
    compression, _, decay = compression.partition("@")  # topk64+e2m1@0.95: [swarm] error_decay = 0.95

    return load_config(ROOT / "configs" / "tiny.toml", [
        "--optim.inner", inner, "--model.init-seed", str(seed), "--train.seed", str(seed),
        *MODEL, "--train.batch-size", str(batch), "--train.threads", "1", "--train.device", "cpu",
        "--train.eval-batches", str(eval_batches), "--train.total-steps", str(total),
        "--optim.local-steps", str(h), f"--optim.{outer}-lr", str(outer_lr), "--optim.warmup-steps", str(warmup),
        "--optim.min-lr-ratio", "1.0", "--optim.pace", "fixed", "--run.worker", worker,
        "--run.dir", str(run_dir / worker), "--run.progress", "false", "--swarm.compression", compression,
        *([] if outer_momentum is None else [f"--optim.{outer}-momentum", str(outer_momentum)]),
        *([] if not decay else ["--swarm.error-decay", decay])])


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
    common = dict(batch=spec["batch"], warmup=spec["warmup"], total=at[-1], eval_batches=spec["eval_batches"],
                  inner=spec.get("inner", "adamw"), seed=spec.get("seed", 0))
    losses: dict[int, float] = {}
    extra: dict = {}
    began = time.perf_counter()
    if spec["method"] == "diloco":
        n = spec["workers"]
        compression = spec.get("compression", "fp16")  # error feedback as the trainer sets it for the format
        solo = spec.get("solo", False)  # one worker without a swarm, as the trainer runs it
        wire = compression.partition("@")[0]
        members = [SingleWorker(compression=wire)] if solo else InProcessGroup(n, compression=wire, timeout=600).members
        ts = trainers(n, run_dir, members, h=spec["H"], outer_lr=spec["outer_lr"], compression=compression,
                      outer_momentum=spec.get("outer_momentum"), solo=solo,
                      **common)

        local_losses: dict[int, float] = {}

        def replica(t):
            for step in range(1, at[-1] + 1):
                t.train_step()
                if t is ts[0] and step in at:  # after the outer step
                    assert t.opt.local_step == 0 and t.opt.last_sync.ok
                    losses[step], local_losses[step] = evaluate_global(t)

        in_threads(replica, ts)
        if local_losses != losses:  # a subset format leaves the unsent values' local work in θ_local
            extra["local_losses"] = {str(k): v for k, v in local_losses.items()}
        hashes = {t.opt.global_hash() for t in ts}
        assert len(hashes) == 1, "replicas disagree"
    else:  # "single" or "data-parallel": the inner optimizer alone, the trainer's model and hyperparameters
        from opendiloco.inner import inner_optimizer

        n = spec["workers"] if spec["method"] == "data-parallel" else 1
        ts = trainers(n, run_dir, [SingleWorker("none") for _ in range(n)], h=10**9, outer_lr=1.0, **common)
        lead = ts[0]
        params = [p for p in lead.model.parameters() if p.requires_grad]
        o = lead.cfg.optim
        opt = inner_optimizer(o.inner, lead.model, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                              weight_decay=o.weight_decay, muon_momentum=o.muon_momentum)(params)
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
    return {**spec, "losses": {str(k): v for k, v in losses.items()}, "seconds": time.perf_counter() - began,
            **extra}


def evaluate_global(t) -> tuple[float, float]:
    """Held-out loss of θ_global and of this replica's θ_local, after an outer step. They are one model
    unless a subset format left the unsent values' local work in θ_local (``opendiloco.comm.subset``)."""
    import torch

    outer = t.opt.outer
    if all(torch.equal(p.detach().float().cpu(), g) for p, g in zip(outer.params, outer.global_params)):
        loss = t.evaluate()
        return loss, loss
    local_loss = t.evaluate()
    local = [p.detach().clone() for p in outer.params]
    outer.reset_local()
    try:
        return t.evaluate(), local_loss
    finally:
        with torch.no_grad():
            for p, v in zip(outer.params, local):
                p.copy_(v)


def suffix(inner: str, seed: int = 0) -> str:
    """Run names: AdamW's at seed 0 keep their old names ("data-parallel", "diloco-H30-lr0.4")."""
    return ("" if inner == "adamw" else f"-{inner}") + ("" if seed == 0 else f"-s{seed}")


def plan(args) -> list[dict]:
    specs, needed = [], set()
    for seed in args.seeds:
        for inner in args.inners:
            base = dict(work=str(args.work), batch=args.batch, warmup=args.warmup, workers=args.workers,
                        eval_batches=args.eval_batches, inner=inner, seed=seed)
            tag = suffix(inner, seed)
            for h in args.hs:
                ks = [k for k in args.outer_steps if k * h <= args.max_inner_steps]
                at = [k * h for k in ks]
                needed |= set(at)
                for lr in args.outer_lrs:
                    for wire in args.compressions:  # the baselines below send nothing: one of each
                        name = (f"H{h}-lr{lr:g}{tag}" + ("" if wire == "fp16" else f"-{wire}")
                                + ("" if args.outer_momentum is None else f"-m{args.outer_momentum:g}"))
                        specs.append({**base, "name": f"diloco-{name}", "method": "diloco", "H": h,
                                      "outer_lr": lr, "at": at, "compression": wire,
                                      "outer_momentum": args.outer_momentum})
                if h in args.one_worker_hs:
                    for lr, momentum in args.solo_outers:
                        for wire in args.compressions:
                            name = f"H{h}-solo{lr:g}m{momentum:g}{tag}" + ("" if wire == "fp16" else f"-{wire}")
                            specs.append({**base, "name": f"diloco1-{name}", "method": "diloco", "H": h,
                                          "outer_lr": lr, "at": at, "workers": 1, "compression": wire,
                                          "outer_momentum": momentum, "solo": True})
            specs.append({**base, "name": f"data-parallel{tag}", "method": "data-parallel"})
            specs.append({**base, "name": f"single{tag}", "method": "single"})
    order = sorted(needed)
    for spec in specs:
        spec.setdefault("at", order)
    return sorted(specs, key=lambda s: s["method"] == "diloco")  # baselines first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/convergence"))
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--hs", type=lambda s: [int(x) for x in s.split(",")], default=[10, 30, 100])
    p.add_argument("--outer-lrs", type=lambda s: [float(x) for x in s.split(",")], default=[0.4, 0.7, 1.0])
    p.add_argument("--outer-steps", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128])
    p.add_argument("--max-inner-steps", type=int, default=3840, help="points beyond this many inner steps are left out")
    p.add_argument("--one-worker-hs", type=lambda s: [int(x) for x in s.split(",")], default=[30])
    p.add_argument("--solo-outers", default=[(0.5, 0.0)],
                   type=lambda s: [tuple(float(v) for v in pair.split(":")) for pair in s.split(",")],
                   help="one-worker runs' outer lr:momentum pairs ([optim] solo_outer_lr, solo_outer_momentum)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--inners", type=lambda s: s.split(","), default=["adamw"], help="inner optimizers: adamw,muon")
    p.add_argument("--compressions", type=lambda s: s.split(","), default=["fp16"],
                   help="DiLoCo's wire formats, e.g. fp16,subset32+int4 ([swarm] compression); topk64+e2m1@0.95 adds "
                        "[swarm] error_decay = 0.95")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="the outer Nesterov momentum of every DiLoCo run (unset: the config's, 0.9; 0 with "
                        "--outer-lrs 1: plain averaging)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                   help="initial weights (model.init_seed, train.seed) to repeat every run with")
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
    """DiLoCo's held-out loss against the baselines of the same data order: data-parallel and one
    worker with the same inner optimizer, and with AdamW (the baselines of the first sweeps)."""
    runs = out["runs"]

    def base(name, r):
        return runs[f"{name}{suffix(r.get('inner', 'adamw'), r.get('seed', 0))}"]["losses"]

    def adamw(name, r):
        return runs[f"{name}{suffix('adamw', r.get('seed', 0))}"]["losses"]

    lines = ["| inner | wire | seed | workers | H | outer lr | momentum | outer steps | inner steps | held-out loss "
             "| / data-parallel | / one worker | / data-parallel AdamW | / one AdamW |", "|---" * 14 + "|"]
    for r in runs.values():
        if r["method"] != "diloco":
            continue
        dp, single = base("data-parallel", r), base("single", r)
        dp_adamw = adamw("data-parallel", r) if f"data-parallel{suffix('adamw', r.get('seed', 0))}" in runs else None
        single_adamw = adamw("single", r) if dp_adamw is not None else None
        momentum = r.get("outer_momentum")
        momentum = (0.0 if r.get("solo") else 0.9) if momentum is None else momentum  # the config's defaults
        for step, loss in sorted(r["losses"].items(), key=lambda kv: int(kv[0])):
            vs = [f"{loss / b[step]:.3f}" if b is not None else "-" for b in (dp, single, dp_adamw, single_adamw)]
            lines.append(f"| {r.get('inner', 'adamw')} | {r.get('compression', 'fp16')} | {r.get('seed', 0)} "
                         f"| {r['workers']} | {r['H']} "
                         f"| {r['outer_lr']:g} | {momentum:g} | {int(step) // r['H']} | {step} | {loss:.4f} "
                         f"| {' | '.join(vs)} |")
    lines += ["", "| baseline | inner | seed | inner steps | held-out loss |", "|---|---|---|---|---|"]
    for r in runs.values():
        if r["method"] == "diloco":
            continue
        for step, loss in sorted(r["losses"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {r['method']} | {r.get('inner', 'adamw')} | {r.get('seed', 0)} | {step} | {loss:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
