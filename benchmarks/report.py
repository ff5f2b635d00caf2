"""Markdown tables and PNG plots from the suite's results JSON.

The generated text goes between ``BEGIN``/``END`` markers of the report file, so the
hand-written parts of ``docs/benchmarks.md`` around it stay as they are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BEGIN = "<!-- BEGIN benchmarks.suite (generated: python -m benchmarks.suite --report-only) -->"
END = "<!-- END benchmarks.suite -->"

def save_results(out: dict, path: Path) -> None:
    """Writes a benchmark's results JSON (the input of its ``--report-only``) and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"results: {path}")


LABELS = {"single": "1 worker, AdamW", "data-parallel": "data-parallel, {n} workers (gloo, every step)"}


def label(entry: dict) -> str:
    if entry["method"] == "diloco":
        return f"DiLoCo, {entry['workers']} workers, H={entry['H']}"
    return LABELS[entry["method"]].format(n=entry["workers"])


def link_name(mbit: float | None) -> str:
    return f"{mbit:g} Mbit/s" if mbit else "loopback"


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _mean(xs):
    xs = [x for x in xs or [] if x is not None]
    return sum(xs) / len(xs) if xs else None


def _bytes(x) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def convergence_table(conv: dict) -> tuple[str, dict]:
    single = conv.get("single", {}).get("final_eval_loss")
    dp = conv.get("data-parallel", {}).get("final_eval_loss")
    rows = ["| run | inner steps per worker | final held-out loss | perplexity | / data-parallel | / single | "
            "replicas identical | wall |", "|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for name, e in conv.items():
        loss = e["final_eval_loss"]
        r_dp = loss / dp if loss is not None and dp else None
        r_single = loss / single if loss is not None and single else None
        if e["method"] == "diloco":
            ratios[name] = {"dp": r_dp, "single": r_single}
        same = {"diloco": "yes" if e.get("hashes_agree") else "NO"}.get(e["method"], "-")
        rows.append(f"| {label(e)} | {e['steps']} | {_f(loss, '{:.4f}')} | "
                    f"{_f(math.exp(loss) if loss is not None else None, '{:.2f}')} | {_f(r_dp)} | {_f(r_single)} | "
                    f"{same} | {e['wall_s'] / 60:.1f} min |")
    return "\n".join(rows), ratios


def communication_table(conv: dict) -> tuple[str, dict]:
    dp = conv.get("data-parallel")
    dp_wire = _mean(dp["wire_bytes_per_step"]) if dp else None
    dp_analytic = dp["analytic_bytes_per_step"] if dp else None
    rows = ["| run | analytic | sent by the communicator | on the wire (measured) | wire / analytic | "
            "reduction vs data-parallel (wire) | (analytic) |", "|---|---|---|---|---|---|---|"]
    factors = {}
    for name, e in conv.items():
        if e["method"] == "single":
            continue
        wire, payload, analytic = _mean(e["wire_bytes_per_step"]), _mean(e["payload_bytes_per_step"]), \
            e["analytic_bytes_per_step"]
        red = dp_wire / wire if dp_wire and wire else None
        red_a = dp_analytic / analytic if dp_analytic and analytic else None
        if e["method"] == "diloco":
            factors[name] = {"wire": red, "analytic": red_a}
        rows.append(f"| {label(e)} | {_bytes(analytic)} | {_bytes(payload) if payload else 'n/a (gloo)'} | "
                    f"{_bytes(wire)} | {_f(wire / analytic if wire and analytic else None, '{:.2f}')} | "
                    f"{_f(red, '{:.0f}x')} | {_f(red_a, '{:.0f}x')} |")
    return "\n".join(rows), factors


def utilisation_table(util: dict) -> tuple[str, dict]:
    rows = ["| run | link | steady-state utilisation (median of workers) | lowest worker | whole run | "
            "compute per round | outer step (sync) |", "|---|---|---|---|---|---|---|"]
    out = {}
    for name, e in util.items():
        link = f"{e['link_mbit']:g} Mbit/s (tbf, netns)" if e["link_mbit"] else "loopback"
        if e["method"] == "diloco":
            steady = [u for u in e["utilisation_steady"] or [] if u is not None]
            med = sorted(steady)[len(steady) // 2] if steady else None
            out[name] = med
            lowest = min(steady) if steady else None
            rows.append(f"| {label(e)} | {link} | {_f(med, '{:.1%}')} | {_f(lowest, '{:.1%}')} | "
                        f"{_f(_mean(e['utilisation_whole']), '{:.1%}')} | "
                        f"{_f(e['round_compute_s_median'], '{:.1f} s')} | {_f(e['sync_s_median'], '{:.2f} s')} |")
        else:
            whole = _mean(e["utilisation_whole"])
            out[name] = whole
            rows.append(f"| {label(e)} | {link} | {_f(whole, '{:.1%}')} (every step) | - | {_f(whole, '{:.1%}')} | "
                        f"- | {_f(e['comm_s_per_step'], '{:.2f} s')} per step |")
    return "\n".join(rows), out


def allreduce_table(util: dict) -> str:
    rows = ["| run | payload per worker per all-reduce | bandwidth-optimal | measured transfer | measured / optimal "
            "| whole outer step / optimal |", "|---|---|---|---|---|---|"]
    for e in util.values():
        if not e.get("optimal_s"):
            continue
        if e["method"] == "diloco":
            measured, whole = e["transfer_s_median"], e["sync_s_median"]
            sent = e["payload_bytes_per_round"]
        else:
            measured, whole, sent = e["comm_s_per_step"], None, e["analytic_bytes_per_step"]
        rows.append(f"| {label(e)} | {_bytes(sent)} | {e['optimal_s']:.2f} s | {_f(measured, '{:.2f} s')} | "
                    f"{_f(measured / e['optimal_s'] if measured else None, '{:.2f}x')} | "
                    f"{_f(whole / e['optimal_s'] if whole else None, '{:.2f}x')} |")
    return "\n".join(rows)


def plot_convergence(conv: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, e in enumerate(conv.values()):
        if e["eval_curve"]:
            steps, losses = zip(*e["eval_curve"])
            ax.plot(steps, losses, marker="o", ms=2.5, lw=1.3, color=f"C{i}", label=label(e))
    ax.set_xlabel("inner steps per worker")
    ax.set_ylabel("held-out loss")
    ax.set_title("Held-out loss, same inner-step budget per worker")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_utilisation(util: dict, values: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in util if values.get(n) is not None]
    fig, ax = plt.subplots(figsize=(8, 3.8), dpi=120)
    bars = ax.barh([f"{label(util[n])}\n{link_name(util[n]['link_mbit'])}" for n in names],
                   [100 * values[n] for n in names],
                   color=["C2" if util[n]["method"] == "diloco" else "C3" for n in names])
    ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    ax.set_xlim(0, 110)
    ax.set_xlabel("compute utilisation (% of wall time)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def render(results: dict, img_prefix: str) -> tuple[str, dict]:
    """The generated markdown, and the headline figures (for the closing note and the console)."""
    plan, conv, util = results["plan"], results["convergence"], results["utilisation"]
    conv_md, ratios = convergence_table(conv)
    comm_md, factors = communication_table(conv)
    util_md, util_values = utilisation_table(util)
    m = results["machine"]
    lines = [
        BEGIN,
        f"Plan **{plan['name']}**: `{results['command']}` ran {results['minutes']:.0f} minutes on {m['cores']} "
        f"cores ({m['cpu']}), torch {m['torch']}, hivemind {m['hivemind']}, Python {m['python']}, kernel "
        f"{m['kernel']}; {'one network namespace per host' if results['netns'] else 'loopback only'}. "
        f"Model: {results['parameters'] / 1e6:.2f}M-parameter Llama from `{plan['config']}`"
        f"{' with ' + ' '.join(plan['model']) if plan['model'] else ''}; every worker runs with 1 torch thread "
        "(the single worker with all cores).",
        "",
        "### Convergence",
        "",
        f"Each worker takes {plan['steps']} inner steps of batch {plan['batch']}; the data-parallel run has "
        f"{plan['workers']}x that batch per step. Held-out loss on the same {plan['eval_batches']} batches for all.",
        "",
        conv_md,
        "",
        f"![held-out loss]({img_prefix}convergence.png)",
        "",
        "### Communication per inner step (bytes each worker sends)",
        "",
        "Analytic: `2(n-1)/n x values x bytes per value / H` (fp16 pseudo-gradients every H steps; "
        "fp32 gradients every step for data-parallel). On the wire: transmitted bytes of the worker's "
        "network interface over the whole run (TCP/IP headers, encryption, DHT traffic, joining "
        "included), divided by its inner steps.",
        "",
        comm_md,
        "",
        "### Compute utilisation",
        "",
        f"Batch {plan['util_batch']} per worker (shorter steps than above, so communication weighs more). "
        "Steady state: from the end of the first outer step to the end of the last, the time in inner "
        "steps over wall time. Whole run: from the first step, start-up included.",
        "",
        util_md,
        "",
        f"![compute utilisation]({img_prefix}utilisation.png)",
        "",
        "### All-reduce efficiency on the shaped link",
        "",
        "Bandwidth-optimal time: `2(n-1)/n x bytes / link rate`. Measured transfer: the reduce-scatter "
        "and all-gather of the FP16 pseudo-gradient (median over rounds and workers); the whole outer step adds "
        "matchmaking through the DHT, waiting for the slowest worker, digest verification and the outer update. "
        "gloo's fp32 gradient all-reduce on the same links is the baseline.",
        "",
        allreduce_table(util),
        END,
    ]
    headline = {"loss_ratio": ratios, "comm_reduction": factors, "utilisation": util_values}
    return "\n".join(lines) + "\n", headline


def write_report(results: dict, report: Path) -> dict:
    report = Path(report)
    img = report.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    prefix = f"bench_{results['plan']['name']}_"
    plot_convergence(results["convergence"], img / f"{prefix}convergence.png")
    section, headline = render(results, f"img/{prefix}")
    plot_utilisation(results["utilisation"], headline["utilisation"], img / f"{prefix}utilisation.png")
    text = report.read_text() if report.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) + 1:]
    else:
        text = (text.rstrip() + "\n\n" if text else "") + section
    tmp = report.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(report)
    return headline
