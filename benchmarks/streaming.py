"""Streaming DiLoCo against plain DiLoCo, in one run: utilisation, loss, peak bytes per sync.

    python -m benchmarks.streaming --work runs/streaming [--fragments 4 --overlap 5 --mix 0.5]

Same workers, model and links as the suite (``benchmarks/suite.py``, full plan): 4
``opendiloco train`` processes through a real swarm, one network namespace each. Both methods run
with ``optim.pace = fixed``, so they take exactly the same inner steps.

- Utilisation at H=50 and H=500 with every worker's link shaped to 100 Mbit/s (tbf): plain DiLoCo
  (one blocking all-reduce of the whole model every H steps), then streaming (P fragments, each
  round in the background for ``overlap`` steps). The figure is steady-state time in inner steps
  over wall time, median over workers.
- Held-out loss at H=50 after the suite's 400 inner steps (batch 8), on loopback: plain, and
  streaming with each ``--mixes`` value.
- Peak bytes per sync event: the most payload bytes one worker sent in one round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from opendiloco.testing.netns import unavailable_reason

from . import analysis
from .network import Loopback, Namespaces
from .report import save_results
from .suite import PLANS, Suite

PLAIN = ["--optim.pace", "fixed"]


def streamed(fragments: int, overlap: int, mix: float, pace: str = "fixed") -> list[str]:
    return ["--optim.pace", pace, "--optim.fragments", str(fragments), "--optim.overlap", str(overlap),
            "--optim.mix", str(mix)]


def figures(run: dict) -> dict:
    recs = run["records"]
    rounds = [analysis.rounds(r) for r in recs]
    steady = [analysis.steady_utilisation(r) for r in recs]
    # The same window without the last outer step: at a run's end a streamed round still in flight
    # is landed at once (a one-off per run, not per round), so this is the per-round figure.
    before_end = [analysis.steady_utilisation(without_last_round(r)) for r in recs]
    return {
        "utilisation_per_round_median": analysis.median_or_none(before_end),
        "utilisation_steady_median": analysis.median_or_none(steady),
        "utilisation_steady": steady,
        "utilisation_whole": [analysis.whole_run_utilisation(r) for r in recs],
        "final_eval_loss": analysis.final_eval_loss(recs[0]),
        "eval_curve": analysis.eval_curve(recs[0]),
        "peak_bytes_per_sync": max((r.get("bytes_sent") or 0 for rs in rounds for r in rs), default=0),
        "bytes_per_step": statistics.median(
            sum(r.get("bytes_sent") or 0 for r in rs) / max(1, rs[-1]["inner_step"]) for rs in rounds if rs),
        "sync_s_median": analysis.median_or_none([r.get("sync_s") for rs in rounds for r in rs]),
        "transfer_s_median": analysis.median_or_none([r.get("transfer_s") for rs in rounds for r in rs]),
        "events": len(rounds[0]),
        "group_sizes": sorted({r["group_size"] for rs in rounds for r in rs}),
        "hashes_agree": len({rs[-1]["global_hash"] for rs in rounds if rs}) == 1,
        "wall_s": run["wall_s"],
    }


def without_last_round(records: list[dict]) -> list[dict]:
    last = max((i for i, r in enumerate(records) if r.get("event") == "outer_step"), default=None)
    return [r for i, r in enumerate(records) if i != last]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/streaming"))
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap", type=int, default=5)
    p.add_argument("--util-overlap", type=int, default=None, help="overlap for the utilisation runs "
                   "(default --overlap)")
    p.add_argument("--mixes", default="0.5,0", help="mix values for the loss comparison (the first is used for "
                                                     "utilisation)")
    p.add_argument("--phases", default="utilisation,loss")
    p.add_argument("--skip-long-fixed", action="store_true", help="no streaming-fixed run at H=500 (5 minutes)")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--report-only", nargs="*", type=Path, default=None, metavar="RESULTS",
                   help="only print the tables (and --plot) of these results files")
    p.add_argument("--plot", type=Path, default=None, help="write a png of utilisation and loss curves here")
    args = p.parse_args(argv)
    results_path = args.results or args.work / "results.json"
    if args.report_only is not None:
        outs = [json.loads(f.read_text()) for f in args.report_only or [results_path]]
        for out in outs:
            print(table(out))
        if args.plot:
            plot(outs, args.plot)
        return 0
    reason = unavailable_reason()
    if reason:
        print(f"needs network namespaces for the shaped link: {reason}", file=sys.stderr)
        return 2
    plan = PLANS["full"]
    suite = Suite(plan, args.work, use_netns=True)
    mixes = [float(m) for m in args.mixes.split(",")]
    out = {"fragments": args.fragments, "overlap": args.overlap, "util_overlap": args.util_overlap, "mixes": mixes,
           "link_mbit": plan.link_mbit, "workers": plan.workers, "runs": {},
           "command": " ".join(["python -m benchmarks.streaming", *(argv or sys.argv[1:])])}
    started = time.monotonic()
    phases = args.phases.split(",")
    if "utilisation" in phases:
        quiet = ["--train.eval-batches", "0"]
        net = Namespaces(plan.workers + 1, link_mbit=plan.link_mbit)
        try:
            tau = args.util_overlap if args.util_overlap is not None else args.overlap
            for h in plan.util_hs:
                steps = h * plan.util_rounds.get(h, 2)
                # Streaming under both paces: "fixed" takes exactly the steps plain DiLoCo takes; "swarm"
                # (the trainer's default) lets every worker start each event when the group's work is
                # done, so no worker waits for a slower one.
                configs = {"plain": PLAIN, "streaming-fixed": streamed(args.fragments, tau, mixes[0]),
                           "streaming-swarm": streamed(args.fragments, tau, mixes[0], "swarm")}
                for name, extra in configs.items():
                    if h >= 500 and name == "streaming-fixed" and args.skip_long_fixed:
                        continue
                    run = suite.diloco(f"util-H{h}-{name}", net, h, steps, plan.util_batch, [*quiet, *extra])
                    out["runs"][f"util-H{h}-{name}"] = {"H": h, "link": plan.link_mbit, **figures(run)}
                    print(f"    {out['runs'][f'util-H{h}-{name}']['utilisation_steady_median']}", flush=True)
        finally:
            net.close()
    if "loss" in phases:
        evals = ["--train.eval-every", "50", "--train.eval-batches", str(plan.eval_batches)]
        net = Loopback(plan.workers + 1)
        h = 50
        configs = [("plain", PLAIN)] + [(f"streaming-mix{m:g}", streamed(args.fragments, args.overlap, m))
                                        for m in mixes]
        for name, extra in configs:
            run = suite.diloco(f"loss-H{h}-{name}", net, h, plan.steps, plan.batch, [*evals, *extra])
            out["runs"][f"loss-H{h}-{name}"] = {"H": h, "link": None, **figures(run)}
            print(f"    {out['runs'][f'loss-H{h}-{name}']['final_eval_loss']}", flush=True)
    out["minutes"] = (time.monotonic() - started) / 60
    save_results(out, results_path)
    print(table(out))
    return 0


def plot(outs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: r for out in reversed(outs) for name, r in out["runs"].items()}  # the first file wins

    def per_round(r):
        return r.get("utilisation_per_round_median") or r["utilisation_steady_median"]

    util = {n: r for n, r in runs.items() if n.startswith("util") and per_round(r)}
    loss = {n: r for n, r in runs.items() if n.startswith("loss") and r["eval_curve"]}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), dpi=120)
    names = list(util)
    bars = a.barh([n.removeprefix("util-") for n in names], [100 * per_round(util[n]) for n in names],
                  color=["C3" if n.endswith("plain") else "C2" for n in names])
    a.bar_label(bars, fmt="%.1f%%", fontsize=8)
    a.set_xlim(0, 110)
    a.set_xlabel("compute utilisation per round, 100 Mbit/s links (%)")
    for i, (n, r) in enumerate(loss.items()):
        steps, values = zip(*r["eval_curve"])
        b.plot(steps, values, marker="o", ms=2.5, color=f"C{i}", label=n.removeprefix("loss-"))
    b.set_xlabel("inner steps per worker")
    b.set_ylabel("held-out loss")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(out: dict) -> str:
    runs = out["runs"]
    rows = ["| run | link | steady utilisation (median of workers) | same, last outer step left out | "
            "outer step, blocking part (median) | peak bytes per sync event | vs plain | held-out loss | vs plain |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        kind, h, method = name.split("-", 2)
        plain = runs.get(f"{kind}-{h}-plain", {})
        util = r["utilisation_steady_median"]
        link = f"{r['link']:g} Mbit/s" if r["link"] else "loopback"
        loss = r["final_eval_loss"] if kind == "loss" else None
        peak_ratio = r["peak_bytes_per_sync"] / plain["peak_bytes_per_sync"] if plain.get("peak_bytes_per_sync") \
            else None
        loss_ratio = loss / plain["final_eval_loss"] if loss and plain.get("final_eval_loss") else None
        rows.append(" | ".join([
            f"| {h} {method}", link, f"{util:.1%}" if util else "-",
            f"{r['utilisation_per_round_median']:.1%}" if r.get("utilisation_per_round_median") else "-",
            f"{r['sync_s_median']:.3f} s" if r["sync_s_median"] is not None else "-",
            f"{r['peak_bytes_per_sync'] / 1e6:.2f} MB", f"{peak_ratio:.3f}x" if peak_ratio else "-",
            f"{loss:.4f}" if loss else "-", f"{loss_ratio:.4f}x |" if loss_ratio else "- |"]))
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
