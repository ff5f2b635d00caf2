"""Figures computed from the runs' ``metrics.jsonl`` records, and the analytic values they are held to."""

from __future__ import annotations

import statistics


def ring_allreduce_bytes(payload_bytes: float, n: int) -> float:
    """Bytes each of ``n`` peers sends in a bandwidth-optimal all-reduce of ``payload_bytes``."""
    return 2 * (n - 1) / n * payload_bytes if n > 1 else 0.0


def bandwidth_optimal_s(payload_bytes: float, n: int, mbit: float) -> float:
    """The all-reduce lower bound ``2(n-1)/n * bytes / link_rate`` for links of ``mbit`` Mbit/s."""
    return ring_allreduce_bytes(payload_bytes, n) * 8 / (mbit * 1e6)


def analytic_bytes_per_step(params: int, n: int, *, bytes_per_value: int, every: int) -> float:
    """Bytes one worker sends per inner step when it all-reduces ``params`` values every ``every`` steps."""
    return ring_allreduce_bytes(params * bytes_per_value, n) / every


def events(records: list[dict], event: str) -> list[dict]:
    return [r for r in records if r.get("event") == event]


def final_eval_loss(records: list[dict]) -> float | None:
    ends = events(records, "end")
    if ends and ends[-1].get("eval_loss") is not None:
        return ends[-1]["eval_loss"]
    evals = events(records, "eval")
    return evals[-1]["eval_loss"] if evals else None


def eval_curve(records: list[dict]) -> list[tuple[int, float]]:
    """(inner step, held-out loss) of every eval, in order; a repeated step keeps the last value."""
    points = {r["inner_step"]: r["eval_loss"] for r in events(records, "eval") if r.get("eval_loss") is not None}
    return sorted(points.items())


def rounds(records: list[dict]) -> list[dict]:
    """The outer steps a worker completed (``ok``), in order."""
    return [r for r in events(records, "outer_step") if r.get("ok")]


def steady_utilisation(records: list[dict]) -> float | None:
    """Compute time / wall time over the rounds after the first (start-up skew left out).

    Round k's window runs from the end of outer step k-1 to the end of outer step k: H inner
    steps, then matchmaking, waiting for peers, the transfer and the outer update.
    """
    done = rounds(records)
    if len(done) < 2:
        return None
    wall = done[-1]["time"] - done[0]["time"]
    compute = sum(r["round_compute_s"] for r in done[1:])
    return compute / wall if wall > 0 else None


def whole_run_utilisation(records: list[dict]) -> float | None:
    ends = events(records, "end")
    return ends[-1].get("utilisation") if ends else None


def median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
