"""One round of a streamed, verified reduce-scatter / all-gather, over any stream of frames.

A group of G members splits the flat vector into contiguous shards; member j owns shard j. A member
that others reach only through a relay (``Group.relayed``: behind NAT) owns an empty shard, so the
bulk of the round flows to members that accept connections (``shard_bounds_for``).
Every shard is cut into parts of ``part_numel`` values. Each member streams its *encoded*
parts of shard j to member j; member j decodes each part as it arrives, and as soon as all G
contributions to part i are in, averages them in member order (fp32), encodes the average
once and streams those bytes back to every member, itself included, while later parts are
still arriving. Every member decodes identical bytes, so every member ends with a
bit-identical average. Before anyone applies it, every member sends every other member the
BLAKE3 digest of all the averaged bytes it received (``CONFIRM``); a different digest refuses the round.

Every byte from a peer is checked before it is used: the sender is the transport's
authenticated peer id, the group id names a round this worker is in, every size is known in
advance, parts come in order and once, values are finite, the owner's digest matches.

The transport is an argument: ``connect(peer) -> ByteStream`` for outgoing streams, and
``Rounds.serve(stream)`` for incoming ones.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import torch

from ..errors import AveragingError, InDoubt, Malformed, PeerFailure, ProtocolError, RoundCounted, Unreachable
from ..fingerprint import new_hasher, tensor_bytes
from . import audit
from .aggregation import Aggregation
from .base import RoundKey
from .blame import MAX_BLAMED, blamed, breaks_attempt
from .buffers import all_finite
from .compression import Codec, codec_label
from .wire import ByteStream, Code, Refused, StreamClosed, payload_size
from .wire import field as meta_field

log = logging.getLogger(__name__)

DEFAULT_PART_NUMEL = 1 << 18  # 256 Ki values: 512 KiB in fp16, a multiple of every codec's block
MAX_WEIGHT = 1e12

Connect = Callable[[str], Awaitable[ByteStream]]


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) ranges covering ``numel`` elements."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def shard_bounds_for(numel: int, members: Sequence[str],
                     relayed: frozenset[str] = frozenset()) -> list[tuple[int, int]]:
    """Each member's [start, end) of the flat vector: nearly equal shards for the members not in
    ``relayed``, empty ones for those in it (every member's shard is equal if all are relayed)."""
    owners = [m for m in members if m not in relayed] or list(members)
    sizes = iter(shard_bounds(numel, len(owners)))
    bounds, cursor = [], 0
    for m in members:
        if m in owners:
            a, b = next(sizes)
            cursor += b - a
            bounds.append((cursor - (b - a), cursor))
        else:
            bounds.append((cursor, cursor))
    return bounds


MIN_AUDIT_ANSWER_S = 5.0
"""The least time a member is given to answer an audit (``RoundRunner.answer_bound``): the chunks are
small and it has every part by then, but a loaded machine's event loop may lag."""


def part_bounds(numel: int, part_numel: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most ``part_numel`` values; one empty part for an empty shard."""
    if numel == 0:
        return [(0, 0)]
    return [(a, min(a + part_numel, numel)) for a in range(0, numel, part_numel)]


def group_label(codec: Codec, result_codec: Codec | None, aggregation: Aggregation, audit_chunks: int) -> str:
    """What a group's members must agree on, e.g. ``fp16|mean-clip4-w4|audit4``: the wire formats
    (``contribution`` or ``contribution/result``), how owners aggregate, and how much members audit.
    Matchmaking groups only announcements that carry the same label; an opening frame names it."""
    label = f"{codec_label(codec, result_codec)}|{aggregation.label}"
    return label + (f"|audit{audit_chunks}" if audit_chunks else "")


def make_group_id(run_id: str, key: RoundKey, attempt: int, members: Sequence[str],
                  relayed: frozenset[str] = frozenset()) -> str:
    """The round's name on the wire; members that split the vector differently name it differently."""
    h = new_hasher()
    h.update(f"{run_id}|{key}|{attempt}|{','.join(members)}".encode())
    if relayed:
        h.update(f"|relayed:{','.join(sorted(relayed))}".encode())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class Group:
    """The members of one round, in shard order, and the id that names the round on the wire."""

    group_id: str
    members: tuple[str, ...]
    key: RoundKey
    relayed: frozenset[str] = frozenset()
    """Members the others reach only through a relay (behind NAT): they own empty shards."""
    attempt: int = -1
    """Which attempt at ``key`` it is (-1: not known). A member in one group of an attempt never joins
    another group of it, nor of an earlier one (``Rounds.serve``)."""


@dataclass
class RoundOutcome:
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


class ShardReducer:
    """The owner's side of one shard: contributions come in part by part, averages go out part by part.

    Pure computation (no I/O, no asyncio): ``add_part`` returns the indices of the parts it
    completed; ``results[i]`` then holds the encoded average of part i.
    """

    def __init__(self, codec: Codec, numel: int, members: Sequence[str], part_numel: int,
                 result_codec: Codec | None = None, aggregation: Aggregation | None = None, committed: bool = False):
        """``committed``: the owner commits to what it combined (``audit.py``): per part, each member's
        Merkle root and norm (``manifests``), and the declared weights, all under its digest."""
        self.codec, self.numel, self.members = codec, numel, tuple(members)
        self.committed = committed
        self.result_codec = result_codec or codec.averages
        self.aggregation = aggregation or Aggregation()
        self.used_weights: list[float] = []
        """The weights the averages use (claims capped), in member order."""
        self.capped: list[str] = []
        self.clipped: set[str] = set()
        """The averages go out in this codec (it may be wider than the contributions')."""
        self.parts = part_bounds(numel, part_numel)
        self.weights: dict[str, float] = {}
        self._next_part: dict[str, int] = {}
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self.parts]
        self.results: list[bytes | memoryview | None] = [None] * len(self.parts)
        self._hasher = new_hasher()
        self.digest: str | None = None
        self.total_weight: float | None = None
        self._roots: list[dict[str, str]] = [{} for _ in self.parts]
        self._norms: list[dict[str, float]] = [{} for _ in self.parts]
        self.manifests: list[dict | None] = [None] * len(self.parts)
        """Per part, what the owner committed to: ``{"roots": [...], "norms": [...]}`` in member order."""

    @property
    def declared(self) -> list[float]:
        """The weights the members declared, in member order."""
        return [self.weights[m] for m in self.members]

    def part_bytes(self, i: int) -> int:
        """The size of member contributions' part i."""
        a, b = self.parts[i]
        return self.codec.wire_bytes(b - a)

    def begin(self, member: str, weight) -> None:
        if member not in self.members:
            raise ProtocolError(f"{member[-8:]} is not a member of this group")
        if member in self.weights:
            raise ProtocolError(f"{member[-8:]} contributed twice")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 <= weight <= MAX_WEIGHT:
            raise ProtocolError(f"{member[-8:]} sent an invalid weight {weight!r}")
        self.weights[member] = float(weight)
        self._next_part[member] = 0
        if len(self.weights) == len(self.members):
            used, capped = self.aggregation.weights([self.weights[m] for m in self.members])
            total = sum(used)
            if total <= 0:
                raise AveragingError("every member of the group contributed weight 0")
            self.used_weights, self.capped = used, [self.members[i] for i in capped]
            if self.committed:
                self._hasher.update(audit.weights_bytes(self.declared))
            self.total_weight = total

    def add_part(self, member: str, index, payload) -> list[int]:
        if member not in self.weights:
            raise ProtocolError(f"{member[-8:]} sent a part before opening its contribution")
        if isinstance(index, bool) or index != self._next_part[member]:
            raise ProtocolError(f"{member[-8:]} sent part {index!r}, expected part {self._next_part[member]}")
        if index >= len(self.parts):
            raise ProtocolError(f"{member[-8:]} sent more parts than the shard has")
        a, b = self.parts[index]
        values = self.codec.view_bytes(payload, b - a)  # size-checked; checked for finiteness when reduced
        if self.committed:
            self._roots[index][member], self._norms[index][member] = self._commitment(member, index, values)
        self._next_part[member] = index + 1
        self._pending[index][member] = values
        done = []
        # Parts complete in order: every member sends part i before part i + 1.
        while len(done) + index < len(self.parts) and self._complete(index + len(done)):
            done.append(self._reduce(index + len(done)))
        return done

    def _commitment(self, member: str, index: int, values: torch.Tensor) -> tuple[str, float]:
        """What the owner commits to for ``member``'s part ``index``: its Merkle root and norm."""
        return audit.MerkleTree(values).root, audit.norm_of(values)

    def _complete(self, i: int) -> bool:
        return self.results[i] is None and len(self._pending[i]) == len(self.members) \
            and self.total_weight is not None

    def _reduce(self, i: int) -> int:
        contributions = self._pending[i]
        # A fixed order in fp32, and only the owner computes it: bit-identical replicas. The result
        # is a fresh tensor (a payload's bytes may be the contribution itself, with the "none" codec).
        norms = [self._norms[i][m] for m in self.members] if self.committed else None
        acc, clipped = self.aggregation.combine([contributions[m] for m in self.members], self.used_weights, norms)
        self.clipped.update(self.members[j] for j in clipped)
        # A weighted mean of finite values is finite: one pass over it checks every contribution; only
        # when it fails are the contributions checked one by one, to name the sender.
        if not all_finite(acc):
            bad = [m for m in self.members if not all_finite(contributions[m])]
            if bad:  # checked here, value by value: evidence
                raise Malformed(f"{', '.join(m[-8:] for m in bad)} sent non-finite values", bad)
            raise PeerFailure("the members' values overflow when combined", self.members)
        self._pending[i] = {}
        encoded = self.result_codec.to_bytes(acc)
        self._hasher.update(encoded)
        if self.committed:
            manifest = {"roots": [self._roots[i][m] for m in self.members], "norms": norms}
            self._hasher.update(audit.manifest_bytes(manifest["roots"], manifest["norms"]))
            self.manifests[i] = manifest
            self._roots[i], self._norms[i] = {}, {}
        self.results[i] = encoded
        if i == len(self.parts) - 1:
            self.digest = self._hasher.hexdigest()
        return i

    @property
    def done(self) -> bool:
        return self.digest is not None

    def has_all_parts(self, member: str) -> bool:
        return self._next_part.get(member, 0) >= len(self.parts)


class RoundRunner:
    """This worker's side of one round: its contribution to every shard, and the shard it owns."""

    def __init__(self, group: Group, me: str, flat: torch.Tensor, weight: float, codec: Codec, *,
                 out: torch.Tensor | None = None, part_numel: int = DEFAULT_PART_NUMEL,
                 timeout: float = 60.0, confirm_timeout: float = 5.0, result_codec: Codec | None = None,
                 error_out: torch.Tensor | None = None, aggregation: Aggregation | None = None,
                 audit_chunks: int = 0):
        """``error_out`` (shaped like ``flat``) receives what encoding lost of this worker's contribution:
        ``flat`` minus the values the owners received (for error feedback). ``audit_chunks``: chunks of
        every other owner's shard this worker spot-checks before it confirms (``audit.py``; 0: none,
        and owners commit to nothing)."""
        if isinstance(audit_chunks, bool) or not isinstance(audit_chunks, int) \
                or not 0 <= audit_chunks <= audit.MAX_AUDIT_CHUNKS:
            raise ValueError(f"audit_chunks must be an int in [0, {audit.MAX_AUDIT_CHUNKS}], got {audit_chunks!r}")
        self.audit_chunks = audit_chunks
        """What the group agrees on (its label); ``_per_owner`` is what this round audits of each shard."""
        if me not in group.members:
            raise ValueError("this worker is not a member of the group")
        if not isinstance(part_numel, int) or part_numel < 1:
            raise ValueError(f"part_numel must be a positive int, got {part_numel!r}")
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
        self._trees: dict[tuple[int, int], audit.MerkleTree] = {}
        """(owner, part) -> the Merkle tree of this worker's own values of that part (answers audits)."""
        self._own_norms: dict[tuple[int, int], float] = {}
        share = (len(group.members) - 1) / len(group.members)
        round_bytes = int(share * (codec.wire_bytes(flat.numel()) + self.result_codec.wire_bytes(flat.numel())))
        self._per_owner = audit.chunks_per_owner(audit_chunks, flat.numel(), len(group.members), part_numel,
                                                 round_bytes)
        self._manifests: dict[int, dict] = {}
        """owner -> what it committed to: ``weights`` and, per part, ``roots`` and ``norms``."""
        self._bounded: dict[str, set[str]] = {"clipped": set(), "capped": set()}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.error: Exception | None = None
        self.malformed: dict[str, str] = {}
        """Members whose bytes failed this worker's own checks in this round, with what was wrong
        (``Malformed``): the communicator leaves them out of its next groups (``swarm/exclusion.py``)."""
        self.unreachable: set[str] = set()
        """Members this worker could not dial at all (``Unreachable``), whatever error ended the attempt."""
        self.refused_by: set[str] = set()
        """Members that refused this worker's streams (``REFUSE``): their attempt failed and they said so,
        so they are alive and back for the retry (not suspects to leave behind)."""
        self._gave_up: dict[str, frozenset[str]] = {}
        """Members that refused this worker's streams or asked how the round ended while it still needed their
        bytes, with whom they blamed for it (``blame.py``; ``breakers``)."""
        self._changed = asyncio.Condition()
        self._shard_digests: dict[int, str] = {}
        self._shard_totals: dict[int, float] = {}
        self._confirm_streams: dict[int, ByteStream] = {}
        self._failed = asyncio.Event()
        self._confirms: dict[str, str] = {}
        self._auditing: set[str] = set()  # members whose audit answers are still to come
        self.answer_bound = max(confirm_timeout, MIN_AUDIT_ANSWER_S)
        self._answer_dtype = audit.value_dtype(codec) if audit_chunks else torch.float32
        self._answer_itemsize = torch.empty(0, dtype=self._answer_dtype).element_size()
        """Seconds within which every member answers this worker's audit, from the request."""
        self._serving: set[str] = set()
        self._parts_out: set[int] = set()
        """Owners this worker has sent (or begun sending) its last part of their shard to."""
        self._results_out: set[str] = set()
        """Members this worker has sent (or begun sending) the end of its own shard's result to."""
        self.finished = False
        self.audited = not audit_chunks
        """Whether this worker's own audit of every other owner passed (always, without an audit): a round is
        applied here only then, never on another member's word (``_held``)."""
        self.digest: str | None = None
        """The whole average's digest, once the round has completed here."""
        self.ended = asyncio.Event()
        """Set when ``run`` has returned or raised: the round's outcome here is final."""
        self.began_at = self.heard_at = time.monotonic()
        """(monotonic) When a frame of this attempt last came in from any member (from its start)."""
        self.heard_from: dict[str, float] = {}
        """(monotonic) The members that sent this worker a frame of this attempt, and when the last came."""

    # -- the round, as the member that started it sees it -------------------------------------------
    async def run(self, connect: Connect) -> RoundOutcome:
        """The round: its verified average, or ``AveragingError`` (``InDoubt`` where members may have
        completed it: see ``may_have_completed``)."""
        try:
            return await self._run(connect)
        finally:
            self.ended.set()

    async def _run(self, connect: Connect) -> RoundOutcome:
        began = time.perf_counter()
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
                            time.perf_counter() - began, confirmed, missing,
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
        return time.monotonic() - self.heard_at

    def _heard(self, member: str) -> None:
        self.heard_at = self.heard_from[member] = time.monotonic()

    async def abandon(self, why: str) -> None:
        """Fails the attempt here now: this worker cannot do its part (``why``). Members that may have
        completed it are asked, as after any failure."""
        await self._fail(AveragingError(f"abandoned: {why}"))

    async def give_up_on(self, member: str, why: str = "failed its attempt",
                         blame: frozenset[str] | None = None) -> None:
        """What we still wait for from ``member`` will never come (its attempt failed: it asks how the round
        ended, naming ``blame``; or it left the run: ``blame`` None), so the round fails here now instead of
        at its timeout."""
        if blame is not None:
            self._gave_up.setdefault(member, blame)
        await self._fail(PeerFailure(f"{member[-8:]} {why} before this worker had all it sends", {member}))

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

    @property
    def breakers(self) -> set[str]:
        """The members that broke this attempt here: the culprits of its first failure that gave up on it
        (refused, or asked how it ended, while this worker still needed their bytes) without blaming a
        third member (``blame.breaks_attempt``). The communicator leaves them out of the round's retries."""
        error = self.error
        if not isinstance(error, PeerFailure) or isinstance(error, Malformed):
            return set()
        return set(error.peers) & self._broke

    @property
    def _broke(self) -> frozenset[str]:
        """The members that gave up on this attempt blaming no third member (``blame.breaks_attempt``)."""
        return frozenset(p for p, blame in self._gave_up.items() if breaks_attempt(p, self.me, blame, self.members))

    def blame(self) -> frozenset[str]:
        """Whom this worker's own failure of the round names (what its refusals and questions carry)."""
        error = self.error
        return frozenset(error.peers) - {self.me} if isinstance(error, PeerFailure) else frozenset()

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

            async def send_parts():
                for i, (pa, pb) in enumerate(parts):
                    payload = self._encode(a + pa, a + pb)
                    self._commit(j, i, payload, pb - pa)
                    if i == len(parts) - 1:
                        self._parts_out.add(j)
                    await stream.send(Code.PART, {"i": i}, payload)
                    self.bytes_sent += payload_size(payload)

            async def receive_results():
                try:
                    return await read_results()
                except ProtocolError as e:
                    raise self._checked(peer, e) from None

            async def read_results():
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
                    frame = await stream.recv(max_payload=self.result_codec.wire_bytes(pb - pa),
                                              expect=Code.RESULT_PART)
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
                    if len(named) > len(self.members) or not all(isinstance(m, str) and m in self.members
                                                                   for m in named):
                        raise ProtocolError(f"the owner's {kind} list names non-members")
                    self._bounded[kind].update(named)
                if manifest is not None:
                    self._manifests[j] = manifest
                return hasher.hexdigest(), float(total)

            sender, receiver = asyncio.create_task(send_parts()), asyncio.create_task(receive_results())
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

    async def _own_shard(self) -> None:
        """Our contribution to our own shard (same encode/decode as on the wire), then its average."""
        await self._begin(self.me, self.weight)
        a, b = self.bounds[self.my_index]
        for i, (pa, pb) in enumerate(self.reducer.parts):
            payload = self._encode(a + pa, a + pb)
            self._commit(self.my_index, i, payload, pb - pa)
            await self._add_part(self.me, i, payload)
            await asyncio.sleep(0)  # let the streams move while we encode
        for i, (pa, pb) in enumerate(self.reducer.parts):
            self.result_codec.decode_into(await self._result(i), self.out[a + pa : a + pb])
        async with self._changed:
            self._shard_digests[self.my_index] = self.reducer.digest
            self._shard_totals[self.my_index] = self.reducer.total_weight
            self._changed.notify_all()

    @property
    def codec_label(self) -> str:
        """What the group agrees on (``group_label``)."""
        return group_label(self.codec, self.result_codec, self.aggregation, self.audit_chunks)

    def _encode(self, a: int, b: int) -> memoryview | bytes:
        """Our contribution's values [a, b) as a payload (their quantisation error into ``error_out``)."""
        if self.error_out is None:
            return self.codec.to_bytes(self.flat[a:b])
        return self.codec.to_bytes_with_error(self.flat[a:b], self.error_out[a:b])

    # -- the owners' commitments and their audit (audit.py) ----------------------------------------
    def _commit(self, j: int, i: int, payload, numel: int) -> None:
        """Remembers the Merkle tree and norm of our part i of shard j, as its owner will decode it."""
        if self.audit_chunks:
            values = self.codec.view_bytes(payload, numel)
            self._trees[(j, i)] = audit.MerkleTree(values)
            self._own_norms[(j, i)] = audit.norm_of(values)

    def _checked_weights(self, meta: dict, total: float) -> list[float]:
        """The declared weights an owner committed to: ours as we sent it, and a total that follows."""
        weights = meta_field(meta, "weights", list)
        if len(weights) != len(self.members) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and 0 <= w <= MAX_WEIGHT
                for w in weights):
            raise ProtocolError("the owner's declared weights are malformed")
        weights = [float(w) for w in weights]
        if weights[self.my_index] != self.weight:
            raise ProtocolError(f"the owner says this worker declared weight {weights[self.my_index]!r}, "
                                f"it declared {self.weight!r}")
        used = sum(self.aggregation.weights(weights)[0])
        if abs(used - total) > 1e-9 * max(used, 1e-30):
            raise ProtocolError(f"total weight {total!r} does not follow from the declared weights ({used!r})")
        return weights

    def _checked_manifest(self, meta: dict, j: int, i: int) -> tuple[list[str], list[float]]:
        """Part i's roots and norms as shard j's owner committed to them; ours must be what we sent."""
        roots, norms = meta_field(meta, "roots", list), meta_field(meta, "norms", list)
        if len(roots) != len(self.members) or len(norms) != len(self.members) \
                or not all(isinstance(r, str) and len(r) == audit.HASH_HEX for r in roots) \
                or not all(isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in norms):
            raise ProtocolError(f"the owner's commitment for part {i} is malformed")
        norms = [float(n) for n in norms]
        if roots[self.my_index] != self._trees[(j, i)].root \
                or not audit.norms_agree(norms[self.my_index], self._own_norms[(j, i)]):
            raise ProtocolError(f"the owner misreports this worker's part {i} (its commitment names other values)")
        return roots, norms

    def _check_size(self, owner: str, i: int, values: torch.Tensor, weights: list[float], norms: list[float]) -> None:
        """Every value of an owner's result part, not only the audited chunks: its norm within what the
        members' committed norms and weights allow (``audit.result_norm_bound``); else the owner is named."""
        size = audit.norm_of(values)
        limit = audit.result_norm_bound(self.aggregation, weights, norms, self.result_codec, values.numel())
        if size > limit:
            failure = Malformed(f"{owner[-8:]} owns a shard whose result part {i} is larger than its members' "
                                f"parts allow (norm {size:.3g} > {limit:.3g})", {owner})
            self._note_malformed(failure)
            raise failure

    def _chunk_span(self, j: int, i: int, c: int) -> tuple[int, int, int, int]:
        """Where chunk c of part i of shard j lies: (the part's first value in the flat vector, the part's
        length, the chunk's [start, end) within the part)."""
        a = self.bounds[j][0]
        pa, pb = part_bounds(self.bounds[j][1] - a, self.part_numel)[i]
        return (a + pa, pb - pa, *audit.chunk_range(pb - pa, c))

    def _own_chunk(self, j: int, i: int, c: int) -> torch.Tensor:
        """Our values of chunk c of part i of shard j, as the owner decoded them (encoded again)."""
        start, n, ca, cb = self._chunk_span(j, i, c)
        block = audit.rounding(self.codec)[0]  # the codec's blocks are aligned to the part's start
        ea, eb = ca // block * block, min(n, -(-cb // block) * block)
        encoded = self.codec.to_bytes(self.flat[start + ea : start + eb])
        values = self.codec.view_bytes(encoded, eb - ea)[ca - ea : cb - ea].clone()
        if audit.leaf_hash(values) != self._trees[(j, i)].leaf(c):
            raise AveragingError(f"encoding part {i} of shard {j} again gave other values: the codec is not "
                                 "deterministic, so owners cannot be audited")
        return values

    async def _audit(self) -> None:
        """Spot-checks ``audit_chunks`` random chunks of every other owner's shard: asks every other member
        for its values of them (with Merkle paths to what the owner committed), recomputes the result."""
        rng = random.SystemRandom()  # picked after the results arrived: no owner can know which
        picked: dict[int, list[tuple[int, int]]] = {}
        for j in range(len(self.members)):
            if j == self.my_index:
                continue
            parts = part_bounds(self.bounds[j][1] - self.bounds[j][0], self.part_numel)
            chunks = [(i, c) for i, (pa, pb) in enumerate(parts) if pb > pa  # an empty shard has nothing to check
                      for c in range(audit.chunk_count(pb - pa))]
            picked[j] = rng.sample(chunks, min(self._per_owner, len(chunks)))
        asked = [[j, i, c] for j, chosen in sorted(picked.items()) for i, c in chosen]
        streams = dict(self._confirm_streams)
        if len(streams) != len(self.members) - 1:  # a failure closed them (``_fail``) as the audit began
            self._raise_if_failed()
            raise AveragingError("the members' streams closed before the audit")
        answers = await asyncio.gather(*(self._ask(m, streams[m], asked) for m in sorted(streams)))
        values = dict(zip(sorted(streams), answers))
        for n, (j, i, c) in enumerate(asked):
            owner = self.members[j]
            start, numel, ca, cb = self._chunk_span(j, i, c)
            chunk = [self._own_chunk(j, i, c).to(torch.float32) if m == self.my_index else values[m][n]
                     for m in range(len(self.members))]
            part_result = self.out[start : start + numel]
            result = part_result[ca:cb]
            tol = audit.tolerance(result, part_result, ca, self.result_codec)
            manifest = self._manifests[j]
            wrong = audit.check_chunk(self.aggregation, manifest["weights"], manifest["norms"][i], chunk, result, tol,
                                      self.result_codec)
            if wrong is not None:
                first = start - self.bounds[j][0]
                failure = Malformed(f"{owner[-8:]} owns a shard whose result failed this worker's audit (part {i}, "
                                    f"values {first + ca}-{first + cb}): {wrong}", {owner})
                self._note_malformed(failure)
                raise failure

    async def _ask(self, m: int, stream: ByteStream, asked: list) -> list[torch.Tensor]:
        """Member m's values of the ``asked`` chunks, each proven against its owner's committed root.

        A member that keeps its stream open and answers nothing within ``answer_bound`` (it has every part
        of the round by then: it asks nothing of anyone to answer), or answers out of form, is named
        (``Malformed``): a round is applied only where its own audit passed, so silence would otherwise
        stall every auditor for nothing, attempt after attempt. One that refuses or closes its stream (its
        attempt failed) only fails the attempt."""
        peer = self.members[m]
        self._auditing.add(peer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.answer_bound
        try:
            await stream.send(Code.AUDIT, {"chunks": asked})
            out = []
            for j, i, c in asked:
                _, numel, ca, cb = self._chunk_span(j, i, c)
                size = self._answer_itemsize * (cb - ca)
                frame = await asyncio.wait_for(stream.recv(max_payload=size, expect=Code.AUDIT_ANSWER),
                                               max(0.0, deadline - loop.time()))
                self._heard(peer)
                self.bytes_received += payload_size(frame.payload)
                if payload_size(frame.payload) != size:
                    raise ProtocolError(f"an audit answer of {payload_size(frame.payload)} bytes")
                values = torch.frombuffer(bytearray(frame.payload), dtype=self._answer_dtype)
                if not all_finite(values) or not audit.path_ok(values, c, frame.meta.get("path"),
                                                                  self._manifests[j]["roots"][i][m], numel):
                    # Its values, or the owner's commitment to them: the member itself checks the latter.
                    raise PeerFailure(f"{peer[-8:]}'s values of part {i} of {self.members[j][-8:]}'s shard do not "
                                      "match what the owner committed to", {peer, self.members[j]})
                out.append(values.to(torch.float32))
            return out
        except asyncio.TimeoutError:
            failure = Malformed(f"{peer[-8:]} left this worker's audit unanswered for {self.answer_bound:.0f}s",
                                {peer})
            self._note_malformed(failure)
            raise failure from None
        except (StreamClosed, Refused, OSError, ConnectionError) as e:
            if isinstance(e, Refused):
                self._checked(peer, e)
            raise PeerFailure(f"audit answers from {peer[-8:]}: {type(e).__name__}: {e}", {peer}) from None
        except ProtocolError as e:  # its own bytes: out of form, of the wrong size or code
            failure = Malformed(f"{peer[-8:]} answered this worker's audit out of form: {e}", {peer})
            self._note_malformed(failure)
            raise failure from None
        finally:
            self._auditing.discard(peer)

    async def _answer_audit(self, stream: ByteStream, sender: str, meta: dict) -> None:
        """Our values of the chunks ``sender`` audits, with their Merkle paths (checked before any work)."""
        asked = meta_field(meta, "chunks", list)
        if len(asked) > self._per_owner * len(self.members):
            raise ProtocolError(f"an audit of {len(asked)} chunks; at most {self._per_owner} per owner")
        per_owner: collections.Counter = collections.Counter()
        for entry in asked:
            if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)):
                raise ProtocolError("a malformed audit request")
            j, i, c = entry
            if not (0 <= j < len(self.members)) or self.members[j] == sender or (j, i) not in self._trees \
                    or not 0 <= c < len(self._trees[(j, i)].levels[0]):
                raise ProtocolError(f"an audit of a chunk that does not exist ({j}, {i}, {c})")
            per_owner[j] += 1
            if per_owner[j] > self._per_owner:
                raise ProtocolError(f"an audit of more than {self._per_owner} chunks of one shard")
        for j, i, c in asked:
            values = self._own_chunk(j, i, c)
            payload = tensor_bytes(values)
            await stream.send(Code.AUDIT_ANSWER, {"path": self._trees[(j, i)].path(c)}, payload)
            self.bytes_sent += payload_size(payload)

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

    # -- the shard we own, as the other members see it ----------------------------------------------
    async def serve(self, stream: ByteStream, opening: dict) -> None:
        """An incoming contribution to our shard: reads its parts, streams the averaged parts back."""
        sender = stream.remote
        writer = None
        try:
            if sender in self._serving:
                raise ProtocolError(f"{sender[-8:]} opened a second contribution")
            self._serving.add(sender)
            a, b = self.bounds[self.my_index]
            numel, parts = meta_field(opening, "numel", int), meta_field(opening, "parts", int)
            if numel != b - a or parts != len(self.reducer.parts):
                raise ProtocolError(f"contribution of {opening.get('numel')!r} values in {opening.get('parts')!r} "
                                    f"parts; this shard has {b - a} in {len(self.reducer.parts)}")
            if meta_field(opening, "codec", str) != self.codec_label:
                raise ProtocolError(f"codec {opening.get('codec')!r}, the group uses {self.codec_label!r}")
            await self._begin(sender, meta_field(opening, "weight", (int, float)))
            writer = asyncio.create_task(self._send_results(stream))
            for i in range(len(self.reducer.parts)):
                frame = await self._unless_failed(stream.recv(max_payload=self.reducer.part_bytes(i), expect=Code.PART))
                self._heard(sender)
                self.bytes_received += payload_size(frame.payload)
                await self._add_part(sender, meta_field(frame.meta, "i", int), frame.payload)
            await self._unless_failed(writer)
            if self.audit_chunks:
                request = await self._unless_failed(asyncio.wait_for(stream.recv(max_payload=0, expect=Code.AUDIT),
                                                                     self.timeout + self.confirm_timeout))
                await self._answer_audit(stream, sender, request.meta)
            confirm = await self._unless_failed(asyncio.wait_for(stream.recv(max_payload=0, expect=Code.CONFIRM),
                                                                 self.timeout + self.confirm_timeout))
            async with self._changed:
                self._confirms[sender] = meta_field(confirm.meta, "digest", str)
                self._changed.notify_all()
        except Exception as e:
            if writer is not None:
                writer.cancel()
            failure = e if isinstance(e, AveragingError) else ProtocolError(f"{type(e).__name__}: {e}")
            if isinstance(e, ProtocolError):  # the sender's bytes (a Malformed), or its stream closed
                failure = self._checked(sender, e)
                if not isinstance(failure, Malformed) and not isinstance(e, Refused):
                    failure = PeerFailure(f"{sender[-8:]}: {e}", {sender})
            if not self.finished:
                await self._fail(failure)
            await stream.refuse(str(e), blame=self.blame())
            log.debug("contribution from %s ended: %s", sender[-8:], e)
        finally:
            stream.close()

    async def _send_results(self, stream: ByteStream) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.reducer.total_weight is not None or self.error is not None)
            self._raise_if_failed()
        opening = {"total_weight": self.reducer.total_weight}
        if self.audit_chunks:
            opening["weights"] = self.reducer.declared
        await stream.send(Code.RESULT, opening)
        for i in range(len(self.reducer.parts)):
            payload = await self._result(i)
            await stream.send(Code.RESULT_PART, {"i": i, **(self.reducer.manifests[i] or {})}, payload)
            self.bytes_sent += payload_size(payload)
        self._results_out.add(stream.remote)  # from here on, that member may complete the round
        await stream.send(Code.RESULT_END, {"digest": self.reducer.digest, "clipped": sorted(self.reducer.clipped),
                                            "capped": self.reducer.capped})

    # -- shared state ----------------------------------------------------------------------------------
    async def _begin(self, member: str, weight) -> None:
        self._raise_if_failed()
        self.reducer.begin(member, weight)
        if self.reducer.total_weight is not None:
            async with self._changed:
                self._changed.notify_all()

    async def _add_part(self, member: str, index: int, payload) -> None:
        self._raise_if_failed()
        try:
            completed = self.reducer.add_part(member, index, payload)
        except Malformed as e:  # the part that completed a reduction found someone's values non-finite
            self._note_malformed(e)
            raise
        if completed:
            async with self._changed:
                self._changed.notify_all()

    def _checked(self, peer: str, error: ProtocolError) -> AveragingError:
        """What a ``ProtocolError`` on ``peer``'s stream says of it: a ``Malformed`` (noted) when its own
        bytes failed a check here; the error itself when the stream only closed or was refused."""
        if isinstance(error, Refused):
            self.refused_by.add(peer)
            if not error.stale:
                self._gave_up.setdefault(peer, error.blame)
        if isinstance(error, (StreamClosed, Refused)):
            return error
        failure = Malformed(f"{peer[-8:]} sent malformed data: {error}", {peer})
        self._note_malformed(failure)
        return failure

    def _note_malformed(self, error: Malformed) -> None:
        for peer in error.peers:
            if peer != self.me:
                self.malformed.setdefault(peer, str(error))

    async def _result(self, i: int):
        async with self._changed:
            await self._changed.wait_for(lambda: self.reducer.results[i] is not None or self.error is not None)
            self._raise_if_failed()
            return self.reducer.results[i]

    async def _unless_failed(self, awaitable):
        """Awaits ``awaitable``, or raises as soon as the round fails (a handler never outlives its round)."""
        task = asyncio.ensure_future(awaitable)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled() or self._failed.is_set():  # the round's failure, not what it left the task to trip on
            if not task.cancelled():
                task.exception()  # retrieved (asyncio would print it); the failure is what is raised
            self._raise_if_failed()
        if task.cancelled():
            raise AveragingError("round cancelled")
        return task.result()

    def _raise_if_failed(self) -> None:
        error = self.error
        if error is not None:  # a fresh exception each time: re-raising one object grows its traceback
            if isinstance(error, PeerFailure):  # still names its culprits, Malformed or not
                raise (Malformed if isinstance(error, Malformed) else PeerFailure)(str(error), error.peers) from None
            raise AveragingError(str(error) if isinstance(error, AveragingError) else f"round failed: {error}") \
                from None

    async def _fail(self, error: Exception) -> None:
        async with self._changed:
            if self.error is None:
                self.error = error
            self._failed.set()
            self._changed.notify_all()
        streams = list(self._confirm_streams.values())
        self._confirm_streams.clear()
        for stream in streams:
            stream.close()


@dataclass
class Ended:
    """What this worker remembers of a finished round, to answer its members' ``ASK_OUTCOME``."""

    members: tuple[str, ...]
    digest: str | None
    """The average's digest if the round completed here (or the group completed it: ``Rounds.settle``)."""
    sent_to: frozenset[str]
    """The members this worker began sending the end of its own shard's result to."""
    blame: frozenset[str] = frozenset()
    """Whom this worker's failure of the round named (what a refusal of a late stream of it carries)."""


class Rounds:
    """The rounds this worker is in, by group id, so that incoming streams find theirs.

    A contribution may arrive before this worker has learnt its group: it waits up to
    ``wait_for_group`` seconds. At most ``max_waiting_per_peer`` streams of one peer, and
    ``max_waiting`` in all, wait like that; more are refused at once, so a flood of streams that
    name rounds nobody knows holds neither tasks nor memory. Finished group ids are remembered, so
    a replayed message of an earlier round is refused at once, with their members and outcome, so
    that a member whose attempt failed in doubt can ask whether this worker completed it
    (``ASK_OUTCOME``; ``resolve``).
    """

    def __init__(self, wait_for_group: float = 10.0, remember: int = 1024, max_waiting: int = 64,
                 max_waiting_per_peer: int = 4):
        self.wait_for_group, self.remember = wait_for_group, remember
        self.max_waiting, self.max_waiting_per_peer = max_waiting, max_waiting_per_peer
        self._waiting: collections.Counter = collections.Counter()
        """Streams waiting for their round to be registered, by remote peer."""
        self._active: dict[str, RoundRunner] = {}
        self._finished: collections.OrderedDict[str, Ended] = collections.OrderedDict()
        self._asking: collections.Counter = collections.Counter()
        """Questions waiting for a round of this worker to end, by remote peer."""
        self._registered = asyncio.Condition()
        self._completed: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Round key -> the group id this worker completed it in (``completed``)."""
        self._attempted: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Round key -> the latest attempt this worker took a group of (``register``)."""

    def completed(self, key: str, group_id: str) -> None:
        """This worker completed round ``key`` in group ``group_id``: a contribution to another group of that
        round (a peer that saw this worker's announcement, but not yet that it had moved on) is refused at
        once, not after ``wait_for_group``: no group of that round will be registered here again."""
        self._completed[key] = group_id
        while len(self._completed) > self.remember:
            self._completed.popitem(last=False)

    def reopen(self, key: str) -> None:
        """This worker starts round ``key`` again (it went back to the run's state, after a partition say):
        whatever it completed there before no longer stands."""
        self._completed.pop(key, None)
        self._attempted.pop(key, None)

    async def register(self, runner: RoundRunner) -> None:
        async with self._registered:
            self._active[runner.group.group_id] = runner
            key, attempt = str(runner.group.key), runner.group.attempt
            self._attempted[key] = max(attempt, self._attempted.get(key, attempt))
            self._attempted.move_to_end(key)
            while len(self._attempted) > self.remember:
                self._attempted.popitem(last=False)
            self._registered.notify_all()

    def finish(self, group_id: str) -> None:
        runner = self._active.pop(group_id, None)
        if runner is None and group_id in self._finished:
            return
        self._finished[group_id] = Ended((), None, frozenset()) if runner is None else \
            Ended(runner.members, runner.digest if runner.finished else None, runner.sent_to, runner.blame())
        while len(self._finished) > self.remember:
            self._finished.popitem(last=False)

    def settle(self, group_id: str, digest: str) -> None:
        """A round that failed here in doubt turned out completed by its group (``resolve``): say so when asked."""
        if group_id in self._finished:
            self._finished[group_id].digest = digest

    def outcome(self, group_id: str) -> dict:
        """A round here, as ``OUTCOME`` tells it: its state (done, failed, running or unknown), the digest
        if done, and the members this worker began sending its shard's end to."""
        runner = self._active.get(group_id)
        if runner is not None:
            state = "done" if runner.finished else "failed" if runner.ended.is_set() else "running"
            ended = Ended(runner.members, runner.digest if runner.finished else None, runner.sent_to)
        else:
            ended = self._finished.get(group_id)
            state = "unknown" if ended is None else "done" if ended.digest else "failed"
        return {"group_id": group_id, "state": state, "digest": (ended.digest or "") if ended else "",
                "sent_to": sorted(ended.sent_to) if ended else []}

    async def serve(self, stream: ByteStream) -> None:
        """Entry point for an incoming stream: the opening frame names the round; its runner serves it."""
        group_id = None
        try:
            opening = await asyncio.wait_for(stream.recv(max_payload=0, expect=(Code.CONTRIBUTE, Code.ASK_OUTCOME)),
                                             self.wait_for_group)
            group_id = meta_field(opening.meta, "group_id", str)
            if opening.code == Code.ASK_OUTCOME:
                await self._answer(stream, group_id, blamed(opening.meta.get("blame")))
                return
            if meta_field(opening.meta, "sender", str) != stream.remote:
                raise ProtocolError("sender field does not match the authenticated peer id")
            round_key = opening.meta.get("round")
            done_in = self._completed.get(round_key) if isinstance(round_key, str) else None
            if done_in is not None and done_in != group_id and group_id not in self._active:
                raise ProtocolError(f"this worker completed round {round_key[:32]} in another group")
            attempt = opening.meta.get("attempt")
            known = isinstance(round_key, str) and type(attempt) is int and attempt >= 0
            place = (round_key, attempt) if known else None
            runner = await self._find(group_id, stream.remote, place)
            if stream.remote not in runner.members or stream.remote == runner.me:
                # Refused without failing the round: an outsider must not be able to break it.
                raise ProtocolError(f"{stream.remote[-8:]} is not a member of round {group_id}")
        except Exception as e:
            log.warning("refused a stream from %s: %s", stream.remote[-8:], e)
            # A round that ended here (failed) names its culprits; otherwise this worker is not in that attempt.
            ended = self._finished.get(group_id) if group_id is not None else None
            await stream.refuse(str(e) if isinstance(e, AveragingError) else f"{type(e).__name__}",
                                blame=ended.blame if ended is not None else (), stale=ended is None)
            stream.close()
            return
        try:  # a handler never outlives its round, whatever the peer does
            await asyncio.wait_for(runner.serve(stream, opening.meta), runner.timeout + runner.confirm_timeout)
        except asyncio.TimeoutError:
            log.debug("contribution stream from %s outlived its round", stream.remote[-8:])
            stream.close()

    async def _answer(self, stream: ByteStream, group_id: str, blame: frozenset[str] = frozenset()) -> None:
        """Tells a member of round ``group_id`` whether the round completed here, once it has ended here
        (waiting at most as long as the round may still last). Only members of the round are answered. A
        member asks only once its own attempt failed: if the round here still waits for its bytes, it fails
        now."""
        remote = stream.remote
        runner = self._active.get(group_id)
        ended = self._finished.get(group_id)
        members = runner.members if runner is not None else ended.members if ended is not None else ()
        if (runner is not None or ended is not None) and remote not in members:
            raise ProtocolError(f"{remote[-8:]} is not a member of round {group_id}")
        if runner is not None and not runner.ended.is_set():
            if runner.waits_on(remote):  # it asks because its attempt failed: what we wait for never comes
                await runner.give_up_on(remote, blame=blame)
            if self._asking[remote] >= self.max_waiting_per_peer:
                raise ProtocolError(f"too many questions of {remote[-8:]} waiting; {group_id} refused")
            self._asking[remote] += 1
            try:
                await asyncio.wait_for(runner.ended.wait(), runner.timeout + runner.confirm_timeout)
            except asyncio.TimeoutError:
                pass  # answered "running": the member may ask again
            finally:
                self._asking[remote] -= 1
                if not self._asking[remote]:
                    del self._asking[remote]
        try:
            await stream.send(Code.OUTCOME, self.outcome(group_id))
        except Exception as e:  # the member is gone: nothing to tell
            log.debug("could not answer %s about round %s: %s", remote[-8:], group_id, e)
        finally:
            stream.close()

    def _elsewhere(self, group_id: str, place: tuple[str, int] | None) -> str | None:
        """Why this worker will never join ``group_id``, if it took another group of the same round at that
        attempt or a later one: it is in it, or was (a member grouped it with another leader's group of the
        attempt, which it did not take, or took and failed: from there it only goes on to later attempts).
        Such a stream used to wait ``wait_for_group`` for nothing."""
        if place is None:
            return None
        round_key, attempt = place
        mine = next((r for r in self._active.values() if r.group.group_id != group_id and r.group.attempt >= attempt
                     >= 0 and str(r.group.key) == round_key), None)
        if mine is not None:
            return f"this worker is in another group of round {round_key[:32]} (attempt {mine.group.attempt})"
        took = self._attempted.get(round_key)
        if took is not None and took >= attempt >= 0 and group_id not in self._active:
            return f"this worker was in another group of round {round_key[:32]} at attempt {took}"
        return None

    def _refuse_if_elsewhere(self, group_id: str, place: tuple[str, int] | None) -> None:
        why = self._elsewhere(group_id, place)
        if why is not None:
            raise ProtocolError(f"{why}, not in {group_id}")

    async def _find(self, group_id: str, remote: str, place: tuple[str, int] | None = None) -> RoundRunner:
        """The runner of ``group_id``, once registered; ``place``: the round key and attempt its opening names."""
        if group_id in self._finished:
            raise ProtocolError(f"round {group_id} is already finished")
        if group_id not in self._active:  # it may still come: wait, within bounds
            self._refuse_if_elsewhere(group_id, place)
            if self._waiting[remote] >= self.max_waiting_per_peer or sum(self._waiting.values()) >= self.max_waiting:
                raise ProtocolError(f"too many streams waiting for unknown rounds; {group_id} refused")
            self._waiting[remote] += 1
            cond = self._registered
            try:
                async with cond:
                    await asyncio.wait_for(cond.wait_for(lambda: group_id in self._active or group_id in self._finished
                                                         or self._elsewhere(group_id, place) is not None),
                                           self.wait_for_group)
            except asyncio.TimeoutError:
                raise ProtocolError(f"unknown group {group_id}") from None
            finally:
                self._waiting[remote] -= 1
                if not self._waiting[remote]:
                    del self._waiting[remote]
            if group_id not in self._active and group_id not in self._finished:
                self._refuse_if_elsewhere(group_id, place)
        if group_id not in self._active:
            raise ProtocolError(f"round {group_id} is already finished")
        return self._active[group_id]


# -- a failed attempt in doubt ------------------------------------------------------------------------

ANSWERS = ("done", "failed", "running", "unknown")
"""What a member says of a round: it completed (and applied) it, failed it, is still in it, never knew it."""
MAX_DIGEST_CHARS = 64
HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Answer:
    state: str
    digest: str = ""
    sent_to: frozenset[str] = frozenset()
    """The members the answering member began sending its shard's end to (final once it is done or failed)."""


async def ask_outcome(connect: Connect, peer: str, group_id: str, members: Sequence[str],
                      blame: Sequence[str] = ()) -> Answer:
    """``peer``'s answer about round ``group_id`` (of ``members``); ``ProtocolError`` if it does not fit.
    ``blame``: whom this worker's failure of the round names (``blame.py``).

    The answer comes on the stream this worker opened to ``peer``: from that authenticated peer.
    """
    stream = await connect(peer)
    try:
        await stream.send(Code.ASK_OUTCOME, {"group_id": group_id, "blame": sorted(blame)[:MAX_BLAMED]})
        frame = await stream.recv(max_payload=0, expect=Code.OUTCOME)
    finally:
        stream.close()
    state, digest = meta_field(frame.meta, "state", str), meta_field(frame.meta, "digest", str)
    sent_to = meta_field(frame.meta, "sent_to", list)
    if meta_field(frame.meta, "group_id", str) != group_id or state not in ANSWERS:
        raise ProtocolError(f"{peer[-8:]} answered {state[:20]!r} about another round or in no known terms")
    if state == "done" and not (0 < len(digest) <= MAX_DIGEST_CHARS and set(digest) <= HEX):
        raise ProtocolError(f"{peer[-8:]} answered done with a malformed digest")
    if len(sent_to) > len(members) or not all(isinstance(m, str) and m in members for m in sent_to):
        raise ProtocolError(f"{peer[-8:]} named non-members")
    return Answer(state, digest if state == "done" else "", frozenset(sent_to))


GONE_POLL_S = 0.5
"""While a member is asked whether it completed a round, how often the asker looks whether it has left the run."""
UNDIALLED_GONE_S = 3.0
"""A member asked whether it completed a round that no dial has reached for this long, every dial failing
(a killed worker's address refuses at once), is taken for gone: had it completed the round, its state is
out of reach, and its record would only say so once it expires (``record_ttl``, 8 s in the long scenario)."""


async def find_outcome(connect: Connect, doubt: InDoubt, timeout: float, gone: Callable[[str], bool] | None = None,
                       pause: float = 0.25) -> tuple[str | None, dict[str, str]]:
    """Asks the other members of the round of ``doubt`` at once whether they completed it: (the digest,
    answers) as soon as one that may have (``doubt.ask``) says it did; (None, answers) once none of them can
    have (each said it failed it, or is ruled out), or when ``timeout`` runs out.

    A member of ``doubt.ask`` that cannot be reached, answers out of form, "running" or "unknown" is asked
    again until ``timeout``, unless it is ruled out: a member completes only with every owner's shard, so
    one that another owner never began sending its shard's end to (that owner's final answer says so) has
    not. The others are asked only for that. A member that does not answer and has left the run, or
    says in its record that it failed the attempt (``gone(peer)``), or that no dial has reached for
    ``UNDIALLED_GONE_S`` (a killed worker), is not waited for: had it completed
    the round, its state left with it, and the members' retry counts their work once in every state that
    remains. ``answers``: the last state of
    each member of ``doubt.ask`` ("unanswered" where none came, "gone", or "ruled out" where none is
    needed any more).

    A member whose bytes failed this worker's own checks or audit (or left it unanswered), or that gave up
    on the round blaming no other member (``doubt.distrusted``), is not believed when it says "done"
    ("distrusted"), nor about whom it sent its shard to: an owner that keeps its result from the audit and
    then says the round completed would otherwise have it applied. A member whose stream only closed, or
    that did not answer in time, may have completed the round, and is believed.
    """
    distrusted = frozenset(doubt.distrusted) - {doubt.me}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    answers = {m: "unanswered" for m in doubt.members if m != doubt.me}
    final: dict[str, frozenset[str]] = {}  # sent_to of the members that are done or failed
    found: list[str] = []

    def ruled_out(m: str) -> bool:
        return any(m not in sent_to for p, sent_to in final.items() if p != m)

    def decided() -> bool:
        return bool(found) or all(answers[m] in ("failed", "gone", "distrusted") or ruled_out(m) for m in doubt.ask)

    async def ask(peer: str) -> None:
        undialled_since = None  # (loop time) the end of the first of the dials to it that have all failed since
        while deadline - loop.time() > 0:
            asking = asyncio.ensure_future(ask_outcome(connect, peer, doubt.group_id, doubt.members,
                                                       sorted(set(doubt.peers) - {doubt.me})))
            try:
                # A dial into a partition neither answers nor fails for as long as the daemon tries (30 s):
                # a member that has left the run meanwhile is not waited for that long.
                while not asking.done():
                    if loop.time() >= deadline:
                        return
                    if gone is not None and gone(peer):
                        answers[peer] = "gone"
                        return
                    await asyncio.wait({asking}, timeout=min(GONE_POLL_S, max(0.0, deadline - loop.time())))
                answer = asking.result()
                undialled_since = None
            except Unreachable as e:  # no dial reached it
                undialled_since = loop.time() if undialled_since is None else undialled_since
                if loop.time() - undialled_since >= UNDIALLED_GONE_S:
                    answers[peer] = "gone"
                    log.info("round %s: %s could not be dialled for %.0f s while asked how the round ended: taken "
                             "for gone (%s)", doubt.group_id, peer[-8:], UNDIALLED_GONE_S, e)
                    return
                answer = Answer("unanswered")
            except Exception as e:  # refused, or out of form: not an answer
                log.debug("asking %s about round %s: %s", peer[-8:], doubt.group_id, e)
                undialled_since = None
                answer = Answer("unanswered")
            finally:
                if not asking.done():
                    asking.cancel()
                    await asyncio.gather(asking, return_exceptions=True)
            answers[peer] = answer.state
            if answer.state == "unanswered" and gone is not None and gone(peer):
                answers[peer] = "gone"
                return
            if answer.state == "done" and peer in distrusted:
                answers[peer] = "distrusted"
                log.warning("round %s: %s says it completed the round, but this worker's own checks of it failed "
                            "(%s): not believed", doubt.group_id, peer[-8:], doubt)
                return
            if answer.state in ("done", "failed"):
                final[peer] = answer.sent_to
                if answer.state == "done" and peer in doubt.ask:  # only those can have completed it
                    found.append(answer.digest)
                return
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))

    pending = {asyncio.create_task(ask(m)) for m in answers}
    try:
        while pending and not decided():
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for m in doubt.ask:
        if answers[m] not in ("failed", "gone", "distrusted") and ruled_out(m) and not found:
            answers[m] = "ruled out"
    return (found[0] if found else None), {m: answers[m] for m in doubt.ask}


async def resolve(doubt: InDoubt, connect: Connect, key: RoundKey, timeout: float,
                  rounds: Rounds | None = None, gone: Callable[[str], bool] | None = None) -> RoundOutcome | None:
    """The group's outcome of an attempt that failed here in doubt, so that this worker ends with it.

    - A member completed the round: this worker's contribution is in the average. If this worker
      holds that very average (the same digest), it is returned to be applied; else ``RoundCounted``
      (completed): adopt the group's state, never apply or carry the work again.
    - No member that is still there can have completed it (``find_outcome``): None, retry.
    - Otherwise (no answer within ``timeout``): ``RoundCounted`` (not completed). Correctness over
      goodput: the work may have been counted, so it is dropped, and the run's state adopted.

    ``rounds`` (this worker's) learns that the round completed, to tell members that ask in turn.
    ``gone(peer)``: whether a member has left the run (see ``find_outcome``).
    """
    digest, answers = await find_outcome(connect, doubt, timeout, gone)
    gid, step = doubt.group_id, key.outer_step + 1
    if digest is not None:
        if rounds is not None:
            rounds.settle(gid, digest)
        if doubt.held is not None and doubt.held.digest == digest:
            log.warning("round %s failed here (%s), but the group completed it with the average this worker holds "
                        "(%s): applying it", gid, doubt, digest)
            return doubt.held
        raise RoundCounted(f"the group completed round {key} ({gid}) without this worker's confirmation (here: "
                           f"{doubt}); adopting its state", group_outer_step=step, completed=True)
    if all(a in ("failed", "ruled out", "gone", "distrusted") for a in answers.values()):
        doubt.failed_too = frozenset(p for p, a in answers.items() if a == "failed")
        doubt.gone = frozenset(p for p, a in answers.items() if a == "gone")
        log.info("round %s: no member can have completed it (%s): retrying", gid,
                 ", ".join(f"{p[-8:]} {a}" for p, a in sorted(answers.items())))
        return None
    silent = sorted(p[-8:] for p, a in answers.items() if a not in ("failed", "ruled out", "gone", "distrusted"))
    log.warning("round %s: %s did not say within %.0fs whether they completed it; this worker's contribution may "
                "have been counted, so its local work is dropped and the run's state adopted (correctness over "
                "goodput)", gid, silent, timeout)
    raise RoundCounted(f"nobody could say whether round {key} ({gid}) completed without this worker "
                       f"({', '.join(silent)} silent; here: {doubt}); adopting the run's state",
                       group_outer_step=step, completed=False)
