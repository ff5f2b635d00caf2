"""hivemind's p2p streams as the round runner's transport: raw byte streams, authenticated peer ids.

libp2p authenticates the remote end of every stream; ``ByteStream.remote`` is that peer id,
never something a peer wrote. Frames and their bounds are ``opendiloco.comm.wire``'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from ..comm.wire import ByteStream


class P2PStreams:
    """One named stream protocol on a p2p node: ``connect`` opens a stream, ``listen`` serves them."""

    def __init__(self, p2p: P2P, name: str):
        self.p2p, self.name = p2p, name

    async def listen(self, on_stream: Callable[[ByteStream], Awaitable[None]]) -> None:
        async def handle(info, reader, writer):
            await on_stream(ByteStream(reader, writer, remote=info.peer_id.to_base58()))

        await self.p2p.add_binary_stream_handler(self.name, handle)

    async def connect(self, peer: str) -> ByteStream:
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.name)
        return ByteStream(reader, writer, remote=peer)
