"""Wire codecs for pseudo-gradients, in plain torch.

Every codec is deterministic: encoding the same fp32 tensor gives the same bytes on every
machine, and decoding the same bytes gives the same fp32 tensor. That is what lets all
workers of a group end a round with bit-identical averages (DESIGN.md invariant 7): the
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

from ..errors import ProtocolError
from ..fingerprint import tensor_bytes

FP16_MAX = float(torch.finfo(torch.float16).max)


class Codec(ABC):
    name: str

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
            lo, hi = torch.aminmax(flat)
            if not (-FP16_MAX <= float(lo) and float(hi) <= FP16_MAX):
                half.clamp_(-FP16_MAX, FP16_MAX)
        return {"values": half}

    def decode(self, encoded, numel):
        return encoded["values"].to(torch.float32)

    def expected_fields(self, numel):
        return {"values": (torch.float16, numel)}

    def view_bytes(self, payload, numel):
        return self._fields(payload, numel)["values"]


class _Blockwise(Codec):
    """Base for codecs that scale each block of ``block_size`` elements separately."""

    block_size = 1024

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.detach().float()
        pad = (-flat.numel()) % self.block_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block_size)

    def _num_blocks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.block_size)) if numel else 0


class ScaledFloat16Compression(_Blockwise):
    """fp16 after dividing each block by its absolute maximum: keeps tiny and huge values representable."""

    name = "scaled-fp16"

    def encode(self, flat):
        blocks = self._blocks(flat)
        scale = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        values = (blocks / scale[:, None]).to(torch.float16)
        return {"values": values.flatten(), "scale": scale}

    def decode(self, encoded, numel):
        blocks = encoded["values"].to(torch.float32).view(-1, self.block_size)
        return (blocks * encoded["scale"][:, None]).flatten()[:numel]

    def expected_fields(self, numel):
        nb = self._num_blocks(numel)
        return {"values": (torch.float16, nb * self.block_size), "scale": (torch.float32, nb)}


class Int8Compression(_Blockwise):
    """Symmetric 8-bit quantisation with one fp32 absmax scale per block (about 4x smaller than fp32)."""

    name = "int8"

    def encode(self, flat):
        blocks = self._blocks(flat)
        scale = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        values = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return {"values": values.flatten(), "scale": scale}

    def decode(self, encoded, numel):
        blocks = encoded["values"].to(torch.float32).view(-1, self.block_size)
        return (blocks * encoded["scale"][:, None]).flatten()[:numel]

    def expected_fields(self, numel):
        nb = self._num_blocks(numel)
        return {"values": (torch.int8, nb * self.block_size), "scale": (torch.float32, nb)}


CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoCompression, Float16Compression, ScaledFloat16Compression, Int8Compression)
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]()
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose one of {sorted(CODECS)}") from None
