"""A state cut into parts that several donors can serve: a small skeleton plus one flat byte vector.

Every tensor of the state (walked in order: dict values, list and tuple items) is moved into one
flat vector of bytes, and left in the skeleton as a placeholder of the same shape and dtype that
holds a single value (a stride-0 view: ``torch.save`` stores one element). The flat vector is cut
into parts of ``part_bytes``, each with its digest. Two workers that hold the same θ_global and
outer state produce the same bytes for those parts whatever else differs (their position in the
round, a warm start's Adam moments: those come last), so a joiner can take each part from any
donor whose digest for it matches the one it builds on, and check every part as it arrives.
"""

from __future__ import annotations

import collections
import io
import math
import time
from dataclasses import dataclass, field

import torch

from ...errors import ProtocolError
from ...fingerprint import new_hasher

MIN_PART_BYTES = 1 << 20
MAX_PART_BYTES = 64 << 20
MAX_PARTS = 4096
PART_BYTES = 2 << 20
MAX_PARTS_WANTED = 1024
MAX_SKELETON_BYTES = 8 << 20
"""A skeleton holds structure, counters and one value per tensor: megabytes would be an attack."""


def part_digest(data) -> bytes:
    h = new_hasher(parallel=True)
    h.update(data)
    return h.digest()


DIGEST_BYTES = len(part_digest(b""))


def _tensors(obj, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _tensors(value, found)


def _replace(obj, make):
    """``obj`` with every tensor ``t`` replaced by ``make(t)``, in walk order."""
    if isinstance(obj, torch.Tensor):
        return make(obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for key, value in obj.items():
            out[key] = _replace(value, make)
        return out
    if isinstance(obj, list):
        return [_replace(v, make) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replace(v, make) for v in obj)
    return obj


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


@dataclass(frozen=True)
class Snapshot:
    """A donor's state, cut for serving: ``skeleton`` (``torch.save`` bytes), ``flat`` (every tensor's
    bytes, in walk order), and the digest of each ``part_bytes`` slice of ``flat``."""

    outer_step: int
    skeleton: bytes
    flat: memoryview
    part_bytes: int
    digests: tuple[bytes, ...]
    made: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return self.flat.nbytes

    def part(self, index: int) -> memoryview:
        return self.flat[index * self.part_bytes : (index + 1) * self.part_bytes]

    def manifest_payload(self) -> bytes:
        return b"".join(self.digests) + self.skeleton


def part_count(size: int, part_bytes: int) -> int:
    return max(1, math.ceil(size / part_bytes))


def part_bytes_for(size: int) -> int:
    """The donor's part size for a state of ``size`` bytes: ``PART_BYTES``, larger for a state that would
    need more than ``MAX_PARTS_WANTED`` parts (whole MiB). The donor chooses it, never the requester (who
    could make it cut its state anew with each request), and every donor of one state chooses alike."""
    wanted = math.ceil(size / MAX_PARTS_WANTED / (1 << 20)) << 20
    return min(MAX_PART_BYTES, max(PART_BYTES, wanted))


def snapshot(state: dict, part_bytes: int | None = None) -> Snapshot:
    """Cuts ``state`` (CPU tensors) into a skeleton and parts of ``part_bytes`` (``part_bytes_for`` its size
    if None)."""
    found: list[torch.Tensor] = []
    _tensors(state, found)
    pieces = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in found if t.numel()]
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save(_replace(state, _placeholder), buf)
    view = memoryview(flat.numpy()).cast("B")
    part_bytes = part_bytes_for(len(view)) if part_bytes is None else part_bytes
    digests = tuple(part_digest(view[i * part_bytes : (i + 1) * part_bytes])
                    for i in range(part_count(len(view), part_bytes)))
    return Snapshot(state["outer_step"], buf.getvalue(), view, part_bytes, digests)


PLAIN_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool})
"""What a state's tensors may be: a placeholder of another kind (quantized, complex, ...) is refused."""
SCALARS = (str, int, float, bool, type(None))
MAX_NODES = 1 << 20
MAX_DEPTH = 32


def _placeholders(skeleton) -> list[torch.Tensor]:
    """The placeholders of a loaded skeleton, in walk order, once it is known to be a plain tree: dicts
    (with string or integer keys), lists, tuples, scalars and plain dense tensors, nothing reached
    twice (a pickle can share one list many times: walking it would take for ever), at most
    ``MAX_NODES`` nodes ``MAX_DEPTH`` deep. ``ProtocolError`` otherwise."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [(skeleton, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, SCALARS):
            continue
        if id(node) in seen:
            raise ProtocolError("skeleton reaches one object twice")
        seen.add(id(node))
        if len(seen) > MAX_NODES or depth > MAX_DEPTH:
            raise ProtocolError(f"skeleton of more than {MAX_NODES} nodes or {MAX_DEPTH} levels")
        if type(node) is torch.Tensor:
            if node.layout != torch.strided or node.is_quantized or node.dtype not in PLAIN_DTYPES:
                raise ProtocolError(f"skeleton holds a {node.dtype} {node.layout} tensor")
            found.append(node)
        elif type(node) in (dict, collections.OrderedDict):
            if not all(type(k) in (str, int) for k in node):
                raise ProtocolError("skeleton holds a dict with keys other than strings and integers")
            stack.extend((v, depth + 1) for v in reversed(node.values()))
        elif type(node) in (list, tuple):
            stack.extend((v, depth + 1) for v in reversed(node))
        else:
            raise ProtocolError(f"skeleton holds a {type(node).__name__}")
    return found


@dataclass(frozen=True)
class Manifest:
    """What a joiner builds on: a donor's skeleton (loaded and checked) and part digests."""

    outer_step: int
    size: int
    part_bytes: int
    digests: tuple[bytes, ...]
    skeleton: dict

    def part_size(self, index: int) -> int:
        return min(self.part_bytes, self.size - index * self.part_bytes)


def read_manifest(meta: dict, payload: bytes, *, part_bytes: int, max_bytes: int) -> Manifest:
    """The manifest a donor sent (meta ``outer_step``, ``size``, ``part_bytes``: the donor's choice, else
    the ``part_bytes`` asked for; payload: digests then skeleton), or
    ``ProtocolError`` for one that does not fit what was asked or what this worker accepts: checked
    whole (the skeleton a plain tree whose tensors take exactly ``size`` bytes, at the announced
    outer step) before a byte of the state is asked for or allocated."""
    outer_step, size = meta.get("outer_step"), meta.get("size")
    if type(outer_step) is not int or type(size) is not int:
        raise ProtocolError("manifest without an integer outer_step and size")
    if not 0 <= size <= max_bytes:
        raise ProtocolError(f"state of {size} bytes announced; at most {max_bytes} accepted")
    part_bytes = meta.get("part_bytes", part_bytes)
    if type(part_bytes) is not int or not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
        raise ProtocolError(f"parts of {part_bytes!r} bytes; {MIN_PART_BYTES}-{MAX_PART_BYTES} only")
    parts = part_count(size, part_bytes)
    if parts > MAX_PARTS:
        raise ProtocolError(f"state of {parts} parts; at most {MAX_PARTS}")
    skeleton_len = len(payload) - parts * DIGEST_BYTES
    if not 0 < skeleton_len <= MAX_SKELETON_BYTES:
        raise ProtocolError(f"manifest of {len(payload)} bytes does not fit {parts} parts and a skeleton")
    digests = tuple(bytes(payload[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]) for i in range(parts))
    try:
        skeleton = torch.load(io.BytesIO(payload[parts * DIGEST_BYTES :]), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ProtocolError(f"skeleton does not load: {type(e).__name__}") from None
    if not isinstance(skeleton, dict):
        raise ProtocolError("state is not a dict")
    need = sum(math.prod(p.shape) * p.element_size() for p in _placeholders(skeleton))
    if need != size:
        raise ProtocolError(f"skeleton's tensors take {need} bytes; {size} announced")
    if skeleton.get("outer_step") != outer_step:
        raise ProtocolError(f"skeleton says outer step {skeleton.get('outer_step')!r}, the manifest {outer_step}")
    return Manifest(outer_step, size, part_bytes, digests, skeleton)


def assemble(manifest: Manifest, flat: bytearray) -> dict:
    """The state a manifest's skeleton and its flat bytes (``manifest.size`` of them) stand for."""
    if len(flat) != manifest.size:
        raise ProtocolError(f"{len(flat)} bytes for a state of {manifest.size}")
    offset = 0

    def fill(p: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        n = math.prod(p.shape)
        if n == 0:
            return torch.empty(p.shape, dtype=p.dtype)
        t = torch.frombuffer(flat, dtype=p.dtype, count=n, offset=offset).reshape(p.shape).clone()
        offset += n * p.element_size()
        return t

    return _replace(manifest.skeleton, fill)
