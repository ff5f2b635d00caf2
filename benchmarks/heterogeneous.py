"""Swarms of workers of different speed: does every worker's compute count? (issue: heterogeneous swarms)

    python -m benchmarks.heterogeneous --work runs/hetero [--wall 60] [--workers 2,4] [--slowdowns 1,2,4]

Every worker is a real ``opendiloco train`` process on 127.0.0.1 (small model, one thread each).
Speeds are set by ``train.throttle``: every worker sleeps ``base`` seconds per inner step, so the
machine's own load matters little, and the slow worker sleeps so that its step takes ``k`` times
as long. Each run trains for the same wall time, then is stopped with SIGTERM. Per swarm size n:

- ``swarm-kK``: n workers, one slowed k x, ``optim.pace = swarm``;
- ``fixed-k4``: the same with ``optim.pace = fixed`` (exactly H steps each), for contrast;
- ``without-slow``: the n-1 full-speed workers alone;
- ``equal-kK``: n workers all at the same speed, with the same total throughput as ``swarm-kK``.

Figures: the share of outer steps in which every worker contributed; each worker's useful compute
(inner steps that entered an average / inner steps in finished rounds); compute utilisation; and
the held-out loss at the common wall time, as ratios against ``equal-kK`` and ``without-slow``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import torch

from opendiloco.testing.proctree import ProcessGroup, spawn_bootstrap
from opendiloco.train.metrics import read_metrics

from .report import save_results

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model.hidden-size", "128", "--model.num-layers", "2", "--model.intermediate-size", "512",
         "--data.seq-len", "64"]


def step_compute_s(batch: int) -> float:
    """Seconds of one inner step of the benchmark model on one thread (no throttle), measured here."""
    from opendiloco.train.config import load_config
    from opendiloco.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(str(ROOT / "configs/tiny.toml"), [*MODEL, "--train.batch-size", str(batch),
                                                       "--run.dir", "/tmp/opendiloco-hetero-calibration"])
    trainer = Trainer(cfg)
    trainer.build_model_and_data()
    model = trainer.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(12):
        x = trainer.stream.next_batch(batch)
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[len(times[2:]) // 2]


def run_swarm(work: Path, name: str, throttles: list[float], *, pace: str, h: int, batch: int, wall: float) -> dict:
    run_dir = work / name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: choose another --work or remove it")
    group = ProcessGroup(run_dir / "logs", cwd=ROOT)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: throttles {[round(t, 3) for t in throttles]} pace={pace}",
          flush=True)
    try:
        peers = spawn_bootstrap(group, run_dir / "bootstrap.addrs")
        procs = []
        for r, throttle in enumerate(throttles):
            args = [sys.executable, "-m", "opendiloco", "train", "--config", str(ROOT / "configs/tiny.toml"), *MODEL,
                    "--train.total-steps", "1000000", "--train.batch-size", str(batch), "--train.threads", "1",
                    "--train.throttle", f"{throttle:.4f}", "--train.eval-batches", "4", "--optim.warmup-steps", "10",
                    "--optim.local-steps", str(h), "--optim.pace", pace, "--run.worker", f"worker-{r}",
                    "--run.dir", str(run_dir / f"worker-{r}"), "--run.progress", "false",
                    "--checkpoint.every-outer-steps", "0", "--swarm.initial-peers", *peers,
                    "--swarm.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--swarm.run-id", name,
                    "--swarm.open"]  # open on purpose: one machine, and the figures in docs/ were measured so
            procs.append(group.spawn(args, f"worker-{r}"))
        # The clock starts when every worker has written its start record (models built, swarm joined).
        deadline = time.monotonic() + 180
        paths = [run_dir / f"worker-{r}" / "metrics.jsonl" for r in range(len(throttles))]
        while not all(p.exists() and any(x.get("event") == "start" for x in read_metrics(p)) for p in paths):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{name}: a worker did not start:\n{group.log('worker-0')}")
            time.sleep(0.2)
        started = time.time()
        time.sleep(wall)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        group.wait(procs, timeout=120)
    finally:
        leaked = group.stop()
    if leaked:
        raise RuntimeError(f"{name}: processes left behind (killed): {leaked}")
    return summarise([read_metrics(p) for p in paths], started, wall, throttles, pace)


def summarise(records: list[list[dict]], started: float, wall: float, throttles: list[float], pace: str) -> dict:
    n = len(records)
    # The round a worker was stopped in (SIGTERM at the end of the run) is not the swarm's doing.
    rounds = [r for r in records[0] if r["event"] == "outer_step" and "stopping" not in (r.get("reason") or "")]
    full = [r["outer_step"] for r in rounds if r["ok"] and r["group_size"] == n]
    # Rounds after the first one that had everybody (workers start at different moments).
    counted = [r for r in rounds if full and r["outer_step"] > min(full) - 1]
    together = sum(r["ok"] and r["group_size"] == n for r in counted)
    workers = []
    for recs in records:
        syncs = [r for r in recs if r["event"] == "outer_step"]
        end = next(r for r in recs if r["event"] == "end")
        # Useful: steps that entered an average / steps whose round is over (entered or dropped);
        # the round a worker was stopped in has not had its chance.
        contributed, dropped = end.get("contributed_steps", 0), end.get("dropped_steps", 0)
        taken = contributed + dropped
        workers.append({"steps_in_finished_rounds": taken, "contributed": contributed,
                        "useful": contributed / taken if taken else None, "dropped": dropped,
                        "steps_taken": end.get("steps_taken"), "utilisation": end.get("utilisation"),
                        "steps_per_s": end.get("steps_taken", 0) / end["loop_s"] if end.get("loop_s") else None,
                        "mean_steps_per_round": taken / len(syncs) if syncs else None})
    evals = [(r["time"] - started, r["eval_loss"]) for r in records[0] if r["event"] == "eval"]
    return {"pace": pace, "workers": n, "throttles": throttles, "wall_s": wall, "rounds": len(counted),
            "rounds_together": together, "together_share": together / len(counted) if counted else 0.0,
            "per_worker": workers, "loss_at_wall": loss_at(evals, wall), "evals": evals}


def loss_at(evals: list[tuple[float, float]], t: float) -> float | None:
    """Held-out loss at time ``t``, linearly between the evals around it (the last one before, at the end)."""
    before = [e for e in evals if e[0] <= t]
    after = [e for e in evals if e[0] > t]
    if not before:
        return None
    if not after:
        return before[-1][1]
    (t0, l0), (t1, l1) = before[-1], after[0]
    return l0 + (l1 - l0) * (t - t0) / (t1 - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/hetero"))
    p.add_argument("--wall", type=float, default=60.0, help="seconds each swarm trains")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--slowdowns", default="1,2,4")
    p.add_argument("--base", type=float, default=0.2, help="seconds every worker sleeps per inner step")
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="write the loss-vs-wall-time plot here (png)")
    p.add_argument("--report-only", action="store_true", help="only print the table (and plot) of --results")
    args = p.parse_args(argv)
    if args.report_only:
        out = json.loads(args.results.read_text())
        print(table(out))
        if args.plot:
            plot(out, args.plot)
        return 0
    c = step_compute_s(args.batch)
    step = args.base + c
    print(f"one inner step computes in {c * 1e3:.1f} ms; a full-speed step takes {step:.3f} s", flush=True)
    out = {"compute_s": c, "base_s": args.base, "wall_s": args.wall, "local_steps": args.local_steps, "runs": {}}
    slowdowns = [float(k) for k in args.slowdowns.split(",")]
    for n in (int(x) for x in args.workers.split(",")):
        runs = out["runs"][str(n)] = {}

        def go(name, throttles, pace="swarm", runs=runs, n=n):
            runs[name] = run_swarm(args.work, f"n{n}-{name}", throttles, pace=pace, h=args.local_steps,
                                   batch=args.batch, wall=args.wall)
            r = runs[name]
            print(f"    together {r['rounds_together']}/{r['rounds']}, useful "
                  f"{[w['useful'] and round(w['useful'], 3) for w in r['per_worker']]}, "
                  f"loss {r['loss_at_wall']}", flush=True)

        for k in slowdowns:
            go(f"swarm-k{k:g}", [args.base] * (n - 1) + [k * step - c])
        go("fixed-k4", [args.base] * (n - 1) + [4 * step - c], pace="fixed")
        go("without-slow", [args.base] * (n - 1))
        for k in slowdowns:
            if k == 1:
                continue
            per_worker = (n - 1 + 1 / k) / n  # the same total throughput, shared equally
            go(f"equal-k{k:g}", [step / per_worker - c] * n)
    save_results(out, args.results or args.work / "results.json")
    print(table(out))
    if args.plot:
        plot(out, args.plot)
        print(f"plot: {args.plot}")
    return 0


def table(out: dict) -> str:
    """The markdown table of docs/benchmarks.md: one row per run, ratios against runs of the same size."""
    rows = ["| workers | run | outer steps with every worker | useful compute, lowest | utilisation, lowest | "
            "held-out loss at equal wall time | vs equal-speed swarm | vs without the slow worker | "
            "mean loss, last third | vs equal-speed | vs without the slow worker |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, runs in out["runs"].items():
        for name, r in runs.items():
            k = name.split("-k")[-1] if "-k" in name else None
            equal = runs.get("swarm-k1" if k == "1" else f"equal-k{k}", {}).get("loss_at_wall")
            base = runs.get("without-slow", {}).get("loss_at_wall")
            loss = r["loss_at_wall"]
            late = late_loss(r, out["wall_s"])
            late_equal = late_loss(runs.get("swarm-k1" if k == "1" else f"equal-k{k}"), out["wall_s"])
            late_base = late_loss(runs.get("without-slow"), out["wall_s"])
            useful = [w["useful"] for w in r["per_worker"] if w["useful"] is not None]
            util = [w["utilisation"] for w in r["per_worker"] if w["utilisation"] is not None]
            compared = name.startswith(("swarm", "fixed"))
            rows.append(" | ".join([
                f"| {n}", name, f"{r['rounds_together']}/{r['rounds']} ({r['together_share']:.0%})",
                f"{min(useful):.1%}" if useful else "-", f"{min(util):.1%}" if util else "-",
                f"{loss:.4f}" if loss else "-",
                f"{loss / equal:.3f}x" if compared and loss and equal and k != "1" else "-",
                f"{loss / base:.3f}x" if compared and loss and base else "-",
                f"{late:.4f}" if late else "-",
                f"{late / late_equal:.3f}x" if compared and late and late_equal and k != "1" else "-",
                f"{late / late_base:.3f}x |" if compared and late and late_base else "- |"]))
    return "\n".join(rows)


def late_loss(run: dict | None, wall: float) -> float | None:
    """Mean held-out loss over the last third of the wall time: less sensitive to where the last
    outer step falls than the value at one instant."""
    if not run:
        return None
    late = [loss for t, loss in run["evals"] if 2 * wall / 3 <= t <= wall]
    return sum(late) / len(late) if late else None


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(out["runs"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), dpi=120, squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for i, (name, r) in enumerate(out["runs"][n].items()):
            if r["evals"]:
                t, loss = zip(*r["evals"])
                ax.plot(t, loss, marker="o", ms=2.5, lw=1.2, color=f"C{i}", label=name,
                        ls="--" if name.startswith(("equal", "without")) else "-")
        ax.axvline(out["wall_s"], color="grey", lw=0.8)
        ax.set_title(f"{n} workers, one slowed k x")
        ax.set_xlabel("wall time since every worker started (s)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
