"""Spot checks of a shard owner's result: no single member decides a shard.

A shard's owner combines its members' parts and sends the result; nobody else sees every input,
so without a check an owner could send anything it likes (60000 everywhere, or -4x the mean) and
every member would apply it. The check, at a fraction of the round's bytes:

- **The owner commits** to what it combined, in the bytes every member's digest covers (so it
  cannot tell two members two stories): per part, a Merkle root of each member's decoded values
  (chunks of ``chunk_numel`` values are the leaves) and each member's norm, and the weights every
  member declared.
- **Each member checks its own entries in full**: its root, its norm and its weight, for every part
  of every shard it contributed to. An owner that misreports one member's input is caught by that
  member, in every round.
- **Each member then audits ``audit_chunks`` random chunks of every other owner's shard**, picked
  after the result arrived (the owner cannot know which): every other member sends its values of
  those chunks with their Merkle paths (so nobody can answer with values other than those the owner
  committed to), and the auditor recomputes the chunk of the result from them, with the owner's
  committed norms and weights under the round's aggregation rule (``aggregation.py``). A result more
  than the result codec's rounding away from it names the owner (``Malformed``).

Under ``method="mean"`` the recomputation is exact up to rounding. Under ``"centered-clip"`` its
iterations need whole parts, so a chunk is only checked to lie within what the members sent (each
value between the smallest and the largest of the members' clipped values, and zero).

What an owner can still do: change a few values of its result, which a random chunk finds with a
probability of about (chunks audited x members) / chunks of the shard per round; and, as a member,
send its own shard any values within the clip bound, like any member.

The arithmetic of the check is pure computation (no I/O); ``AuditingMember`` is a member's side of it
on the wire, in the round ``runner.py`` runs.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
from collections.abc import Sequence

import torch
from blake3 import blake3

from ..errors import AveragingError, Malformed, PeerFailure, ProtocolError
from ..fingerprint import tensor_bytes
from ..timeouts import MIN_AUDIT_ANSWER_S
from .aggregation import Aggregation
from .buffers import all_finite
from .codec import Codec
from .group import MAX_WEIGHT, part_bounds
from .wire import ByteStream, Code, Refused, StreamClosed, payload_size
from .wire import field as meta_field

DEFAULT_AUDIT_CHUNKS = 4
"""Chunks of every other owner's shard a member audits per round (0: no audit)."""
MAX_AUDIT_CHUNKS = 64
MIN_CHUNK = 128
LEAVES_PER_PART = 16
"""A part's chunks: at least ``MIN_CHUNK`` values, about this many per part (paths stay short). Fewer,
larger chunks cost the same answer bytes per audited value and far fewer hashes: with 256 per part the
Merkle trees were most of the audit's cost (0.144 CPU-s per member per 10M values in a group of 4, against
0.046 with 16; ``docs/benchmarks.md``)."""
HASH_HEX = 64


def chunk_numel(part_numel: int) -> int:
    """Values per audited chunk of a part of ``part_numel`` values (a multiple of ``MIN_CHUNK``)."""
    per = math.ceil(max(part_numel, 1) / LEAVES_PER_PART)
    return max(MIN_CHUNK, math.ceil(per / MIN_CHUNK) * MIN_CHUNK)


AUDIT_BYTES_SHARE = 0.1
"""The audit's answers take at most about this share of a round's bytes (at least one chunk per owner)."""


def chunks_per_owner(audit_chunks: int, numel: int, group_size: int, part_numel: int, round_bytes: int) -> int:
    """Chunks a member audits of each other owner's shard: ``audit_chunks``, fewer where a small model
    in a large group would spend more than ``AUDIT_BYTES_SHARE`` of the round on answers.

    The same on every member (from the group's settings), so an answerer can bound what it is asked.
    """
    if audit_chunks <= 0 or group_size < 2:
        return 0
    shard = math.ceil(numel / group_size)
    answer = 4 * chunk_numel(min(part_numel, max(shard, 1))) + 80 * 12  # values, and a path of ~12 hex nodes
    per_chunk = (group_size - 1) ** 2 * answer  # every owner but ours, from every member but us
    return max(1, min(audit_chunks, int(AUDIT_BYTES_SHARE * round_bytes / per_chunk)))


def chunk_count(part_numel: int) -> int:
    return max(1, math.ceil(part_numel / chunk_numel(part_numel)))


def chunk_range(part_numel: int, c: int) -> tuple[int, int]:
    size = chunk_numel(part_numel)
    return c * size, min((c + 1) * size, part_numel)


_LEAF_KEY = b"opendiloco.audit.leaf".ljust(32, b".")
_NODE_KEY = b"opendiloco.audit.node".ljust(32, b".")
"""Keyed BLAKE3, one key per kind: a leaf can never pass for a node (domain separation)."""


def _leaf_bytes(raw) -> bytes:
    return blake3(raw, key=_LEAF_KEY).digest()


def leaf_hash(values: torch.Tensor) -> bytes:
    """The leaf of a chunk: its values as the owner decoded them, in their own dtype (``Codec.view_dtype``)."""
    return _leaf_bytes(tensor_bytes(values.contiguous()))


def _node(left: bytes, right: bytes) -> bytes:
    return blake3(left + right, key=_NODE_KEY).digest()


class MerkleTree:
    """A Merkle tree over a part's chunks: its root commits to every value, a path proves one chunk."""

    def __init__(self, values: torch.Tensor):
        n = values.numel()
        raw = tensor_bytes(values.contiguous())  # the decoded values' own bytes, sliced per chunk
        size = chunk_numel(n) * values.element_size()
        leaves = [_leaf_bytes(raw[a : a + size]) for a in range(0, max(len(raw), 1), size)]
        self.levels = [leaves]
        while len(self.levels[-1]) > 1:
            below = self.levels[-1]
            # An odd node out goes up unchanged.
            self.levels.append([_node(below[k], below[k + 1]) if k + 1 < len(below) else below[k]
                                for k in range(0, len(below), 2)])

    @property
    def root(self) -> str:
        return self.levels[-1][0].hex()

    def leaf(self, c: int) -> bytes:
        return self.levels[0][c]

    def path(self, c: int) -> list[str]:
        """The siblings from leaf ``c`` up ("" where a node went up alone)."""
        out = []
        for level in self.levels[:-1]:
            sibling = c ^ 1
            out.append(level[sibling].hex() if sibling < len(level) else "")
            c //= 2
        return out


def path_ok(values: torch.Tensor, c: int, path: Sequence, root: str, part_numel: int) -> bool:
    """Whether ``values`` are chunk ``c`` of a part whose tree has root ``root``."""
    count = chunk_count(part_numel)
    a, b = chunk_range(part_numel, c) if 0 <= c < count else (0, -1)
    if values.numel() != b - a or not isinstance(path, list):
        return False
    node, width = leaf_hash(values), count
    for sibling in path:
        if width <= 1 or not isinstance(sibling, str):
            return False
        if sibling == "":
            if c ^ 1 < width:  # only the last node of an odd level goes up alone
                return False
        else:
            try:
                other = bytes.fromhex(sibling)
            except ValueError:
                return False
            if len(other) != 32:
                return False
            node = _node(node, other) if c % 2 == 0 else _node(other, node)
        c, width = c // 2, (width + 1) // 2
    return width == 1 and node.hex() == root


def manifest_bytes(roots: Sequence[str], norms: Sequence[float]) -> bytes:
    """What a part's manifest adds to the owner's digest (every member hashes the same bytes)."""
    return ("|".join(roots) + "#" + ",".join(repr(float(x)) for x in norms)).encode()


def weights_bytes(weights: Sequence[float]) -> bytes:
    return ("weights:" + ",".join(repr(float(w)) for w in weights)).encode()


FP16_MAX = 65504.0


def norm_of(values: torch.Tensor) -> float:
    """A part's norm as the owner's clip takes it, summed in fp32 (3.5x faster than in fp16 here, and
    exact to fp32), with fp16's range kept: an fp16 part whose norm overflows fp16 is inf, and is scaled
    to nothing (``Aggregation.scales``)."""
    norm = float(torch.linalg.vector_norm(values, dtype=torch.float32))
    return math.inf if values.dtype == torch.float16 and norm > FP16_MAX else norm


def norms_agree(claimed: float, actual: float) -> bool:
    """Norms computed by two machines: thread counts change the summation order, and an fp16 norm
    may then round to the next fp16 value (2**-10 apart)."""
    if math.isinf(actual) or math.isinf(claimed):
        return claimed == actual
    return abs(claimed - actual) <= 2e-3 * abs(actual) + 1e-30


def tolerance(result: torch.Tensor, part_result: torch.Tensor, offset: int, codec: Codec) -> torch.Tensor:
    """Per value of ``result`` (a chunk of ``part_result``, at ``offset``), how far rounding may move it."""
    block, step, absolute = codec.rounding
    if block == 1:
        scale = result.abs()
    else:
        first, last = offset // block, (offset + result.numel() - 1) // block
        blocks = part_result[first * block : (last + 1) * block]
        pad = (-blocks.numel()) % block
        maxima = torch.nn.functional.pad(blocks.abs(), (0, pad)).view(-1, block).amax(dim=1)
        index = (torch.arange(offset, offset + result.numel()) // block) - first
        scale = maxima[index]
    return scale * (2 * step) + 2 * absolute + 1e-6 * float(result.abs().max()) + 1e-30


def as_sent(expected: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What an honest owner would send of ``expected``, where a chunk alone encodes as it does in its
    part (value by value: fp16 saturates, say); else ``expected`` itself (``tolerance`` covers it)."""
    return codec.roundtrip(expected) if codec.rounding.block == 1 else expected


def result_norm_bound(aggregation: Aggregation, declared: Sequence[float], norms: Sequence[float], codec: Codec,
                      numel: int) -> float:
    """The largest norm an honest owner's result part of ``numel`` values can have, from what it committed
    to: the members' declared weights and their parts' norms (each member checks its own entries).

    The part is a weighted mean of the members' clipped parts (``"mean"``), or a point that CenteredClip
    moves only within their convex hull (``"centered-clip"``), so by the triangle inequality its norm is at
    most the weighted mean (or the largest) of their clipped norms; then the result codec's rounding (at
    most ``step`` of each block's largest magnitude per value: ``sqrt(block) * step`` of the norm), with
    1% for norms that two machines sum in another order. Every value of every part is bounded so, not
    only the audited chunks."""
    weights, _ = aggregation.weights(list(declared))
    total = sum(weights)
    members = [i for i, w in enumerate(weights) if w > 0]
    if total <= 0 or not members:
        return 0.0
    scale, _ = aggregation.scales({i: norms[i] for i in members})
    clipped = [0.0 if scale[i] == 0 else scale[i] * norms[i] for i in members]
    if aggregation.method == "mean":
        bound = sum(weights[i] / total * n for i, n in zip(members, clipped))
    else:
        bound = max(clipped)
    block, step, absolute = codec.rounding
    return bound * (1 + step * math.sqrt(min(block, max(numel, 1)))) * 1.01 + absolute * math.sqrt(numel) + 1e-30


def check_chunk(aggregation: Aggregation, declared: Sequence[float], norms: Sequence[float],
                values: Sequence[torch.Tensor], result: torch.Tensor, tol: torch.Tensor,
                codec: Codec | None = None) -> str | None:
    """What is wrong with an owner's chunk of result, recomputed from its members' values, or None.

    ``declared``: the weights the members declared (the owner's commitment); ``norms``: of each
    member's whole part; ``values``: each member's values of the chunk, in member order; ``codec``:
    the result's (``as_sent``).
    """
    for m, (x, n) in enumerate(zip(values, norms)):
        if float(x.double().square().sum()) > (n * n) * 1.01 + 1e-30:  # n may be an fp16 norm
            return f"member {m}'s values are larger than the norm the owner committed to"
    weights, _ = aggregation.weights(list(declared))
    total = sum(weights)
    members = [i for i, w in enumerate(weights) if w > 0]
    if total <= 0 or not members:
        return "no member has weight"
    scale, _ = aggregation.scales({i: norms[i] for i in members})
    if aggregation.method == "mean":
        expected = torch.zeros_like(result)
        for i in members:
            expected.add_(values[i], alpha=weights[i] * scale[i] / total)
        if codec is not None:
            expected = as_sent(expected, codec)
        off = (result - expected).abs() - tol
        if bool((off > 0).any()):
            return f"its result is {float((result - expected).abs().max()):.3g} away from what its members sent"
        return None
    clipped = torch.stack([values[i] * scale[i] for i in members])
    lo = torch.minimum(clipped.amin(dim=0), torch.zeros_like(result)) - tol
    hi = torch.maximum(clipped.amax(dim=0), torch.zeros_like(result)) + tol
    if bool(((result < lo) | (result > hi)).any()):
        return "its result lies outside what its members sent"
    return None


class AuditingMember:
    """A round member's side of the audit on the wire (mixed into ``runner.RoundRunner``): it remembers
    the Merkle tree and norm of every part it sends, checks what each owner committed to about it as the
    result arrives, audits random chunks of every other owner's result once all are in, and answers the
    other members' audits with its own values of the chunks they picked.

    What it uses of the round: ``members``, ``my_index``, ``bounds``, ``part_numel``, ``flat``, ``out``,
    ``weight``, ``codec``, ``result_codec``, ``aggregation``, the streams kept open for the confirmation
    (``_confirm_streams``), the byte counts, and how the round notes a failure (``_heard``, ``_checked``,
    ``_note_malformed``, ``_raise_if_failed``).
    """

    def _init_audit(self, audit_chunks: int) -> None:
        """The audit's state for ``audit_chunks`` chunks of every other owner's shard (0: no audit); the
        round's members, vector and codecs are set."""
        self.audit_chunks = audit_chunks
        """What the group agrees on (its label); ``_per_owner`` is what this round audits of each shard."""
        numel, size = self.flat.numel(), len(self.members)
        self._trees: dict[tuple[int, int], MerkleTree] = {}
        """(owner, part) -> the Merkle tree of this worker's own values of that part (answers audits)."""
        self._own_norms: dict[tuple[int, int], float] = {}
        share = (size - 1) / size
        round_bytes = int(share * (self.codec.wire_bytes(numel) + self.result_codec.wire_bytes(numel)))
        self._per_owner = chunks_per_owner(audit_chunks, numel, size, self.part_numel, round_bytes)
        self._manifests: dict[int, dict] = {}
        """owner -> what it committed to: ``weights`` and, per part, ``roots`` and ``norms``."""
        self._auditing: set[str] = set()  # members whose audit answers are still to come
        self.answer_bound = max(self.confirm_timeout, MIN_AUDIT_ANSWER_S)
        """Seconds within which every member answers this worker's audit, from the request."""
        self._answer_dtype = self.codec.view_dtype if audit_chunks else torch.float32
        self._answer_itemsize = torch.empty(0, dtype=self._answer_dtype).element_size()
        self.audited = not audit_chunks
        """Whether this worker's own audit of every other owner passed (always, without an audit): a round is
        applied here only then, never on another member's word (``_held``)."""

    def _commit(self, j: int, i: int, payload, numel: int) -> None:
        """Remembers the Merkle tree and norm of our part i of shard j, as its owner will decode it."""
        if self.audit_chunks:
            values = self.codec.view_bytes(payload, numel)
            self._trees[(j, i)] = MerkleTree(values)
            self._own_norms[(j, i)] = norm_of(values)

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
                or not all(isinstance(r, str) and len(r) == HASH_HEX for r in roots) \
                or not all(isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in norms):
            raise ProtocolError(f"the owner's commitment for part {i} is malformed")
        norms = [float(n) for n in norms]
        if roots[self.my_index] != self._trees[(j, i)].root \
                or not norms_agree(norms[self.my_index], self._own_norms[(j, i)]):
            raise ProtocolError(f"the owner misreports this worker's part {i} (its commitment names other values)")
        return roots, norms

    def _check_size(self, owner: str, i: int, values: torch.Tensor, weights: list[float], norms: list[float]) -> None:
        """Every value of an owner's result part, not only the audited chunks: its norm within what the
        members' committed norms and weights allow (``result_norm_bound``); else the owner is named."""
        size = norm_of(values)
        limit = result_norm_bound(self.aggregation, weights, norms, self.result_codec, values.numel())
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
        return (a + pa, pb - pa, *chunk_range(pb - pa, c))

    def _own_chunk(self, j: int, i: int, c: int) -> torch.Tensor:
        """Our values of chunk c of part i of shard j, as the owner decoded them (encoded again)."""
        start, n, ca, cb = self._chunk_span(j, i, c)
        block = self.codec.rounding[0]  # the codec's blocks are aligned to the part's start
        ea, eb = ca // block * block, min(n, -(-cb // block) * block)
        encoded = self.codec.to_bytes(self.flat[start + ea : start + eb])
        values = self.codec.view_bytes(encoded, eb - ea)[ca - ea : cb - ea].clone()
        if leaf_hash(values) != self._trees[(j, i)].leaf(c):
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
                      for c in range(chunk_count(pb - pa))]
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
            tol = tolerance(result, part_result, ca, self.result_codec)
            manifest = self._manifests[j]
            wrong = check_chunk(self.aggregation, manifest["weights"], manifest["norms"][i], chunk, result, tol,
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
                if not all_finite(values) or not path_ok(values, c, frame.meta.get("path"),
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
