"""An emulated wide-area network: a user-space Ethernet hub that delays, drops and paces frames.

This kernel has no ``netem``, so the impairments are applied here, in one process that owns one
TAP device per attached host. ``opendiloco.testing.world`` creates the TAPs through this hub
(in the hub's own network namespace) and moves each into its host's namespace; the hub keeps
the file descriptor, so every frame a host sends comes to the hub, and the hub alone decides
when (and whether) it reaches the other hosts. Hosts belong to regions; links are described
per unordered pair of regions (a *link class*: ``a|a`` inside region a, ``a|b`` between a
and b) by a ``LinkSpec``.

What happens to a frame from host S (region r) to host D (region q), link class ``{r, q}``:

1. learning: the hub learns S's MAC; broadcast, multicast and unknown destinations are
   flooded (each copy goes through the steps below);
2. partition: dropped if r and q are in different groups, or S or D is disconnected;
3. S's access link: the class's rate, as a FIFO drained by a token bucket whose depth is one
   frame of the largest size; a frame that would wait longer than the class's queue is
   dropped (tail drop);
4. loss: dropped with the class's probability (per frame);
5. D's access link: the same shaping on the receiving side, in order of arrival;
6. propagation: delivered ``delay ± jitter`` later (uniform), never before an earlier frame
   from S to D (per directed host pair FIFO).

So the rate belongs to each host's access link, per link class: a host in region a sends at
most ``rate(a|b)`` to all of region b together, and receives at most that from all of b
together, while its traffic inside a (at ``rate(a|a)``) and to a third region is paced
separately. "1 Gbit/s inside a region, 100 Mbit/s between regions" thus means what it says for
each host, whatever its fan-out or fan-in. Hosts do not share a backbone: two hosts of region a
sending to region b get the rate each.

Control: a unix socket taking one JSON object per line and answering one per line
(``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``); commands: ``ping``, ``attach``,
``detach``, ``set_link``, ``links``, ``partition``, ``heal``, ``port`` (up/down), ``stats``,
``shutdown``. The hub exits when its parent process dies (``--parent``).

Run as ``python -m opendiloco.testing.wan --control PATH`` or by this file's path (which
avoids importing the ``opendiloco`` package, and with it torch): it imports only the standard
library.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass, fields

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
ETH_HEADER = 14
DEFAULT_MTU = 16000
READ_SIZE = 65536 + ETH_HEADER
READ_BUDGET = 64  # frames read from one TAP per wake-up, so timers are not starved
PR_SET_PDEATHSIG = 1

_INGRESS, _DELIVER = 0, 1


@dataclass
class LinkSpec:
    """One link class. ``rate_mbit`` None: unlimited; ``queue_ms``: the most a frame may wait
    for each access link's token bucket before it is dropped (raised to at least 4 frames of
    the largest size at that rate, so a large MTU still passes)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None
    queue_ms: float = 50.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.queue_ms <= 0:
            raise ValueError(f"delay and jitter must be >= 0 and the queue > 0: {self}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss is a probability, got {self.loss}")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate must be positive (or None for unlimited), got {self.rate_mbit}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LinkSpec:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown link parameters: {sorted(unknown)}")
        return cls(**data)


def link_key(a: str, b: str) -> str:
    """The name of the link class between regions a and b (unordered)."""
    return "|".join(sorted((a, b)))


class _Link:
    __slots__ = ("key", "spec", "delay", "jitter", "loss", "rate", "tau", "queue", "frames", "bytes",
                 "dropped_loss", "dropped_partition", "dropped_queue", "dropped_down")

    def __init__(self, key: str, spec: LinkSpec, max_frame: int):
        self.key = key
        self.frames = self.bytes = 0
        self.dropped_loss = self.dropped_partition = self.dropped_queue = self.dropped_down = 0
        self.configure(spec, max_frame)

    def configure(self, spec: LinkSpec, max_frame: int) -> None:
        self.spec = spec
        self.delay = spec.delay_ms / 1e3
        self.jitter = min(spec.jitter_ms, spec.delay_ms) / 1e3  # never earlier than no delay at all
        self.loss = spec.loss
        self.rate = spec.rate_mbit * 1e6 / 8 if spec.rate_mbit else 0.0  # bytes per second
        self.tau = max_frame / self.rate if self.rate else 0.0  # bucket depth: one largest frame
        self.queue = max(spec.queue_ms / 1e3, 4 * self.tau)

    def stats(self) -> dict:
        return {"spec": self.spec.to_dict(), "frames": self.frames, "bytes": self.bytes,
                "dropped_loss": self.dropped_loss, "dropped_partition": self.dropped_partition,
                "dropped_queue": self.dropped_queue, "dropped_down": self.dropped_down}


class _Port:
    __slots__ = ("name", "host", "region", "fd", "group", "up", "out", "inn", "sent_frames", "sent_bytes",
                 "received_frames", "received_bytes")

    def __init__(self, name: str, host: str, region: str, fd: int):
        self.name, self.host, self.region, self.fd = name, host, region, fd
        self.group = 0
        self.up = True
        self.out: dict[str, list[float]] = {}  # link class -> [clock] of this host's sending side
        self.inn: dict[str, list[float]] = {}  # link class -> [clock] of its receiving side
        self.sent_frames = self.sent_bytes = self.received_frames = self.received_bytes = 0


class _Path:
    """A directed host pair: its link class, both access-link buckets, and its last delivery time."""

    __slots__ = ("src", "dst", "link", "out", "inn", "last")

    def __init__(self, src: _Port, dst: _Port, link: _Link):
        self.src, self.dst, self.link = src, dst, link
        self.out = src.out.setdefault(link.key, [0.0])
        self.inn = dst.inn.setdefault(link.key, [0.0])
        self.last = 0.0


class _Stop(Exception):
    pass


class Hub:
    def __init__(self, control: str, *, mtu: int = DEFAULT_MTU, parent: int | None = None, seed: int | None = None):
        self.control_path = control
        self.max_frame = mtu + ETH_HEADER
        self.parent = parent
        self.random = random.Random(seed)
        self.ports: dict[int, _Port] = {}  # fd -> port
        self.by_name: dict[str, _Port] = {}
        self.macs: dict[bytes, _Port] = {}
        self.links: dict[str, _Link] = {}
        self.paths: dict[tuple[_Port, _Port], _Path] = {}
        self.groups: dict[str, int] = {}  # region -> partition group (absent: group 0, "the rest")
        self.heap: list = []
        self.seq = 0
        self.frames_in = self.flooded = self.write_errors = 0
        self.delivered = 0
        self.late_sum = self.late_max = 0.0
        self.started = time.monotonic()
        self.epoll = select.epoll()
        self.clients: dict[int, tuple[socket.socket, bytearray]] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    # ---- links and ports

    def link(self, key: str) -> _Link:
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = _Link(key, LinkSpec(), self.max_frame)
        return link

    def set_link(self, a: str, b: str, spec: LinkSpec) -> None:
        self.link(link_key(a, b)).configure(spec, self.max_frame)

    def attach(self, name: str, host: str, region: str) -> _Port:
        if name in self.by_name or len(name.encode()) > 15:
            raise ValueError(f"bad or duplicate port name {name!r}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
        port = _Port(name, host, region, fd)
        port.group = self.groups.get(region, 0)
        self.ports[fd] = port
        self.by_name[name] = port
        self.epoll.register(fd, select.EPOLLIN)
        return port

    def detach(self, port: _Port) -> None:
        if port.fd < 0:
            return
        self.epoll.unregister(port.fd)
        os.close(port.fd)
        del self.ports[port.fd]
        del self.by_name[port.name]
        port.fd = -1  # frames still scheduled for it are dropped at delivery
        for mac in [m for m, p in self.macs.items() if p is port]:
            del self.macs[mac]
        for key in [k for k in self.paths if port in k]:
            del self.paths[key]

    def partition(self, groups: list[list[str]]) -> None:
        self.groups = {}
        for gid, regions in enumerate(groups, start=1):
            for region in regions:
                if region in self.groups:
                    raise ValueError(f"region {region!r} is in two groups")
                self.groups[region] = gid
        for port in self.ports.values():
            port.group = self.groups.get(port.region, 0)

    # ---- the data path

    def _path(self, src: _Port, dst: _Port) -> _Path:
        path = self.paths.get((src, dst))
        if path is None:
            path = self.paths[(src, dst)] = _Path(src, dst, self.link(link_key(src.region, dst.region)))
        return path

    def _push(self, when: float, path: _Path, frame: bytes, kind: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, path, frame, kind))

    def _read(self, port: _Port) -> None:
        now = time.monotonic()
        fd = port.fd
        for _ in range(READ_BUDGET):
            try:
                frame = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError as e:  # the device is gone (its namespace was deleted)
                print(f"wan: port {port.name} ({port.host}): {e}; detached", file=sys.stderr, flush=True)
                self.detach(port)
                return
            self.frames_in += 1
            port.sent_frames += 1
            port.sent_bytes += len(frame)
            if len(frame) < ETH_HEADER:
                continue
            self.macs[frame[6:12]] = port
            dst = None if frame[0] & 1 else self.macs.get(frame[:6])
            if dst is None:
                self.flooded += 1
                for other in list(self.ports.values()):
                    if other is not port:
                        self._send(self._path(port, other), frame, now)
            elif dst is not port:
                self._send(self._path(port, dst), frame, now)

    def _send(self, path: _Path, frame: bytes, now: float) -> None:
        """Partition, then the sender's access link."""
        link = path.link
        src, dst = path.src, path.dst
        if not (src.up and dst.up):
            link.dropped_down += 1
            return
        if src.group != dst.group:
            link.dropped_partition += 1
            return
        if link.rate:
            clock = path.out
            end = max(clock[0], now) + len(frame) / link.rate
            depart = end - link.tau
            if depart > now:
                if depart - now > link.queue:
                    link.dropped_queue += 1
                    return
                clock[0] = end
                self._push(depart, path, frame, _INGRESS)
                return
            clock[0] = end
        self._ingress(path, frame, now)

    def _ingress(self, path: _Path, frame: bytes, t: float) -> None:
        """Loss, the receiver's access link, then propagation; ``t``: when it left the sender."""
        link = path.link
        if link.loss and self.random.random() < link.loss:
            link.dropped_loss += 1
            return
        arrive = t
        if link.rate:
            clock = path.inn
            end = max(clock[0], t) + len(frame) / link.rate
            if end - link.tau > t:
                arrive = end - link.tau
                if arrive - t > link.queue:
                    link.dropped_queue += 1
                    return
            clock[0] = end
        when = arrive + link.delay
        if link.jitter:
            when += self.random.uniform(-link.jitter, link.jitter)
        if when < path.last:
            when = path.last
        path.last = when
        self._push(when, path, frame, _DELIVER)

    def _deliver(self, path: _Path, frame: bytes, late: float) -> None:
        dst = path.dst
        if dst.fd < 0:
            return
        try:
            os.write(dst.fd, frame)
        except OSError as e:
            self.write_errors += 1  # EIO: its interface is down; EAGAIN: its receive path is full
            if e.errno == errno.EBADFD:
                self.detach(dst)
            return
        path.link.frames += 1
        path.link.bytes += len(frame)
        dst.received_frames += 1
        dst.received_bytes += len(frame)
        self.delivered += 1
        self.late_sum += late
        if late > self.late_max:
            self.late_max = late

    def _run_due(self) -> None:
        heap = self.heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            when, _, path, frame, kind = heapq.heappop(heap)
            if kind == _DELIVER:
                self._deliver(path, frame, now - when)
            else:
                self._ingress(path, frame, when)

    # ---- control channel

    def stats(self) -> dict:
        cpu = os.times()
        return {
            "links": {key: link.stats() for key, link in sorted(self.links.items())},
            "hosts": {p.host: {"region": p.region, "port": p.name, "up": p.up, "sent_frames": p.sent_frames,
                               "sent_bytes": p.sent_bytes, "received_frames": p.received_frames,
                               "received_bytes": p.received_bytes} for p in self.ports.values()},
            "hub": {"frames_in": self.frames_in, "flooded": self.flooded, "delivered": self.delivered,
                    "write_errors": self.write_errors, "pending": len(self.heap),
                    "late_ms_mean": 1e3 * self.late_sum / max(1, self.delivered), "late_ms_max": 1e3 * self.late_max,
                    "cpu_s": cpu.user + cpu.system, "uptime_s": time.monotonic() - self.started,
                    "groups": self.groups},
        }

    def command(self, msg: dict) -> dict:
        cmd = msg.get("cmd")
        if cmd == "ping":
            return {"pid": os.getpid()}
        if cmd == "attach":
            port = self.attach(str(msg["port"]), str(msg["host"]), str(msg["region"]))
            return {"port": port.name}
        if cmd == "detach":
            self.detach(self._port(msg))
            return {}
        if cmd == "port":
            self._port(msg).up = bool(msg["up"])
            return {}
        if cmd == "set_link":
            self.set_link(str(msg["a"]), str(msg["b"]), LinkSpec.from_dict(msg["spec"]))
            return {}
        if cmd == "links":
            return {"links": {key: link.spec.to_dict() for key, link in self.links.items()}}
        if cmd == "partition":
            self.partition([[str(r) for r in group] for group in msg["groups"]])
            return {}
        if cmd == "heal":
            self.partition([])
            return {}
        if cmd == "stats":
            return self.stats()
        if cmd == "shutdown":
            raise _Stop
        raise ValueError(f"unknown command {cmd!r}")

    def _port(self, msg: dict) -> _Port:
        for port in self.ports.values():
            if port.host == msg.get("host") or port.name == msg.get("port"):
                return port
        raise KeyError(f"no such port: {msg}")

    def _client(self, fd: int) -> None:
        conn, buf = self.clients[fd]
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.epoll.unregister(fd)
            del self.clients[fd]
            conn.close()
            return
        buf += data
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            stop = False
            try:
                reply = {"ok": True, **self.command(json.loads(line))}
            except _Stop:
                reply, stop = {"ok": True}, True
            except Exception as e:  # noqa: BLE001 - reported to the client, the hub goes on
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            conn.setblocking(True)
            conn.settimeout(5.0)
            conn.sendall(json.dumps(reply).encode() + b"\n")
            conn.setblocking(False)
            if stop:
                raise _Stop

    # ---- main loop

    def serve(self) -> None:
        def stop(signum, frame):
            raise _Stop

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        if self.parent:
            try:  # dies with the process that started it...
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            except (OSError, AttributeError):
                pass  # ...and the parent check below covers it anyway
            if os.getppid() != self.parent:
                return
        if os.path.exists(self.control_path):
            os.unlink(self.control_path)
        self.listener.bind(self.control_path)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        checked = time.monotonic()
        try:
            while True:
                timeout = 0.5
                if self.heap:
                    timeout = min(timeout, max(0.0, self.heap[0][0] - time.monotonic()))
                for fd, _ in self.epoll.poll(timeout):
                    port = self.ports.get(fd)
                    if port is not None:
                        self._read(port)
                    elif fd == self.listener.fileno():
                        try:
                            conn, _ = self.listener.accept()
                        except BlockingIOError:
                            continue
                        conn.setblocking(False)
                        self.clients[conn.fileno()] = (conn, bytearray())
                        self.epoll.register(conn.fileno(), select.EPOLLIN)
                    elif fd in self.clients:
                        self._client(fd)
                    self._run_due()
                self._run_due()
                now = time.monotonic()
                if self.parent and now - checked > 0.5:
                    checked = now
                    if os.getppid() != self.parent:
                        return
        except _Stop:
            pass
        finally:
            self.close()

    def close(self) -> None:
        for port in list(self.ports.values()):
            self.detach(port)  # closing the last fd of a TAP deletes the device
        for conn, _ in self.clients.values():
            conn.close()
        self.listener.close()
        try:
            os.unlink(self.control_path)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", required=True, help="path of the unix socket for JSON-line commands")
    parser.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="the attached interfaces' MTU")
    parser.add_argument("--parent", type=int, default=None, help="exit when this process (our parent) is gone")
    parser.add_argument("--seed", type=int, default=None, help="seed for loss and jitter")
    parser.add_argument("--links", default="{}", help='initial links as JSON: {"a|b": {"delay_ms": 40, ...}}')
    args = parser.parse_args(argv)
    hub = Hub(args.control, mtu=args.mtu, parent=args.parent, seed=args.seed)
    for key, spec in json.loads(args.links).items():
        a, _, b = key.partition("|")
        hub.set_link(a, b or a, LinkSpec.from_dict(spec))
    hub.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
