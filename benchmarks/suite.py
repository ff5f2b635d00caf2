"""The whole benchmark suite of issue #6, in one run; writes results JSON, tables and plots.

    python -m benchmarks.suite            # full: tens of minutes on 2 CPU cores; rewrites docs/benchmarks.md's
                                          # generated section and docs/img/bench_*.png
    python -m benchmarks.suite --quick    # same measurements on a smaller model, under 10 minutes;
                                          # report in runs/bench-quick/ unless --report says otherwise
    python -m benchmarks.suite --report-only --results runs/bench/results.json   # tables and plots again

1. Convergence, same number of inner steps per worker: one worker with AdamW; data-parallel
   with 4 workers (gloo, gradients averaged every step); DiLoCo with 4 workers through the real
   swarm (``opendiloco train``, fp16 all-reduce) for each H. Final held-out loss of each.
2. Communication: bytes each worker sent per inner step, measured on its network interface
   (one network namespace per worker) and by the communicator, against the analytic value.
3. Compute utilisation of DiLoCo for each H, on loopback and with every worker's link limited to
   ``--link-mbit`` by tc tbf in its own namespace; data-parallel on the same shaped link for contrast.
4. All-reduce efficiency: the FP16 pseudo-gradient transfer time on the shaped link against the
   bandwidth-optimal ``2(n-1)/n * bytes / rate``; gloo's gradient all-reduce on the same link as baseline.

Namespaces need root and iproute2 (``--netns auto`` falls back to loopback and says so: no
wire bytes and no shaped runs then). Every process is started and stopped by this script, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from opendiloco.testing.netns import NetnsError, unavailable_reason
from opendiloco.testing.proctree import ProcessGroup
from opendiloco.train.metrics import read_metrics

from . import analysis
from .network import Loopback, Namespaces
from .report import link_name

ROOT = Path(__file__).resolve().parents[1]
DHT_PORT, GLOO_PORT = 31337, 29500


@dataclass
class Plan:
    """What one run of the suite measures (``full`` or ``quick``)."""

    name: str
    config: str = "configs/tiny.toml"
    model: list[str] = field(default_factory=list)
    """Overrides of the model/data shape (the quick plan shrinks the model)."""
    workers: int = 4
    steps: int = 400
    batch: int = 8
    warmup: int = 25
    eval_every: int = 25
    """Inner steps between evals of the baselines (DiLoCo evaluates after every outer step)."""
    eval_batches: int = 8
    hs: tuple[int, ...] = (10, 50)
    util_batch: int = 2
    util_hs: tuple[int, ...] = (50, 500)
    util_rounds: dict = field(default_factory=lambda: {50: 4, 500: 2})
    dp_shaped_steps: int = 20
    link_mbit: float = 100.0


PLANS = {
    "full": Plan("full"),
    "quick": Plan("quick", model=["--model.hidden-size", "128", "--model.num-layers", "2",
                                  "--model.intermediate-size", "512", "--data.seq-len", "64"],
                  steps=100, warmup=10, eval_every=10, eval_batches=4, hs=(10, 50)),
}


class Suite:
    def __init__(self, plan: Plan, work: Path, use_netns: bool, device: str = "auto", precision: str = "auto"):
        """``device`` and ``precision`` go to every run alike (DiLoCo and the baselines): like is
        compared with like. The defaults are the trainer's (a GPU where there is one, bf16 there)."""
        self.plan, self.work, self.use_netns = plan, work, use_netns
        self.device, self.precision = device, precision
        self.work.mkdir(parents=True, exist_ok=True)

    # -- launching -------------------------------------------------------------------------------
    def _common(self, steps: int, batch: int, run_dir: Path, worker: str) -> list[str]:
        p = self.plan
        return ["--config", str(ROOT / p.config), *p.model, "--train.total-steps", str(steps),
                "--train.batch-size", str(batch), "--optim.warmup-steps", str(min(p.warmup, steps)),
                "--train.threads", "1", "--run.worker", worker, "--run.dir", str(run_dir), "--run.progress", "false",
                "--checkpoint.every-outer-steps", "0", "--train.device", self.device,
                "--train.precision", self.precision]

    def _run(self, name: str, net, launch, timeout: float, *, method: str, h: int | None = None) -> dict:
        """Starts the processes ``launch(group, net)`` returns, waits, and reads counters and metrics."""
        run_dir = self.work / name
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: choose another --work or remove it")
        group = ProcessGroup(run_dir / "logs", cwd=ROOT)
        before = [net.counters(i) for i in range(net.hosts)]
        start = time.monotonic()
        link = link_name(net.link_mbit) if net.link_mbit or net.kind == "loopback" else "unshaped"
        print(f"[{time.strftime('%H:%M:%S')}] {name} ({net.kind}, {link})", flush=True)
        try:
            workers = launch(group, net, run_dir)
            group.wait(workers, timeout)
        finally:
            leaked = group.stop()
        if leaked:
            raise RuntimeError(f"{name}: processes left behind (killed): {leaked}")
        after = [net.counters(i) for i in range(net.hosts)]
        tx = [a["tx_bytes"] - b["tx_bytes"] if a and b else None for b, a in zip(before, after)]
        records = [read_metrics(run_dir / f"worker-{r}" / "metrics.jsonl") for r in range(len(workers))]
        wall = time.monotonic() - start
        print(f"    {wall:.0f} s", flush=True)
        return {"method": method, "H": h, "records": records, "wire_tx": tx[1:], "wall_s": wall,
                "network": net.kind, "link_mbit": net.link_mbit}

    def baseline(self, name: str, net, world: int, steps: int, batch: int, extra: list[str] = ()) -> dict:
        def launch(group, net, run_dir):
            master = f"{net.ip(1)}:{net.port(1, GLOO_PORT)}"
            procs = []
            for r in range(world):
                args = [sys.executable, "-m", "benchmarks.baseline", "--world-size", str(world), "--rank", str(r),
                        "--master", master, *self._common(steps, batch, run_dir / f"worker-{r}", f"worker-{r}"),
                        *extra]
                if world == 1:
                    args[args.index("--train.threads") + 1] = "0"  # alone: every core
                procs.append(group.spawn(net.cmd(r + 1, args), f"worker-{r}", env=net.env(r + 1)))
            return procs

        return self._run(name, net, launch, timeout=steps * 30 + 300,
                         method="data-parallel" if world > 1 else "single")

    def diloco(self, name: str, net, h: int, steps: int, batch: int, extra: list[str] = ()) -> dict:
        n = self.plan.workers

        def launch(group, net, run_dir):
            addrs = run_dir / "bootstrap.addrs"
            boot = group.spawn(net.cmd(0, [sys.executable, "-m", "opendiloco", "dht", "--host-maddrs",
                                           f"/ip4/{net.ip(0)}/tcp/{net.port(0, DHT_PORT)}", "--addrs-file",
                                           str(addrs)]), "bootstrap")
            deadline = time.monotonic() + 90
            while not (addrs.exists() and addrs.read_text().strip()):
                if boot.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bootstrap did not start:\n{group.log('bootstrap')}")
                time.sleep(0.2)
            peers = addrs.read_text().split()
            procs = []
            for r in range(n):
                args = [sys.executable, "-m", "opendiloco", "train",
                        *self._common(steps, batch, run_dir / f"worker-{r}", f"worker-{r}"),
                        "--optim.local-steps", str(h), "--swarm.initial-peers", *peers,
                        "--swarm.open",  # open on purpose: emulated links of this machine; docs' figures were so
                        "--swarm.host-maddrs", f"/ip4/{net.ip(r + 1)}/tcp/{net.port(r + 1, DHT_PORT)}",
                        "--swarm.run-id", name, "--swarm.compression", "fp16", "--swarm.min-group-size", str(n),
                        "--swarm.straggler-wait", "300", "--swarm.matchmaking-timeout", "600",
                        "--swarm.allreduce-timeout", "300", *extra]
                procs.append(group.spawn(net.cmd(r + 1, args), f"worker-{r}"))
            return procs

        return self._run(name, net, launch, timeout=steps * 30 + 600, method="diloco", h=h)

    # -- the phases ------------------------------------------------------------------------------
    def convergence(self) -> dict:
        p = self.plan
        evals = ["--train.eval-every", str(p.eval_every), "--train.eval-batches", str(p.eval_batches)]
        out = {}
        net = self._network(p.workers + 1, None)
        try:
            out["single"] = self.baseline("single", net, 1, p.steps, p.batch, evals)
            out["data-parallel"] = self.baseline("data-parallel", net, p.workers, p.steps, p.batch, evals)
            for h in p.hs:
                out[f"diloco-H{h}"] = self.diloco(f"diloco-H{h}", net, h, p.steps, p.batch,
                                                  ["--train.eval-every", "0", "--train.eval-batches",
                                                   str(p.eval_batches)])
        finally:
            net.close()
        return out

    def utilisation(self) -> dict:
        p = self.plan
        quiet = ["--train.eval-batches", "0"]
        links = [None] + ([p.link_mbit] if self.use_netns else [])
        out = {}
        for mbit in links:
            net = self._network(p.workers + 1, mbit) if mbit else Loopback(p.workers + 1)
            tag = f"{mbit:g}mbit" if mbit else "loopback"
            try:
                for h in p.util_hs:
                    steps = h * p.util_rounds.get(h, 2)
                    out[f"util-H{h}-{tag}"] = self.diloco(f"util-H{h}-{tag}", net, h, steps, p.util_batch, quiet)
                if mbit:
                    out[f"util-dp-{tag}"] = self.baseline(f"util-dp-{tag}", net, p.workers, p.dp_shaped_steps,
                                                          p.util_batch, quiet)
            finally:
                net.close()
        return out

    def _network(self, hosts: int, mbit: float | None):
        return Namespaces(hosts, link_mbit=mbit) if self.use_netns else Loopback(hosts)


def summarise(runs: dict, plan: Plan, params: int) -> dict:
    """Turns the raw runs into the figures the report shows (kept apart so it can be re-run)."""
    n = plan.workers
    conv, util = {}, {}
    for name, run in runs.items():
        recs = run["records"]
        steps = max((r["inner_step"] for r in analysis.events(recs[0], "end")), default=0)
        rounds = [analysis.rounds(rec) for rec in recs]
        payload = [sum(r.get("bytes_sent") or 0 for r in rs) for rs in rounds]
        method, h = run["method"], run["H"]
        if method == "diloco":
            analytic = analysis.analytic_bytes_per_step(params, n, bytes_per_value=2, every=h)
        elif method == "data-parallel":
            analytic = analysis.analytic_bytes_per_step(params + 1, n, bytes_per_value=4, every=1)
        else:
            analytic = 0.0
        entry = {
            "method": method, "H": h, "workers": len(recs), "steps": steps,
            "network": run["network"], "link_mbit": run["link_mbit"], "wall_s": run["wall_s"],
            "final_eval_loss": analysis.final_eval_loss(recs[0]),
            "final_eval_losses": [analysis.final_eval_loss(r) for r in recs],
            "eval_curve": analysis.eval_curve(recs[0]),
            "wire_bytes_per_step": [t / steps if t is not None and steps else None for t in run["wire_tx"]],
            "payload_bytes_per_step": [b / steps for b in payload] if method == "diloco" and steps else None,
            "analytic_bytes_per_step": analytic,
            "utilisation_whole": [analysis.whole_run_utilisation(r) for r in recs],
            "utilisation_steady": [analysis.steady_utilisation(r) for r in recs] if method == "diloco" else None,
            "hashes_agree": len({rs[-1]["global_hash"] for rs in rounds if rs}) == 1 if method == "diloco" else None,
            "group_sizes": sorted({r["group_size"] for rs in rounds for r in rs}) if method == "diloco" else None,
        }
        if method == "diloco":
            transfers = [r["transfer_s"] for rs in rounds for r in rs if r.get("transfer_s")]
            syncs = [r["sync_s"] for rs in rounds for r in rs if r.get("sync_s")]
            entry["transfer_s_median"] = analysis.median_or_none(transfers)
            entry["sync_s_median"] = analysis.median_or_none(syncs)
            entry["payload_bytes_per_round"] = analysis.median_or_none(
                [r.get("bytes_sent") for rs in rounds for r in rs])
            entry["round_compute_s_median"] = analysis.median_or_none(
                [r["round_compute_s"] for rs in rounds for r in rs[1:]])
        else:
            comm = [e.get("comm_s") for rec in recs for e in analysis.events(rec, "end")]
            entry["comm_s_per_step"] = analysis.median_or_none([c / steps for c in comm if c is not None]) \
                if steps else None
        if run["link_mbit"]:
            per_round = (2 * params) if method == "diloco" else 4 * (params + 1)
            entry["optimal_s"] = analysis.bandwidth_optimal_s(per_round, n, run["link_mbit"])
        (util if name.startswith("util") else conv)[name] = entry
    return {"convergence": conv, "utilisation": util}


def machine() -> dict:
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "hivemind": _version("hivemind"), "kernel": platform.release()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller model and runs: under 10 minutes")
    p.add_argument("--work", type=Path, default=None, help="run dirs (default runs/bench or runs/bench-quick)")
    p.add_argument("--netns", choices=["auto", "on", "off"], default="auto",
                   help="one network namespace per host: wire bytes and the shaped link (needs root)")
    p.add_argument("--phases", default="convergence,utilisation", help="comma-separated subset to run")
    p.add_argument("--report", type=Path, default=None,
                   help="markdown file whose generated section is rewritten (default docs/benchmarks.md for the "
                        "full suite, <work>/report.md for --quick)")
    p.add_argument("--report-only", action="store_true", help="only redraw tables and plots from --results")
    p.add_argument("--results", type=Path, default=None, help="results JSON (default <work>/results.json)")
    p.add_argument("--device", default="auto", help="every run's train.device (auto: a GPU where there is one)")
    p.add_argument("--precision", default="auto", help="every run's train.precision (auto: bf16 on a GPU)")
    args = p.parse_args(argv)
    args.plan = PLANS["quick" if args.quick else "full"]
    args.work = args.work or ROOT / ("runs/bench-quick" if args.quick else "runs/bench")
    args.results = args.results or args.work / "results.json"
    args.report = args.report or (args.work / "report.md" if args.quick else ROOT / "docs/benchmarks.md")
    return args


def _interrupt(signum, frame):
    # Unwinds through the finally blocks (processes stopped, namespaces deleted); a second signal
    # must not break off that cleanup half-way.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    from .report import write_report

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    if not args.report_only:
        reason = unavailable_reason() if args.netns != "off" else "--netns off"
        if reason and args.netns == "on":
            print(f"--netns on: {reason}", file=sys.stderr)
            return 2
        use_netns = reason is None
        if reason:
            print(f"network namespaces not used ({reason}): loopback only, no wire bytes, no shaped link",
                  file=sys.stderr)
        phases = [x.strip() for x in args.phases.split(",") if x.strip()]
        unknown = set(phases) - {"convergence", "utilisation"}
        if unknown:
            print(f"unknown phase(s) {sorted(unknown)}", file=sys.stderr)
            return 2
        suite = Suite(args.plan, args.work, use_netns, device=args.device, precision=args.precision)
        started = time.monotonic()
        runs = {}
        try:
            for phase in phases:
                runs.update(getattr(suite, phase)())
        except NetnsError as e:
            print(f"network namespaces failed: {e} (try --netns off)", file=sys.stderr)
            return 1
        params = analysis.events(next(iter(runs.values()))["records"][0], "start")[0]["parameters"]
        results = {"plan": asdict(args.plan), "machine": machine(), "netns": use_netns, "parameters": params,
                   "minutes": (time.monotonic() - started) / 60, "command": " ".join(["python -m benchmarks.suite",
                                                                                      *(argv or sys.argv[1:])]),
                   **summarise(runs, args.plan, params)}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1))
        print(f"results: {args.results} ({results['minutes']:.1f} min)")
    results = json.loads(args.results.read_text())
    write_report(results, args.report)
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
