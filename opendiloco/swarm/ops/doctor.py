"""``opendiloco doctor``: can this machine take part in a swarm, and if not, what to do.

It starts a p2p daemon the way a worker would (same listen and announce addresses, same client mode)
and asks each initial peer, one at a time: does it answer, how far away is it, how far off is this
clock, and can it dial this node back at the address it sees it at (``reachability.py``). Each finding
is one line: ``ok``, ``warn`` or ``fail``, and what to do about it. A worker runs the reachability part
against its first initial peer when it starts (``startup_warnings``) and logs what is wrong.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import SwarmError
from ...timeouts import DIAL_BACK_TIMEOUT as DIAL_TIMEOUT
from ..connectivity.reachability import Probe, address_kind, ip_and_port, probe
from ..daemon.node import start_dht, visible_maddrs

log = logging.getLogger(__name__)

CLOCK_LIMIT_S = 3.0
"""hivemind's DHT admits no peer whose clock is farther off than this (``MAX_DHT_TIME_DISCREPANCY_SECONDS``)."""
CLOCK_WARN_S = 1.0


@dataclass(frozen=True)
class Finding:
    level: str
    """``ok``, ``warn`` or ``fail``."""
    text: str

    def __str__(self) -> str:
        return f"{self.level:<4} {self.text}"


def _short(addr: str) -> str:
    ip_port = ip_and_port(addr)
    peer = addr.rsplit("/p2p/", 1)[-1][-8:] if "/p2p/" in addr else "?"
    return f"{ip_port[0]}:{ip_port[1]} (…{peer})" if ip_port else addr


def judge_addresses(announced: Sequence[str], initial_peers: Sequence[str], client_mode: bool) -> list[Finding]:
    """What the addresses this node announces say, before any peer is asked."""
    ips = sorted({ip for ip, _ in filter(None, map(ip_and_port, announced))})
    if not ips:
        return [Finding("fail", "this node announces no TCP address: peers cannot dial it; listen on one "
                                "(host_maddrs, e.g. /ip4/0.0.0.0/tcp/31337)")]
    kinds = {address_kind(ip) for ip in ips}
    found = [Finding("ok", f"this node announces {', '.join(ips)}" + (" (client mode: it only dials out)"
                                                                       if client_mode else ""))]
    peer_kinds = {address_kind(ip) for ip, _ in filter(None, map(ip_and_port, initial_peers))}
    if kinds == {"loopback"} and peer_kinds - {"loopback"}:
        found.append(Finding("fail", "this node announces only loopback addresses, and its initial peers are on other "
                                     "machines: listen on a real interface (host_maddrs /ip4/0.0.0.0/tcp/PORT)"))
    return found


def judge_probe(p: Probe, announced: Sequence[str], client_mode: bool) -> list[Finding]:
    """What one initial peer's answers say."""
    peer = _short(p.peer)
    if p.error is not None:
        return [Finding("fail", f"initial peer {peer} does not answer ({p.error}): is it running, is its port open "
                                "to this machine, is the address copied whole with its /p2p/ part?")]
    rtt = f", round trip {p.rtt_s * 1000:.0f} ms" if p.rtt_s is not None else ""
    found = [Finding("ok", f"initial peer {peer} answers: connected in {p.connect_s * 1000:.0f} ms{rtt}")]
    if p.clock_offset_s is not None:
        off = p.clock_offset_s
        side = "behind" if off > 0 else "ahead of"
        if abs(off) > CLOCK_LIMIT_S:
            found.append(Finding("fail", f"this machine's clock is {abs(off):.1f} s {side} {peer}'s; the DHT admits no "
                                         f"peer more than {CLOCK_LIMIT_S:g} s off: set the clock (NTP, e.g. "
                                         "`timedatectl set-ntp true`)"))
        elif abs(off) > CLOCK_WARN_S:
            found.append(Finding("warn", f"this machine's clock is {abs(off):.1f} s {side} {peer}'s (the DHT admits "
                                         f"{CLOCK_LIMIT_S:g} s): keep it in sync (NTP)"))
        else:
            found.append(Finding("ok", f"clocks agree with {peer} within {max(abs(off), 0.001):.3f} s"))
    found += judge_reach(p, announced, client_mode)
    return found


def judge_reach(p: Probe, announced: Sequence[str], client_mode: bool) -> list[Finding]:
    peer = _short(p.peer)
    if p.reach_error is not None or p.observed is None:
        return [Finding("warn", f"could not check whether {peer} can dial this node back ({p.reach_error})")]
    seen = ip_and_port(p.observed)
    seen_ip = seen[0] if seen else p.observed
    own = sorted({ip for ip, _ in filter(None, map(ip_and_port, announced))})
    if client_mode:
        return [Finding("ok", f"{peer} sees this node at {seen_ip}; in client mode it dials out only (it takes part "
                              "in rounds through connections it opens)")]
    ports = sorted(set(p.open_ports) | set(p.closed_ports))
    if seen_ip not in own:
        if p.open_ports:
            return [Finding("warn", f"{peer} sees this node at {seen_ip}, which it does not announce (it announces "
                                    f"{', '.join(own)}): a NAT forwards port {p.open_ports[0]}; announce "
                                    f"/ip4/{seen_ip}/tcp/{p.open_ports[0]} (announce_maddrs) so that peers dial it")]
        return [Finding("fail", f"behind NAT: {peer} sees this node at {seen_ip}, it announces {', '.join(own)}, and "
                                f"the peer could not dial it back: join in client mode (client_mode = true; it then "
                                f"dials out only), or forward port {ports[0] if ports else 'PORT'} on the router and "
                                f"announce /ip4/{seen_ip}/tcp/PORT (announce_maddrs)")]
    if p.closed_ports and not p.open_ports:
        return [Finding("fail", f"{peer} sees this node at {seen_ip} but could not dial port(s) "
                                f"{', '.join(map(str, p.closed_ports))} there: a firewall blocks them; open them, or "
                                "join in client mode (client_mode = true)")]
    return [Finding("ok", f"reachable: {peer} dialled this node back at {seen_ip}, port(s) "
                          f"{', '.join(map(str, p.open_ports))}")]


def _ports(announced: Sequence[str]) -> list[int]:
    return sorted({port for _, port in filter(None, map(ip_and_port, announced))})


def _ask(dht, addr: str, ports: list[int], timeout: float) -> Probe:
    future = dht.run_coroutine(functools.partial(probe, addr=addr, ports=ports, timeout=timeout), return_future=True)
    try:  # the probe's own steps: a dial, connect, ping, open a stream, its answer (after the dial-back)
        return future.result(5 * timeout + DIAL_TIMEOUT + 5)
    except Exception as e:  # the DHT process itself did not answer
        return Probe(peer=addr, error=f"no answer from the probe: {type(e).__name__}: {e}")


def examine(*, initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str] = (),
            client_mode: bool = False, startup_timeout: float = 30.0, timeout: float = 10.0) -> list[Finding]:
    """Every check, as findings (the daemon, the addresses, each initial peer)."""
    began = time.monotonic()
    try:
        dht = start_dht(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, client_mode=client_mode,
                        startup_timeout=startup_timeout)
    except SwarmError as e:
        return [Finding("fail", f"the p2p daemon did not start: {e}")]
    started = time.monotonic() - began
    level = "ok" if started < startup_timeout / 2 else "warn"
    found = [Finding(level, f"the p2p daemon started in {started:.1f} s (a worker waits up to {startup_timeout:g} s)")]
    try:
        announced = visible_maddrs(dht)
        found += judge_addresses(announced, initial_peers, client_mode)
        if not initial_peers:
            found.append(Finding("warn", "no initial peers given: nothing to check against (a worker without them "
                                         "starts a swarm of its own)"))
        for addr in initial_peers:
            found += judge_probe(_ask(dht, addr, _ports(announced), timeout), announced, client_mode)
    finally:
        dht.shutdown()
    return found


def startup_warnings(dht, initial_peers: Sequence[str], client_mode: bool, timeout: float = 10.0) -> list[Finding]:
    """A worker's short check at start: can its first initial peer dial it back? Only what is wrong."""
    if not initial_peers:
        return []
    announced = visible_maddrs(dht)
    p = _ask(dht, initial_peers[0], _ports(announced), timeout)
    if p.error is not None or p.reach_error is not None:  # joining says so; an older peer, or asked too often
        log.debug("reachability check at start: %s", p.error or p.reach_error)
        return []
    return [f for f in judge_reach(p, announced, client_mode) if f.level != "ok"]
