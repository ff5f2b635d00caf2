"""`opendiloco dht`: a long-running DHT node that others join through."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from collections.abc import Sequence

from .node import start_dht, visible_maddrs

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
                  addrs_file: str | None = None, stop: threading.Event | None = None) -> int:
    """Serves the DHT until SIGINT/SIGTERM (or ``stop``); prints the addresses to join through."""
    dht = start_dht(initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                    identity_path=identity_path)
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        addrs = visible_maddrs(dht)
        print("DHT node running. Join with:", flush=True)
        for addr in addrs:
            print(f"  --swarm.initial-peers {addr}", flush=True)
        if addrs_file:
            write_atomically(addrs_file, "\n".join(addrs) + "\n")
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        dht.shutdown()
    return 0
