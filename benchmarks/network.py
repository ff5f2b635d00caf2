"""Where the benchmark's processes run: all on 127.0.0.1, or one emulated host each (namespaces).

Host 0 is the swarm's bootstrap (or gloo's rendezvous is on host 1); hosts 1..N are the workers.
"""

from __future__ import annotations

from opendiloco.testing.netns import Hosts
from opendiloco.testing.ports import free_port


class Loopback:
    """Every process on 127.0.0.1 in this machine's own namespace; no per-host byte counters."""

    kind = "loopback"
    link_mbit: float | None = None

    def __init__(self, hosts: int):
        self.hosts = hosts

    def ip(self, i: int) -> str:
        return "127.0.0.1"

    def port(self, i: int, base: int) -> int:
        return free_port()

    def cmd(self, i: int, args: list[str]) -> list[str]:
        return args

    def env(self, i: int) -> dict:
        return {}

    def counters(self, i: int) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        pass


class Namespaces:
    """One network namespace per host on a bridge; optionally each worker's link shaped with tbf."""

    kind = "netns"

    def __init__(self, hosts: int, *, link_mbit: float | None = None, subnet: str = "10.204.0"):
        self.link_mbit = link_mbit
        self.net = Hosts(hosts, subnet=subnet).setup()
        try:
            if link_mbit:
                for i in range(1, hosts):
                    self.net.shape(i, link_mbit)
        except BaseException:
            self.net.teardown()
            raise

    @property
    def hosts(self) -> int:
        return len(self.net)

    def ip(self, i: int) -> str:
        return self.net.ip_of(i)

    def port(self, i: int, base: int) -> int:
        return base  # every host has its own port space

    def cmd(self, i: int, args: list[str]) -> list[str]:
        return self.net.exec(i, *args)

    def env(self, i: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": "eth0"}

    def counters(self, i: int) -> dict[str, int] | None:
        return self.net.counters(i)

    def close(self) -> None:
        self.net.teardown()
