"""The reference training loop end to end, on a model small enough for a 2-core CI machine."""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from opendiloco import InProcessGroup, SingleWorker
from opendiloco.cli import main
from opendiloco.train import startup
from opendiloco.train.config import config_fingerprint, load_config
from opendiloco.train.data import PackedStream
from opendiloco.train.metrics import read_metrics
from opendiloco.train.startup import make_communicator
from opendiloco.train.trainer import Trainer, TrainError, lr_lambda, train

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--model.hidden-size", "32", "--model.num-layers", "2", "--model.num-heads", "4", "--model.intermediate-size", "64",
    "--data.seq-len", "32", "--train.batch-size", "4", "--train.eval-batches", "2", "--train.threads", "1",
    "--optim.local-steps", "4", "--optim.warmup-steps", "2", "--optim.lr", "3e-3", "--run.progress", "false",
    "--run.log-every", "2", "--run.worker", "w", "--swarm.compression", "fp16",
]


def small_config(run_dir, *extra):
    return load_config(None, [*SMALL, "--run.dir", str(run_dir), *extra])


def assert_resumes_bit_exactly(config, tmp_path: Path, stop_after: int):
    """Trains ``config(run_dir)`` in one go (in ``tmp_path / "whole"``), and stopped after ``stop_after`` inner
    steps then resumed (in ``tmp_path / "split"``): the two give the same losses, step by step, and the same
    last eval loss, bit for bit. Returns the three runs' results (whole, first, second)."""
    whole = train(config(tmp_path / "whole"))
    cfg = config(tmp_path / "split")
    first = train(cfg, stop_after=stop_after)
    second = train(cfg, resume=True)
    assert first.losses + second.losses == whole.losses  # exact float equality, step by step
    assert second.eval_loss == whole.eval_loss
    return whole, first, second


# int4: error feedback on, its residual resumed; subset8+int4: a shared-seed eighth of the values a round
@pytest.mark.parametrize("compression", ["fp16", "int4", "subset8+int4"])
def test_resume_is_bit_exact(tmp_path, compression):
    wire = ["--swarm.compression", compression]
    whole = train(small_config(tmp_path / "whole", "--train.total-steps", "12", *wire))
    assert len(whole.losses) == 12 and whole.outer_steps == 3

    cfg = small_config(tmp_path / "split", "--train.total-steps", "12", *wire)
    first = train(cfg, stop_after=6)  # stops mid local round (local_steps 4)
    assert first.stopped and first.inner_steps == 6
    with pytest.raises(TrainError, match="--resume"):
        train(cfg)  # a fresh start would silently overwrite the run
    other_h = small_config(tmp_path / "split", "--train.total-steps", "12", "--optim.local-steps", "3", *wire)
    with pytest.raises(TrainError, match=r"does not fit this config .*local_steps 4 \(this optimizer: 3\)"):
        train(other_h, resume=True)  # its counters and round only mean something under the same H
    second = train(cfg, resume=True)
    assert second.inner_steps == 12 and not second.stopped
    assert first.losses + second.losses == whole.losses  # exact float equality, step by step
    assert second.eval_loss == whole.eval_loss

    hashes = [[r["global_hash"] for r in read_metrics(d / "metrics.jsonl") if r["event"] == "outer_step"]
              for d in (tmp_path / "whole", tmp_path / "split")]
    assert hashes[0] == hashes[1]


def test_a_checkpoint_written_in_the_background_resumes_bit_exactly_and_stores_weights_once(tmp_path):
    import torch

    momentum = ["--optim.solo-outer-momentum", "0.9"]  # an outer momentum buffer in the checkpoint
    whole = train(small_config(tmp_path / "whole", "--train.total-steps", "12", *momentum))
    cfg = small_config(tmp_path / "split", "--train.total-steps", "12", *momentum)
    train(cfg, stop_after=6)  # step 4: an outer step, written in the background; step 6: the final one
    records = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["event"] == "checkpoint"]
    assert [(r["inner_step"], r["background"]) for r in records] == [(4, True), (6, False)]
    ckpt_dir = tmp_path / "split" / "checkpoints"
    background = ckpt_dir / "step-000000004.pt"
    state = torch.load(background, weights_only=True)
    # θ_global equals θ_local right after an outer step: stored once, as the model's weights
    glob = state["optimizer"]["outer"]["global_params"]
    assert state["global_params_from_model"] == list(range(len(glob))) and all(g is None for g in glob)
    params = sum(t.numel() for t in state["model"].values())

    def tensor_bytes(obj):
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(tensor_bytes(v) for v in obj.values())
        return sum(tensor_bytes(v) for v in obj) if isinstance(obj, (list, tuple)) else 0

    # weights, two AdamW moments, outer momentum: 16 bytes per parameter (and the RNG and step counters)
    assert 16 * params <= tensor_bytes(state) < 16 * params + 8192
    (ckpt_dir / "step-000000006.pt").unlink()
    (ckpt_dir / "latest").unlink()  # resume from the background checkpoint
    second = train(cfg, resume=True)
    assert second.losses == whole.losses[4:]
    assert second.eval_loss == whole.eval_loss


def test_streaming_resume_is_bit_exact_and_records_each_fragment(tmp_path):
    # 2 fragments, each round lands 1 step after it starts; the cut (step 7) is mid flight: the
    # round of fragment 1 started at step 6... (H=4: events at 2, 4, 6, 8, ... land at 3, 5, 7, 9).
    stream = ["--optim.fragments", "2", "--optim.overlap", "1", "--optim.mix", "0.5", "--train.total-steps", "13"]
    whole = train(small_config(tmp_path / "whole", *stream))
    assert whole.outer_steps == 6
    cfg = small_config(tmp_path / "split", *stream)
    first = train(cfg, stop_after=6)
    second = train(cfg, resume=True)
    assert first.losses + second.losses == whole.losses
    records = [[r for r in read_metrics(d / "metrics.jsonl") if r["event"] == "outer_step"]
               for d in (tmp_path / "whole", tmp_path / "split")]
    assert [r["global_hash"] for r in records[0]] == [r["global_hash"] for r in records[1]]
    assert [(r["inner_step"], r["fragment"]) for r in records[0]] == [(3, 0), (5, 1), (7, 0), (9, 1), (11, 0),
                                                                       (13, 1)]


def test_a_run_ending_with_a_round_in_flight_applies_it_before_its_last_eval(tmp_path):
    # Events start at 2, 4, ..., 12 and land one step later: the last one is still in flight at step 12.
    result = train(small_config(tmp_path, "--optim.fragments", "2", "--optim.overlap", "1",
                                "--train.total-steps", "12"))
    assert result.inner_steps == 12 and result.outer_steps == 6
    records = read_metrics(tmp_path / "metrics.jsonl")
    last = [r for r in records if r["event"] == "outer_step"][-1]
    assert last["outer_step"] == 6 and last["inner_step"] == 12 and last["ok"]
    evals = [r for r in records if r["event"] == "eval"]
    assert evals[-1]["outer_step"] == 6  # evaluated after the last round landed
    assert [r["outer_step"] for r in evals] == [2, 4, 6]  # after every whole-model sync, not every fragment


def test_loss_goes_down_and_metrics_are_written(tmp_path):
    result = train(small_config(tmp_path, "--train.total-steps", "24", "--optim.lr", "5e-3"))
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.8, (first, last)

    records = read_metrics(tmp_path / "metrics.jsonl")
    events = [r["event"] for r in records]
    assert events[0] == "start" and events[-1] == "end"
    outer = [r for r in records if r["event"] == "outer_step"]
    assert [r["outer_step"] for r in outer] == [1, 2, 3, 4, 5, 6]
    for r in outer:
        for key in ("outer_step", "inner_step", "loss", "eval_loss", "group_size", "allreduce_s", "global_hash",
                    "time"):
            assert key in r, key
        assert r["group_size"] == 1 and r["ok"] and len(r["global_hash"]) == 16
    assert outer[-1]["eval_loss"] < outer[0]["eval_loss"]
    evals = [r for r in records if r["event"] == "eval"]
    assert evals and all(r["perplexity"] > 1 for r in evals)
    assert [r["inner_step"] for r in records if r["event"] == "train"] == list(range(2, 25, 2))
    assert (tmp_path / "config.toml").is_file()
    assert result.eval_loss == outer[-1]["eval_loss"]


def test_plot_writes_png(tmp_path, capsys):
    for name in ("a", "b"):
        train(small_config(tmp_path / name, "--train.total-steps", "8", "--run.worker", name))
    out = tmp_path / "plots" / "loss.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert main(["plot", str(tmp_path / "missing"), "--out", str(out)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_lambda(s, warmup=10, total=100, min_ratio=0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[100] == pytest.approx(0.1)


def _wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_cli_train_subprocess_stops_cleanly_on_sigint_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "opendiloco.cli", "train", *SMALL, "--run.dir", str(run_dir),
           "--train.total-steps", "100000", "--checkpoint.every-outer-steps", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        started = _wait_for(lambda: metrics.is_file() and '"event": "train"' in metrics.read_text(), 90)
        assert started, proc.stderr.read() if proc.poll() is not None else "no training progress in 90 s"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "continue with --resume" in err
    end = json.loads(metrics.read_text().splitlines()[-1])
    assert end["event"] == "end" and end["stopped"] is True
    stopped_at = end["inner_step"]
    assert (run_dir / "checkpoints" / "latest").is_file()

    cfg = load_config(None, [*SMALL, "--run.dir", str(run_dir), "--train.total-steps", str(stopped_at + 2)])
    resumed = train(cfg, resume=True)
    assert resumed.inner_steps == stopped_at + 2 and len(resumed.losses) == 2


class _ServesState(SingleWorker):
    """A group of one whose 'live peer' hands out a fixed state, as a swarm would to a joiner."""

    def __init__(self, state):
        super().__init__(compression="fp16")
        self.state = state
        self.progress = []

    def download_state(self, timeout, **bounds):
        return self.state

    def report_progress(self, **fields):
        self.progress.append(fields)


def test_joiner_adopts_peer_state_schedule_and_data_position(tmp_path, monkeypatch):
    # Both alone (a SingleWorker), with a swarm's outer step: a momentum buffer in the state, and far
    # enough in 8 steps that starting from it shows.
    outer = ["--optim.solo-outer-lr", "0.4", "--optim.solo-outer-momentum", "0.9"]
    peer = Trainer(small_config(tmp_path / "peer", "--train.total-steps", "8", *outer))
    peer_result = peer.run()
    comm = _ServesState(peer.opt.shareable_state())
    monkeypatch.setattr(startup, "make_communicator", lambda cfg, run_dir: comm)

    joiner = Trainer(small_config(tmp_path / "joiner", "--train.total-steps", "12", "--run.worker", "late", *outer))
    result = joiner.run()
    assert result.inner_steps == 12 and len(result.losses) == 4 and result.outer_steps == 3
    assert result.losses[0] < peer_result.losses[0] - 0.5  # starts from the trained θ_global, not from scratch
    assert joiner.scheduler.last_epoch == 12
    expected = PackedStream(joiner.stream.corpus, joiner.tokenizer, 32, lanes=4)
    expected.skip(12 * 4)  # 8 steps skipped on joining + 4 trained, 4 rows each
    assert joiner.stream.state_dict() == expected.state_dict()
    fields = comm.progress[-1]
    assert {"outer_step", "inner_step", "samples_per_s", "loss", "global_hash"} <= fields.keys()
    assert fields["global_hash"] == joiner.opt.global_hash()
    # The optimizer publishes its pace: work this round, rate, and when it expects its next round.
    paced = [f for f in comm.progress if "round_work" in f]
    assert paced and {"work_rate", "work_per_step", "ready", "ready_in", "contributed_steps"} <= paced[-1].keys()
    assert any(f["ready"] for f in paced)  # entering a round says so


def test_make_communicator_seam(tmp_path, monkeypatch):
    comm = make_communicator(load_config(None, ["--swarm.compression", "int8"]), tmp_path)
    assert isinstance(comm, SingleWorker) and comm.codec.name == "int8"

    calls = []
    fake = types.ModuleType("opendiloco.swarm.communicator")
    fake.SwarmCommunicator = types.SimpleNamespace(
        from_config=lambda swarm, run_dir, config_fingerprint: calls.append((swarm, run_dir, config_fingerprint)))
    monkeypatch.setitem(sys.modules, "opendiloco.swarm.communicator", fake)
    cfg = load_config(None, ["--swarm.enabled"])
    make_communicator(cfg, tmp_path)
    assert calls == [(cfg.swarm, tmp_path, config_fingerprint(cfg))]


def test_a_worker_without_a_swarm_takes_the_solo_outer_step(tmp_path):
    """Outer momentum tuned for averages overshoots one worker's own progress (one worker through DiLoCo
    lost 3-10% to plain AdamW at outer lr 0.4, momentum 0.9); alone, the trainer steps with [optim]
    solo_outer_lr and solo_outer_momentum. A group keeps the run's outer_lr and outer_momentum."""
    def outer(trainer):
        group = trainer.opt.outer.optimizer.param_groups[0]
        return group["lr"], group["momentum"], group["nesterov"]

    alone = Trainer(small_config(tmp_path / "alone"))
    alone.build(make_communicator(alone.cfg, alone.run_dir))
    assert outer(alone) == (0.5, 0.0, False)
    tuned = Trainer(small_config(tmp_path / "tuned", "--optim.solo-outer-lr", "0.7",
                                 "--optim.solo-outer-momentum", "0.5"))
    tuned.build(make_communicator(tuned.cfg, tuned.run_dir))
    assert outer(tuned) == (0.7, 0.5, True)

    group = InProcessGroup(2, compression="fp16")
    paired = [Trainer(small_config(tmp_path / f"paired{i}", "--run.worker", f"p{i}")) for i in range(2)]
    for t, member in zip(paired, group.members):
        t.build(member)
        assert outer(t) == (0.4, 0.9, True)
