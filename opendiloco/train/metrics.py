"""Per-worker ``metrics.jsonl``: one JSON object per line, appended and flushed as it happens; and the
``Tally`` of a run, the running numbers its records are made of."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from opendiloco.optimizer import SyncReport


class MetricsWriter:
    def __init__(self, path: Path, forward: Callable[[dict], None] | None = None):
        """``forward``: also called with every record (e.g. the W&B / TensorBoard sinks)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self.forward = forward

    def write(self, event: str, **fields) -> None:
        record = {"event": event, "time": time.time(), **{k: _clean(v) for k, v in fields.items()}}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self.forward is not None:
            self.forward(record)

    def close(self) -> None:
        self._f.close()
        close = getattr(self.forward, "close", None)
        if close is not None:
            close()


def _clean(v):
    """JSON has no NaN/Inf: write null instead of an invalid file."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (a killed writer) is skipped."""
    records = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


@dataclass
class Tally:
    """Running numbers of one ``Trainer.run``: throughput, losses to average, what was last evaluated.

    An inner step's loss stays on the device where it was computed (``add_loss``) until the loop
    needs it on the host: ``read_losses`` brings every step's loss since the last read (and the last
    step's gradient norm) in one transfer, the one wait for the device of a log interval. The values
    are those ``float`` gives one by one, summed over micro-batches in the same order.
    """

    tokens_per_step: int
    global_hash: str
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)
    step_s: float = 0.0
    """Moving average of the seconds one inner step takes (outer steps left out)."""
    compute_s: float = 0.0
    """Seconds spent in inner steps (forward, backward, inner optimizer), outer steps left out."""
    sync_s: float = 0.0
    """Seconds spent in outer steps (averaging with peers, waiting for them, applying)."""
    round_compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    """The loss of every inner step read so far, in order."""
    round_losses: list[float] = field(default_factory=list)
    log_losses: list[float] = field(default_factory=list)
    grad_norm: float | None = None
    """The gradient norm of the last step read (None without clipping)."""
    log_start: float = field(default_factory=time.perf_counter)
    log_tokens: int = 0
    last_report: float = float("-inf")
    eval_loss: float | None = None
    eval_step: int | None = None
    unread: list[torch.Tensor] = field(default_factory=list)
    """Per inner step not read yet: its micro-batches' losses, on the device."""
    unread_norm: torch.Tensor | None = None

    def add(self, seconds: float, sync_s: float = 0.0) -> None:
        """One inner step that took ``seconds`` in all, ``sync_s`` of them in an outer step."""
        compute = max(0.0, seconds - sync_s)
        self.steps += 1
        self.log_tokens += self.tokens_per_step
        self.compute_s += compute
        self.round_compute_s += compute
        self.sync_s += sync_s
        self.step_s = compute if self.steps == 1 else 0.9 * self.step_s + 0.1 * compute

    def add_loss(self, micro_losses: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """One inner step's losses (one per micro-batch, a 1-D tensor) and gradient norm, left on the device."""
        self.unread.append(micro_losses)
        self.unread_norm = grad_norm

    def read_losses(self) -> list[float]:
        """The losses of the steps added since the last read, one per step, brought to the host in one
        transfer with the last step's gradient norm (``grad_norm``)."""
        if not self.unread:
            return []
        norm = [] if self.unread_norm is None else [self.unread_norm.reshape(1)]
        values = torch.cat([*self.unread, *norm]).tolist()
        self.grad_norm = values.pop() if norm else None
        losses, at = [], 0
        for micro in self.unread:
            losses.append(sum(values[at:at + micro.numel()]))
            at += micro.numel()
        self.unread, self.unread_norm = [], None
        return losses

    def record_losses(self, losses: list[float]) -> None:
        """Steps' losses read (``read_losses``), or agreed among the worker's processes, in step order."""
        self.losses += losses
        self.round_losses += losses
        self.log_losses += losses

    def take_log_interval(self) -> tuple[float, float]:
        """The mean loss and the tokens per second of the log interval that ends now; the next one begins."""
        now = time.perf_counter()
        figures = sum(self.log_losses) / len(self.log_losses), self.log_tokens / (now - self.log_start)
        self.log_losses, self.log_start, self.log_tokens = [], now, 0
        return figures

    @property
    def last_loss(self) -> float | None:
        """The loss of the last step read, None before the first read."""
        return self.losses[-1] if self.losses else None

    def tokens_per_s(self) -> float:
        return self.tokens_per_step * self.steps / max(1e-9, time.perf_counter() - self.start)


def outer_step_fields(report: SyncReport, tally: Tally, *, eval_loss: float | None) -> dict:
    """What an ``outer_step`` record tells of a round (``report``) and of the inner steps since the last
    one (``tally``), after its outer and inner step."""
    extra = report.extra
    return dict(loss=sum(tally.round_losses) / len(tally.round_losses), eval_loss=eval_loss, ok=report.ok,
                group_size=report.group_size, peers=list(report.peers), allreduce_s=report.allreduce_s,
                sync_s=report.seconds, transfer_s=extra.get("transfer_s"), matchmaking_s=extra.get("matchmaking_s"),
                bytes_sent=extra.get("bytes_sent"), bytes_received=extra.get("bytes_received"),
                round_compute_s=tally.round_compute_s, global_hash=report.global_hash, reason=report.reason,
                steps=report.steps, contributed_steps=report.contributed_steps, dropped_steps=report.dropped_steps,
                weight=report.weight, fragment=report.fragment, clipped=extra.get("clipped"),
                capped=extra.get("capped"), held=bool(extra.get("held")))
