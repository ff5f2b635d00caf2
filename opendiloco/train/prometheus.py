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


def round_phases(record: dict) -> dict[str, float]:
    """Seconds of each phase of an ``outer_step`` record (phases it does not tell are left out)."""
    def num(name):
        v = record.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    out = {}
    waiting, transfer, inside, whole = num("matchmaking_s"), num("transfer_s"), num("allreduce_s"), num("sync_s")
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

        self.worker = Info(PREFIX + "worker", "this worker: its name and peer id", registry=r)
        self.global_hash = Info(PREFIX + "global", "the hash of θ_global after the last outer step", registry=r)
        self.inner_step = gauge("inner_step", "inner steps taken (the last record's)")
        self.outer_step = gauge("outer_step", "outer steps applied (the last record's)")
        self.train_loss = gauge("train_loss", "mean training loss since the previous train record")
        self.learning_rate = gauge("learning_rate", "the inner optimizer's learning rate")
        self.grad_norm = gauge("grad_norm", "gradient norm at the last train record")
        self.tokens = gauge("tokens_per_second", "training tokens per second since the previous train record")
        self.eval_loss = gauge("eval_loss", "loss on the held-out batches at the last evaluation")
        self.round_loss = gauge("round_loss", "mean training loss of the last round's inner steps")
        self.group_size = gauge("group_size", "members of the last round (this worker included)")
        self.peers_seen = gauge("peers_seen", "distinct other workers this worker has averaged with since it started")
        self.last_round = gauge("last_round_seconds", "seconds of the last outer step, by phase", ["phase"])
        self.round_time = counter("round_seconds", "seconds spent in outer steps, by phase", ["phase"])
        self.compute_time = counter("compute_seconds", "seconds spent in inner steps of finished rounds")
        self.utilisation = gauge("round_utilisation_ratio", "compute / (compute + outer step) of the last round")
        self.rounds = counter("rounds", "outer steps, by result (ok: averaged; failed: not averaged)", ["result"])
        self.held = counter("held_rounds", "failed rounds whose group lacked most of the workers this one last "
                                           "averaged with (the run may be split): its work kept for the next one")
        self.sent = counter("sent_bytes", "bytes of pseudo-gradients and averages sent in rounds")
        self.received = counter("received_bytes", "bytes of pseudo-gradients and averages received in rounds")
        self.contributed = counter("contributed_steps", "inner steps whose work entered an average")
        self.dropped = counter("dropped_steps", "inner steps whose work was thrown away")
        self.checkpoints = counter("checkpoints", "checkpoints written")
        self.ckpt_blocked = gauge("last_checkpoint_blocked_seconds", "seconds the last checkpoint held up training")
        self.ckpt_blocked_total = counter("checkpoint_blocked_seconds", "seconds checkpoints held up training")
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
        def num(name):
            v = record.get(name)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        def put(metric, name):
            v = num(name)
            if v is not None:
                metric.set(v)

        event = record.get("event")
        put(self.inner_step, "inner_step")
        put(self.outer_step, "outer_step")
        if event == "start":
            self._me = str(record.get("peer_id") or "")
            self.worker.info({"worker": str(record.get("worker") or ""), "peer_id": self._me})
        elif event == "train":
            put(self.train_loss, "loss")
            put(self.learning_rate, "lr")
            put(self.grad_norm, "grad_norm")
            put(self.tokens, "tokens_per_s")
        elif event == "eval":
            put(self.eval_loss, "eval_loss")
        elif event == "outer_step":
            self._outer_step(record, num, put)
        elif event == "checkpoint":
            self.checkpoints.inc()
            put(self.ckpt_blocked, "blocked_s")
            if num("blocked_s") is not None:
                self.ckpt_blocked_total.inc(max(0.0, num("blocked_s")))
        elif event == "end":
            put(self.eval_loss, "eval_loss")

    def _outer_step(self, record, num, put) -> None:
        put(self.round_loss, "loss")
        put(self.eval_loss, "eval_loss")
        put(self.group_size, "group_size")
        self.rounds.labels("ok" if record.get("ok") else "failed").inc()
        if record.get("held") is True:
            self.held.inc()
        for phase, seconds in round_phases(record).items():
            self.last_round.labels(phase).set(seconds)
            self.round_time.labels(phase).inc(seconds)
        compute, whole = num("round_compute_s"), num("sync_s")
        if compute is not None:
            self.compute_time.inc(max(0.0, compute))
            if whole is not None and compute + whole > 0:
                self.utilisation.set(compute / (compute + whole))
        for name, counter in (("bytes_sent", self.sent), ("bytes_received", self.received),
                              ("contributed_steps", self.contributed), ("dropped_steps", self.dropped)):
            if num(name) is not None and num(name) > 0:
                counter.inc(num(name))
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
