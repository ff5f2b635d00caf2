"""The block-scaled codecs' bytes against a slow reference that follows their definition value by value.

The fast codecs round through fp32 bit patterns, lookup tables and chunks shared among threads;
the reference below does it the obvious way (exact fractions, one value at a time). Both must give
the same bytes, and decode any payload to the same fp32 values: every worker of a group relies on
it (docs/invariants.md, 7). A small golden set also pins the bytes themselves, as the codecs
produced them before they were made fast (a codec's bytes change only with its ``revision``).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from opendiloco.comm.compression import SmallFormat, _float_magnitudes
from opendiloco.comm.formats import get_codec

SMALL = ["int8", "int4", "e2m1", "e3m0"]
BLOCK_SCALED = ["scaled-fp16", *SMALL]
F32 = np.float32
TINY = F32(np.finfo(np.float32).tiny)
FP32_MAX = float(np.finfo(np.float32).max)


def _e4m3() -> SmallFormat:
    """An 8-bit float (no codec uses one): covers SmallFormat's per-value float path."""
    return SmallFormat("e4m3", 8, _float_magnitudes(4, 3, 7, 128), block_size=256)


def _codec(name):
    return _e4m3() if name == "e4m3" else get_codec(name)


# -- the reference -------------------------------------------------------------------------------
def _code(codec, q: np.float32) -> int:
    """The stored code of one value already divided by its block's scale."""
    if codec.name == "scaled-fp16":
        return int(np.array(q, dtype=np.float16).view(np.uint16))
    if codec.magnitudes.tolist() == list(range(len(codec.magnitudes))):  # integers: round half to even
        return round(Fraction(float(q))) + int(codec.top)
    mags = [Fraction(m) for m in codec.magnitudes.tolist()]
    exact = abs(Fraction(float(q)))
    above = min(bisect.bisect_left(mags, exact), len(mags) - 1)  # the magnitudes either side of |q|
    index = min({max(above - 1, 0), above}, key=lambda i: (abs(exact - mags[i]), -i))  # nearest; ties: the larger
    return (int(math.copysign(1, q) < 0) << (codec.bits - 1)) | index


def reference_encode(codec, values: list[float]) -> bytes:
    bs, top = codec.block_size, F32(codec.top)
    padded = [F32(v) for v in values] + [F32(0)] * (-len(values) % bs)
    largest = F32(FP32_MAX / (codec.top * (1 + 2.0**-10)))  # clamps take their bounds as fp32
    scales, codes = [], []
    for b in range(0, len(padded), bs):
        block = padded[b : b + bs]
        absmax = max(abs(v) for v in block)
        if not np.isfinite(absmax):
            raise ValueError("non-finite")
        scale = min(max(absmax / top, TINY), largest)
        scales.append(scale)
        codes += [_code(codec, v / scale) for v in block]
    if codec.bits == 16:
        values_bytes = struct.pack(f"<{len(codes)}H", *codes)
    elif codec.bits == 8:
        values_bytes = bytes(codes)
    else:
        values_bytes = bytes(lo | hi << 4 for lo, hi in zip(codes[::2], codes[1::2]))
    return np.array(scales, dtype="<f4").tobytes() + values_bytes


def _value(codec, code: int) -> np.float32:
    if codec.name == "scaled-fp16":
        return F32(np.array(code, dtype=np.uint16).view(np.float16))
    if codec.magnitudes.tolist() == list(range(len(codec.magnitudes))):
        return F32(min(code - codec.top, codec.top))  # the one spare code decodes to top
    magnitude = F32(codec.magnitudes[code & ((1 << (codec.bits - 1)) - 1)])
    return -magnitude if code >> (codec.bits - 1) else magnitude


def reference_decode(codec, payload: bytes, numel: int) -> bytes:
    bs, nb = codec.block_size, math.ceil(numel / codec.block_size)
    scales = np.frombuffer(payload[: 4 * nb], dtype="<f4")
    raw = payload[4 * nb :]
    if codec.bits == 16:
        codes = list(struct.unpack(f"<{len(raw) // 2}H", raw))
    elif codec.bits == 8:
        codes = list(raw)
    else:
        codes = [c for byte in raw for c in (byte & 15, byte >> 4)]
    with np.errstate(all="ignore"):
        out = [_value(codec, codes[i]) * scales[i // bs] for i in range(numel)]
    return np.array(out, dtype="<f4").tobytes()


# -- inputs --------------------------------------------------------------------------------------
def _normals(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.logspace(-6, 2, n)).tolist()


def _ties(codec, seed: int) -> list[float]:
    """Blocks whose values sit on the format's midpoints and magnitudes, and one fp32 step either
    side: with an absmax of top * 2**k the scale is exactly 2**k, so the divided values are the
    ties themselves; other absmaxes put them within a rounding of the ties."""
    mags = codec.magnitudes.tolist() if codec.name != "scaled-fp16" else [0.0, 1.0]
    points = torch.tensor(mags + [(a + b) / 2 for a, b in zip(mags, mags[1:])], dtype=torch.float32)
    points = torch.cat([points, torch.nextafter(points, torch.tensor(0.0)), torch.nextafter(points, torch.tensor(9e9))])
    points = torch.cat([points, -points])
    bs, top = codec.block_size, codec.top
    g = torch.Generator().manual_seed(seed)
    out = []
    for absmax in [top, top * 2.0**-30, top * 2.0**60, *(torch.rand(3, generator=g) * 10).tolist()]:
        scale = absmax / top
        vals = (points * scale).tolist()
        for b in range(0, len(vals), bs - 1):
            chunk = vals[b : b + bs - 1]
            out += [absmax if b % 2 else -absmax] + chunk + [0.0] * (bs - 1 - len(chunk))
    return out


def _specials(codec) -> list[float]:
    bs = codec.block_size
    big, tiny = FP32_MAX, float(TINY)
    return ([0.0] * bs + [-0.0] * bs  # all-zero blocks: the smallest scale
            + [1e-45, -1e-44, 1e-40, tiny, -tiny / 2] * bs  # subnormal absmax
            + [big, -big, 1.0, -1e-30, 1e38, 3.0] * bs  # the largest scale (clamped), with rounding at top
            + [65504.0, 65520.0, -6.1e-5, 5.96e-8, 2.98e-8, 1e-8] * bs  # fp16's edges
            + [0.3] * 7)  # a partial block


CASES = {
    "normals": lambda c: _normals(3001, 1),
    "ties": lambda c: _ties(c, 2),
    "specials": _specials,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", [*BLOCK_SCALED, "e4m3"])
def test_bytes_match_the_reference(name, case):
    codec = _codec(name)
    values = torch.tensor(CASES[case](codec), dtype=torch.float32)
    want = reference_encode(codec, values.tolist())
    assert bytes(codec.to_bytes(values)) == want
    encoded = codec.encode(values)
    assert encoded["scale"].numpy().tobytes() + encoded["values"].numpy().tobytes() == want


@pytest.mark.parametrize("name", [*BLOCK_SCALED, "e4m3"])
def test_any_payload_decodes_as_the_reference_does(name):
    """Every code, and scales that no encoder makes (negative, zero, subnormal, inf, NaN)."""
    codec = _codec(name)
    g = torch.Generator().manual_seed(3)
    for numel in [1, codec.block_size - 1, 5 * codec.block_size + 3]:
        payload = torch.randint(0, 256, (codec.wire_bytes(numel),), generator=g, dtype=torch.uint8)
        nb = math.ceil(numel / codec.block_size)
        scales = torch.randn(nb, generator=g) * 1e3
        scales[:6] = torch.tensor([float("inf"), float("nan"), -2.0, 0.0, 1e-45, 3e38])[:nb]
        payload[: 4 * nb] = scales.view(torch.uint8)
        payload = payload.numpy().tobytes()
        want = reference_decode(codec, payload, numel)
        assert codec.from_bytes(payload, numel).numpy().tobytes() == want
        out = torch.full((numel + 1,), 7.0)  # an odd offset: no 8-byte view of it
        codec.decode_into(payload, out[1:])
        assert out[1:].numpy().tobytes() == want


@pytest.mark.parametrize("name", BLOCK_SCALED)
@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_and_threads_change_nothing(name, threads):
    """Blocks are encoded independently: a long input's bytes are those of its blocks encoded one
    by one (checked on the blocks around each chunk boundary against the reference), whatever the
    number of threads that share the chunks."""
    codec = _codec(name)
    bs, chunk = codec.block_size, codec.CHUNK
    x = torch.tensor(_normals(3 * chunk + bs + 5, 4), dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        payload = bytes(codec.to_bytes(x))
        decoded = codec.from_bytes(payload, x.numel())
        error = torch.empty_like(x)
        assert bytes(codec.to_bytes_with_error(x, error)) == payload
        roundtrip = torch.empty_like(x)
        codec.roundtrip_into(x, roundtrip, chunk=2 * chunk)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(error, x - decoded) and torch.equal(roundtrip, decoded)
    nb = math.ceil(x.numel() / bs)
    per_block = (len(payload) - 4 * nb) // nb  # bytes of values
    for block in sorted({0, nb - 1} | {k * chunk // bs + d for k in (1, 2, 3) for d in (-1, 0)}):
        part = x[block * bs : (block + 1) * bs]
        want = reference_encode(codec, part.tolist())
        first = 4 * nb + block * per_block
        got = payload[4 * block : 4 * block + 4] + payload[first : first + per_block]
        assert got == want, block
        assert decoded[block * bs : (block + 1) * bs].numpy().tobytes() == reference_decode(codec, want, part.numel())


def _golden_input(n: int = 3001) -> torch.Tensor:
    x, out = 12345, []
    for k in range(n):  # an LCG: the same values on every machine and torch version
        x = (1103515245 * x + 12345) % 2**31
        out.append(((x >> 7) / 2**24 - 0.5) * 10.0 ** (k % 9 - 4))
    out += [1.0, 0.5 / 7, 1.5 / 7, 2.5 / 7, 6.5 / 7, 0.25 / 6, 1.25 / 6, 2.5 / 6, 5 / 6, 0.75, 2**-7, -0.0, 1e-40]
    return torch.tensor(out, dtype=torch.float32)


GOLDEN = {  # sha256 (first 32 hex digits) of to_bytes, and of the decoded fp32 values
    "scaled-fp16": ("a97585d24ca8e080662eaeedfc9ccfc6", "3ee273ef3db7653d904358a58c558ae1"),
    "int8": ("c37337a291f76adf58180fbde0edfd25", "44a3c3c9d2ba51fe4db23ad2a78ebdc7"),
    "int4": ("a58dea162d22c129e337bcf02cd35ac4", "26678594197b284babe29f891276ceaf"),
    "e2m1": ("dd95c1caa6cde9cd754003f13d73c1d9", "18970e0d50db57abc766ba6e475c92bf"),
    "e3m0": ("8047232585b5ece318ed704573443c70", "8e9881621f8ee0f28fd6f49c42d138c0"),
}
"""Computed by the codecs as they were before the fast path (the reference agrees with both)."""


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    codec, x = get_codec(name), _golden_input()
    payload = bytes(codec.to_bytes(x))
    assert payload == reference_encode(codec, x.tolist())
    decoded = codec.from_bytes(payload, x.numel()).numpy().tobytes()
    digests = tuple(hashlib.sha256(b).hexdigest()[:32] for b in (payload, decoded))
    assert digests == GOLDEN[name], f"{name}'s bytes changed: bump its revision (and this table) if on purpose"
