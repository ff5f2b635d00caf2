"""Wire formats against fp16, in one run: bytes per inner step, held-out loss, codec speed.

    python -m benchmarks.compression --work runs/compression --results docs/bench_compression.json

- Codec speed: encode + decode of 10M fp32 values with pseudo-gradient-like magnitudes (median of
  5, torch's default threads), each format against fp16.
- Loss and bytes: the suite's full plan on loopback, 4 ``opendiloco train`` workers through a
  real swarm, H=50, 400 inner steps, batch 8, ``pace = fixed`` (every run takes the same inner
  steps on the same data). One run per format, with and without error feedback; the held-out
  loss is worker 0's last eval (all workers hold the same θ_global), the bytes are the payload
  each worker sent per inner step (median of workers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from opendiloco.comm.formats import get_codec

from . import analysis
from .network import Loopback
from .report import save_results
from .suite import PLANS, Suite

RUNS = {
    "fp16": ("fp16", None, False),
    "int8": ("int8", None, False),
    "int8+ef": ("int8", None, True),
    "int4": ("int4", None, False),
    "int4+ef": ("int4", None, True),
    "e2m1+ef": ("e2m1", None, True),
    "int4+ef/int8": ("int4", "int8", True),
}
"""Run name -> (contribution format, averaged-shard format or None for the same, error feedback)."""


def overrides(compression: str, result: str | None, feedback: bool) -> list[str]:
    out = ["--swarm.compression", compression, "--swarm.error-feedback", str(feedback).lower(),
           "--optim.pace", "fixed"]
    return out + (["--swarm.result-compression", result] if result else [])


def codec_speed(names: list[str], numel: int = 10_000_000, repeats: int = 5) -> dict[str, float]:
    """Seconds to encode and decode ``numel`` values, per format (median of ``repeats``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, -1, numel)
    out = torch.empty_like(x)
    seconds = {}
    for name in names:
        codec = get_codec(name)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            codec.decode_into(codec.to_bytes(x), out)
            times.append(time.perf_counter() - t)
        seconds[name] = statistics.median(times)
    return seconds


def figures(run: dict) -> dict:
    rounds = [analysis.rounds(r) for r in run["records"]]
    return {
        "final_eval_loss": analysis.final_eval_loss(run["records"][0]),
        "eval_curve": analysis.eval_curve(run["records"][0]),
        "bytes_per_step": statistics.median(
            sum(r.get("bytes_sent") or 0 for r in rs) / max(1, rs[-1]["inner_step"]) for rs in rounds if rs),
        "group_sizes": sorted({r["group_size"] for rs in rounds for r in rs}),
        "hashes_agree": len({rs[-1]["global_hash"] for rs in rounds if rs}) == 1,
        "outer_steps": len(rounds[0]),
        "wall_s": run["wall_s"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/compression"))
    p.add_argument("--runs", default=",".join(RUNS), help=f"which of {', '.join(RUNS)} (fp16 is the baseline)")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--report-only", type=Path, default=None, metavar="RESULTS", help="only print the tables")
    args = p.parse_args(argv)
    if args.report_only:
        print(table(json.loads(args.report_only.read_text())))
        return 0
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown or "fp16" not in names:
        print(f"--runs: unknown {unknown}; fp16 (the baseline) is required", file=sys.stderr)
        return 2
    plan = PLANS["full"]
    out = {"command": " ".join(["python -m benchmarks.compression", *(argv or sys.argv[1:])]),
           "workers": plan.workers, "H": 50, "steps": plan.steps, "batch": plan.batch, "runs": {},
           "codec_seconds_10M": codec_speed(["fp16", "scaled-fp16", "int8", "int4", "e2m1", "e3m0"]),
           "threads": torch.get_num_threads()}
    print(json.dumps(out["codec_seconds_10M"]), flush=True)
    started = time.monotonic()
    suite = Suite(plan, args.work, use_netns=False)
    evals = ["--train.eval-every", "50", "--train.eval-batches", str(plan.eval_batches)]
    net = Loopback(plan.workers + 1)
    try:
        for name in names:
            compression, result, feedback = RUNS[name]
            run = suite.diloco(name.replace("/", "-res-").replace("+", "-"), net, 50, plan.steps, plan.batch,
                               [*evals, *overrides(compression, result, feedback)])
            out["runs"][name] = {"compression": compression, "result": result or compression,
                                 "error_feedback": feedback, **figures(run)}
            print(f"    loss {out['runs'][name]['final_eval_loss']}", flush=True)
    finally:
        net.close()
    out["minutes"] = (time.monotonic() - started) / 60
    save_results(out, args.results or args.work / "results.json")
    print(table(out))
    return 0


def table(out: dict) -> str:
    base = out["runs"].get("fp16", {})
    lines = ["| run | contributions | averages | error feedback | bytes per inner step | vs fp16 | held-out loss "
             "| vs fp16 | replicas agree |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["runs"].items():
        bytes_ratio = r["bytes_per_step"] / base["bytes_per_step"] if base.get("bytes_per_step") else None
        loss_ratio = (r["final_eval_loss"] / base["final_eval_loss"]
                      if base.get("final_eval_loss") and r["final_eval_loss"] else None)
        lines.append(f"| {name} | {r['compression']} | {r['result']} | {'yes' if r['error_feedback'] else 'no'} "
                     f"| {r['bytes_per_step'] / 1e3:.1f} kB | {_x(bytes_ratio)} | {_f(r['final_eval_loss'])} "
                     f"| {_x(loss_ratio, 4)} | {'yes' if r['hashes_agree'] else 'NO'} |")
    speed = out["codec_seconds_10M"]
    lines += ["", "| format | encode + decode, 10M values | vs fp16 |", "|---|---|---|"]
    for name, s in speed.items():
        lines.append(f"| {name} | {s * 1e3:.0f} ms | {_x(s / speed['fp16'], 2)} |")
    return "\n".join(lines)


def _x(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}x"


def _f(v):
    return "-" if v is None else f"{v:.4f}"


if __name__ == "__main__":
    sys.exit(main())
