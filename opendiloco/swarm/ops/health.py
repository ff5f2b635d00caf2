"""A health check for containers and process supervisors: is this node's p2p port listening?

    python -m opendiloco.swarm.ops.health                      # port from $OPENDILOCO_P2P_PORT, else 31337
    python -m opendiloco.swarm.ops.health --port 31337 --file runs/x/metrics.jsonl --max-age 900

Exit status 0 when healthy, 1 when not, with one line saying why. It reads the kernel's socket
tables (``/proc/net/tcp`` and ``tcp6``, i.e. the current network namespace: inside a container,
the container's own sockets), so it opens no connection to the p2p daemon and needs neither
hivemind nor a GPU (importing the ``opendiloco`` package does load torch: a few seconds cold).
Where ``/proc`` has no socket tables it falls back to connecting to the port on localhost.

``--file`` also requires a file to have been modified within ``--max-age`` seconds (e.g. a
worker's ``metrics.jsonl``, appended every ``run.log_every`` inner steps): a worker whose p2p
daemon is up but whose training loop has stalled then reads as unhealthy.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence

DEFAULT_PORT = 31337
PORT_ENV = "OPENDILOCO_P2P_PORT"
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


def _listening_ports(tables: Sequence[str]) -> set[int] | None:
    """TCP ports with a listening socket, from /proc/net/tcp-style tables; None if none could be read."""
    ports: set[int] = set()
    read_any = False
    for table in tables:
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == TCP_LISTEN:
                try:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
                except (IndexError, ValueError):
                    continue
    return ports if read_any else None


def port_listening(port: int, tables: Sequence[str] = ("/proc/net/tcp", "/proc/net/tcp6"),
                   timeout: float = 2.0) -> bool:
    ports = _listening_ports(tables)
    if ports is not None:
        return port in ports
    for host in ("127.0.0.1", "::1"):
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            continue
    return False


def check(port: int | None, file: str | None = None, max_age: float = 900.0,
          tables: Sequence[str] = ("/proc/net/tcp", "/proc/net/tcp6")) -> tuple[bool, str]:
    """Returns (healthy, one-line reason)."""
    problems, fine = [], []
    if port is not None:
        if port_listening(port, tables):
            fine.append(f"p2p port {port} is listening")
        else:
            problems.append(f"nothing listens on TCP port {port} (DHT node not started, or it died)")
    if file is not None:
        try:
            age = time.time() - os.stat(file).st_mtime
        except OSError:
            problems.append(f"{file} does not exist yet")
        else:
            if age > max_age:
                problems.append(f"{file} was last written {age:.0f}s ago (more than {max_age:.0f}s)")
            else:
                fine.append(f"{file} written {age:.0f}s ago")
    if problems:
        return False, "unhealthy: " + "; ".join(problems)
    return True, "ok: " + ("; ".join(fine) or "nothing to check")


def _port_from_env() -> int:
    value = os.environ.get(PORT_ENV, "").strip()
    if not value:
        return DEFAULT_PORT
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"unhealthy: ${PORT_ENV}={value!r} is not a port number") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opendiloco.swarm.ops.health", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=None,
                   help=f"TCP port the p2p daemon listens on (default ${PORT_ENV}, else {DEFAULT_PORT})")
    p.add_argument("--no-port", action="store_true", help="skip the port check (e.g. only check --file)")
    p.add_argument("--file", default=None, help="a file that must have been modified recently")
    p.add_argument("--max-age", type=float, default=900.0, help="seconds; for --file (default 900)")
    args = p.parse_args(argv)
    port = None if args.no_port else (args.port if args.port is not None else _port_from_env())
    if port is not None and not 0 < port < 65536:
        print(f"unhealthy: {port} is not a TCP port", file=sys.stderr)
        return 1
    healthy, reason = check(port, args.file, args.max_age)
    print(reason, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
