"""Optional metric outputs besides ``metrics.jsonl``: Weights & Biases, TensorBoard and Prometheus.

Each sink receives the same records as ``metrics.jsonl`` and logs their numbers as scalars at the
record's inner step, under ``train/``, ``eval/``, ``swarm/`` (one point per outer step: group
size, sync time, utilisation of the round, bytes sent, contributed and dropped steps),
``checkpoint/`` and ``run/``. Prometheus (``prometheus.py``) takes the records themselves, to add
them up into counters. A sink that fails is logged once and turned off: metrics never
stop training.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..extras import install_hint

log = logging.getLogger(__name__)

SINKS = ("wandb", "tensorboard")

_FIELDS = {
    "train": {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
              "grad_norm": "train/grad_norm"},
    "eval": {"eval_loss": "eval/loss", "perplexity": "eval/perplexity"},
    "outer_step": {"loss": "swarm/round_loss", "group_size": "swarm/group_size", "sync_s": "swarm/sync_s",
                   "allreduce_s": "swarm/allreduce_s", "transfer_s": "swarm/transfer_s",
                   "bytes_sent": "swarm/bytes_sent", "round_compute_s": "swarm/round_compute_s",
                   "contributed_steps": "swarm/contributed_steps", "dropped_steps": "swarm/dropped_steps",
                   "outer_step": "swarm/outer_step", "ok": "swarm/ok"},
    "checkpoint": {"blocked_s": "checkpoint/blocked_s"},
    "end": {"utilisation": "run/utilisation", "tokens_per_s": "run/tokens_per_s"},
}


def scalars(record: dict) -> tuple[int | None, dict[str, float]]:
    """The record's inner step and its numbers under their sink names (None values left out)."""
    names = _FIELDS.get(record.get("event"), {})
    out = {}
    for field, name in names.items():
        value = record.get(field)
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)):
            out[name] = float(value)
    if record.get("event") == "outer_step":
        compute, sync = record.get("round_compute_s"), record.get("sync_s")
        if isinstance(compute, (int, float)) and isinstance(sync, (int, float)) and compute + sync > 0:
            out["swarm/utilisation"] = compute / (compute + sync)
    step = record.get("inner_step")
    return (step if isinstance(step, int) else None), out


class Sink:
    name = "sink"

    def write(self, record: dict) -> None:
        """One record of metrics.jsonl; by default its numbers go to ``log`` (if it has any)."""
        step, values = scalars(record)
        if values:
            self.log(step, values)

    def log(self, step: int | None, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, run_dir: Path, *, project: str, run_name: str, mode: str, config: dict):
        import wandb

        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode, config=config,
                               settings=wandb.Settings(silent=True, console="off"))
        # The inner step is a field, not W&B's own step: that one must only grow, and a worker that
        # adopts a peer's state may go back a few steps.
        self._run.define_metric("inner_step")
        self._run.define_metric("*", step_metric="inner_step")

    def log(self, step, values):
        self._run.log({**values, "inner_step": step} if step is not None else values)

    def close(self):
        self._run.finish()


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step, values):
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self):
        self._writer.close()


def missing_package(names) -> str | None:
    """A one-line error if a requested sink's package is not installed, else None."""
    import importlib.util

    packages = {"wandb": "wandb", "tensorboard": "tensorboard"}
    for name in names:
        if importlib.util.find_spec(packages[name]) is None:
            return f"run.log_to includes {name!r}, but {packages[name]} is not installed: " \
                   f"install the extra {name!r} ({install_hint(name)})"
    return None


class SinkSet:
    """Forwards records to the sinks; a sink that raises is turned off after one warning."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def __call__(self, record: dict) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as e:
                log.warning("metrics to %s failed, turned off: %s: %s", sink.name, type(e).__name__, e)
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                log.warning("closing %s failed: %s: %s", sink.name, type(e).__name__, e)
        self.sinks = []


def make_sinks(cfg, run_dir: Path, started: tuple[Sink, ...] | list[Sink] = ()) -> SinkSet | None:
    """The sinks ``cfg.run.log_to`` asks for (one that cannot start is logged and left out), after
    ``started`` (sinks the trainer started itself, such as the Prometheus exporter)."""
    if not cfg.run.log_to and not started:
        return None
    sinks: list[Sink] = list(started)
    for name in dict.fromkeys(cfg.run.log_to):
        try:
            if name == "wandb":
                sinks.append(WandbSink(run_dir, project=cfg.run.wandb_project, mode=cfg.run.wandb_mode,
                                       run_name=f"{cfg.run.name or cfg.swarm.run_id}/{cfg.worker}",
                                       config=cfg.model_dump()))
            else:
                sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        except Exception as e:
            log.warning("metrics to %s could not start, left out: %s: %s", name, type(e).__name__, e)
    return SinkSet(sinks)
