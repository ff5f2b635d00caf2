"""State transfer: serving this worker's θ_global and outer state to joiners, and downloading a peer's.

The state travels as one ``torch.save`` payload in bounded frames, with its digest. A donor
serves at most ``MAX_CONCURRENT_SERVES`` requests at a time, one per peer, and at most
``SERVES_PER_PEER`` to one peer per ``SERVE_WINDOW_S`` (more are refused before anything is
serialized); in a closed run only members reach it at all (``streams.py``). A receiver refuses an
announcement larger than ``max_bytes`` before reading any of it. The digest guards the transfer
only: *which* state to adopt is the run's decision (``quorum.py``), checked by the receiver.

A download may come with the receiver's own check of the state (``opendiloco.state_check``): a
state it refuses is refused here, naming the donor, so that the caller goes on to the next donor.
The state returned names its donor (``donor``, set here, never by the donor).

A joiner may instead take the state in parts from several donors (``multi_donor.py``): it asks each
for a manifest at one outer step (a turn, as a download is), and the donor keeps that cut
(``layout.Snapshot``; the last ``KEPT_CUTS``) to serve parts of it, named by their digest, at
most ``PART_STREAMS_PER_PEER`` at a time to one peer (more wait for one of
``MAX_CONCURRENT_PART_SERVES`` sends) and ``PART_BYTES_PER_WINDOW`` times the state's size per peer
per window. A part request never makes a donor cut its state; cuts nobody used for
``SNAPSHOT_KEEP_S`` are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import io
import logging
import time
from collections.abc import Callable

import torch

from ...comm.base import SharedState, StateProvider
from ...comm.wire import ByteStream, Code
from ...comm.wire import field as meta_field
from ...errors import ProtocolError
from ...fingerprint import new_hasher
from ...timeouts import SNAPSHOT_FRESH_S, SNAPSHOT_KEEP_S
from ...timeouts import STATE_CONNECT_TIMEOUT as CONNECT_TIMEOUT
from ...timeouts import STATE_HEAD_TIMEOUT as HEAD_TIMEOUT
from ...timeouts import STATE_SERVE_WINDOW_S as SERVE_WINDOW_S
from ...timeouts import STATE_STALL_TIMEOUT as STALL_TIMEOUT
from ..streams import P2PStreams
from .layout import Snapshot, snapshot

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
MAX_CONCURRENT_SERVES = 2
SERVES_PER_PEER = 4
SEND_TIMEOUT_BASE = 30.0
MIN_RATE_BYTES_PER_S = 1 << 20
"""A requester reading slower than 1 MiB/s (plus 30 s) is dropped."""
PART_STREAMS_PER_PEER = 2
MAX_CONCURRENT_PART_SERVES = 8
PART_BYTES_PER_WINDOW = 3
"""A peer may take at most this many times the state's size in parts per ``SERVE_WINDOW_S``."""
KEPT_CUTS = 2
"""A new cut does not end downloads of the one before it: their parts are still served."""
MAX_CUTS_HELD = KEPT_CUTS
"""Cuts of its state a donor holds at most, kept or still being sent (a slow reader holds the cut its part
comes from until its send ends or times out), so at most this many times the state's size in bytes: a
manifest request that would need one more is answered from the newest cut of that step if there is one,
else refused (busy), whoever asks and however slowly they read."""


def _digest(payload) -> str:
    h = new_hasher(parallel=True)
    h.update(payload)
    return h.hexdigest()


class StateServer:
    def __init__(self, streams: P2PStreams):
        self.streams = streams
        self.provider: StateProvider | None = None
        self._slots: asyncio.Semaphore | None = None
        self._serving: set[str] = set()
        self._served: dict[str, collections.deque] = {}
        """Recent serve times by peer (monotonic), for the per-peer rate limit."""
        self._cuts: list[Snapshot] = []
        """The newest cuts of this worker's state (at most ``KEPT_CUTS``), oldest first."""
        self._pinned: dict[int, tuple[Snapshot, int]] = {}
        """Cuts that part sends (under way or waiting for a slot) hold, by id: (the cut, how many sends)."""
        self.cuts_made = 0
        self._snapshot_used = 0.0
        self._snapshot_lock: asyncio.Lock | None = None
        self._part_slots: asyncio.Semaphore | None = None
        self._part_streams: collections.Counter[str] = collections.Counter()
        self._part_bytes: dict[str, collections.deque] = {}
        """Recent (monotonic time, bytes) of parts served, by peer."""
        self._asked: dict[str, tuple[int, float]] = {}
        """Peers that asked for a manifest: (its outer step, monotonic time), until they say they have it."""
        self.joiners: dict[str, tuple[int, float]] = {}
        """Peers downloading or that downloaded this worker's state: (its outer step, monotonic time), from
        the request and again once a joiner in parts says it has it. They continue from it, so this
        worker's next round waits for them (``recent_joiners``) even before their own progress record
        reaches it through the DHT (not waiting for a peer that is catching up made it miss the round
        it caught up for, and catch up again)."""

    def recent_joiners(self, outer_step: int, within: float) -> set[str]:
        """Peers served the state of ``outer_step`` in the last ``within`` seconds."""
        now, joiners = time.monotonic(), dict(self.joiners)  # written on the event loop, read on the round thread
        for peer in [p for p, (_, t) in joiners.items() if now - t > within]:
            self.joiners.pop(peer, None)
        return {p for p, (step, t) in joiners.items() if step == outer_step and now - t <= within}

    def _take_turn(self, peer: str) -> None:
        """Counts a request of ``peer``, or raises ``ProtocolError`` if it is over its share."""
        now = time.monotonic()
        for other in [p for p, times in self._served.items() if not times or now - times[-1] > SERVE_WINDOW_S]:
            del self._served[other]  # forget peers that have been quiet for a window
        times = self._served.setdefault(peer, collections.deque())
        while times and now - times[0] > SERVE_WINDOW_S:
            times.popleft()
        if peer in self._serving:
            raise ProtocolError("one state download at a time per peer")
        if len(times) >= SERVES_PER_PEER:
            raise ProtocolError(f"at most {SERVES_PER_PEER} state downloads per peer per {SERVE_WINDOW_S:.0f}s")
        times.append(now)

    async def listen(self) -> None:
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_SERVES)
        self._snapshot_lock = asyncio.Lock()
        self._part_slots = asyncio.Semaphore(MAX_CONCURRENT_PART_SERVES)
        await self.streams.listen(self._serve)

    async def _serve(self, stream: ByteStream) -> None:
        try:
            request = await asyncio.wait_for(stream.recv(max_payload=0, expect=(
                Code.STATE_REQUEST, Code.STATE_MANIFEST_REQUEST, Code.STATE_PART_REQUEST, Code.STATE_DONE)), 10)
        except Exception as e:
            await stream.refuse(str(e) if isinstance(e, ProtocolError) else type(e).__name__)
            stream.close()
            return
        if request.code == Code.STATE_MANIFEST_REQUEST:
            await self._serve_manifest(stream, request.meta)
        elif request.code == Code.STATE_PART_REQUEST:
            await self._serve_part(stream, request.meta)
        elif request.code == Code.STATE_DONE:
            self._note_done(stream.remote, request.meta)
            stream.close()
        else:
            await self._serve_whole(stream, request)

    async def _serve_whole(self, stream: ByteStream, request) -> None:
        counted = False
        try:
            min_step = request.meta.get("min_outer_step")
            if self.provider is None:
                raise ProtocolError("this worker has no state to share yet")
            self._take_turn(stream.remote)
            self._serving.add(stream.remote)
            counted = True
            async with self._slots:
                loop = asyncio.get_running_loop()
                outer_step, payload, digest = await loop.run_in_executor(None, self._serialize)
                if isinstance(min_step, int) and outer_step < min_step:
                    raise ProtocolError(f"at outer step {outer_step}, not yet {min_step}")

                async def send():
                    await stream.send(Code.STATE, {"size": payload.nbytes, "outer_step": outer_step,
                                                   "digest": digest})
                    for i in range(0, payload.nbytes, CHUNK_BYTES):
                        await stream.send(Code.STATE_PART, None, payload[i : i + CHUNK_BYTES])

                # A requester that stops reading must not hold a slot for ever.
                # Noted before it is sent: a round this worker starts meanwhile already waits for it.
                self.joiners[stream.remote] = (outer_step, time.monotonic())
                await asyncio.wait_for(send(), SEND_TIMEOUT_BASE + payload.nbytes / MIN_RATE_BYTES_PER_S)
        except Exception as e:
            await stream.refuse(str(e) if isinstance(e, ProtocolError) else type(e).__name__)
        finally:
            if counted:
                self._serving.discard(stream.remote)
            stream.close()

    async def _serve_manifest(self, stream: ByteStream, meta: dict) -> None:
        """Sends the manifest of this worker's state at the asked outer step: of its newest cut if that is
        at this step and fresh, else of a new cut (``SNAPSHOT_FRESH_S``: a later joiner gets this
        worker's position in the round as it is now, not as it was when an earlier joiner asked)."""
        try:
            outer_step = meta_field(meta, "outer_step", int)  # its "part_bytes" is not heeded: the donor cuts
            if self.provider is None:
                raise ProtocolError("this worker has no state to share yet")
            self._take_turn(stream.remote)
            async with self._snapshot_lock:
                snap = self._cuts[-1] if self._cuts else None
                if snap is not None and snap.outer_step > outer_step:
                    await stream.send(Code.STATE_MANIFEST, {"outer_step": snap.outer_step, "size": 0})  # moved on
                    return
                if snap is None or snap.outer_step != outer_step or time.monotonic() - snap.made > SNAPSHOT_FRESH_S:
                    if self._make_room():
                        provider = self.provider
                        snap = await asyncio.get_running_loop().run_in_executor(None, lambda: snapshot(provider()))
                        self._cuts = [*self._cuts[-(KEPT_CUTS - 1):], snap]
                        self.cuts_made += 1
                    elif snap is None or snap.outer_step != outer_step:
                        raise ProtocolError(f"busy: {MAX_CUTS_HELD} cuts of this state are being served")
                self._keep_snapshot()
            if snap.outer_step < outer_step:
                raise ProtocolError(f"at outer step {snap.outer_step}, not yet {outer_step}")
            if snap.outer_step > outer_step:  # it moved on: the joiner may ask again once the run confirms this step
                await stream.send(Code.STATE_MANIFEST, {"outer_step": snap.outer_step, "size": 0})
                return
            self._note_asked(stream.remote, outer_step)
            self.joiners[stream.remote] = (outer_step, time.monotonic())  # on its way: a round meanwhile waits
            payload = snap.manifest_payload()
            meta = {"outer_step": outer_step, "size": snap.size, "part_bytes": snap.part_bytes}
            await asyncio.wait_for(stream.send(Code.STATE_MANIFEST, meta, payload),
                                   SEND_TIMEOUT_BASE + len(payload) / MIN_RATE_BYTES_PER_S)
        except Exception as e:
            await stream.refuse(str(e) if isinstance(e, ProtocolError) else type(e).__name__)
        finally:
            stream.close()

    def held_cuts(self) -> list[Snapshot]:
        """The cuts this donor holds: kept, or held by part sends."""
        held = {id(s): s for s in self._cuts}
        held.update({key: snap for key, (snap, _) in self._pinned.items()})
        return list(held.values())

    def _make_room(self) -> bool:
        """Drops kept cuts that no send holds, oldest first, until one more cut fits ``MAX_CUTS_HELD``."""
        while len(self.held_cuts()) >= MAX_CUTS_HELD:
            idle = [s for s in self._cuts if id(s) not in self._pinned]
            if not idle:
                return False
            self._cuts.remove(idle[0])
        return True

    def _pin(self, snap: Snapshot, by: int) -> None:
        held, count = self._pinned.get(id(snap), (snap, 0))
        if count + by > 0:
            self._pinned[id(snap)] = (held, count + by)
        else:
            self._pinned.pop(id(snap), None)

    def _note_asked(self, peer: str, outer_step: int) -> None:
        now = time.monotonic()
        for other in [p for p, (_, t) in self._asked.items() if now - t > SNAPSHOT_KEEP_S]:
            del self._asked[other]
        self._asked[peer] = (outer_step, now)

    def _note_done(self, peer: str, meta: dict) -> None:
        """A joiner that asked for this worker's manifest says it has the state: it is counted as coming from
        now (``recent_joiners``), however long its download took. Only the step it asked for, recently."""
        asked = self._asked.get(peer)
        if asked is not None and meta.get("outer_step") == asked[0] and time.monotonic() - asked[1] <= SNAPSHOT_KEEP_S:
            del self._asked[peer]
            self.joiners[peer] = (asked[0], time.monotonic())

    def _cut_holding(self, outer_step: int, part_bytes: int, index: int, digest: str) -> Snapshot:
        """A kept cut whose part ``index`` is the asked one (by its digest), or ``ProtocolError``."""
        for snap in reversed(self._cuts):
            if (snap.outer_step, snap.part_bytes) == (outer_step, part_bytes):
                if not 0 <= index < len(snap.digests):
                    raise ProtocolError(f"no part {index}")
                if snap.digests[index].hex() == digest:
                    return snap
        raise ProtocolError(f"no cut of outer step {outer_step} with that part {index} here (ask for its manifest)")

    async def _serve_part(self, stream: ByteStream, meta: dict) -> None:
        """Sends one part of a kept cut (never a new cut); waits for one of ``MAX_CONCURRENT_PART_SERVES``."""
        peer, counted, snap = stream.remote, False, None
        try:
            snap = self._cut_holding(meta_field(meta, "outer_step", int), meta_field(meta, "part_bytes", int),
                                     index := meta_field(meta, "index", int), meta_field(meta, "digest", str))
            if self._part_streams[peer] >= PART_STREAMS_PER_PEER:
                raise ProtocolError(f"at most {PART_STREAMS_PER_PEER} parts at a time per peer")
            data = snap.part(index)
            self._take_bytes(peer, data.nbytes, snap.size)
            self._part_streams[peer] += 1
            self._pin(snap, +1)
            counted = True
            self._keep_snapshot()

            async def send():
                async with self._part_slots:
                    for i in range(0, data.nbytes, CHUNK_BYTES):
                        await stream.send(Code.STATE_PART, None, data[i : i + CHUNK_BYTES])

            await asyncio.wait_for(send(), 2 * SEND_TIMEOUT_BASE + data.nbytes / MIN_RATE_BYTES_PER_S)
        except Exception as e:
            await stream.refuse(str(e) if isinstance(e, ProtocolError) else type(e).__name__)
        finally:
            if counted:
                self._part_streams[peer] -= 1
                if not self._part_streams[peer]:
                    del self._part_streams[peer]
                self._pin(snap, -1)
            stream.close()

    def _take_bytes(self, peer: str, nbytes: int, state_size: int) -> None:
        """Counts a part for ``peer``, or raises ``ProtocolError`` if it is over its byte budget."""
        now = time.monotonic()
        for other in [p for p, q in self._part_bytes.items() if not q or now - q[-1][0] > SERVE_WINDOW_S]:
            del self._part_bytes[other]
        recent = self._part_bytes.setdefault(peer, collections.deque())
        while recent and now - recent[0][0] > SERVE_WINDOW_S:
            recent.popleft()
        if sum(n for _, n in recent) + nbytes > PART_BYTES_PER_WINDOW * max(state_size, 1):
            raise ProtocolError(f"at most {PART_BYTES_PER_WINDOW}x the state in parts per peer per "
                                f"{SERVE_WINDOW_S:.0f}s")
        recent.append((now, nbytes))

    def _keep_snapshot(self) -> None:
        """Marks the cut as in use; it is dropped once nobody used it for ``SNAPSHOT_KEEP_S``."""
        self._snapshot_used = time.monotonic()
        asyncio.get_running_loop().call_later(SNAPSHOT_KEEP_S + 1, self._drop_idle_snapshot)

    def _drop_idle_snapshot(self) -> None:
        if self._cuts and time.monotonic() - self._snapshot_used >= SNAPSHOT_KEEP_S:
            self._cuts = []

    def _serialize(self) -> tuple[int, memoryview, str]:
        """The provider's state as bytes with its digest (runs on an executor thread, off the event loop)."""
        state = self.provider()
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = buf.getbuffer()
        return state["outer_step"], payload, _digest(payload)


UNBOUND_STATE_BYTES = 64 << 30
"""The download bound of a worker that has no model attached and whose caller names none."""


def download_bound(max_bytes: int | None, provider: StateProvider | None) -> int:
    """The most bytes a download may take: the caller's bound or this worker's model's (its optimizer's
    ``SharedState``), whichever is smaller; ``UNBOUND_STATE_BYTES`` when there is neither."""
    bounds = [b for b in (max_bytes, provider.max_bytes if isinstance(provider, SharedState) else None)
              if b is not None]
    return min(bounds) if bounds else UNBOUND_STATE_BYTES


def own_check(provider: StateProvider | None):
    """What this worker would refuse of a peer's state (its optimizer's ``SharedState.check``), or None."""
    return provider.check if isinstance(provider, SharedState) else None


def head_timeout(max_bytes: int) -> float:
    """How long a whole download waits for its donor to start: ``HEAD_TIMEOUT`` plus every busy slot's
    longest send of a state of ``max_bytes``."""
    return HEAD_TIMEOUT + MAX_CONCURRENT_SERVES * (SEND_TIMEOUT_BASE + max_bytes / MIN_RATE_BYTES_PER_S)


async def fetch_state(streams: P2PStreams, peer: str, min_outer_step: int | None, max_bytes: int,
                      check: Callable[[dict, int | None], None] | None = None) -> dict:
    """Downloads, checks (size, digest, type; then ``check(state, min_outer_step)``, which raises
    ``ValueError`` for a state this worker would refuse) and loads a peer's state."""
    stream = await connect_to(streams, peer)
    try:
        await stream.send(Code.STATE_REQUEST, {"min_outer_step": min_outer_step})
        # The head may wait while the donor serves others (its slots are few); the parts may not stall.
        head = await within(stream.recv(max_payload=0, expect=Code.STATE), peer, head_timeout(max_bytes))
        size = meta_field(head.meta, "size", int)
        if not 0 < size <= max_bytes:
            raise ProtocolError(f"state of {size} bytes announced; at most {max_bytes} accepted")
        payload = bytearray()
        while len(payload) < size:
            frame = await within(stream.recv(max_payload=min(CHUNK_BYTES, size - len(payload)),
                                              expect=Code.STATE_PART), peer)
            if not frame.payload:
                raise ProtocolError("empty state part")
            payload += frame.payload
        if await asyncio.get_running_loop().run_in_executor(None, _digest, payload) != head.meta.get("digest"):
            raise ProtocolError("state does not match its digest")
    finally:
        stream.close()
    state = await asyncio.get_running_loop().run_in_executor(None, _load, payload)
    return await checked_state(state, peer, check, min_outer_step)


async def checked_state(state, donor: str, check: Callable[[dict, int | None], None] | None,
                        min_outer_step: int | None) -> dict:
    """A loaded state, named after its ``donor`` and passed through ``check`` (``ProtocolError`` if refused)."""
    if not isinstance(state, dict):
        raise ProtocolError("state is not a dict")
    state.pop("confirmed_hash", None)  # the receiver's to name (the run's votes), never the donor's
    state["donor"] = donor
    if check is not None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, check, state, min_outer_step)
        except ValueError as e:  # StateRefused: the message names the donor
            log.warning("%s", e)
            raise ProtocolError(str(e)) from None
    return state


async def connect_to(streams: P2PStreams, peer: str) -> ByteStream:
    """A stream to a donor, or ``ProtocolError`` if it cannot be reached within ``CONNECT_TIMEOUT``."""
    try:
        return await asyncio.wait_for(streams.connect(peer), CONNECT_TIMEOUT)
    except asyncio.TimeoutError:
        raise ProtocolError(f"could not reach {peer[-8:]} within {CONNECT_TIMEOUT:.0f}s") from None


async def within(awaitable, peer: str, timeout: float = STALL_TIMEOUT):
    """The donor's next frame, or ``ProtocolError`` if it sends nothing for ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise ProtocolError(f"{peer[-8:]} sent nothing for {timeout:.0f}s") from None


def _load(payload: bytearray):
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
