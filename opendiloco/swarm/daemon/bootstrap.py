"""`opendiloco dht`: a long-running DHT node that others join through."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence

from .node import SwarmError, start_dht, visible_maddrs

log = logging.getLogger(__name__)


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run_bootstrap(*, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
                  announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                  addrs_file: str | None = None, stop: threading.Event | None = None,
                  metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> int:
    """Serves the DHT until SIGINT/SIGTERM (or ``stop``); prints the addresses to join through.
    ``metrics_port``: also serve the node's figures for Prometheus (``DhtCollector``; 0: any free port)."""
    server = None
    if metrics_port is not None:  # before the DHT: a port in use is told at once
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        collector = DhtCollector()
        registry.register(collector)
        try:
            server, _ = start_http_server(metrics_port, addr=metrics_host, registry=registry)
        except OSError as e:
            raise SwarmError(f"--metrics-port: cannot serve metrics on {metrics_host}:{metrics_port}: "
                             f"{e.strerror or e}") from None
    try:
        dht = start_dht(initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                        identity_path=identity_path)
    except BaseException:
        if server is not None:
            server.shutdown()
            server.server_close()
        raise
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        addrs = visible_maddrs(dht)
        if addrs_file:  # before anything is printed: whoever reads the output may go for the file
            write_atomically(addrs_file, "\n".join(addrs) + "\n")
        print("DHT node running. Join with:", flush=True)
        for addr in addrs:
            print(f"  --swarm.initial-peers {addr}", flush=True)
        if server is not None:
            collector.dht = dht
            host = f"[{metrics_host}]" if ":" in metrics_host else metrics_host
            print(f"metrics for Prometheus at http://{host}:{server.server_port}/metrics", flush=True)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server is not None:
            server.shutdown()
            server.server_close()
        dht.shutdown()
    return 0


async def _dht_figures(dht, node) -> dict[str, float]:
    """Runs in the DHT process: the node's routing table, stored records and p2p connections."""
    return {"routing_table_peers": len(node.protocol.routing_table.peer_id_to_uid),
            "stored_records": len(node.protocol.storage),
            "connected_peers": len(await node.p2p.list_peers())}


class DhtCollector:
    """The bootstrap node's figures, read from its DHT process at each scrape (at most 5 s)."""

    HELP = {"routing_table_peers": "peers in this node's DHT routing table",
            "stored_records": "DHT records (keys) this node stores",
            "connected_peers": "peers its p2p daemon is connected to"}

    def __init__(self):
        self.dht = None
        self.started = time.time()

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        figures = {}
        if self.dht is not None:
            try:
                figures = self.dht.run_coroutine(_dht_figures, return_future=True).result(5.0)
            except Exception as e:  # busy or stopping: this scrape goes without them
                log.debug("DHT figures: %s: %s", type(e).__name__, e)
        up = GaugeMetricFamily("opendiloco_dht_up", "1 while the DHT node answers its figures")
        up.add_metric([], 1.0 if figures else 0.0)
        yield up
        started = GaugeMetricFamily("opendiloco_dht_start_time_seconds", "when the node started (Unix time)")
        started.add_metric([], self.started)
        yield started
        for name, value in figures.items():
            family = GaugeMetricFamily(f"opendiloco_dht_{name}", self.HELP[name])
            family.add_metric([], float(value))
            yield family
