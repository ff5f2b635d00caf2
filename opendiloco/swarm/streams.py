"""hivemind's p2p streams as the round runner's transport: raw byte streams, authenticated peer ids.

libp2p authenticates the remote end of every stream; ``ByteStream.remote`` is that peer id,
never something a peer wrote. Frames and their bounds are ``opendiloco.comm.wire``'s.

In a closed run every stream opens with ``HELLO``: the opener's proof of the run secret, bound
to the protocol and both peer ids (``Membership.stream_proof``). A stream without a valid one
is refused before its handler sees a byte of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from ..comm.wire import ByteStream, Code
from ..errors import Unreachable
from ..timeouts import STREAM_HELLO_TIMEOUT as HELLO_TIMEOUT
from .connectivity.addresses import AddressBook, dial_addrs
from .connectivity.relays import RelayLinks
from .connectivity.reversal import ConnectionReversal
from .membership import Membership

log = logging.getLogger(__name__)

NOT_REACHED = ("failed to dial", "routing: not found", "failed to find any peer in table")
"""What the daemon says when it could not connect to a peer at all: no address of it answered, or it
knows none (nothing was exchanged)."""


class P2PStreams:
    """One named stream protocol on a p2p node: ``connect`` opens a stream, ``listen`` serves them."""

    def __init__(self, p2p: P2P, name: str, membership: Membership | None = None,
                 relay_links: RelayLinks | None = None, address_book: AddressBook | None = None,
                 reversal: ConnectionReversal | None = None):
        self.p2p, self.name = p2p, name
        self.relay_links = relay_links
        """Where peers behind NAT can be reached: a stream to one of them goes through its relays."""
        self.address_book = address_book
        """Where public peers listen now, as their records say: dialled when the daemon's own dial fails."""
        self.reversal = reversal
        """A public worker's way to a peer behind NAT that it cannot dial: the peer dials back."""
        self.membership = membership if membership is not None and membership.closed else None
        self.me = p2p.peer_id.to_base58()
        self.refused = 0
        """Streams refused for want of a valid proof (for status and tests)."""

    async def listen(self, on_stream: Callable[[ByteStream], Awaitable[None]]) -> None:
        async def handle(info, reader, writer):
            stream = ByteStream(reader, writer, remote=info.peer_id.to_base58())
            try:
                if self.membership is not None and not await self._admit(stream):
                    return
                await on_stream(stream)
            except asyncio.CancelledError:  # the node is shutting down: the stream ends with it, no traceback
                stream.close()

        await self.p2p.add_binary_stream_handler(self.name, handle)

    async def _admit(self, stream: ByteStream) -> bool:
        try:
            hello = await asyncio.wait_for(stream.recv(max_payload=0, expect=Code.HELLO), HELLO_TIMEOUT)
            if self.membership.admits(hello.meta.get("proof"), self.name, stream.remote, self.me):
                return True
            reason = "not a member of this run"
        except Exception as e:  # garbage, silence, or a closed stream: the same answer
            reason = f"no valid membership proof ({type(e).__name__})"
        self.refused += 1
        log.debug("refused a %s stream from %s: %s", self.name, stream.remote[-8:], reason)
        await stream.refuse("not a member of this run")
        stream.close()
        return False

    async def connect(self, peer: str) -> ByteStream:
        if self.relay_links is not None:  # a peer behind NAT: through its relays, on a connection kept open
            await self.relay_links.ensure(peer)
        try:
            reader, writer = await self._open(peer)
        except Unreachable:  # at the addresses its daemon knew: its record may name newer ones
            addrs = self.address_book.of(peer) if self.address_book is not None else ()
            if addrs and await dial_addrs(self.p2p, peer, addrs):
                log.info("reached %s at the addresses its record names (%s)", peer[-8:], " ".join(addrs))
            elif self.reversal is None or not await self.reversal.ask(peer):
                raise
            reader, writer = await self._open(peer)
        stream = ByteStream(reader, writer, remote=peer)
        if self.membership is not None:
            await stream.send(Code.HELLO, {"proof": self.membership.stream_proof(self.name, self.me, peer)})
        return stream

    async def _open(self, peer: str):
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.name)
        except ControlFailure as e:
            if not any(says in str(e) for says in NOT_REACHED):  # the daemon reached the peer: another failure
                raise
            raise Unreachable(f"could not dial {peer[-8:]}: {e}", {peer}) from None
        return reader, writer
