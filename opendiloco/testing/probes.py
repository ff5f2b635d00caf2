"""Small network probes to run inside emulated hosts (no iperf, netcat or ping needed).

``serve --port P`` answers on TCP and UDP port P; the first line of a TCP connection picks:

- ``sink``: reads until EOF, then answers ``{"bytes", "seconds"}`` (first byte to EOF; also both
  times, ``"first"`` and ``"last"``, on the machine's monotonic clock, the same in every namespace);
- ``peer``: answers ``{"peer": <address the connection came from>}``;
- ``udp TAG``: answers ``{"udp": <datagrams received with TAG>}``.

Every UDP datagram is counted by its tag; one starting with ``E`` is echoed back.
Clients: ``send HOST PORT --bytes N [--seconds T] [--cc cubic]`` (bulk TCP), ``connect HOST PORT`` (can a connection be
opened? who does the server see?), ``rtt HOST PORT`` (UDP echo times), ``udp HOST PORT --count N``
(datagrams sent vs received). Each prints one JSON line and exits 0 unless its arguments are bad;
each has a time limit. Standard library only: run it by path (``command()``) to skip importing
the ``opendiloco`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections import Counter


def command(*args: str) -> list[str]:
    """The argv that runs this module with ``args`` (by path: no package import)."""
    return [sys.executable, os.path.abspath(__file__), *args]


def _serve(port: int, timeout: float) -> int:
    udp_counts: Counter = Counter()
    lock = threading.Lock()
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(64)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))

    def udp_loop():
        while True:
            data, addr = udp.recvfrom(65536)
            tag = data[1:9]
            with lock:
                udp_counts[tag] += 1
            if data[:1] == b"E":
                udp.sendto(data, addr)

    def handle(conn: socket.socket, addr):
        conn.settimeout(timeout)
        with conn:
            f = conn.makefile("rb")
            line = f.readline().decode().split()
            if not line:
                return
            if line[0] == "sink":
                n, first, last = 0, None, None
                while chunk := f.read1(1 << 20):
                    if first is None:
                        first = time.monotonic()
                    n += len(chunk)
                    last = time.monotonic()
                reply = {"bytes": n, "seconds": (last - first) if first else 0.0, "first": first, "last": last}
            elif line[0] == "peer":
                reply = {"peer": addr[0]}
            elif line[0] == "udp":
                with lock:
                    reply = {"udp": udp_counts[line[1].encode()[:8].ljust(8)]}
            else:
                reply = {"error": f"unknown request {line[0]!r}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")

    threading.Thread(target=udp_loop, daemon=True).start()
    print(json.dumps({"ready": port}), flush=True)
    tcp.settimeout(0.5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn, addr = tcp.accept()
        except TimeoutError:
            continue
        threading.Thread(target=handle, args=(conn, addr), daemon=True).start()
    return 0


def _request(host: str, port: int, line: str, timeout: float) -> dict:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(line.encode() + b"\n")
        return json.loads(s.makefile("rb").readline())


def _send(host: str, port: int, size: int, timeout: float, cc: str | None = None,
          seconds: float | None = None) -> dict:
    started = time.monotonic()
    stop = started + seconds if seconds else float("inf")
    with socket.socket() as s:
        if cc:  # any available algorithm as root; else one of net.ipv4.tcp_allowed_congestion_control
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        s.settimeout(timeout)
        s.connect((host, port))
        s.sendall(b"sink\n")
        block = b"x" * (1 << 16)
        left = size
        while left > 0 and time.monotonic() < stop:
            s.sendall(block[:left])
            left -= min(left, len(block))
        s.shutdown(socket.SHUT_WR)
        reply = json.loads(s.makefile("rb").readline())
    return {"bytes": size - left, "seconds": time.monotonic() - started, "server": reply}


def _connect(host: str, port: int, timeout: float) -> dict:
    started = time.monotonic()
    try:
        reply = _request(host, port, "peer", timeout)
    except OSError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
    return {"ok": True, "peer": reply.get("peer"), "seconds": time.monotonic() - started}


def _rtt(host: str, port: int, count: int, interval: float, timeout: float) -> dict:
    rtts, lost = [], 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        s.settimeout(timeout)
        for i in range(count):
            payload = b"E" + b"rtt".ljust(8) + i.to_bytes(4, "big")
            started = time.monotonic()
            s.send(payload)
            try:
                while s.recv(2048) != payload:  # a late echo of an earlier probe
                    pass
                rtts.append(1e3 * (time.monotonic() - started))
            except (TimeoutError, ConnectionRefusedError):
                lost += 1
            time.sleep(interval)
    return {"rtts_ms": rtts, "lost": lost}


def _udp(host: str, port: int, count: int, size: int, interval: float, timeout: float) -> dict:
    tag = os.urandom(4).hex()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        for i in range(count):
            try:
                s.send((b"C" + tag.encode() + i.to_bytes(4, "big")).ljust(size, b"."))
            except ConnectionRefusedError:  # an ICMP error for an earlier datagram
                pass
            time.sleep(interval)
    time.sleep(0.3)  # the last ones in flight
    received = _request(host, port, f"udp {tag}", timeout)["udp"]
    return {"sent": count, "received": received}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="network probes for emulated hosts")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--port", type=int, default=5001)
    p.add_argument("--timeout", type=float, default=120.0, help="exit after this many seconds")
    for name in ("send", "connect", "rtt", "udp"):
        p = sub.add_parser(name)
        p.add_argument("host")
        p.add_argument("port", type=int)
        p.add_argument("--timeout", type=float, default=10.0)
        p.add_argument("--bytes", type=int, default=1_000_000)
        p.add_argument("--count", type=int, default=10)
        p.add_argument("--size", type=int, default=64)
        p.add_argument("--interval", type=float, default=0.01)
        p.add_argument("--seconds", type=float, default=None, help="send: stop sending after this long")
        p.add_argument("--cc", default=None, help="send: the TCP congestion control of the connection")
    args = parser.parse_args(argv)
    if args.what == "serve":
        return _serve(args.port, args.timeout)
    if args.what == "send":
        out = _send(args.host, args.port, args.bytes, args.timeout, args.cc, args.seconds)
    elif args.what == "connect":
        out = _connect(args.host, args.port, args.timeout)
    elif args.what == "rtt":
        out = _rtt(args.host, args.port, args.count, args.interval, args.timeout)
    else:
        out = _udp(args.host, args.port, args.count, args.size, args.interval, args.timeout)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
