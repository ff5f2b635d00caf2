"""What a shard's owner does with the parts it receives: each member's contribution part by part,
the weighted average of part i in member order (fp32) as soon as every member's part i is in,
encoded once for every member; and, for the audit, what the owner commits to (``audit.py``).

``ShardReducer`` is the computation (no I/O); ``ShardOwner`` serves it to the members on the wire.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

import torch

from ..errors import AveragingError, Malformed, PeerFailure, ProtocolError
from ..fingerprint import new_hasher
from . import audit
from .aggregation import Aggregation
from .buffers import all_finite
from .compression import Codec
from .group import MAX_WEIGHT, part_bounds
from .wire import ByteStream, Code, Refused, payload_size
from .wire import field as meta_field

log = logging.getLogger(__name__)


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
        """The averages go out in this codec (it may be wider than the contributions')."""
        self.aggregation = aggregation or Aggregation()
        self.used_weights: list[float] = []
        """The weights the averages use (claims capped), in member order."""
        self.capped: list[str] = []
        self.clipped: set[str] = set()
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


class ShardOwner:
    """A round member's side as the owner of its shard (mixed into ``runner.RoundRunner``): it serves
    every other member's contribution (``serve``: parts in, averaged parts out, then the audit's
    answers and the member's confirmation), adds its own, and feeds them all to its ``ShardReducer``
    (``reducer``), waking the round's waits (``_changed``) as parts complete."""

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
            if writer is not None:  # never left running after its handler (cancelled too), nor its error unread
                writer.cancel()
                if writer.done() and not writer.cancelled():
                    writer.exception()
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

    async def _result(self, i: int):
        async with self._changed:
            await self._changed.wait_for(lambda: self.reducer.results[i] is not None or self.error is not None)
            self._raise_if_failed()
            return self.reducer.results[i]

