"""Wire codecs for pseudo-gradients, in plain torch.

Three kinds: ``none`` (fp32), ``fp16`` (saturating), and the block-scaled family: each block of
values is divided by one fp32 scale (its absolute maximum over the format's largest magnitude)
and rounded to a small format: scaled fp16 (``scaled-fp16``), 8-bit integers (``int8``), 4-bit
integers (``int4``) or 4-bit floats (``e2m1``, ``e3m0``), each value to the nearest one the
format holds.

Every codec is deterministic: encoding the same fp32 tensor gives the same bytes on every
machine, and decoding the same bytes gives the same fp32 tensor. That is what lets all
workers of a group end a round with bit-identical averages (docs/invariants.md, 7): the
average is encoded once, by the peer that reduced it, and every peer (that one included)
uses the decoded bytes.

An encoded tensor is a ``dict[str, torch.Tensor]`` of flat CPU tensors; ``decode`` needs the
element count because block-wise codecs pad.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod

import torch

from ..errors import NonFiniteError, ProtocolError
from ..fingerprint import tensor_bytes

FP16_MAX = float(torch.finfo(torch.float16).max)


class Codec(ABC):
    name: str
    revision: int = 1
    """Bumped when a codec's bytes change under the same name: peers of different revisions never group."""

    @property
    def label(self) -> str:
        return self.name if self.revision == 1 else f"{self.name}.v{self.revision}"

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode a flat fp32 CPU tensor."""

    @abstractmethod
    def decode(self, encoded: dict[str, torch.Tensor], numel: int) -> torch.Tensor:
        """Decode back to a flat fp32 tensor of ``numel`` elements."""

    @abstractmethod
    def expected_fields(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        """The fields ``encode`` produces for ``numel`` elements: name -> (dtype, element count).

        Used to validate what a peer sends before decoding it.
        """

    def roundtrip(self, flat: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(flat), flat.numel())

    def roundtrip_into(self, flat: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
        """``out[:] = roundtrip(flat)``, a cache-sized chunk at a time (no full-size wire copy).

        Chunks are multiples of every codec's block, so the values equal those of encoding
        ``flat`` in parts of the same size, as the round runner does.
        """
        for a in range(0, flat.numel(), chunk):
            self.decode_into(self.to_bytes(flat[a : a + chunk]), out[a : a + chunk])
        return out

    def wire_bytes(self, numel: int) -> int:
        return sum(torch.empty(0, dtype=dt).element_size() * n for dt, n in self.expected_fields(numel).values())

    def to_bytes_with_error(self, flat: torch.Tensor, error_out: torch.Tensor) -> memoryview | bytes:
        """``to_bytes``, and ``error_out[:] = flat - decoded payload``: what this encoding lost (error
        feedback adds it to the next contribution)."""
        payload = self.to_bytes(flat)
        self.decode_into(payload, error_out)
        torch.sub(flat, error_out, out=error_out)
        return payload

    def to_bytes(self, flat: torch.Tensor) -> memoryview | bytes:
        """``encode`` as one payload: the fields' bytes in name order (no copy for one-field codecs)."""
        fields = self.encode(flat)
        names = sorted(fields)
        if len(names) == 1:
            return tensor_bytes(fields[names[0]])
        return b"".join(tensor_bytes(fields[n]) for n in names)

    def from_bytes(self, payload: bytes, numel: int) -> torch.Tensor:
        """Decodes a payload made by ``to_bytes``; refuses one whose size does not fit ``numel``."""
        fields = self._fields(payload, numel)
        return self.decode(fields, numel) if numel else torch.zeros(0)

    def view_bytes(self, payload: bytes, numel: int) -> torch.Tensor:
        """The payload's values in a form ``torch.add`` accepts: no copy where the wire dtype is a float
        (fp16, fp32), decoded to fp32 otherwise. Same values as ``from_bytes``."""
        return self.from_bytes(payload, numel)

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        """Decodes a payload straight into the fp32 tensor ``out`` (one pass where the codec allows)."""
        out.copy_(self.view_bytes(payload, out.numel()))

    def _fields(self, payload: bytes, numel: int) -> dict[str, torch.Tensor]:
        expected = self.expected_fields(numel)
        sizes = {n: torch.empty(0, dtype=dt).element_size() * c for n, (dt, c) in expected.items()}
        if len(payload) != sum(sizes.values()):
            raise ProtocolError(f"payload of {len(payload)} bytes; {sum(sizes.values())} expected for {numel} values")
        fields, offset = {}, 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: decoding never writes to them
            for name in sorted(expected):
                dtype, count = expected[name]
                fields[name] = torch.frombuffer(payload, dtype=dtype, count=count, offset=offset) if count \
                    else torch.empty(0, dtype=dtype)
                offset += sizes[name]
        return fields


class NoCompression(Codec):
    name = "none"

    def encode(self, flat):
        return {"values": flat.detach().to(torch.float32).contiguous()}

    def decode(self, encoded, numel):
        return encoded["values"].to(torch.float32)

    def expected_fields(self, numel):
        return {"values": (torch.float32, numel)}

    def view_bytes(self, payload, numel):
        return self._fields(payload, numel)["values"]


class Float16Compression(Codec):
    """Round to fp16, saturating at the fp16 range instead of producing inf."""

    name = "fp16"

    def encode(self, flat):
        # Saturate only when a value is out of range (one fast min/max pass decides), and then on the
        # half tensor: values that round past the fp16 range become ±inf and are clamped back to
        # ±FP16_MAX, which is what clamping the fp32 values first gives.
        flat = flat.detach()
        half = flat.to(torch.float16)
        if flat.numel() and flat.is_floating_point():
            lo, hi = (float(v) for v in torch.aminmax(flat))
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise NonFiniteError("refusing to encode non-finite values")
            if not (-FP16_MAX <= lo and hi <= FP16_MAX):
                half.clamp_(-FP16_MAX, FP16_MAX)
        return {"values": half}

    def decode(self, encoded, numel):
        return encoded["values"].to(torch.float32)

    def expected_fields(self, numel):
        return {"values": (torch.float16, numel)}

    def view_bytes(self, payload, numel):
        return self._fields(payload, numel)["values"]


class BlockScaled(Codec):
    """Values in blocks of ``block_size``, each divided by one fp32 scale and stored in a small format.

    The scale maps the block's absolute maximum onto the format's largest magnitude ``top``, and
    is clamped so that no finite input decodes to inf (and an all-zero block to a normal number).
    Non-finite input is refused. Fields: ``scale`` (fp32, one per block) and ``values``.
    """

    block_size: int
    top: float
    """The largest magnitude the format holds: a block's absmax maps onto it."""
    values_dtype: torch.dtype = torch.uint8
    bits: int = 8

    def _num_blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def expected_fields(self, numel):
        nb = self._num_blocks(numel)
        count = nb * self.block_size * self.bits // (8 * torch.empty(0, dtype=self.values_dtype).element_size())
        return {"values": (self.values_dtype, count), "scale": (torch.float32, nb)}

    def encode(self, flat):
        flat = flat.detach().float().reshape(-1)
        pad = (-flat.numel()) % self.block_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks = flat.view(-1, self.block_size)
        scale = blocks.abs().amax(dim=1)
        if not bool(torch.isfinite(scale).all()):
            raise NonFiniteError("refusing to encode non-finite values")
        scale = scale.div_(self.top).clamp_(_TINY, _FP32_MAX / (self.top * (1 + 2.0**-10)))
        return {"values": self._quantize(blocks / scale[:, None]).reshape(-1), "scale": scale}

    def decode(self, encoded, numel):
        scale = encoded["scale"]
        blocks = self._dequantize(encoded["values"]).view(scale.numel(), self.block_size)
        return blocks.mul_(scale[:, None]).reshape(-1)[:numel]

    def _quantize(self, normalized: torch.Tensor) -> torch.Tensor:
        """Values in [-top, top] (shape blocks x block_size) to the stored format."""
        raise NotImplementedError

    def _dequantize(self, values: torch.Tensor) -> torch.Tensor:
        """The stored format back to fp32 values in [-top, top] (a fresh tensor)."""
        raise NotImplementedError


_TINY = float(torch.finfo(torch.float32).tiny)
_FP32_MAX = float(torch.finfo(torch.float32).max)


class ScaledFloat16Compression(BlockScaled):
    """fp16 of each block divided by its absolute maximum: keeps tiny and huge values representable."""

    name, block_size, top, values_dtype, bits = "scaled-fp16", 1024, 1.0, torch.float16, 16

    def _quantize(self, normalized):
        return normalized.to(torch.float16)

    def _dequantize(self, values):
        return values.to(torch.float32)


class SmallFormat(BlockScaled):
    """``bits``-bit codes for the values of ``magnitudes`` and their negatives, nearest one chosen.

    Integer formats (evenly spaced magnitudes 0, 1, ..., top) store ``round(x) + top``, so that
    rounding is one pass. Small floats (the magnitudes of their exponent/mantissa grid) store a
    sign bit above the index of the nearest magnitude, found by comparing with the midpoints
    (ties to the larger magnitude). Two 4-bit codes share a byte, the first in the low nibble.
    Decoding is one table lookup per byte.
    """

    def __init__(self, name: str, bits: int, magnitudes: list[float], block_size: int):
        if bits not in (4, 8) or len(magnitudes) != 1 << (bits - 1) or magnitudes[0] != 0:
            raise ValueError("magnitudes: 2**(bits-1) ascending values from 0")
        self.name, self.bits, self.block_size = name, bits, block_size
        self.magnitudes = torch.tensor(magnitudes, dtype=torch.float32)
        self.top = float(self.magnitudes[-1])
        self._integer = torch.equal(self.magnitudes, torch.arange(len(magnitudes), dtype=torch.float32))
        self._midpoints = (self.magnitudes[1:] + self.magnitudes[:-1]) / 2
        codes = torch.arange(1 << bits, dtype=torch.float32)
        if self._integer:  # code c holds c - top (the one spare code decodes to top)
            values = (codes - self.top).clamp_(max=self.top)
        else:  # code = sign << (bits-1) | index
            values = torch.cat([self.magnitudes, -self.magnitudes])
        # 4-bit: one lookup per byte yields both of its values.
        self._table = values if bits == 8 else torch.stack([values.repeat(16), values.repeat_interleave(16)], 1)

    def _quantize(self, normalized):
        if self._integer:
            codes = normalized.round_().clamp_(-self.top, self.top).add_(self.top).to(torch.uint8)
        else:
            mag = normalized.abs()
            codes = (mag >= self._midpoints[0]).to(torch.uint8)
            for mid in self._midpoints[1:].tolist():  # counting the midpoints below: 3x torch.bucketize's speed
                codes += mag >= mid
            codes.bitwise_or_(torch.signbit(normalized).to(torch.uint8) << (self.bits - 1))
        if self.bits == 8:
            return codes
        pairs = codes.view(-1, 2)
        return pairs[:, 0].bitwise_or(pairs[:, 1] << 4)

    def _dequantize(self, values):
        return self._table.index_select(0, values.int()).reshape(-1)  # int32 indices: half the memory of int64


def _float_magnitudes(exponent_bits: int, mantissa_bits: int, bias: int, count: int) -> list[float]:
    """The non-negative values of a small float format (subnormals included, no inf/NaN), ascending."""
    out = []
    for code in range(count):
        e, m = code >> mantissa_bits, code & ((1 << mantissa_bits) - 1)
        if e == 0:
            out.append(m / (1 << mantissa_bits) * 2.0 ** (1 - bias))
        else:
            out.append((1 + m / (1 << mantissa_bits)) * 2.0 ** (e - bias))
    return out


def _int8():  # revision 2: offset codes in blocks of 256 (revision 1: two's complement in blocks of 1024)
    codec = SmallFormat("int8", 8, [float(i) for i in range(128)], block_size=256)
    codec.revision = 2
    return codec


def _int4():
    return SmallFormat("int4", 4, [float(i) for i in range(8)], block_size=64)


def _e2m1():  # OCP MX FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    return SmallFormat("e2m1", 4, _float_magnitudes(2, 1, 1, 8), block_size=64)


def _e3m0():  # powers of two, 2^-6 .. 2^0, and zero
    return SmallFormat("e3m0", 4, [0.0] + [2.0**-k for k in range(6, -1, -1)], block_size=64)


CODECS: dict[str, object] = {
    "none": NoCompression, "fp16": Float16Compression, "scaled-fp16": ScaledFloat16Compression,
    "int8": _int8, "int4": _int4, "e2m1": _e2m1, "e3m0": _e3m0,
}
"""Codec name -> a callable that makes one."""
QUANTIZED = frozenset({"int8", "int4", "e2m1", "e3m0"})
"""The formats coarse enough for error feedback to pay (on by default in the trainer)."""


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]()
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose one of {sorted(CODECS)}") from None


def codec_label(codec: Codec, result_codec: Codec | None = None) -> str:
    """How a group names its wire formats: ``int4``, or ``int4/int8`` when averages travel wider."""
    if result_codec is None or result_codec.label == codec.label:
        return codec.label
    return f"{codec.label}/{result_codec.label}"
