"""The only module that touches hivemind's private attributes, pinned to hivemind 1.1.12.

hivemind's public API lacks a few things this project needs; each accessor here names one, and what it
reaches into. A new hivemind release is checked against this file alone (``tests/test_architecture.py``
fails where any other library module reaches a private attribute of hivemind's ``P2P`` or ``DHT``):

- ``P2P._client`` (the daemon's control client, ``p2pclient.Client``): dialling a peer at addresses of
  our choosing (``connect``: its record's addresses, its relays' circuits, an initial peer), closing
  every connection to a peer (``disconnect``: a connection left dead by an address change), and
  opening a stream of a libp2p protocol that hivemind does not serve (``open_stream``: circuit relay
  v2's RESERVE, libp2p's ping). ``P2P`` opens streams only of its own handlers' protocols.
- ``P2P._make_process_args`` (the daemon's command line from its keyword arguments): a flag hivemind
  does not pass on (``edit_daemon_flags``).
- ``DHT._outer_pipe`` (the parent's end of the pipe to the DHT process), ``DHT._parent_pid`` (the
  process that started the DHT) and the names of the DHT process's request handlers (``_get``,
  ``_store``, ``_run_coroutine``, ``_shutdown``): requests sent and answered by number
  (``node.WorkerBoundDHT``, ``dht_calls.py``), and the watchdog that ends the DHT process with its
  parent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

HIVEMIND_VERSION = "1.1.12"
"""The hivemind release these accessors were written against."""

DHT_GET, DHT_STORE, DHT_RUN_COROUTINE, DHT_SHUTDOWN = "_get", "_store", "_run_coroutine", "_shutdown"
"""The DHT process's request handlers, by the names a request on its pipe calls them."""


async def connect(p2p: P2P, peer: PeerID, addrs: Sequence[Multiaddr]) -> None:
    """Dials ``peer`` at ``addrs`` (the daemon learns them; at once if already connected)."""
    await p2p._client.connect(peer, list(addrs))


async def disconnect(p2p: P2P, peer: PeerID) -> None:
    """Closes every connection the daemon holds to ``peer``: the next stream or call dials anew."""
    await p2p._client.disconnect(peer)


async def open_stream(p2p: P2P, peer: PeerID, protocols: Sequence[str]):
    """A stream to ``peer`` of one of ``protocols`` (any libp2p protocol): its ``(reader, writer)``."""
    _, reader, writer = await p2p._client.stream_open(peer, tuple(protocols))
    return reader, writer


def edit_daemon_flags(edit: Callable[[dict], None]) -> None:
    """Makes every daemon this process starts from now on pass its keyword flags through ``edit``
    (which changes them in place) before they become its command line."""
    make_process_args = P2P._make_process_args

    def edited(*args, **kwargs) -> list[str]:
        edit(kwargs)
        return make_process_args(*args, **kwargs)

    P2P._make_process_args = staticmethod(edited)


def dht_request_pipe(dht: hivemind.DHT):
    """The parent's end of the pipe that carries requests to ``dht``'s process."""
    return dht._outer_pipe


def dht_parent_pid(dht: hivemind.DHT) -> int:
    """The id of the process that started ``dht`` (read in the DHT process too)."""
    return dht._parent_pid
