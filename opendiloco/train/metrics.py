"""Per-worker ``metrics.jsonl``: one JSON object per line, appended and flushed as it happens."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path


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
