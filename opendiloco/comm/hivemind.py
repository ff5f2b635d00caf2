"""The swarm communicator: a hivemind DHT to find peers, and a verified all-reduce over its p2p streams.

hivemind's own DecentralizedAverager is not used for the averaging: it sends each peer back a
*difference* to add to its own values (peers never end bit-identical), and a failure mid round
can leave a partially averaged result reported as success (HIVEMIND_NOTES.md). Here a round is:

1. matchmaking: each worker announces it is ready for outer step ``k`` in the DHT; when every
   live worker of the run at step ``k`` is ready (or ``straggler_wait`` has passed with at
   least ``min_group_size``), the ready peer with the smallest id closes the group and
   publishes its members;
2. reduce-scatter / all-gather (``allreduce.py``): member j reduces shard j and streams the
   encoded average back to everyone; every shard is checked (group id, sender identity, shape,
   dtype, finiteness, digest) and the round is used only when *all* shards arrived;
3. verification: members publish a digest of the whole average and refuse to apply it if any
   member reports a different one.

A failed round changes nothing and is retried with whoever is still there; a worker that finds
the group ahead of it raises ``BehindError`` so its optimizer downloads state instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import msgpack
import torch
import uvloop
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.timed_storage import get_dht_time

from ..swarm import records
from ..swarm.node import start_dht, visible_maddrs
from .allreduce import ProtocolError, ShardReducer, ShardResult, decode_shard, make_group_id, pack, shard_bounds
from .base import AverageResult, AveragingError, BehindError, Communicator, StateProvider
from .compression import get_codec
from .local import flatten, unflatten

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
Message = averaging_pb2.DownloadData


@dataclass
class SwarmSettings:
    run_id: str = "opendiloco"
    compression: str = "fp16"
    min_group_size: int = 1
    matchmaking_timeout: float = 30.0
    allreduce_timeout: float = 60.0
    straggler_wait: float = 10.0
    max_attempts: int = 3
    heartbeat_interval: float = 2.0
    record_ttl: float = 8.0
    verify_timeout: float = 5.0
    poll_interval: float = 0.1


def _message(meta: dict | None = None, chunk: bytes = b"") -> Message:
    return Message(metadata=msgpack.packb(meta) if meta is not None else b"",
                   tensor_part=runtime_pb2.Tensor(buffer=chunk))


def _chunks(payload: bytes) -> list[bytes]:
    return [payload[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)] or [b""]


async def _read_payload(first: Message, rest: AsyncIterator[Message], size: int, limit: int) -> bytes:
    if not isinstance(size, int) or size < 0 or size > limit:
        raise ProtocolError(f"announced payload of {size!r} bytes; at most {limit} allowed")
    parts, received = [first.tensor_part.buffer], len(first.tensor_part.buffer)
    while received < size:
        msg = await anext(rest)
        parts.append(msg.tensor_part.buffer)
        received += len(msg.tensor_part.buffer)
    if received != size:
        raise ProtocolError(f"received {received} bytes, announced {size}")
    return b"".join(parts)


class PeerFailure(AveragingError):
    """A round failed because of these peers (unreachable, refused, or silent until the timeout)."""

    def __init__(self, message: str, peers):
        super().__init__(message)
        self.peers = set(peers)


class DriftError(BehindError):
    """Our θ_global differs from the one most of the run holds at the same outer step."""


class _Round:
    """This worker's side of one round: its shard reducer, as the handlers see it."""

    def __init__(self, group_id: str, members: Sequence[str], reducer: ShardReducer):
        self.group_id, self.members, self.reducer = group_id, tuple(members), reducer
        self.result: ShardResult | None = None
        self.error: Exception | None = None
        self.finished = asyncio.Event()
        self._reducing = False

    async def contribute(self, sender: str, weight: float, header: list, payload: bytes) -> None:
        if self.finished.is_set():
            raise ProtocolError("round already finished")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.reducer.add, sender, weight, header, payload)
        # Decided on the event loop with no await in between: exactly one contributor reduces.
        if self.reducer.complete and not self._reducing:
            self._reducing = True
            try:
                self.result = await loop.run_in_executor(None, self.reducer.reduce)
            except Exception as e:
                self.error = e
            self.finished.set()

    def fail(self, error: Exception) -> None:
        if not self.finished.is_set():
            self.error = error
            self.finished.set()

    async def wait(self, timeout: float) -> ShardResult:
        await asyncio.wait_for(self.finished.wait(), timeout)
        if self.error is not None:
            raise self.error
        return self.result


class HivemindCommunicator(Communicator):
    def __init__(self, dht, settings: SwarmSettings | None = None, *, own_dht: bool = True):
        self.dht = dht
        self.settings = s = settings or SwarmSettings()
        if s.min_group_size < 1:
            raise ValueError("min_group_size must be >= 1")
        self.codec = get_codec(s.compression)
        self._own_dht = own_dht
        self._peer_id = dht.peer_id.to_base58()
        self._reduce_handler = f"opendiloco.{s.run_id}.reduce"
        self._state_handler = f"opendiloco.{s.run_id}.state"
        self._rounds: dict[str, _Round] = {}
        self._round_registered: asyncio.Condition | None = None
        self._progress = {"outer_step": -1}
        self._progress_lock = threading.Lock()
        self._state_provider: StateProvider | None = None
        self._heal_hash: str | None = None
        self._closed = False
        self._interrupted = threading.Event()
        self._publishing: set = set()

        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="opendiloco-comm", daemon=True)
        self._thread.start()
        self._call(self._setup(), timeout=30)
        self._heartbeat_task = asyncio.run_coroutine_threadsafe(self._heartbeat(), self._loop)

    @classmethod
    def from_config(cls, cfg, run_dir: str | None = None) -> HivemindCommunicator:
        """Starts a DHT node from a ``SwarmConfig`` and wraps it."""
        dht = start_dht(initial_peers=cfg.initial_peers, host_maddrs=cfg.host_maddrs,
                        announce_maddrs=cfg.announce_maddrs, identity_path=cfg.identity_path,
                        client_mode=cfg.client_mode)
        settings = SwarmSettings(**{k: getattr(cfg, k) for k in SwarmSettings.__dataclass_fields__
                                    if hasattr(cfg, k)})
        comm = cls(dht, settings)
        addrs = visible_maddrs(dht)
        log.info("worker %s joined run %r; peers can join through: %s", comm.peer_id, settings.run_id,
                 " ".join(addrs))
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "peer_addrs.txt"), "w") as f:
                f.write("\n".join(addrs) + "\n")
        return comm

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._peer_id

    def _call(self, coro, timeout: float):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise AveragingError(f"timed out after {timeout:.1f}s") from None

    async def _setup(self) -> None:
        self._round_registered = asyncio.Condition()
        self.p2p = await self.dht.replicate_p2p()
        await self.p2p.add_protobuf_handler(self._reduce_handler, self._rpc_reduce, Message,
                                            stream_input=True, stream_output=True)
        await self.p2p.add_protobuf_handler(self._state_handler, self._rpc_state, Message, stream_output=True)

    # -- progress records --------------------------------------------------------------------
    def report_progress(self, **fields) -> None:
        with self._progress_lock:
            changed = fields.get("outer_step", self._progress["outer_step"]) != self._progress["outer_step"]
            self._progress.update(fields)
        if changed:  # keep the future: an unreferenced task may be garbage-collected mid-flight
            future = asyncio.run_coroutine_threadsafe(self._publish(), self._loop)
            self._publishing.add(future)
            future.add_done_callback(self._publishing.discard)

    async def _publish(self, left: bool = False) -> None:
        with self._progress_lock:
            rec = records.WorkerRecord(peer_id=self._peer_id, time=get_dht_time(), left=left,
                                       **{k: v for k, v in self._progress.items()
                                          if k in records.WorkerRecord.__dataclass_fields__})
        await self.dht.store(records.workers_key(self.settings.run_id), rec.to_value(),
                             get_dht_time() + self.settings.record_ttl, subkey=self._peer_id, return_future=True)

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._publish()
            except Exception as e:  # the DHT may be shutting down
                log.debug("heartbeat failed: %s", e)
            await asyncio.sleep(self.settings.heartbeat_interval)

    def live_workers(self) -> dict[str, records.WorkerRecord]:
        return records.read_workers(self.dht, self.settings.run_id)

    # -- averaging ---------------------------------------------------------------------------
    def average(self, tensors, *, weight=1.0, outer_step=0):
        s = self.settings
        flat = flatten(tensors)
        self.report_progress(outer_step=outer_step)
        self._raise_if_drifted(outer_step)
        start, attempt, errors, suspects = time.perf_counter(), 0, [], set()
        while len(errors) < s.max_attempts:
            self._raise_if_interrupted()
            members, attempt = self._matchmake(outer_step, attempt, flat.numel(), suspects)
            group_id = make_group_id(s.run_id, outer_step, attempt, members)
            transfer_s, sent = 0.0, 0
            try:
                if len(members) == 1:
                    if weight <= 0:
                        raise AveragingError("alone in the group and contributing weight 0")
                    averaged, total, digest = self.codec.roundtrip(flat), float(weight), "solo"
                else:
                    transfer_start = time.perf_counter()
                    averaged, total, digest, sent = self._call(
                        self._allreduce(group_id, members, flat, float(weight)), timeout=s.allreduce_timeout + 10)
                    transfer_s = time.perf_counter() - transfer_start
                    self._verify(outer_step, attempt, members, digest)
            except AveragingError as e:
                if isinstance(e, PeerFailure):
                    suspects |= e.peers - {self._peer_id}
                errors.append(f"attempt {attempt}: {e}")
                log.warning("outer step %d, attempt %d with %d peers failed: %s", outer_step, attempt,
                            len(members), e)
                attempt += 1
                continue
            self.report_progress(last_sync_time=get_dht_time())
            return AverageResult(unflatten(averaged, tensors), tuple(members), total,
                                 time.perf_counter() - start,
                                 extra={"attempts": len(errors) + 1, "group_id": group_id, "digest": digest,
                                        "transfer_s": transfer_s, "bytes_sent": sent})
        raise AveragingError(f"outer step {outer_step}: no complete round in {s.max_attempts} attempts: "
                             + "; ".join(errors))

    def _raise_if_behind(self, workers: dict[str, records.WorkerRecord], outer_step: int) -> None:
        ahead = [r.outer_step for p, r in workers.items() if p != self._peer_id and r.outer_step > outer_step]
        if ahead:
            raise BehindError(f"peers are at outer step {max(ahead)}, this worker at {outer_step}",
                              group_outer_step=max(ahead))

    def _raise_if_drifted(self, outer_step: int) -> None:
        """Compares our θ_global hash with the other workers at the same outer step (majority wins)."""
        with self._progress_lock:
            mine = self._progress.get("global_hash")
        if not mine:
            return
        counts: dict[str, int] = {mine: 1}
        for peer, rec in self.live_workers().items():
            if peer != self._peer_id and rec.outer_step == outer_step and rec.global_hash:
                counts[rec.global_hash] = counts.get(rec.global_hash, 0) + 1
        majority, votes = max(counts.items(), key=lambda kv: kv[1])
        if majority != mine and votes > counts[mine]:
            self._heal_hash = majority
            raise DriftError(f"θ_global drifted: hash {mine} vs {majority} held by {votes} peer(s) at outer step "
                             f"{outer_step}", group_outer_step=outer_step)

    def _matchmake(self, outer_step: int, attempt: int, numel: int,
                   suspects: set[str] = frozenset()) -> tuple[list[str], int]:
        """Waits for the run's live workers to be ready for ``outer_step``; returns (members, attempt).

        ``suspects`` (peers that broke an earlier attempt) are not waited for, but may still join.
        """
        s, me = self.settings, self._peer_id
        key = records.round_key(s.run_id, outer_step)
        t0, announced = time.monotonic(), None
        while True:
            workers = self.live_workers()
            self._raise_if_behind(workers, outer_step)
            ready = {}
            for peer, value in records.subkey_values(self.dht, key).items():
                if isinstance(value, dict) and isinstance(value.get("attempt"), int):
                    ready[peer] = value
            attempt = max([attempt] + [v["attempt"] for v in ready.values()])
            if announced != attempt:
                value = {"attempt": attempt, "numel": numel, "codec": self.codec.name}
                expiry = get_dht_time() + s.matchmaking_timeout + s.allreduce_timeout
                records.store(self.dht, key, value, expiry, subkey=me)
                ready[me], announced = value, attempt
            compatible = {p for p, v in ready.items() if v.get("attempt") == attempt
                          and v.get("numel") == numel and v.get("codec") == self.codec.name}
            expected = ({p for p, r in workers.items() if r.outer_step == outer_step} - suspects) | {me}
            waited = time.monotonic() - t0
            if len(compatible) >= s.min_group_size and (expected <= compatible or waited >= s.straggler_wait):
                break
            self._raise_if_interrupted()
            if waited >= s.matchmaking_timeout:
                raise AveragingError(f"matchmaking for outer step {outer_step}: {len(compatible)} peer(s) ready "
                                     f"after {waited:.0f}s, need {s.min_group_size}")
            time.sleep(s.poll_interval)

        gkey = records.group_key(s.run_id, outer_step, attempt)
        leader = min(compatible)
        deadline = time.monotonic() + s.straggler_wait + 2 * s.verify_timeout
        while True:
            # A group already closed for this round wins over our own view of who is ready.
            live = set(self.live_workers()) | {me}
            published = {p: m for p, m in records.subkey_values(self.dht, gkey).items()
                         if isinstance(m, list) and all(isinstance(x, str) for x in m) and live & set(m)}
            if published:
                members = published[min(published)]
                if me in members:
                    return sorted(members), attempt
                raise BehindError(f"left out of the group for outer step {outer_step}",
                                  group_outer_step=outer_step + 1, timeout=s.allreduce_timeout + s.verify_timeout)
            if leader == me:
                members = sorted(compatible)
                expiry = get_dht_time() + s.allreduce_timeout + s.matchmaking_timeout
                records.store(self.dht, gkey, members, expiry, subkey=me)
                leader = None  # read it back: a concurrent leader with a smaller id would win
                continue
            self._raise_if_interrupted()
            if time.monotonic() > deadline:
                raise AveragingError(f"no group was published for outer step {outer_step}")
            self._raise_if_behind(self.live_workers(), outer_step)
            time.sleep(s.poll_interval)

    async def _allreduce(self, group_id: str, members: list[str], flat: torch.Tensor,
                         weight: float) -> tuple[torch.Tensor, float, str, int]:
        """Reduce-scatter then all-gather of ``flat``; returns (average, total weight, digest, bytes sent)."""
        loop = asyncio.get_running_loop()
        me = members.index(self._peer_id)
        bounds = shard_bounds(flat.numel(), len(members))
        numels = [b - a for a, b in bounds]
        parts = await loop.run_in_executor(None, lambda: [pack(self.codec.encode(flat[a:b])) for a, b in bounds])
        rnd = _Round(group_id, members, ShardReducer(self.codec, numels[me], members))
        async with self._round_registered:
            self._rounds[group_id] = rnd
            self._round_registered.notify_all()
        loop.call_later(2 * self.settings.allreduce_timeout, self._rounds.pop, group_id, None)

        async def own_shard():
            await rnd.contribute(self._peer_id, weight, *parts[me])
            result = await rnd.wait(self.settings.allreduce_timeout)
            return await loop.run_in_executor(
                None, decode_shard, self.codec, numels[me], result.header, result.payload, result.digest), result

        tasks = [asyncio.create_task(own_shard() if j == me else
                                     self._exchange(rnd, members[j], weight, parts[j], numels[j]))
                 for j in range(len(members))]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.settings.allreduce_timeout,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
            if pending:
                silent = {members[j] for j, t in enumerate(tasks) if t in pending and j != me}
                silent |= set(rnd.reducer.missing()) - {self._peer_id}
                raise PeerFailure(f"no answer within {self.settings.allreduce_timeout:.0f}s from "
                                  f"{sorted(p[-8:] for p in silent)}", silent)
        except BaseException as e:
            for task in tasks:
                task.cancel()
            rnd.fail(e if isinstance(e, Exception) else AveragingError("cancelled"))
            if isinstance(e, AveragingError):
                raise
            raise AveragingError(f"{type(e).__name__}: {e}") from e
        results = [t.result() for t in tasks]
        averaged = torch.cat([values for values, _ in results])
        total = {round(r.total_weight, 9) for _, r in results}
        if len(total) != 1:
            raise AveragingError(f"shards report different total weights {sorted(total)}")
        digest = hashlib.sha256("".join(r.digest for _, r in results).encode()).hexdigest()[:32]
        # Payload this worker put on the wire: its contributions to the other shards, and its own
        # shard's average once to each other member (sent by _rpc_reduce, which every member awaited).
        sent = sum(len(parts[j][1]) for j in range(len(members)) if j != me)
        sent += (len(members) - 1) * len(results[me][1].payload)
        return averaged, results[0][1].total_weight, digest, sent

    async def _exchange(self, rnd: _Round, peer: str, weight: float, part: tuple[list, bytes], numel: int):
        """Sends our contribution to shard owner ``peer`` and receives that shard's average."""
        header, payload = part
        meta = {"group_id": rnd.group_id, "sender": self._peer_id, "weight": weight, "header": header,
                "size": len(payload)}
        chunks = _chunks(payload)

        async def requests():
            for i, chunk in enumerate(chunks):
                yield _message(meta if i == 0 else None, chunk)

        try:
            for attempt in range(2):
                stream = await self.p2p.iterate_protobuf_handler(PeerID.from_base58(peer), self._reduce_handler,
                                                                 requests(), Message)
                first = await anext(stream, None)
                if first is not None:
                    break
                # The stream ended with no message at all (seen rarely on loopback: the p2p layer
                # cancelled the owner's handler). The owner answers a resent contribution with the
                # shard's result, so one more try is safe.
                log.debug("peer %s closed the stream without answering (try %d)", peer[-8:], attempt + 1)
            else:
                raise ProtocolError(f"peer {peer[-8:]} closed the stream without answering")
            reply = msgpack.unpackb(first.metadata)
            if "error" in reply:
                raise ProtocolError(f"peer {peer[-8:]} refused: {reply['error']}")
            limit = self.codec.wire_bytes(numel)
            payload = await _read_payload(first, stream, reply.get("size"), limit)
        except ProtocolError as e:
            raise PeerFailure(str(e), {peer}) from None
        except (AveragingError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise PeerFailure(f"exchange with {peer[-8:]} failed: {type(e).__name__}: {e}", {peer}) from None
        loop = asyncio.get_running_loop()
        values = await loop.run_in_executor(None, decode_shard, self.codec, numel, reply.get("header"), payload,
                                            reply.get("digest"))
        return values, ShardResult(reply["header"], b"", reply["digest"], float(reply["total_weight"]),
                                   tuple(reply.get("contributors", ())))

    async def _rpc_reduce(self, requests: AsyncIterator[Message], context: P2PContext) -> AsyncIterator[Message]:
        """Handler: receives a member's contribution to our shard, answers with the shard's average."""
        try:
            first = await anext(requests)
            meta = msgpack.unpackb(first.metadata)
            sender = context.remote_id.to_base58()
            if meta.get("sender") != sender:
                raise ProtocolError("sender field does not match the authenticated peer id")
            rnd = await self._wait_for_round(meta.get("group_id"))
            limit = self.codec.wire_bytes(rnd.reducer.numel)
            payload = await _read_payload(first, requests, meta.get("size"), limit)
            if sender not in rnd.reducer.missing():  # a resend (its first answer was lost): the first one counts
                log.debug("%s resent its contribution to %s", sender[-8:], rnd.group_id)
            else:
                await rnd.contribute(sender, meta.get("weight"), meta.get("header"), payload)
            result = await rnd.wait(self.settings.allreduce_timeout)
        except Exception as e:
            log.warning("refused a contribution from %s: %s", context.remote_id.to_base58()[-8:], e)
            yield _message({"error": str(e)[:500]})
            return
        reply = {"header": result.header, "digest": result.digest, "total_weight": result.total_weight,
                 "contributors": list(result.contributors), "size": len(result.payload)}
        for i, chunk in enumerate(_chunks(result.payload)):
            yield _message(reply if i == 0 else None, chunk)

    async def _wait_for_round(self, group_id) -> _Round:
        """A peer may reach us before we closed the same group: wait for it a little."""
        if not isinstance(group_id, str):
            raise ProtocolError("missing group id")
        async with self._round_registered:
            try:
                await asyncio.wait_for(self._round_registered.wait_for(lambda: group_id in self._rounds),
                                       timeout=self.settings.straggler_wait + self.settings.verify_timeout)
            except TimeoutError:
                raise ProtocolError(f"unknown group {group_id}") from None
            return self._rounds[group_id]

    def _verify(self, outer_step: int, attempt: int, members: list[str], digest: str) -> None:
        """Members compare digests of the whole average through the DHT before anyone applies it."""
        s = self.settings
        key = records.done_key(s.run_id, outer_step, attempt)
        records.store(self.dht, key, digest, get_dht_time() + s.allreduce_timeout, subkey=self._peer_id)
        deadline = time.monotonic() + s.verify_timeout
        while True:
            seen = {p: v for p, v in records.subkey_values(self.dht, key).items() if p in members}
            wrong = {p for p, v in seen.items() if v != digest}
            if wrong:
                raise AveragingError(f"members {[p[-8:] for p in wrong]} hold a different average; refused")
            if len(seen) == len(members):
                return
            if time.monotonic() > deadline:
                log.warning("outer step %d: %d of %d members confirmed the average (the others may have died); "
                            "applying it", outer_step, len(seen), len(members))
                return
            time.sleep(s.poll_interval)

    # -- state for joiners -------------------------------------------------------------------
    def attach_state_provider(self, provider: StateProvider) -> None:
        self._state_provider = provider

    async def _rpc_state(self, request: Message, context: P2PContext) -> AsyncIterator[Message]:
        try:
            if self._state_provider is None:
                raise ProtocolError("this worker has no state to share yet")
            meta = msgpack.unpackb(request.metadata) if request.metadata else {}
            min_step = meta.get("min_outer_step")
            state = await asyncio.get_running_loop().run_in_executor(None, self._state_provider)
            if isinstance(min_step, int) and state["outer_step"] < min_step:
                raise ProtocolError(f"at outer step {state['outer_step']}, not yet {min_step}")
            buf = io.BytesIO()
            torch.save(state, buf)
            payload = buf.getvalue()
        except Exception as e:
            yield _message({"error": str(e)[:500]})
            return
        reply = {"size": len(payload), "digest": hashlib.sha256(payload).hexdigest(),
                 "outer_step": state["outer_step"]}
        for i, chunk in enumerate(_chunks(payload)):
            yield _message(reply if i == 0 else None, chunk)

    async def _fetch_state(self, peer: str, min_outer_step: int | None, max_bytes: int) -> dict:
        stream = await self.p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer), self._state_handler, _message({"min_outer_step": min_outer_step}), Message)
        first = await anext(stream)
        reply = msgpack.unpackb(first.metadata)
        if "error" in reply:
            raise ProtocolError(reply["error"])
        payload = await _read_payload(first, stream, reply.get("size"), max_bytes)
        if hashlib.sha256(payload).hexdigest() != reply.get("digest"):
            raise ProtocolError("state does not match its digest")
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ProtocolError("state is not a dict")
        return state

    def download_state(self, timeout: float, min_outer_step: int | None = None,
                       max_bytes: int = 64 << 30) -> dict | None:
        """State from the most advanced live peer; None if the run has no other live worker."""
        deadline = time.monotonic() + timeout
        errors: dict[str, str] = {}
        while True:
            others = [r for p, r in self.live_workers().items() if p != self._peer_id and r.outer_step >= 0]
            if not others and min_outer_step is None:
                return None
            candidates = sorted((r for r in others if (min_outer_step is None or r.outer_step >= min_outer_step)
                                 and (self._heal_hash is None or r.global_hash == self._heal_hash)),
                                key=lambda r: -r.outer_step)
            for rec in candidates:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                t0 = time.perf_counter()
                try:
                    state = self._call(self._fetch_state(rec.peer_id, min_outer_step, max_bytes), remaining)
                except Exception as e:
                    errors[rec.peer_id[-8:]] = str(e)
                    continue
                log.info("downloaded state of outer step %s from %s in %.2fs", state.get("outer_step"),
                         rec.peer_id[-8:], time.perf_counter() - t0)
                self._heal_hash = None
                return state
            if time.monotonic() >= deadline:
                self._heal_hash = None
                raise AveragingError(f"no peer served state within {timeout:.0f}s"
                                     + (f": {errors}" if errors else ""))
            time.sleep(0.5)

    # -- shutdown ----------------------------------------------------------------------------
    def interrupt(self) -> None:
        self._interrupted.set()

    def _raise_if_interrupted(self) -> None:
        if self._interrupted.is_set():
            raise AveragingError("the worker is stopping: round abandoned")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._heartbeat_task.cancel()
            self._call(self._publish(left=True), timeout=5)
        except Exception as e:
            log.debug("could not announce leaving: %s", e)
        try:
            self._call(self.p2p.shutdown(), timeout=5)
        except Exception as e:
            log.debug("p2p replica shutdown: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if self._own_dht:
            self.dht.shutdown()
