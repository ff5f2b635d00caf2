"""A joiner's first rounds, with and without a warm start of its inner AdamW ([optim] warm_start).

    python -m benchmarks.warm_start [--seeds 0 1] [--json FILE]

In-process (``InProcessGroup``, the swarm's fp16 codec; each replica the trainer's own model, data
shard and inner step): three workers train a 0.2M-parameter Llama for ``--before`` outer steps of H
inner steps; then a fourth joins from worker 0's shareable state (through ``torch.save``/``load``,
as a download would carry it) and the four train ``--after`` outer steps together. Everything up to
the join is the same in both arms; the arms differ only in whether the joiner takes the donor's
Adam moments. Figures, each a ratio within one seed's pair of arms:

- the joiner's mean training loss in its first round (and its second), over the old workers' mean
  in the same round (each on its own data shard, so a shard's difficulty is in it);
- the held-out loss of the joiner's own weights at the end of each round's inner steps (before the
  outer step averages them), over the old workers' mean: the same held-out batches for every
  worker, so only what the round's training did differs;
- the held-out loss of θ_global after each outer step after the join, warm over cold.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

from .convergence import config, in_threads


def run(seed: int, warm: bool, args, work: Path) -> dict:
    import torch

    from opendiloco import InProcessGroup
    from opendiloco.train.metrics import MetricsWriter
    from opendiloco.train.trainer import Trainer

    torch.manual_seed(seed)
    kw = dict(h=args.h, outer_lr=0.4, batch=8, warmup=20, total=args.h * (args.before + args.after),
              eval_batches=args.eval_batches)

    def trainer(rank: int, comm):
        cfg = config(work / f"{warm}-{seed}", f"worker-{rank}", **kw)
        cfg.optim.warm_start = bool(warm)
        cfg.optim.betas = [0.9, args.beta2]
        cfg.model.init_seed = seed
        t = Trainer(cfg)
        t.build(comm)
        t.metrics = MetricsWriter(Path(cfg.run.dir) / "metrics.jsonl")
        return t

    def steps(ts, n, losses):
        def replica(i):
            for _ in range(n):
                loss, _ = ts[i].train_step()
                losses[i].append(loss)

        in_threads(replica, range(len(ts)))

    group3 = InProcessGroup(3, compression="fp16", timeout=600)
    old = [trainer(r, group3.members[r]) for r in range(3)]
    steps(old, args.before * args.h, [[] for _ in old])
    group4 = InProcessGroup(4, compression="fp16", timeout=600)
    for r, t in enumerate(old):
        t.opt.communicator = group4.members[r]
    joiner = trainer(3, group4.members[3])
    buf = io.BytesIO()
    torch.save(old[0].opt.shareable_state(), buf)
    buf.seek(0)
    joiner.adopt_state(torch.load(buf, weights_only=True))
    assert joiner.opt.warm_started == bool(warm) and joiner.opt.global_hash() == old[0].opt.global_hash()
    if warm == "second":  # the donor's second moments only
        for entry in joiner.opt.inner.state.values():
            entry["exp_avg"].zero_()
    ts = [*old, joiner]
    losses = [[] for _ in ts]
    held_out, local = [], []
    for _ in range(args.after):
        steps(ts, args.h - 1, losses)  # the round's last inner step is followed by its outer step
        local.append([t.evaluate() for t in ts])
        steps(ts, 1, losses)
        assert len({t.opt.global_hash() for t in ts}) == 1, "replicas disagree"
        held_out.append(joiner.evaluate())
    per_round = [[statistics.fmean(w[k * args.h:(k + 1) * args.h]) for k in range(args.after)] for w in losses]
    return {"seed": seed, "warm": warm, "joiner": per_round[3], "old": [statistics.fmean(r) for r in
                                                                        zip(*per_round[:3])],
            "held_out": held_out, "local_held_out": local}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--h", type=int, default=20)
    p.add_argument("--before", type=int, default=6, help="outer steps of the three workers before the join")
    p.add_argument("--after", type=int, default=4, help="outer steps of the four after it")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--beta2", type=float, default=0.95, help="the inner AdamW's beta2 (the config's default 0.95)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for warm in (False, True, "second"):
                results.append(run(seed, warm, args, Path(tmp)))
    print(f"beta2={args.beta2}, H={args.h}, join after {args.before} outer steps, "
          f"{args.after} outer steps of 4 workers after it")
    print("seed  arm     joiner/old training loss, round 1  round 2   joiner/old held-out of its weights, "
          "round 1  round 2   held-out after each outer step")
    for r in results:
        ratios = [j / o for j, o in zip(r["joiner"], r["old"])]
        local = [w[3] / statistics.fmean(w[:3]) for w in r["local_held_out"]]
        print(f"{r['seed']:4d}  {str(r['warm']):6s}  {ratios[0]:32.3f}  {ratios[1]:7.3f}   {local[0]:46.4f}  "
              f"{local[1]:7.4f}   " + " ".join(f"{x:.4f}" for x in r["held_out"]))
    for seed in args.seeds:
        cold, warm = (next(r for r in results if r["seed"] == seed and r["warm"] == w) for w in (False, True))
        print(f"seed {seed}: held-out loss warm/cold after each outer step: "
              + " ".join(f"{w / c:.4f}" for w, c in zip(warm["held_out"], cold["held_out"]))
              + f"; joiner's round-1 loss warm/cold {warm['joiner'][0] / cold['joiner'][0]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
