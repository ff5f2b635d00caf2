"""``opendiloco status --serve PORT``: one self-refreshing page of a run, and the JSON it polls.

``RunHistory`` keeps what successive reads of the run's records showed (workers, their loss over
time, when each reached each outer step); ``StatusServer`` serves ``/`` (the page: plain HTML, inline
JS and SVG, nothing fetched from elsewhere) and ``/api/run`` (the history as JSON) from a thread, with
the standard library. Both only show records a member of the run can read; nothing here writes to
the run. Neither imports hivemind: the reading is ``status.RunReader``'s (``serve_status``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

log = logging.getLogger(__name__)

SHOWN = ("peer_id", "name", "outer_step", "inner_step", "steps_per_s", "samples_per_s", "loss", "global_hash",
         "last_sync_time", "contributed_steps", "dropped_steps", "ready")
"""The worker record's fields the page shows (nothing else of a record leaves the server)."""


class RunHistory:
    """What the reads of a run have shown so far; ``view()`` is the JSON of ``/api/run``.

    A worker missing from a read is kept, not live, for ``forget_after`` seconds. Each worker's loss
    curve keeps at most ``max_points`` points (halved, every other point, when full: the whole run's
    shape stays); the timeline keeps the last ``max_rounds`` outer steps.
    """

    def __init__(self, run_id: str, closed: bool, *, max_points: int = 500, max_rounds: int = 30,
                 forget_after: float = 600.0):
        self.run_id, self.closed = run_id, closed
        self.max_points, self.max_rounds, self.forget_after = max_points, max_rounds, forget_after
        self.workers: dict[str, dict] = {}
        self.loss: dict[str, list[list[float]]] = {}
        self.reached: dict[int, dict[str, float]] = {}
        """outer step -> {peer: when it was first seen there}"""
        self.reads, self.error, self.updated = 0, None, None
        self._lock = threading.Lock()

    def update(self, now: float, workers, last_rounds: dict[str, dict] | None = None,
               addresses: dict[str, list[str]] | None = None) -> None:
        """One read of the run: its live workers (records or dicts), their last rounds and addresses."""
        last_rounds, addresses = last_rounds or {}, addresses or {}
        with self._lock:
            seen = set()
            for w in workers:
                rec = asdict(w) if is_dataclass(w) else dict(w)
                peer = str(rec["peer_id"])
                seen.add(peer)
                row = {k: _finite(rec.get(k)) for k in SHOWN}
                before = self.workers.get(peer, {})
                last_round = last_rounds.get(peer)
                if last_round is None and before.get("outer_step") == row["outer_step"]:
                    last_round = before.get("last_round")  # its round's records may have expired since
                row.update(live=True, last_seen=now, first_seen=before.get("first_seen", now),
                           address=_address(addresses.get(peer)) or before.get("address"), last_round=last_round)
                self.workers[peer] = row
                self._add_point(peer, now, row)
                if isinstance(row["outer_step"], int) and row["outer_step"] > 0:
                    self.reached.setdefault(row["outer_step"], {}).setdefault(peer, now)
            for peer, row in list(self.workers.items()):
                if peer not in seen:
                    row["live"] = False
                    if now - row["last_seen"] > self.forget_after:
                        del self.workers[peer]
            for step in sorted(self.reached)[:-self.max_rounds]:
                del self.reached[step]
            self.reads, self.error, self.updated = self.reads + 1, None, now

    def failed(self, now: float, message: str) -> None:
        """A read that failed (the DHT did not answer): the page says so and keeps the last figures."""
        with self._lock:
            self.error, self.updated = message, now

    def _add_point(self, peer: str, now: float, row: dict) -> None:
        loss = row.get("loss")
        if not isinstance(loss, (int, float)):
            return
        points = self.loss.setdefault(peer, [])
        if points and points[-1][1] == row["inner_step"]:
            return
        points.append([now, row["inner_step"], float(loss)])
        if len(points) > self.max_points:
            del points[1:-1:2]

    def view(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        with self._lock:
            workers = [dict(w) for w in self.workers.values()]
            by_step: dict[int, Counter] = {}
            for w in workers:
                if w["live"] and w.get("global_hash"):
                    by_step.setdefault(w["outer_step"], Counter())[w["global_hash"]] += 1
            for w in workers:
                hashes = by_step.get(w["outer_step"])
                w["hash_agrees"] = None if not (w["live"] and hashes and w.get("global_hash")) else (
                    hashes[w["global_hash"]] == max(hashes.values()))
                w["since_sync_s"] = now - w["last_sync_time"] if w.get("last_sync_time") else None
            workers.sort(key=lambda w: (not w["live"], -(w["outer_step"] or 0), w["peer_id"]))
            rounds = [{"outer_step": k, "first": min(t.values()), "last": max(t.values()), "workers": len(t),
                       "reached": t} for k, t in sorted(self.reached.items())]
            live = [w for w in workers if w["live"]]
            hashes = {w["global_hash"] for w in live if w.get("global_hash")
                      and w["outer_step"] == max(x["outer_step"] for x in live)}
            return {"run_id": self.run_id, "closed": self.closed, "now": now, "updated": self.updated,
                    "reads": self.reads, "error": self.error, "live_workers": len(live),
                    "hashes_at_head": len(hashes), "workers": workers,
                    "loss": {p: list(v) for p, v in self.loss.items()}, "rounds": rounds}


def _finite(value):
    """JSON has no NaN or infinity (a worker whose loss diverged publishes one): None instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _address(addrs) -> str | None:
    """One address to show: the first that is not a relay (``p2p-circuit``), else the first."""
    if not addrs:
        return None
    direct = [a for a in addrs if "p2p-circuit" not in a]
    return (direct or list(addrs))[0]


def page_html() -> bytes:
    return resources.files(__package__).joinpath("status_page.html").read_bytes()


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer
    headers_out = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                   "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                              "style-src 'unsafe-inline'; connect-src 'self'"}

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", self.server.html)
        elif path == "/api/run":
            body = json.dumps(self.server.history.view(), allow_nan=False, default=str).encode()
            self._send(200, "application/json", body)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def do_HEAD(self):  # noqa: N802
        self.do_GET()

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for k, v in self.headers_out.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
        log.debug("%s " + format, self.address_string(), *args)


class StatusServer(ThreadingHTTPServer):
    """Serves ``history`` from a thread of its own (``start``/``close``); ``port`` 0 takes a free port."""

    daemon_threads = True

    def __init__(self, history: RunHistory, host: str = "127.0.0.1", port: int = 0):
        self.history, self.html = history, page_html()
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="status-page", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self.shutdown()
        self.server_close()


def keep_reading(history: RunHistory, read: Callable[[], tuple], stop: threading.Event, interval: float) -> None:
    """Calls ``read()`` -> (workers, last rounds, addresses) every ``interval`` seconds until ``stop``."""
    while not stop.is_set():
        try:
            history.update(time.time(), *read())
        except Exception as e:  # a DHT that does not answer now may answer at the next read
            history.failed(time.time(), f"{type(e).__name__}: {e}")
            log.warning("reading the run failed: %s: %s", type(e).__name__, e)
        stop.wait(interval)
