"""Plays a world scenario with the real CLI and reports what the swarm lost to it.

    python -m benchmarks.world benchmarks/scenarios/ci.toml [--out runs/world] [--clean [--clean-duration S]]

``--clean`` first plays the same world without its faults (for ``--clean-duration`` seconds:
it only sets the rate), so that goodput is also reported relative to it. Writes
``<out>/<name>/``: ``report.json``, ``summary.txt`` and ``timeline.png`` (one lane per worker:
training, rounds coloured by group size, catch-up downloads, faults as marks; below it the loss
curves), beside the workers' run dirs and logs. Needs root (network namespaces), iproute2,
iptables and, for hosts with a clock offset, faketime. See docs/scenarios.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opendiloco.testing.scenario import ScenarioError, load_scenario
from opendiloco.testing.scenario_report import analyse, summary
from opendiloco.testing.scenario_runner import ScenarioRunner


def _max_wait(scenario) -> float:
    return float(scenario.overrides.get("swarm.max_wait", 600.0))


def play(path: str, out: Path, clean: bool = False, clean_duration: float | None = None) -> dict:
    scenario = load_scenario(path)
    clean_report = None
    if clean:
        base = scenario.without_faults(clean_duration)
        ScenarioRunner(base, out / base.name).run()
        clean_report = analyse(out / base.name, _max_wait(scenario))
        (out / base.name / "report.json").write_text(json.dumps(clean_report, indent=1))
    run_dir = ScenarioRunner(scenario, out / scenario.name).run()
    report = analyse(run_dir, _max_wait(scenario), clean=clean_report)
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    text = summary(report)
    (run_dir / "summary.txt").write_text(text + "\n")
    try:
        timeline(run_dir, run_dir / "timeline.png")
    except Exception as e:  # the picture is a convenience: the report stands without it
        print(f"no timeline: {type(e).__name__}: {e}", file=sys.stderr)
    print(text)
    return report


def timeline(run_dir: Path, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from opendiloco.train.metrics import read_metrics

    world = json.loads((run_dir / "world.json").read_text())
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    t0 = next(e["time"] for e in events if e["kind"] == "begin")
    workers = sorted(h for h in world["hosts"] if h != "bootstrap")
    fig, (ax, loss_ax) = plt.subplots(2, 1, figsize=(14, 2 + 0.45 * len(workers) + 3),
                                      gridspec_kw={"height_ratios": [max(2, len(workers)), 3]}, sharex=True)
    cmap = plt.get_cmap("viridis")
    sizes = max(2, len(workers))
    for lane, w in enumerate(workers):
        offset = float(world["hosts"][w].get("clock_offset_s", 0.0))
        path = run_dir / "workers" / w / "metrics.jsonl"
        recs = read_metrics(path) if path.exists() else []
        launches = [e["time"] - t0 for e in events if e["kind"] == "launch" and e.get("worker") == w]
        exits = [e["time"] - t0 for e in events if e["kind"] in ("exit", "kill") and e.get("worker") == w]
        for a in launches:  # alive: a thin grey bar from launch to exit
            b = min([x for x in exits if x >= a] or [events[-1]["time"] - t0])
            ax.barh(lane, b - a, left=a, height=0.15, color="0.8")
        last = None
        for r in recs:
            t = r["time"] - offset - t0
            if r["event"] == "start":
                last = t
            if r["event"] != "outer_step":
                continue
            sync = r.get("sync_s") or 0.0
            if last is not None and t - sync > last:
                ax.barh(lane, t - sync - last, left=last, height=0.5, color="#9ecae1")  # training
            ok = r.get("ok")
            color = cmap((r.get("group_size") or 1) / sizes) if ok else "#e6550d"
            if not ok and "caught up" in (r.get("reason") or ""):
                color = "#756bb1"  # downloaded the state
            elif not ok and r.get("held"):
                color = "#636363"  # held: its group lacked most of the run (a partition)
            ax.barh(lane, max(sync, 0.2), left=t - sync, height=0.5, color=color)
            last = t
        if recs:
            xs = [r["time"] - offset - t0 for r in recs if r["event"] == "train" and r.get("loss") is not None]
            ys = [r["loss"] for r in recs if r["event"] == "train" and r.get("loss") is not None]
            loss_ax.plot(xs, ys, lw=0.8, label=w)
    marks = {"kill": ("x", "red"), "freeze": ("v", "black"), "thaw": ("^", "black"), "readdress": ("D", "purple"),
             "launch": ("|", "green"), "stop": ("s", "grey")}
    for e in events:
        if e["kind"] in marks and e.get("worker") in workers:
            m, c = marks[e["kind"]]
            ax.plot(e["time"] - t0, workers.index(e["worker"]), marker=m, color=c, ms=9, ls="none")
        elif e["kind"] in ("partition", "heal", "kill_bootstrap", "link", "restore_link"):
            ax.axvline(e["time"] - t0, color="red" if e["kind"] != "heal" else "green", lw=0.8, ls="--")
            ax.text(e["time"] - t0, len(workers) - 0.4, e["kind"].replace("_", " "), fontsize=7, rotation=90,
                    va="top")
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels([f"{w} ({world['hosts'][w]['region']}{', nat' if world['hosts'][w].get('nat') else ''})"
                        for w in workers])
    ax.set_title(f"{run_dir.name}: light blue training, rounds coloured by group size (orange failed, grey held, "
                 "purple download); x kill, v/^ freeze/thaw, D new address, | launch")
    loss_ax.set_ylabel("train loss")
    loss_ax.set_xlabel("seconds")
    loss_ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def _median_s(values: list[float]) -> str:
    return f"{sorted(values)[len(values) // 2]:.2f} s" if values else "-"


def growth(run_dirs: list[Path]) -> str:
    """A table of played scenarios side by side: how rounds cost grows with the number of workers."""
    from opendiloco.train.metrics import read_metrics

    rows = ["| workers | outer steps | round, last to arrive (median) | round, all members (median) | "
            "failed rounds per 100 | full rounds | goodput | from the first outer step |",
            "|---|---|---|---|---|---|---|---|"]
    for run_dir in run_dirs:
        report = json.loads((run_dir / "report.json").read_text())
        by_step: dict[int, list[dict]] = {}
        failed = applied = 0
        for w in report["workers"]:
            for r in read_metrics(run_dir / "workers" / w / "metrics.jsonl"):
                if r["event"] == "outer_step":
                    if r.get("ok"):
                        applied += 1
                        by_step.setdefault(r["outer_step"], []).append(r)
                    else:
                        failed += 1
        last = [min(x.get("sync_s") or 0 for x in rs) for rs in by_step.values() if len(rs) > 1]
        every = [x.get("sync_s") or 0 for rs in by_step.values() for x in rs]
        rows.append(f"| {len(report['workers'])} | {report['outer_steps']} | {_median_s(last)} | {_median_s(every)} | "
                    f"{100 * failed / max(1, applied + failed):.1f} | {report['full_rounds']} of {report['groups']} | "
                    f"{report['goodput']:.1%} | {report.get('steady_goodput', float('nan')):.1%} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.world", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", help="a scenario TOML (benchmarks/scenarios/*.toml)")
    p.add_argument("--out", type=Path, default=Path("runs/world"))
    p.add_argument("--clean", action="store_true", help="also play it without faults (relative goodput)")
    p.add_argument("--clean-duration", type=float, default=300.0,
                   help="seconds of the faultless run (it only sets the rate; default 300, at most the scenario's)")
    p.add_argument("--growth", type=Path, nargs="+", metavar="RUN_DIR",
                   help="instead of playing: a table of these played runs side by side")
    args = p.parse_args(argv)
    if args.growth:
        print(growth(args.growth))
        return 0
    try:
        duration = load_scenario(args.scenario).duration_s
        play(args.scenario, args.out, clean=args.clean, clean_duration=min(args.clean_duration, duration))
    except ScenarioError as e:
        print(f"scenario error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; everything the run started was removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
