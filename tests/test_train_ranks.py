"""A worker that is a torchrun job (gloo on CPU): its checkpoint is the worker's, written once, and
loads on another number of processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco.train.ranks import RanksError, WorkerRanks
from opendiloco.train.trainer import train
from tests.test_train_loop import SMALL, small_config

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ["--train.eval-every", "0", "--train.grad-accum", "2"]  # DDP syncs once per inner step (no_sync)


def _train(run_dir: Path, nproc: int, *extra: str) -> None:
    if nproc == 1:  # one process: the same trainer, in this one (a fresh interpreter costs seconds of CPU)
        train(small_config(run_dir, *EXTRA, *[e for e in extra if e != "--resume"]), resume="--resume" in extra)
        return
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    args = [*head, "-m", "opendiloco", "train", *SMALL, "--run.dir", str(run_dir), *EXTRA, *extra]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_of_a_worker_resumes_on_another_number_of_processes(tmp_path):
    # The reference: one process throughout, in this one.
    reference = tmp_path / "reference"
    train(small_config(reference, *EXTRA, "--train.total-steps", "8"))
    expected = train(small_config(reference, *EXTRA, "--train.total-steps", "16"), resume=True).eval_loss
    runs = {"2then1": (2, 1), "1then2": (1, 2)}
    for name, (first, second) in runs.items():
        run_dir = tmp_path / name
        _train(run_dir, first, "--train.total-steps", "8")
        saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        # The worker's checkpoints, by rank 0: one file per step saved, no per-rank copies.
        steps = {r["inner_step"] for r in _records(run_dir, "checkpoint")}
        assert saved == ["latest", *(f"step-{s:09d}.pt" for s in sorted(steps))], saved
        _train(run_dir, second, "--train.total-steps", "16", "--resume")
        start = _records(run_dir, "start")[-1]
        assert start["resumed"] and start["inner_step"] == 8, start
    final = {name: _records(tmp_path / name, "end")[-1]["eval_loss"] for name in runs}
    for name in runs:
        assert math.isclose(final[name], expected, rel_tol=1e-4), (final, expected)


def test_torchrun_environment_is_checked():
    ranks = WorkerRanks.from_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert ranks.multi and not ranks.leader and ranks.rows(8) == 4
    with pytest.raises(RanksError, match="divide evenly"):
        ranks.rows(5)
    with pytest.raises(RanksError, match="invalid ranks"):
        WorkerRanks.from_env({"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(RanksError, match="not numeric"):
        WorkerRanks.from_env({"WORLD_SIZE": "two"})
    assert not WorkerRanks.from_env({}).multi


@pytest.mark.slow
def test_an_uneven_batch_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "-m", "opendiloco", "train", *SMALL, "--run.dir", str(tmp_path / "r")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "error: train.batch_size 4 is the worker's batch; it must divide evenly over its 3 processes" \
        in proc.stderr
    assert "]: Traceback" not in proc.stderr  # torchrun's own report of the failed job follows, not ours
