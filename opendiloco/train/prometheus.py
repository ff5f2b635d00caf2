"""A worker's figures for Prometheus (``[run] metrics_port``): a sink fed by the records of ``metrics.jsonl``.

The worker serves them at ``http://<metrics_host>:<metrics_port>/metrics`` (127.0.0.1 unless the user
names another host). Every value comes from a record the worker also wrote to ``metrics.jsonl``:
gauges hold the last record's figure, ``*_total`` counters add up the records since the worker
started. Names follow Prometheus' conventions (base units, ``_seconds``, ``_bytes``, ``_total``,
``_ratio``); the list is in docs/observability.md.
"""

from __future__ import annotations

import logging

from .sinks import Sink

log = logging.getLogger(__name__)

PREFIX = "opendiloco_"
PHASES = ("waiting", "transfer", "apply")
"""A round's time as the training loop sees it: matchmaking (``waiting``), the exchange and its
verification (``transfer``), and the rest of the outer step here (``apply``: the pseudo-gradient, the
outer update, the hash)."""


GAUGES_FROM_RECORDS = (
    ("inner_step", "inner steps taken (the last record's)", None, "inner_step"),
    ("outer_step", "outer steps applied (the last record's)", None, "outer_step"),
    ("train_loss", "mean training loss since the previous train record", {"train"}, "loss"),
    ("learning_rate", "the inner optimizer's learning rate", {"train"}, "lr"),
    ("grad_norm", "gradient norm at the last train record", {"train"}, "grad_norm"),
    ("tokens_per_second", "training tokens per second since the previous train record", {"train"}, "tokens_per_s"),
    ("eval_loss", "loss on the held-out batches at the last evaluation", {"eval", "outer_step", "end"}, "eval_loss"),
    ("round_loss", "mean training loss of the last round's inner steps", {"outer_step"}, "loss"),
    ("group_size", "members of the last round (this worker included)", {"outer_step"}, "group_size"),
    ("last_checkpoint_blocked_seconds", "seconds the last checkpoint held up training", {"checkpoint"}, "blocked_s"),
)
"""(name, help, the events whose records set it (None: every record), the record's field): gauges that
hold the figure of the last record that tells it."""

COUNTERS_FROM_RECORDS = (
    ("compute_seconds", "seconds spent in inner steps of finished rounds", "outer_step", "round_compute_s"),
    ("sent_bytes", "bytes of pseudo-gradients and averages sent in rounds", "outer_step", "bytes_sent"),
    ("received_bytes", "bytes of pseudo-gradients and averages received in rounds", "outer_step", "bytes_received"),
    ("contributed_steps", "inner steps whose work entered an average", "outer_step", "contributed_steps"),
    ("dropped_steps", "inner steps whose work was thrown away", "outer_step", "dropped_steps"),
    ("checkpoint_blocked_seconds", "seconds checkpoints held up training", "checkpoint", "blocked_s"),
)
"""(name without ``_total``, help, the event whose records feed it, the record's field): counters that add
up the field's positive figures."""


def _number(record: dict, name: str) -> float | None:
    """A record's figure, or None where it is missing or not a number."""
    v = record.get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def round_phases(record: dict) -> dict[str, float]:
    """Seconds of each phase of an ``outer_step`` record (phases it does not tell are left out)."""
    out = {}
    waiting, transfer = _number(record, "matchmaking_s"), _number(record, "transfer_s")
    inside, whole = _number(record, "allreduce_s"), _number(record, "sync_s")
    if waiting is not None:
        out["waiting"] = waiting
    if transfer is not None:
        out["transfer"] = transfer
    if inside is not None and whole is not None:
        out["apply"] = max(0.0, whole - inside)
    return out


class PrometheusSink(Sink):
    """Serves the figures over HTTP from a thread of its own; ``port`` 0 takes any free port (``self.port``)."""

    name = "prometheus"

    def __init__(self, port: int, host: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server
        from prometheus_client.process_collector import ProcessCollector

        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

        def gauge(name, doc, labels=()):
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels, registry=r)

        self._gauges = [(events, field, gauge(name, doc)) for name, doc, events, field in GAUGES_FROM_RECORDS]
        self._counters = [(event, field, counter(name, doc)) for name, doc, event, field in COUNTERS_FROM_RECORDS]
        self.worker = Info(PREFIX + "worker", "this worker: its name and peer id", registry=r)
        self.global_hash = Info(PREFIX + "global", "the hash of θ_global after the last outer step", registry=r)
        self.peers_seen = gauge("peers_seen", "distinct other workers this worker has averaged with since it started")
        self.last_round = gauge("last_round_seconds", "seconds of the last outer step, by phase", ["phase"])
        self.round_time = counter("round_seconds", "seconds spent in outer steps, by phase", ["phase"])
        self.utilisation = gauge("round_utilisation_ratio", "compute / (compute + outer step) of the last round")
        self.rounds = counter("rounds", "outer steps, by result (ok: averaged; failed: not averaged)", ["result"])
        self.held = counter("held_rounds", "failed rounds whose group lacked most of the workers this one last "
                                           "averaged with (the run may be split): its work kept for the next one")
        self.checkpoints = counter("checkpoints", "checkpoints written")
        for result in ("ok", "failed"):  # present from the start, so that rate() sees the first increase
            self.rounds.labels(result)
        for phase in PHASES:
            self.round_time.labels(phase)
        self._peers: set[str] = set()
        self._me = ""
        self._server, self._thread = start_http_server(port, addr=host, registry=r)
        self.host, self.port = host, self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def write(self, record: dict) -> None:
        event = record.get("event")
        for events, field, gauge in self._gauges:
            v = _number(record, field)
            if v is not None and (events is None or event in events):
                gauge.set(v)
        for feeding_event, field, counter in self._counters:
            v = _number(record, field)
            if v is not None and v > 0 and event == feeding_event:
                counter.inc(v)
        if event == "start":
            self._me = str(record.get("peer_id") or "")
            self.worker.info({"worker": str(record.get("worker") or ""), "peer_id": self._me})
        elif event == "outer_step":
            self._outer_step(record)
        elif event == "checkpoint":
            self.checkpoints.inc()

    def _outer_step(self, record: dict) -> None:
        self.rounds.labels("ok" if record.get("ok") else "failed").inc()
        if record.get("held") is True:
            self.held.inc()
        for phase, seconds in round_phases(record).items():
            self.last_round.labels(phase).set(seconds)
            self.round_time.labels(phase).inc(seconds)
        compute, whole = _number(record, "round_compute_s"), _number(record, "sync_s")
        if compute is not None and whole is not None and compute + whole > 0:
            self.utilisation.set(compute / (compute + whole))
        peers = record.get("peers")
        if isinstance(peers, list):
            self._peers |= {str(p) for p in peers} - {self._me}
            self.peers_seen.set(len(self._peers))
        if isinstance(record.get("global_hash"), str) and record["global_hash"]:
            self.global_hash.info({"hash": record["global_hash"]})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def start_exporter(port: int, host: str) -> PrometheusSink:
    """The worker's exporter, or ``OSError`` with one line to tell (a port in use, an unknown host)."""
    try:
        return PrometheusSink(port, host)
    except OSError as e:
        raise OSError(f"run.metrics_port: cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
