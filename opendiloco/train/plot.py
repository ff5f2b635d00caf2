"""Loss curves of one or several workers, from their metrics.jsonl, to a PNG."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics


def load_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``train`` loss, ``eval`` loss and outer-step loss points of one run dir, by kind."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a worker's run dir?)")
    curves: dict[str, list[tuple[int, float]]] = {"train": [], "eval": [], "outer_step": []}
    key = {"train": "loss", "eval": "eval_loss", "outer_step": "loss"}
    for rec in read_metrics(path):
        kind = rec.get("event")
        if kind in curves and rec.get(key[kind]) is not None:
            curves[kind].append((int(rec["inner_step"]), float(rec[key[kind]])))
    return curves


def plot_runs(run_dirs: list[Path], out: Path, title: str | None = None) -> Path:
    from ..extras import require

    matplotlib = require("matplotlib", "plot", "opendiloco plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    for i, run_dir in enumerate(run_dirs):
        run_dir = Path(run_dir)
        curves = load_curves(run_dir)
        label = run_dir.name if len({Path(d).name for d in run_dirs}) == len(run_dirs) else str(run_dir)
        color = f"C{i % 10}"
        train = curves["train"] or curves["outer_step"]
        if train:
            ax.plot(*zip(*train), color=color, lw=1.2, label=f"{label} train")
        if curves["eval"]:
            ax.plot(*zip(*curves["eval"]), color=color, ls="--", marker="o", ms=3, label=f"{label} eval")
    ax.set_xlabel("inner step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "OpenDiLoCo loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
