"""One round of a streamed, verified reduce-scatter / all-gather, over any stream of frames.

Every member streams its *encoded* parts of shard j to member j (``group.py``: who owns which shard);
member j decodes each part as it arrives, and as soon as all G contributions to part i are in, averages
them in member order (fp32, ``reducer.py``), encodes the average once and streams those bytes back to
every member, itself included, while later parts are still arriving. Every member decodes identical
bytes, so every member ends with a bit-identical average. Before anyone applies it, every member sends
every other member the BLAKE3 digest of all the averaged bytes it received (``CONFIRM``); a different
digest refuses the round.

Every byte from a peer is checked before it is used: the sender is the transport's
authenticated peer id, the group id names a round this worker is in, every size is known in
advance, parts come in order and once, values are finite, the owner's digest matches.

The transport is an argument: ``connect(peer) -> ByteStream`` for outgoing streams, and
``Rounds.serve(stream)`` (``rounds_taken.py``) for incoming ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import torch

from ..errors import AveragingError, InDoubt, PeerFailure, ProtocolError, Unreachable
from ..fingerprint import new_hasher
from . import audit
from .aggregation import Aggregation
from .buffers import all_finite
from .compression import Codec
from .failure import AttemptFailure
from .group import DEFAULT_PART_NUMEL, MAX_WEIGHT, Group, group_label, part_bounds, shard_bounds_for
from .reducer import ShardOwner, ShardReducer
from .wire import ByteStream, Code, Connect, payload_size
from .wire import field as meta_field

log = logging.getLogger(__name__)


@dataclass
class RoundOutcome:
    """A round that completed here: the verified average (``flat``) and what it took."""

    flat: torch.Tensor
    total_weight: float
    digest: str
    bytes_sent: int
    seconds: float
    confirmed_by: tuple[str, ...] = ()
    missing_confirmations: tuple[str, ...] = ()
    bounded: dict[str, list[str]] = dataclass_field(default_factory=dict)
    """Members whose contribution the shard owners cut: ``{"clipped": [...], "capped": [...]}``
    (norm clipped in some part; weight claim capped)."""
    bytes_received: int = 0
    """Payload bytes of the parts and averaged parts this member received (the counterpart of ``bytes_sent``)."""


def _now() -> float:
    """The round's clock: its event loop's (``loop.time()``). Time reaches the round only through the loop (this
    clock, ``asyncio.sleep``, ``asyncio.wait_for``), so a loop under virtual time runs it in virtual time."""
    return asyncio.get_running_loop().time()


def check_settings(group: Group, me: str, part_numel: int, audit_chunks: int) -> None:
    """``ValueError`` unless ``me`` is in ``group``, ``part_numel`` is a positive int and ``audit_chunks`` an
    int in [0, ``audit.MAX_AUDIT_CHUNKS``]."""
    if isinstance(audit_chunks, bool) or not isinstance(audit_chunks, int) \
            or not 0 <= audit_chunks <= audit.MAX_AUDIT_CHUNKS:
        raise ValueError(f"audit_chunks must be an int in [0, {audit.MAX_AUDIT_CHUNKS}], got {audit_chunks!r}")
    if me not in group.members:
        raise ValueError("this worker is not a member of the group")
    if not isinstance(part_numel, int) or part_numel < 1:
        raise ValueError(f"part_numel must be a positive int, got {part_numel!r}")


class RoundRunner(ShardOwner, audit.AuditingMember, AttemptFailure):
    """This worker's side of one round: its contribution to every shard, and the shard it owns.

    Serving its own shard is ``reducer.ShardOwner``'s part; its audit of the other owners is
    ``audit.AuditingMember``'s; how the attempt fails and whom that names is ``failure.AttemptFailure``'s."""

    def __init__(self, group: Group, me: str, flat: torch.Tensor, weight: float, codec: Codec, *,
                 out: torch.Tensor | None = None, part_numel: int = DEFAULT_PART_NUMEL,
                 timeout: float = 60.0, confirm_timeout: float = 5.0, result_codec: Codec | None = None,
                 error_out: torch.Tensor | None = None, aggregation: Aggregation | None = None,
                 audit_chunks: int = 0):
        """``error_out`` (shaped like ``flat``) receives what encoding lost of this worker's contribution:
        ``flat`` minus the values the owners received (for error feedback). ``audit_chunks``: chunks of
        every other owner's shard this worker spot-checks before it confirms (``audit.py``; 0: none,
        and owners commit to nothing)."""
        check_settings(group, me, part_numel, audit_chunks)
        self.group, self.me, self.codec = group, me, codec
        self.result_codec = result_codec or codec.averages
        self.error_out = error_out
        self.members = group.members
        self.my_index = self.members.index(me)
        self.flat = flat
        self.out = out if out is not None else torch.empty_like(flat)
        self.weight = float(weight)
        self.part_numel = part_numel
        self.timeout, self.confirm_timeout = timeout, confirm_timeout
        self.bounds = shard_bounds_for(flat.numel(), self.members, group.relayed)
        a, b = self.bounds[self.my_index]
        self.aggregation = aggregation or Aggregation()
        self.reducer = ShardReducer(codec, b - a, self.members, part_numel, self.result_codec, self.aggregation,
                                    committed=audit_chunks > 0)
        self._init_audit(audit_chunks)
        self._init_failure()
        self._init_progress()

    def _init_progress(self) -> None:
        """What the round has done so far: bytes, shards, confirmations, and whom it heard from when."""
        self._bounded: dict[str, set[str]] = {"clipped": set(), "capped": set()}
        self.bytes_sent = 0
        self.bytes_received = 0
        self._shard_digests: dict[int, str] = {}
        self._shard_totals: dict[int, float] = {}
        self._confirm_streams: dict[int, ByteStream] = {}
        self._confirms: dict[str, str] = {}
        self._serving: set[str] = set()
        self._parts_out: set[int] = set()
        """Owners this worker has sent (or begun sending) its last part of their shard to."""
        self._results_out: set[str] = set()
        """Members this worker has sent (or begun sending) the end of its own shard's result to."""
        self.finished = False
        self.digest: str | None = None
        """The whole average's digest, once the round has completed here."""
        self.ended = asyncio.Event()
        """Set when ``run`` has returned or raised: the round's outcome here is final."""
        self.began_at = self.heard_at = 0.0
        """(loop time) When a frame of this attempt last came in from any member (from ``run``'s start)."""
        self.heard_from: dict[str, float] = {}
        """(loop time) The members that sent this worker a frame of this attempt, and when the last came."""

    # -- the round, as the member that started it sees it -------------------------------------------
    async def run(self, connect: Connect) -> RoundOutcome:
        """The round: its verified average, or ``AveragingError`` (``InDoubt`` where members may have
        completed it: see ``may_have_completed``)."""
        self.began_at = self.heard_at = _now()
        try:
            return await self._run(connect)
        finally:
            self.ended.set()

    async def _run(self, connect: Connect) -> RoundOutcome:
        began = self.began_at
        others = [j for j in range(len(self.members)) if j != self.my_index]
        tasks = [asyncio.create_task(self._exchange(j, connect)) for j in others]
        tasks.append(asyncio.create_task(self._own_shard()))
        # The round also ends the moment it fails here (``_fail``: ``give_up_on``, say), even with a
        # task still blocked on a member that neither answers nor closes its stream.
        work, failed = asyncio.gather(*tasks), asyncio.ensure_future(self._failed.wait())
        try:
            done, _ = await asyncio.wait([work, failed], timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            if work in done:
                work.result()  # the first exception of a task, if any
            elif failed in done:
                self._raise_if_failed()
            else:
                silent = {self.members[j] for j, t in zip(others, tasks) if not t.done()}
                silent |= {m for m in self.members if m not in self.reducer.weights} - {self.me}
                raise PeerFailure(f"no answer within {self.timeout:.0f}s from {sorted(p[-8:] for p in silent)}",
                                  silent or set(self.members) - {self.me})
            totals = {round(t, 9) for t in self._shard_totals.values()}
            if len(totals) != 1:
                raise ProtocolError(f"shards report different total weights {sorted(totals)}")
            digest = self._whole_digest()
            if self.audit_chunks:
                await self._unless_failed(self._audit())
                self.audited = True
            confirmed, missing = await self._verify(digest)
        except BaseException as e:
            failed.cancel()
            await self._fail(e if isinstance(e, Exception) else AveragingError("round cancelled"))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(work, return_exceptions=True)  # its exception is retrieved
            if isinstance(e, asyncio.CancelledError):
                raise
            failure = e if isinstance(e, AveragingError) else AveragingError(f"{type(e).__name__}: {e}")
            ask = self.may_have_completed()
            if ask:  # this worker cannot tell on its own whether the round happened: resolve() asks them
                doubt = InDoubt(str(failure), getattr(failure, "peers", ()), group_id=self.group.group_id,
                                me=self.me, members=self.members, ask=ask, held=self._held(began))
                doubt.distrusted = frozenset(self.malformed) | self._broke
                raise doubt from e
            if failure is e:
                raise
            raise failure from e
        self.digest, self.finished = digest, True
        return self._outcome(digest, began, confirmed, missing)

    def _whole_digest(self) -> str:
        whole = new_hasher()
        whole.update("".join(self._shard_digests[j] for j in range(len(self.members))).encode())
        return whole.hexdigest()[:32]

    def _outcome(self, digest: str, began: float, confirmed: tuple[str, ...], missing: tuple[str, ...]) -> RoundOutcome:
        self._bounded["clipped"] |= self.reducer.clipped
        self._bounded["capped"] |= set(self.reducer.capped)
        return RoundOutcome(self.out, self._shard_totals[self.my_index], digest, self.bytes_sent,
                            _now() - began, confirmed, missing,
                            {k: sorted(v) for k, v in self._bounded.items()}, self.bytes_received)

    @property
    def sent_to(self) -> frozenset[str]:
        """The members this worker has begun sending the end of its own shard's result to."""
        return frozenset(self._results_out)

    def waits_on(self, member: str) -> bool:
        """Whether this round still needs bytes from ``member``: its parts of our shard, its shard, or its
        answers to our audit."""
        return (self.members.index(member) not in self._shard_digests or not self.reducer.has_all_parts(member)
                or member in self._auditing)

    def silent_for(self) -> float:
        """Seconds since any member sent this worker a frame of this attempt, while two members or more
        still owe it parts of its shard (the other one, in a group of two); else 0.

        Every member sends its parts at once, whatever the others do, so a worker whose connections broke
        misses parts from every member it had not had them all from. Results wait on every member's parts:
        a worker that lacks only those of a single member, or only results, hears nothing while it waits
        on someone else's trouble."""
        owing = sum(not self.reducer.has_all_parts(m) for m in self.members if m != self.me)
        if owing < min(2, len(self.members) - 1):
            return 0.0
        return _now() - self.heard_at

    def _heard(self, member: str) -> None:
        self.heard_at = self.heard_from[member] = _now()

    def may_have_completed(self) -> tuple[str, ...]:
        """The members that may have completed this round, whatever happened here (empty: nobody did).

        A member completes only with every shard's result, and shard j's result comes only from its
        owner j, once every member's parts of it are in. So nobody completes before this worker has
        sent its last part to every other owner, and only a member that got the end of this worker's
        own shard can. Sends count from their start: a frame may arrive although its send failed.
        """
        if len(self._parts_out) < len(self.members) - 1:
            return ()
        return tuple(sorted(self._results_out))

    def _held(self, began: float) -> RoundOutcome | None:
        """The whole average if every shard reached this worker verified, its own audit passed, and no
        member confirmed another one (a failed attempt may still hold it), else None. Without its own audit
        a worker holds nothing to apply: an owner that leaves it unanswered and says "done" when asked
        would have its result applied unchecked."""
        if not self.audited:
            return None
        if len(self._shard_digests) != len(self.members) or None in self._shard_digests.values() \
                or len({round(t, 9) for t in self._shard_totals.values()}) != 1:
            return None
        digest = self._whole_digest()
        if any(d != digest for d in self._confirms.values()):
            return None
        confirmed = tuple(sorted(self._confirms))
        missing = tuple(sorted(set(self.members) - {self.me} - set(confirmed)))
        return self._outcome(digest, began, confirmed, missing)

    async def _exchange(self, j: int, connect: Connect) -> None:
        """Streams our parts of shard j to its owner; receives and checks the owner's averaged parts."""
        peer = self.members[j]
        a, b = self.bounds[j]
        parts = part_bounds(b - a, self.part_numel)
        stream = None
        try:
            stream = await connect(peer)
            await stream.send(Code.CONTRIBUTE, {"group_id": self.group.group_id, "sender": self.me,
                                                "weight": self.weight, "numel": b - a, "parts": len(parts),
                                                "codec": self.codec_label, "round": str(self.group.key),
                                                "attempt": self.group.attempt})
            sender = asyncio.create_task(self._send_parts(stream, j, parts))
            receiver = asyncio.create_task(self._receive_results(stream, j, parts))
            try:  # either side failing ends the exchange at once
                done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                await sender
                digest, total = await receiver
            finally:
                sender.cancel()
                receiver.cancel()
            self._shard_digests[j], self._shard_totals[j] = digest, total
            self._confirm_streams[j], stream = stream, None  # kept open for our CONFIRM
        except (ProtocolError, OSError, ConnectionError) as e:
            raise PeerFailure(f"exchange with {peer[-8:]}: {e}", {peer}) from None
        except Unreachable as e:
            self.unreachable |= e.peers
            raise
        except (AveragingError, asyncio.CancelledError):  # Malformed among them
            raise
        except Exception as e:  # the transport's own errors (unreachable peer, closed daemon...)
            raise PeerFailure(f"exchange with {peer[-8:]} failed: {type(e).__name__}: {e}", {peer}) from None
        finally:
            if stream is not None:
                stream.close()

    async def _send_parts(self, stream: ByteStream, j: int, parts: list[tuple[int, int]]) -> None:
        """Our ``parts`` of shard j, encoded, in order, to its owner."""
        a = self.bounds[j][0]
        for i, (pa, pb) in enumerate(parts):
            payload = self._encode(a + pa, a + pb)
            self._commit(j, i, payload, pb - pa)
            if i == len(parts) - 1:
                self._parts_out.add(j)
            await stream.send(Code.PART, {"i": i}, payload)
            self.bytes_sent += payload_size(payload)

    async def _receive_results(self, stream: ByteStream, j: int, parts: list[tuple[int, int]]) -> tuple[str, float]:
        """Shard j's averaged parts from its owner (``_read_results``); bytes that fail a check name it."""
        try:
            return await self._read_results(stream, j, parts)
        except ProtocolError as e:
            raise self._checked(self.members[j], e) from None

    async def _read_results(self, stream: ByteStream, j: int, parts: list[tuple[int, int]]) -> tuple[str, float]:
        """Shard j's averaged parts, decoded into ``out`` and checked (finite, the owner's commitments, its
        digest, whom it says it cut): the shard's digest and the group's total weight."""
        peer = self.members[j]
        a = self.bounds[j][0]
        first = await stream.recv(max_payload=0, expect=Code.RESULT)
        self._heard(peer)
        total = meta_field(first.meta, "total_weight", (int, float))
        if not (math.isfinite(total) and 0 < total <= MAX_WEIGHT * len(self.members)):
            raise ProtocolError(f"invalid total weight {total!r}")
        hasher = new_hasher()
        manifest = None
        if self.audit_chunks:
            manifest = {"weights": self._checked_weights(first.meta, total), "roots": [], "norms": []}
            hasher.update(audit.weights_bytes(manifest["weights"]))
        for i, (pa, pb) in enumerate(parts):
            frame = await stream.recv(max_payload=self.result_codec.wire_bytes(pb - pa), expect=Code.RESULT_PART)
            self._heard(peer)
            if meta_field(frame.meta, "i", int) != i:
                raise ProtocolError(f"result part {frame.meta.get('i')!r} where part {i} was due")
            target = self.out[a + pa : a + pb]
            self.result_codec.decode_into(frame.payload, target)
            if not all_finite(target):
                raise ProtocolError("averaged part is not finite")
            hasher.update(frame.payload)
            if manifest is not None:
                roots, norms = self._checked_manifest(frame.meta, j, i)
                self._check_size(peer, i, target, manifest["weights"], norms)
                hasher.update(audit.manifest_bytes(roots, norms))
                manifest["roots"].append(roots)
                manifest["norms"].append(norms)
            self.bytes_received += payload_size(frame.payload)
        end = await stream.recv(max_payload=0, expect=Code.RESULT_END)
        self._heard(peer)
        if meta_field(end.meta, "digest", str) != hasher.hexdigest():
            raise ProtocolError("averaged shard does not match its digest")
        for kind in self._bounded:  # whom the owner cut: members only, each named once
            named = meta_field(end.meta, kind, list)
            if len(named) > len(self.members) or not all(isinstance(m, str) and m in self.members for m in named):
                raise ProtocolError(f"the owner's {kind} list names non-members")
            self._bounded[kind].update(named)
        if manifest is not None:
            self._manifests[j] = manifest
        return hasher.hexdigest(), float(total)

    @property
    def codec_label(self) -> str:
        """What the group agrees on (``group_label``)."""
        return group_label(self.codec, self.result_codec, self.aggregation, self.audit_chunks)

    def _encode(self, a: int, b: int) -> memoryview | bytes:
        """Our contribution's values [a, b) as a payload (their quantisation error into ``error_out``)."""
        if self.error_out is None:
            return self.codec.to_bytes(self.flat[a:b])
        return self.codec.to_bytes_with_error(self.flat[a:b], self.error_out[a:b])

    async def _verify(self, digest: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Tells every member our digest and waits for theirs; a different one refuses the round."""
        streams = list(self._confirm_streams.values())
        self._confirm_streams.clear()
        others = set(self.members) - {self.me}
        try:
            for stream in streams:
                try:
                    await stream.send(Code.CONFIRM, {"digest": digest})
                except Exception as e:  # a member that died after the transfer: it just won't confirm
                    log.debug("could not confirm to %s: %s", stream.remote[-8:], e)
            async with self._changed:
                self._changed.notify_all()
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: others <= self._confirms.keys()
                                                                  or self.error is not None), self.confirm_timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            # Closed once the confirmations are in (or not coming), not right after our CONFIRM: the member
            # reads it, then closes its end; this end going away first gives a transport a chance to lose it.
            for stream in streams:
                stream.close()
        async with self._changed:
            self._raise_if_failed()
            wrong = {p for p, d in self._confirms.items() if d != digest}
            if wrong:
                raise PeerFailure(f"members {sorted(p[-8:] for p in wrong)} hold a different average; refused", wrong)
            confirmed = tuple(sorted(self._confirms))
        missing = tuple(sorted(others - set(confirmed)))
        if missing:
            log.warning("round %s: %d of %d members confirmed the average (the others may have died); applying it",
                        self.group.group_id, len(confirmed) + 1, len(self.members))
        return confirmed, missing

    async def _fail(self, error: Exception) -> None:
        """Fails the attempt here (``AttemptFailure``) and closes the streams kept open for the confirmation."""
        await super()._fail(error)
        streams = list(self._confirm_streams.values())
        self._confirm_streams.clear()
        for stream in streams:
            stream.close()
