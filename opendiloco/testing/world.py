"""An emulated world for scenario tests: hosts in regions, joined by an emulated wide-area network.

Every host is a Linux network namespace whose ``eth0`` is a TAP device of the hub in
``opendiloco.testing.wan`` (one process, in a namespace of its own), which applies each link
class's delay, jitter, loss and rate (see that module for the exact model). Hosts of all
regions share one IPv4 subnet, ``<subnet>.0.0/17``: a host of the k-th region gets
``<subnet>.<k>.<n>``. A NAT'd host sits behind a router namespace of its own, like a home
router: the router holds the public address (on the hub), the host a private one
(``<subnet>.<128+j>.2/24``, router ``.1``), MASQUERADE on the way out, and nothing new gets in.
IPv6 is off everywhere. The machine's own namespace gets no address and no route.

``World(...)`` is a context manager; ``teardown()`` ends the hub, every process still inside
the world's namespaces and the namespaces themselves, also at interpreter exit and on SIGTERM
(``setup()`` on the main thread installs a handler that tears down and dies of the signal as
before, or calls the program's own handler if it had one). The hub dies with the process
that started it; ``cleanup_stale(prefix)`` removes what a killed run left (namespaces whose
creating process is gone; each is marked with its creator's pid and start time, in its
loopback's alias).

Needs root (CAP_NET_ADMIN), iproute2, /dev/net/tun, and iptables for NAT'd hosts;
``unavailable_reason()`` says why not, if not.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from . import wan
from .wan import DEFAULT_MTU, LinkSpec, link_key

__all__ = ["DEFAULT_MTU", "HostInfo", "LinkSpec", "World", "WorldError", "cleanup_stale", "unavailable_reason"]

_MARK = "opendiloco-world"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PUBLIC_PREFIX = 17  # <subnet>.0.0/17: regions 1..127; NAT'd hosts' private /24s from <subnet>.128 up


class WorldError(RuntimeError):
    """An ``ip``/``iptables`` command or the hub failed."""


def _run(*args: str, input: str | None = None, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        raise WorldError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable_reason(*, nat: bool = True) -> str | None:
    """Why a world cannot be built here, or None if it (probably) can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces and TAP devices needs root (CAP_NET_ADMIN)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TAP devices)"
    if nat and (shutil.which("iptables") is None or shutil.which("iptables-restore") is None):
        return "iptables is not installed (needed for NAT'd hosts)"
    return None


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _mark_of(pid: int, prefix: str) -> str:
    return f"{_MARK} prefix={prefix} pid={pid} start={_start_time(pid)}"


def _netns_list() -> list[str]:
    out = _run("ip", "-j", "netns", "list", check=False).stdout.strip()
    try:
        return [entry["name"] for entry in json.loads(out or "[]")]
    except (ValueError, KeyError, TypeError):
        return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]


def _kill(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_start_time(p) is not None and not _zombie(p) for p in pids):
            time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def cleanup_stale(prefix: str) -> list[str]:
    """Removes the namespaces named ``<prefix>-...`` that a world made whose creating process is
    gone (and ends the processes still inside them); returns the namespaces removed."""
    removed = []
    for ns in _netns_list():
        if not ns.startswith(f"{prefix}-"):
            continue
        proc = _run("ip", "-n", ns, "-j", "link", "show", "lo", check=False)
        try:
            alias = json.loads(proc.stdout)[0].get("ifalias", "")
        except (ValueError, IndexError):
            alias = ""
        fields = dict(item.split("=", 1) for item in alias.split()[1:] if "=" in item)
        if alias and (not alias.startswith(_MARK) or fields.get("prefix") != prefix):
            continue  # not made by a world with this prefix
        pid = int(fields.get("pid", "0") or 0)
        if alias and pid and _start_time(pid) == fields.get("start") and not _zombie(pid):
            continue  # its creator is still running
        _kill(_netns_pids(ns))
        if _run("ip", "netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
    for workdir in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(prefix) + "-*")):
        try:
            with open(os.path.join(workdir, "owner")) as owner:
                fields = dict(item.split("=", 1) for item in owner.read().split()[1:] if "=" in item)
        except OSError:
            continue
        pid = int(fields.get("pid", "0") or 0)
        if fields.get("prefix") == prefix and not (_start_time(pid) == fields.get("start") and not _zombie(pid)):
            shutil.rmtree(workdir, ignore_errors=True)  # the hub's log and socket of a world that is gone
    return removed


@dataclass
class HostInfo:
    name: str
    region: str
    nat: bool
    netns: str  # where the host's processes run
    public_netns: str  # the namespace holding its public address: the host's own, or its NAT router's
    ip: str  # reachable (public) address
    private_ip: str  # the address on the host itself
    port: str  # the hub's name for its TAP
    nat_index: int = -1


_live: set[World] = set()
_atexit_registered = False
_previous_sigterm = None


def _teardown_live() -> None:
    for world in list(_live):
        try:
            world.teardown()
        except Exception as e:  # noqa: BLE001 - best effort while exiting
            print(f"world {world.prefix}: teardown failed: {e}", file=sys.stderr)


def _on_sigterm(signum, frame):
    """SIGTERM with no handler of the program's own: tear down, then die of it as before. A
    program with its own handler gets it called instead (its cleanup, and atexit, take over)."""
    previous = _previous_sigterm
    if callable(previous):
        return previous(signum, frame)
    if previous == signal.SIG_IGN:
        return None
    _teardown_live()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    return None


def _install_handlers() -> None:
    global _atexit_registered, _previous_sigterm
    if not _atexit_registered:
        atexit.register(_teardown_live)
        _atexit_registered = True
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _previous_sigterm = current
        signal.signal(signal.SIGTERM, _on_sigterm)


class World:
    """Hosts in regions; ``links`` maps region pairs (unordered; ``("a", "a")``: inside a) to a
    ``LinkSpec``. A pair of regions with no entry is an error; inside a region it means no
    impairment. ``mtu``: of every interface (large, so that the hub sees few frames: see
    docs/world.md). ``tcp_congestion``: the hosts' default TCP congestion control; None keeps
    what new namespaces get (the machine's own setting). A namespace may only pick one listed
    in the machine's ``net.ipv4.tcp_allowed_congestion_control``; a root process can still pick
    any available one per socket (``TCP_CONGESTION``)."""

    def __init__(self, links: dict[tuple[str, str], LinkSpec], *, prefix: str | None = None, subnet: str = "10.77",
                 mtu: int = DEFAULT_MTU, seed: int | None = None, tcp_congestion: str | None = None,
                 workdir: str | None = None):
        if not re.fullmatch(r"(25[0-5]|2[0-4]\d|1?\d?\d)\.(25[0-5]|2[0-4]\d|1?\d?\d)", subnet):
            raise ValueError(f"subnet is the first two octets, like '10.77'; got {subnet!r}")
        self.prefix = prefix or f"odw{os.getpid()}"
        if not _NAME.match(self.prefix):
            raise ValueError(f"bad prefix {self.prefix!r}")
        if not 1280 <= mtu <= 65521:
            raise ValueError(f"mtu must be within 1280..65521, got {mtu}")
        if tcp_congestion is not None and not re.fullmatch(r"[a-z0-9_]+", tcp_congestion):
            raise ValueError(f"bad congestion control name {tcp_congestion!r}")
        self.subnet, self.mtu, self.seed, self.tcp_congestion = subnet, mtu, seed, tcp_congestion
        self.links: dict[str, LinkSpec] = {}
        self.regions: list[str] = []
        for (a, b), spec in links.items():
            key = link_key(self._region(a), self._region(b))
            if key in self.links and self.links[key] != spec:
                raise ValueError(f"two different specs for regions {a!r} and {b!r}")
            self.links[key] = spec
        self.hosts: dict[str, HostInfo] = {}
        self._pending: list[HostInfo] = []
        self._next_address: dict[str, int] = {}
        self._next_nat = 0
        self._next_port = 0
        self.hub_ns = f"{self.prefix}-hub"
        self.hub: subprocess.Popen | None = None
        self._workdir_arg = workdir
        self.workdir: str | None = None
        self._created: list[str] = []  # namespaces, in order of creation
        self._control: socket.socket | None = None
        self._reader = None
        self._lock = threading.RLock()
        self.is_set_up = False

    # ---- naming and addresses

    def _region(self, region: str) -> str:
        if not isinstance(region, str) or not region or "|" in region or region.strip() != region:
            raise ValueError(f"bad region name {region!r}")
        if region not in self.regions:
            if len(self.regions) >= 127:
                raise ValueError("at most 127 regions")
            self.regions.append(region)
        return region

    def _public_ip(self, region: str) -> str:
        n = self._next_address.get(region, 0) + 1
        if n > 254:
            raise ValueError(f"region {region!r} has no address left")
        self._next_address[region] = n
        return f"{self.subnet}.{self.regions.index(region) + 1}.{n}"

    def _check_links(self, region: str) -> None:
        for other in self.regions:
            if other != region and any(h.region == other for h in self._all_hosts()):
                if link_key(region, other) not in self.links:
                    raise ValueError(f"no link given between regions {region!r} and {other!r}")

    def _all_hosts(self) -> list[HostInfo]:
        return list(self.hosts.values()) + self._pending

    # ---- lifecycle

    def setup(self) -> World:
        reason = unavailable_reason(nat=any(h.nat for h in self._pending))
        if reason:
            raise WorldError(reason)
        if self.is_set_up:
            return self
        cleanup_stale(self.prefix)
        _install_handlers()
        _live.add(self)
        try:
            self.workdir = tempfile.mkdtemp(prefix=f"{self.prefix}-", dir=self._workdir_arg)
            with open(os.path.join(self.workdir, "owner"), "w") as f:
                f.write(_mark_of(os.getpid(), self.prefix) + "\n")
            self._add_netns(self.hub_ns)
            control = os.path.join(self.workdir, "hub.sock")
            args = [sys.executable, os.path.abspath(wan.__file__), "--control", control, "--mtu", str(self.mtu),
                    "--parent", str(os.getpid())]
            if self.seed is not None:
                args += ["--seed", str(self.seed)]
            with open(os.path.join(self.workdir, "hub.log"), "ab") as log:
                self.hub = subprocess.Popen(["ip", "netns", "exec", self.hub_ns, *args], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self._connect(control)
            for key, spec in self.links.items():
                a, _, b = key.partition("|")
                self._call("set_link", a=a, b=b, spec=spec.to_dict())
            self.is_set_up = True
            pending, self._pending = self._pending, []
            for host in pending:
                self._create(host)
        except BaseException:
            self.teardown()
            raise
        return self

    def __enter__(self) -> World:
        return self.setup()

    def __exit__(self, *exc) -> None:
        errors = self.teardown()
        if errors and exc[0] is None:
            raise WorldError(f"teardown: {errors}")

    def teardown(self) -> list[str]:
        """Ends the hub and every process left in the world's namespaces, deletes the namespaces;
        returns what went wrong (empty: all clean). Safe to call twice."""
        errors: list[str] = []
        with self._lock:
            _live.discard(self)
            self.is_set_up = False
            if self._control is not None:
                try:
                    self._control.close()
                except OSError:
                    pass
                self._control = None
            if self.hub is not None:
                if self.hub.poll() is None:
                    self.hub.terminate()
                    try:
                        self.hub.wait(5)
                    except subprocess.TimeoutExpired:
                        self.hub.kill()
                        self.hub.wait(5)
                        errors.append("the hub ignored SIGTERM")
            for ns in reversed(self._created):
                leftover = _netns_pids(ns)
                if leftover:
                    errors.append(f"{ns}: processes still running, killed: {leftover}")
                    _kill(leftover)
                proc = _run("ip", "netns", "del", ns, check=False)
                if proc.returncode != 0:
                    errors.append(f"{ns}: {proc.stderr.strip()}")
            self._created.clear()
            self.hosts.clear()
            if self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir = None
        return errors

    # ---- the hub's control channel

    def _connect(self, path: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.hub.poll() is not None:
                raise WorldError(f"the hub exited with {self.hub.returncode}: {self.hub_log()}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise WorldError(f"the hub did not open its control socket in {timeout}s: {self.hub_log()}") \
                        from None
                time.sleep(0.02)
        sock.settimeout(10.0)
        self._control = sock
        self._reader = sock.makefile("rb")
        self._call("ping")

    def _call(self, cmd: str, **args) -> dict:
        with self._lock:
            if self._control is None:
                raise WorldError("the world is not set up")
            try:
                self._control.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
                line = self._reader.readline()
            except OSError as e:
                raise WorldError(f"hub control: {e}; {self.hub_log()}") from e
            if not line:
                raise WorldError(f"the hub closed its control channel: {self.hub_log()}")
            reply = json.loads(line)
            if not reply.pop("ok", False):
                raise WorldError(f"hub: {cmd}: {reply.get('error')}")
            return reply

    def hub_log(self, tail: int = 2000) -> str:
        if not self.workdir:
            return ""
        try:
            with open(os.path.join(self.workdir, "hub.log"), errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    @property
    def hub_pid(self) -> int | None:
        return self.hub.pid if self.hub is not None else None

    # ---- hosts

    def _add_netns(self, ns: str, *sysctls: str) -> None:
        _run("ip", "netns", "add", ns)
        self._created.append(ns)
        # mark it first: cleanup_stale() knows it by this; then loopback up, IPv6 off
        _run("ip", "-n", ns, "link", "set", "lo", "alias", _mark_of(os.getpid(), self.prefix), "up")
        _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1", *sysctls)

    def add_host(self, name: str, region: str, *, nat: bool = False) -> str:
        """Adds a host (before or after ``setup()``); returns the namespace its processes run in."""
        if not isinstance(name, str) or not _NAME.match(name) or name == "hub" or name.endswith("-nat"):
            raise ValueError(f"bad host name {name!r} (letters, digits, '_.-'; not 'hub', not ending in '-nat')")
        if name in self.hosts or any(h.name == name for h in self._pending):
            raise ValueError(f"host {name!r} exists")
        region = self._region(region)
        self._check_links(region)
        ns = f"{self.prefix}-{name}"
        self._next_port += 1
        host = HostInfo(name=name, region=region, nat=nat, netns=ns,
                        public_netns=f"{ns}-nat" if nat else ns, ip=self._public_ip(region), private_ip="",
                        port=f"wan{self._next_port}")
        if nat:
            if self._next_nat >= 128:
                raise ValueError("at most 128 NAT'd hosts")
            host.nat_index = self._next_nat
            self._next_nat += 1
            host.private_ip = f"{self.subnet}.{128 + host.nat_index}.2"
        else:
            host.private_ip = host.ip
        if not self.is_set_up:
            self._pending.append(host)
            return ns
        reason = unavailable_reason(nat=nat)
        if reason:
            raise WorldError(reason)
        self._create(host)
        return ns

    def _create(self, host: HostInfo) -> None:
        try:
            self._build(host)
        except BaseException:
            self.hosts.pop(host.name, None)  # its namespaces, if any, go at teardown
            raise

    def _build(self, host: HostInfo) -> None:
        with self._lock:
            self.hosts[host.name] = host
            cc = [f"net.ipv4.tcp_congestion_control={self.tcp_congestion}"] if self.tcp_congestion else []
            self._add_netns(host.netns, *cc)
            if host.nat:
                self._add_netns(host.public_netns)
            self._call("attach", port=host.port, host=host.name, region=host.region)
            _run("ip", "-n", self.hub_ns, "link", "set", host.port, "netns", host.public_netns)
            # the public side: the host itself, or its router
            _run("ip", "-n", host.public_netns, "-batch", "-", input="\n".join([
                f"link set {host.port} name eth0",
                f"link set eth0 mtu {self.mtu} up",
                f"addr add {host.ip}/{_PUBLIC_PREFIX} dev eth0",
            ]) + "\n")
            if not host.nat:
                return
            router, lan = host.public_netns, f"{self.subnet}.{128 + host.nat_index}"
            _run("ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0",
                 "netns", host.netns)
            _run("ip", "-n", router, "-batch", "-", input=(
                f"link set lan0 mtu {self.mtu} up\naddr add {lan}.1/24 dev lan0\n"))
            _run("ip", "-n", host.netns, "-batch", "-", input=(
                f"link set eth0 mtu {self.mtu} up\naddr add {lan}.2/24 dev eth0\n"
                f"route add default via {lan}.1\n"))
            _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            # a home router: out through MASQUERADE; in, only what belongs to connections from inside
            _run("ip", "netns", "exec", router, "iptables-restore", input="\n".join([
                "*nat",
                "-A POSTROUTING -o eth0 -j MASQUERADE",
                "COMMIT",
                "*filter",
                ":INPUT ACCEPT [0:0]",
                ":FORWARD ACCEPT [0:0]",
                ":OUTPUT ACCEPT [0:0]",
                "-A FORWARD -i eth0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                "-A FORWARD -i eth0 -j DROP",
                "-A INPUT -i eth0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                "-A INPUT -i eth0 -p icmp -j ACCEPT",
                "-A INPUT -i eth0 -j DROP",
                "COMMIT",
            ]) + "\n")

    def _host(self, name: str) -> HostInfo:
        host = self.hosts.get(name) or next((h for h in self._pending if h.name == name), None)
        if host is None:
            raise KeyError(f"no host {name!r}")
        return host

    def host(self, name: str) -> HostInfo:
        return self._host(name)

    def netns(self, name: str) -> str:
        return self._host(name).netns

    def region_of(self, name: str) -> str:
        return self._host(name).region

    def ip_of(self, name: str) -> str:
        """The address other hosts reach this one at (a NAT'd host's: its router's)."""
        return self._host(name).ip

    def private_ip_of(self, name: str) -> str:
        """The address on the host's own interface (differs from ``ip_of`` for a NAT'd host)."""
        return self._host(name).private_ip

    def exec(self, name: str, *cmd: str) -> list[str]:
        """The argv that runs ``cmd`` inside the host's namespace."""
        return ["ip", "netns", "exec", self._host(name).netns, *cmd]

    def counters(self, name: str) -> dict[str, int]:
        """Bytes and packets the host's ``eth0`` has sent and received so far."""
        out = _run("ip", "-n", self._host(name).netns, "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def readdress(self, name: str) -> str:
        """Gives the host (a NAT'd one: its router) a new public address; the old one is gone at
        once (connections on it break). Returns the new address."""
        host = self._host(name)
        new = self._public_ip(host.region)
        if host.name in self.hosts:
            # delete first: deleting a primary address would take a secondary in its subnet along
            _run("ip", "-n", host.public_netns, "-batch", "-", input=(
                f"addr del {host.ip}/{_PUBLIC_PREFIX} dev eth0\naddr add {new}/{_PUBLIC_PREFIX} dev eth0\n"))
        host.ip = new
        if not host.nat:
            host.private_ip = new
        return new

    # ---- the network

    def set_link(self, a: str, b: str, spec: LinkSpec) -> None:
        """Changes a link class now (frames already scheduled keep their times)."""
        key = link_key(self._region(a), self._region(b))
        self.links[key] = spec
        if self.is_set_up:
            self._call("set_link", a=a, b=b, spec=spec.to_dict())

    def link(self, a: str, b: str) -> LinkSpec:
        return self.links.get(link_key(a, b), LinkSpec())

    def partition(self, *groups: set[str] | list[str] | tuple[str, ...]) -> None:
        """Frames between regions of different groups are dropped; regions named in no group
        form one more group together (so ``partition({"a"})`` cuts a off from the rest)."""
        seen: set[str] = set()
        for group in groups:
            for region in group:
                if region in seen:
                    raise ValueError(f"region {region!r} is in two groups")
                seen.add(region)
        self._call("partition", groups=[sorted(g) for g in groups])

    def heal(self) -> None:
        self._call("heal")

    def disconnect(self, name: str) -> None:
        """Drops every frame to and from this host (its cable pulled) until ``reconnect``."""
        self._call("port", host=name, up=False)

    def reconnect(self, name: str) -> None:
        self._call("port", host=name, up=True)

    def stats(self) -> dict:
        """The hub's counters: per link class (``"a|b"``) frames and bytes delivered and frames
        dropped by loss, partition, full queue and disconnection; per host; the hub's own."""
        return self._call("stats")
