"""Frames on a byte stream: typed message codes, bounded sizes, and the streams that carry them.

A frame is ``code (u8) | meta length (u32) | payload length (u32) | meta | payload``. ``meta``
is a small msgpack map; ``payload`` is raw bytes (an encoded part of a tensor). A receiver names
the largest payload it will accept *before* reading it, so a peer can never make it buffer more
than the round implies. Nothing here knows hivemind: ``ByteStream`` wraps any asyncio
reader/writer pair (a p2p stream, a socket, or the in-memory pipe used by the protocol tests).
"""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgpack

from ..errors import ProtocolError
from .blame import MAX_BLAMED, blamed

PREFIX = struct.Struct("!BII")
MAX_META_BYTES = 16 << 10
MAX_REASON_CHARS = 300


class Code(enum.IntEnum):
    # reduce-scatter / all-gather (runner.py)
    CONTRIBUTE = 1
    """A member opens its contribution to a shard: group id, sender, weight, element and part counts."""
    PART = 2
    """One encoded part of the contribution (meta: its index)."""
    RESULT = 3
    """The shard owner starts its answer (meta: the group's total weight)."""
    RESULT_PART = 4
    """One encoded part of the averaged shard."""
    RESULT_END = 5
    """The owner's digest of all the averaged shard's bytes."""
    CONFIRM = 6
    """A member's digest of the whole average, sent to every other member before anyone applies it."""
    REFUSE = 7
    """The sender refuses the round or the message (meta: a short reason)."""
    AUDIT = 12
    """A member asks another for its values of chunks of the round's shards (meta: ``chunks``, [owner, part, chunk])."""
    AUDIT_ANSWER = 13
    """One asked chunk: the values (fp32) and their Merkle path (meta: ``path``) to the owner's committed root."""
    # matchmaking (swarm/matchmaking.py)
    GROUP = 8
    """Records of a round key and attempt (meta: both), an announcement or a group with its members'
    announcements, pushed beside the DHT (payload: signed records, ``swarm/pushed_records.py``): the
    receiver checks and keeps them, and wakes its matchmaker."""
    # membership (swarm/streams.py)
    HELLO = 9
    """The first frame of every stream in a closed run: the opener's proof that it holds the run secret."""
    # a failed attempt in doubt (outcome.py)
    ASK_OUTCOME = 10
    """A member whose attempt failed asks another member of it: did you complete round ``group_id``?"""
    OUTCOME = 11
    """The answer: ``state`` (done, failed, running or unknown) and, when done, the average's ``digest``."""
    # state transfer to joiners (swarm/state/transfer.py)
    STATE_REQUEST = 16
    STATE = 17
    STATE_PART = 18
    STATE_MANIFEST_REQUEST = 21
    """A joiner asks for a donor's state at ``outer_step``, cut in parts of ``part_bytes`` (swarm/state/layout.py)."""
    STATE_MANIFEST = 22
    """The donor's answer: ``outer_step`` and flat ``size``; payload: the parts' digests, then the skeleton."""
    STATE_PART_REQUEST = 23
    """A joiner asks for part ``index`` of a manifest it holds (``outer_step``, ``part_bytes``); the
    answer is the part's bytes in STATE_PART frames."""
    STATE_DONE = 24
    """A joiner has taken (and checked) the state of ``outer_step`` it asked this donor for: it is on its
    way to that round now. No answer."""
    # reachability (swarm/connectivity/reachability.py)
    REACH = 19
    """A node asks a peer to dial it back on its listening ports (meta: ``ports``)."""
    REACH_ANSWER = 20
    """The address the peer sees the asker at, and which of its ports it could dial there."""
    # connection reversal (swarm/connectivity/reversal.py)
    REVERSE = 25
    """A public worker asks one behind NAT, through its relay, to dial it back; the same code answers."""


class StreamClosed(ProtocolError):
    """The peer closed the stream (or the connection broke) before a whole frame arrived."""


class Refused(ProtocolError):
    """The peer answered with ``REFUSE``; ``blame``: the members it says caused it (``blamed``); ``stale``:
    it says it is not in that attempt at all (``blame.py``)."""

    def __init__(self, message: str, blame: frozenset[str] = frozenset(), stale: bool = False):
        super().__init__(message)
        self.blame, self.stale = blame, stale



@dataclass
class Frame:
    code: Code
    meta: dict
    payload: bytes = b""


def payload_size(payload) -> int:
    """Bytes in a payload, whether ``bytes`` or a (possibly multi-byte-item) memoryview."""
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


def encode_frame_prefix(code: Code, meta: dict | None, payload_len: int) -> bytes:
    raw = msgpack.packb(meta, use_bin_type=True) if meta else b""
    if len(raw) > MAX_META_BYTES:
        raise ValueError(f"frame meta of {len(raw)} bytes exceeds {MAX_META_BYTES}")
    return PREFIX.pack(int(code), len(raw), payload_len) + raw


class ByteStream:
    """Frames over an asyncio ``StreamReader``/``StreamWriter`` pair whose remote peer is ``remote``.

    ``remote`` must be authenticated by the transport (libp2p does: it is the peer id that
    signed the connection); nothing a peer writes *inside* the stream is trusted to name it.
    """

    def __init__(self, reader: asyncio.StreamReader, writer, remote: str):
        self.reader, self.writer, self.remote = reader, writer, remote
        self.bytes_sent = 0

    async def send(self, code: Code, meta: dict | None = None, payload=b"") -> None:
        payload_len = payload_size(payload)
        self.writer.write(encode_frame_prefix(code, meta, payload_len))
        if payload_len:
            self.writer.write(payload)
        self.bytes_sent += payload_len
        await self.writer.drain()

    async def refuse(self, reason: str, blame=(), stale: bool = False) -> None:
        """Tells the peer this end will not go on, and why; ``blame``: the members this worker's own failure
        names, if it failed (so that the peer does not take the refusal for the cause); ``stale``: this
        worker is not in that attempt at all (another group, or none it knows)."""
        meta = {"reason": reason[:MAX_REASON_CHARS]}
        if blame:
            meta["blame"] = sorted(blame)[:MAX_BLAMED]
        if stale:
            meta["stale"] = True
        try:
            await self.send(Code.REFUSE, meta)
        except Exception:  # the peer may be gone already: refusing is best effort
            pass

    async def recv(self, *, max_payload: int, expect: Code | tuple[Code, ...] | None = None) -> Frame:
        """The next frame; refuses unknown codes, oversized meta or payload, and unexpected codes."""
        try:
            code_value, meta_len, payload_len = PREFIX.unpack(await self.reader.readexactly(PREFIX.size))
            try:
                code = Code(code_value)
            except ValueError:
                raise ProtocolError(f"unknown message code {code_value}") from None
            if meta_len > MAX_META_BYTES:
                raise ProtocolError(f"frame meta of {meta_len} bytes; at most {MAX_META_BYTES} allowed")
            limit = 0 if code == Code.REFUSE else max_payload
            if payload_len > limit:
                raise ProtocolError(f"{code.name} frame announces {payload_len} payload bytes; at most {limit} allowed")
            raw = await self.reader.readexactly(meta_len) if meta_len else b""
            payload = await self.reader.readexactly(payload_len) if payload_len else b""
        except asyncio.IncompleteReadError as e:
            raise StreamClosed(f"stream closed by {self.remote[-8:]} after {len(e.partial)} bytes of a frame") from None
        except (ConnectionError, OSError) as e:
            raise StreamClosed(f"stream to {self.remote[-8:]} broke: {e}") from None
        meta = _unpack_meta(raw)
        if code == Code.REFUSE:
            raise Refused(f"{self.remote[-8:]} refused: {str(meta.get('reason', ''))[:MAX_REASON_CHARS]}",
                          blamed(meta.get("blame")), meta.get("stale") is True)
        if expect is not None:
            allowed = expect if isinstance(expect, tuple) else (expect,)
            if code not in allowed:
                raise ProtocolError(f"expected {'/'.join(c.name for c in allowed)}, got {code.name}")
        return Frame(code, meta, payload)

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already closed or broken
            pass


Connect = Callable[[str], Awaitable[ByteStream]]
"""How a member opens a stream to another: ``connect(peer) -> ByteStream`` (the transport's dial)."""


def _unpack_meta(raw: bytes) -> dict:
    if not raw:
        return {}
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"malformed frame meta ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise ProtocolError("frame meta is not a map")
    return meta


def field(meta: dict, name: str, kind: type | tuple[type, ...]):
    """``meta[name]`` if it has the expected type (bool is never an int here), else ``ProtocolError``."""
    value = meta.get(name)
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        value = None
    if not isinstance(value, kind):
        raise ProtocolError(f"message field {name!r} missing or of the wrong type")
    return value


# -- an in-memory pipe: the protocol tests' transport ----------------------------------------------

class _MemoryWriter:
    """Like a socket transport, it may read a written buffer *later* (on the next loop iteration),
    so a sender that reuses a buffer before it went out sends the wrong bytes here too."""

    def __init__(self, peer_reader: asyncio.StreamReader):
        self._peer = peer_reader
        self._pending: list = []
        self._closed = False

    def write(self, data) -> None:
        if self._closed:
            raise ConnectionResetError("in-memory stream closed")
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for data in pending:
            self._peer.feed_data(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._flush()
            self._peer.feed_eof()


def memory_pipe(a: str, b: str) -> tuple[ByteStream, ByteStream]:
    """Two connected streams: the first is ``a``'s end (its remote is ``b``), the second ``b``'s."""
    reader_a, reader_b = asyncio.StreamReader(), asyncio.StreamReader()
    return (ByteStream(reader_a, _MemoryWriter(reader_b), remote=b),
            ByteStream(reader_b, _MemoryWriter(reader_a), remote=a))
