"""The benchmark's baselines: data-parallel over gloo is one model trained on N workers' data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.network import free_port
from opendiloco.testing.proctree import ProcessGroup
from opendiloco.train.metrics import read_metrics
from tests.test_train_loop import SMALL

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _run(tmp_path: Path, name: str, world: int, steps: int = 6) -> list[dict]:
    master = f"127.0.0.1:{free_port()}"
    group = ProcessGroup(tmp_path / name / "logs", cwd=ROOT)
    try:
        procs = [group.spawn([sys.executable, "-m", "benchmarks.baseline", "--world-size", str(world),
                              "--rank", str(rank), "--master", master, "--timeout", "60", *SMALL,
                              "--run.worker", f"worker-{rank}", "--run.dir", str(tmp_path / name / f"worker-{rank}"),
                              "--train.total-steps", str(steps), "--train.eval-every", "3"], f"worker-{rank}")
                 for rank in range(world)]
        group.wait(procs, timeout=150)
    finally:
        leaked = group.stop()
    assert not leaked, f"processes left behind: {leaked}"
    return [read_metrics(tmp_path / name / f"worker-{r}" / "metrics.jsonl") for r in range(world)]


def test_data_parallel_replicas_stay_identical_and_differ_from_one_worker(tmp_path):
    dp = _run(tmp_path, "dp", 2)
    single = _run(tmp_path, "single", 1)
    ends = [[r for r in recs if r["event"] == "end"][0] for recs in dp + single]
    # Both ranks applied the same averaged gradients to the same initial weights.
    assert ends[0]["params_hash"] == ends[1]["params_hash"]
    # ...which are not rank 0's own gradients: averaging with rank 1's data changed the result.
    assert ends[0]["params_hash"] != ends[2]["params_hash"]
    assert ends[0]["comm_s"] > 0 and ends[2]["comm_s"] == 0
    assert ends[0]["bucket_bytes"] > 0
    evals = [r["inner_step"] for r in dp[0] if r["event"] == "eval"]
    assert evals == [3, 6] and ends[0]["eval_loss"] is not None
    assert not [r for r in dp[1] if r["event"] == "eval"], "only rank 0 evaluates"
