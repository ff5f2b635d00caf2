"""Can peers reach this node? A dial-back check, and what a node learns from its initial peers.

Every node of ours (workers, the bootstrap, ``opendiloco doctor``'s probe) serves ``REACH``: a peer
names its TCP listening ports, and the node answers with the address it sees that peer at (libp2p's
remote address of the stream, not something the peer wrote) and which of those ports it could open a
*new* TCP connection to at that address. A node behind NAT is seen at its router's address, which it
does not announce, and its ports there are closed; a node behind a firewall is seen at its own address
with its port closed. The reused connection the question came over proves nothing, so the answer is
always a fresh dial.

The dial goes only to the asker's own observed address, never through a relay (there the address is
the relay's), at most ``MAX_PORTS`` ports, each one TCP connect that is closed at once, at most once per
asker per ``PER_PEER_S`` and for ``MAX_DIALLING`` askers at a time: the service cannot be used to make a
node connect anywhere else, nor to hold its sockets. ``probe`` (run inside a DHT process) asks one initial peer:
connect, ping (round trip and the peer's clock), then ``REACH``.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import time
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from ...comm.wire import ByteStream, Code
from ...comm.wire import field as meta_field
from ...timeouts import DIAL_BACK_PER_PEER_S as PER_PEER_S
from ...timeouts import DIAL_BACK_TIMEOUT as DIAL_TIMEOUT
from ..daemon import hivemind_privates

log = logging.getLogger(__name__)

PROTOCOL = "opendiloco.reach"
MAX_PORTS = 4
MAX_ASKERS = 4096
MAX_DIALLING = 8


def address_kind(ip: str) -> str:
    """``loopback``, ``private`` (RFC 1918, shared CGNAT space, link-local, unique local) or ``public``."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return "unknown"
    if addr.is_loopback:
        return "loopback"
    if addr.is_private or addr.is_link_local or (addr.version == 4 and addr in ipaddress.ip_network("100.64.0.0/10")):
        return "private"
    return "public"


def ip_and_port(maddr: str) -> tuple[str, int] | None:
    """(ip, tcp port) of a multiaddr like ``/ip4/1.2.3.4/tcp/5/p2p/...``; None for other kinds."""
    parts = str(maddr).strip("/").split("/")
    if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[3].isdigit():
        return parts[1], int(parts[3])
    return None


def direct(observed: str) -> bool:
    """Whether a stream came straight from its peer (``/ip4|ip6/ADDR/tcp/PORT``, perhaps ``/p2p/ID``):
    through a relay, the address is the relay's, which the asker must not make this node dial."""
    parts = str(observed).strip("/").split("/")
    return ip_and_port(observed) is not None and (len(parts) == 4 or (len(parts) == 6 and parts[4] == "p2p"))


class ReachServer:
    """Answers ``REACH`` on a p2p node (registered inside its DHT process by ``serve``): at most
    ``MAX_DIALLING`` answers being dialled at once, each asker once per ``PER_PEER_S``."""

    def __init__(self):
        self._last: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._dialling = asyncio.Semaphore(MAX_DIALLING)

    def _asked_recently(self, peer: str, now: float) -> bool:
        if now - self._last.get(peer, -PER_PEER_S) < PER_PEER_S:
            return True
        self._last[peer] = now
        self._last.move_to_end(peer)
        while len(self._last) > MAX_ASKERS:  # oldest first: fresh identities cannot grow it without bound
            self._last.popitem(last=False)
        return False

    async def handle(self, info, reader, writer) -> None:
        stream = ByteStream(reader, writer, remote=info.peer_id.to_base58())
        try:
            frame = await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.REACH), 5.0)
            ports = meta_field(frame.meta, "ports", list)
            ports = [p for p in ports[:MAX_PORTS] if isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536]
            observed = str(info.addr)[:200]
            refused = ("relayed: no dial-back through a relay" if not direct(observed)
                       else "busy" if self._dialling.locked()
                       else "asked too often" if self._asked_recently(stream.remote, time.monotonic()) else None)
            if refused:
                await stream.send(Code.REACH_ANSWER, {"observed": observed, "refused": refused})
                return
            target = ip_and_port(observed)
            async with self._dialling:
                results = await asyncio.gather(*(_dial(target[0], p) for p in ports))
            await stream.send(Code.REACH_ANSWER, {"observed": observed,
                                                  "open": [p for p, ok in zip(ports, results) if ok],
                                                  "closed": [p for p, ok in zip(ports, results) if not ok]})
        except Exception as e:  # a bad question gets no answer
            log.debug("reach request from %s: %s: %s", stream.remote[-8:], type(e).__name__, e)
        finally:
            stream.close()


async def _dial(ip: str, port: int, timeout: float = DIAL_TIMEOUT) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def serve(dht, node) -> None:
    """Runs in a DHT process (``dht.run_coroutine(serve)``): registers the ``REACH`` handler."""
    await node.p2p.add_binary_stream_handler(PROTOCOL, ReachServer().handle)


@dataclass
class Probe:
    """What one initial peer told this node."""

    peer: str
    error: str | None = None
    connect_s: float | None = None
    rtt_s: float | None = None
    clock_offset_s: float | None = None
    """The peer's clock minus this one's (± rtt / 2)."""
    observed: str | None = None
    """The address the peer sees this node at."""
    open_ports: list[int] = field(default_factory=list)
    closed_ports: list[int] = field(default_factory=list)
    reach_error: str | None = None


async def probe(dht, node, addr: str, ports: list[int], timeout: float) -> Probe:
    """Runs in a DHT process: connects to the initial peer ``addr``, pings it, asks it to dial back."""
    from hivemind.proto import dht_pb2
    from hivemind.utils.timed_storage import get_dht_time

    maddr = Multiaddr(addr)
    base58 = maddr.value_for_protocol("p2p")
    peer_id = PeerID.from_base58(base58)
    result = Probe(peer=addr)
    p2p: P2P = node.p2p
    target = ip_and_port(addr)
    if target is not None and not await _dial(*target, timeout=timeout):  # the address itself, not a known peer
        result.error = f"nothing accepts a TCP connection at {target[0]}:{target[1]} within {timeout:g} s"
        return result
    began = time.perf_counter()
    try:
        where = [maddr.decapsulate(Multiaddr(f"/p2p/{base58}"))]
        await asyncio.wait_for(hivemind_privates.connect(p2p, peer_id, where), timeout)
    except Exception as e:  # unreachable, refused, wrong peer id: all said as one line
        result.error = f"{type(e).__name__}: {e}".strip().rstrip(":") if str(e) else type(e).__name__
        return result
    result.connect_s = time.perf_counter() - began
    try:
        asked = get_dht_time()
        t0 = time.perf_counter()
        response = await node.protocol.get_stub(peer_id).rpc_ping(
            dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False), timeout=timeout)
        result.rtt_s = time.perf_counter() - t0
        if response.dht_time:
            result.clock_offset_s = response.dht_time - (asked + result.rtt_s / 2)
    except Exception as e:
        log.debug("ping %s: %s", addr, e)
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer_id, PROTOCOL), timeout)
        stream = ByteStream(reader, writer, remote=peer_id.to_base58())
        try:
            await stream.send(Code.REACH, {"ports": ports[:MAX_PORTS]})
            answer = await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.REACH_ANSWER),
                                            timeout + DIAL_TIMEOUT)
        finally:
            stream.close()
        result.observed = meta_field(answer.meta, "observed", str)[:200]
        if "refused" in answer.meta:
            result.reach_error = str(answer.meta["refused"])[:100]
        else:
            result.open_ports = [p for p in meta_field(answer.meta, "open", list) if isinstance(p, int)][:MAX_PORTS]
            result.closed_ports = [p for p in meta_field(answer.meta, "closed", list) if isinstance(p, int)][:MAX_PORTS]
    except Exception as e:  # an older peer without the service, or a broken answer
        result.reach_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return result
