"""Wire codecs for pseudo-gradients, in plain torch.

The dense formats (every value travels; the registry of names is ``opendiloco.comm.formats``).
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
element count because block-wise codecs pad. What every codec is (and says about itself): ``codec.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import queue
import threading

import torch

from ..errors import NonFiniteError
from ..fingerprint import tensor_bytes
from .codec import Codec, Rounding, codec_label

__all__ = ["FP16_MAX", "BlockScaled", "Codec", "Float16Compression", "NoCompression", "ScaledFloat16Compression",
           "SmallFormat", "codec_label", "e2m1", "e3m0", "int4", "int8"]

FP16_MAX = float(torch.finfo(torch.float16).max)


class NoCompression(Codec):
    name = "none"
    rounding = Rounding(1, 1e-6, 0.0)

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
    rounding = Rounding(1, 2.0**-10, 2.0**-23)  # fp16's subnormals are 2**-24 apart
    view_dtype = torch.float16

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

    Encoding and decoding take ``CHUNK`` values at a time (``_in_chunks``): each chunk's handful
    of passes stays in cache. A payload is built in one buffer, the fields in name order.
    """

    block_size: int
    top: float
    """The largest magnitude the format holds: a block's absmax maps onto it."""
    values_dtype: torch.dtype = torch.uint8
    bits: int = 8
    CHUNK = 1 << 18
    """Values per chunk (a multiple of every block size)."""

    @property
    def rounding(self) -> Rounding:
        return Rounding(self.block_size, 2.0**-10, 0.0)

    def _num_blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def expected_fields(self, numel):
        nb = self._num_blocks(numel)
        count = nb * self.block_size * self.bits // (8 * torch.empty(0, dtype=self.values_dtype).element_size())
        return {"values": (self.values_dtype, count), "scale": (torch.float32, nb)}

    def encode(self, flat):
        _, scale, values = self._encode(flat)
        return {"values": values, "scale": scale}

    def to_bytes(self, flat):
        return tensor_bytes(self._encode(flat)[0])

    def decode(self, encoded, numel):
        out = torch.empty(numel)
        self._decode(encoded["scale"], encoded["values"], out)
        return out

    def decode_into(self, payload, out):
        fields = self._fields(payload, out.numel())
        self._decode(fields["scale"], fields["values"], out)

    def to_bytes_with_error(self, flat, error_out):
        payload, scale, values = self._encode(flat)
        self._decode(scale, values, error_out, minus=flat.detach().float().reshape(-1))
        return tensor_bytes(payload)

    def _encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(payload, its scale field, its values field): views of one uint8 buffer."""
        flat = flat.detach().float().reshape(-1)
        n, bs = flat.numel(), self.block_size
        nb, full = self._num_blocks(n), n // bs
        (values_dtype, count), per_block = self.expected_fields(n)["values"], self.bits * bs // 8
        payload = torch.empty(nb * 4 + count * values_dtype.itemsize, dtype=torch.uint8)
        scale, values = payload[: nb * 4].view(torch.float32), payload[nb * 4 :]
        absmax = torch.empty(nb, 1)  # checked for finiteness once, at the end
        step = self.CHUNK // bs
        parts = list(zip(flat[: full * bs].view(full, bs).split(step), absmax[:full].split(step),
                         scale[:full, None].split(step), values[: full * per_block].split(step * per_block)))
        if full < nb:  # the last block, padded with zeros
            tail = flat.new_zeros(1, bs)
            tail.view(-1)[: n - full * bs] = flat[full * bs :]
            parts.append((tail, absmax[full:], scale[full:, None], values[full * per_block :]))
        _in_chunks(parts, self._encode_chunk, n)
        if not bool(torch.isfinite(absmax).all()):
            raise NonFiniteError("refusing to encode non-finite values")
        return payload, scale, values.view(values_dtype)

    def _encode_chunk(self, blocks, absmax, scale, values, work) -> None:
        w = work[: blocks.numel()].view_as(blocks)
        torch.amax(torch.abs(blocks, out=w), dim=1, keepdim=True, out=absmax)
        torch.div(absmax, self._constants["top"], out=scale).clamp_(_TINY, _FP32_MAX / (self.top * (1 + 2.0**-10)))
        self._quantize(blocks, scale, values, work)

    def _decode(self, scale: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                minus: torch.Tensor | None = None) -> None:
        """``out[:] =`` the decoded values, or ``minus`` less them when ``minus`` is given."""
        n, bs = out.numel(), self.block_size
        nb, full = self._num_blocks(n), n // bs
        if nb > scale.numel():
            raise ValueError(f"{scale.numel()} blocks cannot hold {n} values")
        if not out.is_contiguous():
            tmp = torch.empty(n)
            self._decode(scale, values, tmp, minus)
            out.copy_(tmp.view_as(out))
            return
        out, values, step = out.view(-1), values.view(torch.uint8), self.CHUNK // bs
        per_block = self.bits * bs // 8
        chunks = [out[: full * bs].view(full, bs).split(step), values[: full * per_block].split(step * per_block),
                  scale[:full, None].split(step)]
        minus_chunks = [None] * len(chunks[0]) if minus is None else minus[: full * bs].view(full, bs).split(step)
        parts = [(*p, m, None) for p, m in zip(zip(*chunks), minus_chunks)]
        if full < nb:  # the last, padded block
            parts.append((None, values[full * per_block : nb * per_block], scale[full:nb, None],
                          None if minus is None else minus[full * bs :], out[full * bs :]))
        _in_chunks(parts, self._decode_chunk, n)

    def _decode_chunk(self, out, values, scale, minus, target, work) -> None:
        """Decodes a chunk into ``out``, or (``out`` None) the padded last block into scratch and its
        first values into ``target``; with ``minus``, ``minus - decoded`` instead."""
        if out is None:
            out = work[-self.block_size :].view(1, -1)
        self._dequantize(out, values, scale, work)
        if target is not None:
            decoded = out.view(-1)[: target.numel()]
            target.copy_(decoded) if minus is None else torch.sub(minus, decoded, out=target)
        elif minus is not None:
            torch.sub(minus, out, out=out)

    @functools.cached_property
    def _constants(self) -> dict[str, torch.Tensor]:
        """0-d tensors for the per-chunk ops (a Python number would become a new tensor each time)."""
        return {"top": torch.tensor(self.top)}

    def _quantize(self, blocks: torch.Tensor, scale: torch.Tensor, values: torch.Tensor, work: torch.Tensor) -> None:
        """``values[:] =`` (uint8 view) the stored form of ``blocks / scale`` (``blocks``: k x block_size,
        ``scale``: k x 1, ``work``: fp32 scratch of twice blocks' size)."""
        raise NotImplementedError

    def _dequantize(self, out: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, work: torch.Tensor) -> None:
        """``out[:] =`` the stored ``values`` (uint8 view) times their block's scale (``out``: k x block_size
        fp32, ``scale``: k x 1, ``work``: fp32 scratch of twice out's size)."""
        raise NotImplementedError


_TINY = float(torch.finfo(torch.float32).tiny)
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _in_chunks(parts: list[tuple], fn, numel: int) -> None:
    """``fn(*part, work)`` for every part (a chunk), ``work`` being a per-thread fp32 scratch.

    With more than one torch thread, the chunks are shared among ``_Workers``: a chunk's passes
    are too short to split among threads (one parallel region per pass costs more than it saves,
    and on a busy machine each can wait for a descheduled thread), so whole chunks are shared.
    Chunks are independent: the bytes do not depend on which thread takes which.
    """
    if torch.get_num_threads() <= 1 or numel < 1 << 15:  # one thread, or passes under torch's grain size
        work = _scratch()
        for part in parts:
            fn(*part, work)
        return
    counter = itertools.count()

    def take_chunks():
        work = _scratch()
        while (i := next(counter)) < len(parts):
            fn(*parts[i], work)

    _Workers.get().run(take_chunks, min(torch.get_num_threads(), len(parts)))


def _scratch() -> torch.Tensor:
    """This thread's fp32 scratch: twice a chunk, enough for any codec's chunk."""
    work = getattr(_local, "work", None)
    if work is None:
        work = _local.work = torch.empty(2 * BlockScaled.CHUNK)
    return work


_local = threading.local()


class _Workers:
    """Threads whose torch ops run inline: each sets its own torch thread count to 1.

    ``torch.set_num_threads`` sets the calling thread's OpenMP thread count and the count that
    threads started later begin with; the latter is put back once the workers have set theirs.
    Where torch's threads work otherwise, the workers' ops simply run as any thread's would.
    """

    _instance: _Workers | None = None
    _lock = threading.Lock()

    def __init__(self, count: int):
        self.count, self.tasks = count, queue.SimpleQueue()
        started, default = threading.Barrier(count + 1), []

        def serve():
            default.append(torch.get_num_threads())  # a new thread's count: the default
            torch.set_num_threads(1)
            started.wait()
            while True:
                task, done = self.tasks.get()
                task()
                done.release()

        for _ in range(count):
            threading.Thread(target=serve, name="codec-chunks", daemon=True).start()
        started.wait()
        # put the default back, from a thread of its own (this one's count stays as it is)
        restore = threading.Thread(target=torch.set_num_threads, args=(max(default),))
        restore.start()
        restore.join()

    @classmethod
    def get(cls) -> _Workers:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Workers(torch.get_num_threads())
            return cls._instance

    def run(self, task, copies: int) -> None:
        """``task()`` on ``copies`` workers at once; returns when all are done (raising the first error)."""
        errors, done = [], threading.Semaphore(0)

        def guarded():
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)

        for _ in range(min(copies, self.count)):
            self.tasks.put((guarded, done))
        for _ in range(min(copies, self.count)):
            done.acquire()
        if errors:
            raise errors[0]


def _forget_workers() -> None:  # a forked child has none of its parent's threads
    _Workers._instance = None
    _Workers._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


class ScaledFloat16Compression(BlockScaled):
    """fp16 of each block divided by its absolute maximum: keeps tiny and huge values representable."""

    name, block_size, top, values_dtype, bits = "scaled-fp16", 1024, 1.0, torch.float16, 16

    def _quantize(self, blocks, scale, values, work):
        w = work[: blocks.numel()].view_as(blocks)
        torch.div(blocks, scale, out=w)
        values.view(torch.float16).view_as(w).copy_(w)

    def _dequantize(self, out, values, scale, work):
        out.copy_(values.view(torch.float16).view_as(out)).mul_(scale)


class SmallFormat(BlockScaled):
    """``bits``-bit codes for the values of ``magnitudes`` and their negatives, nearest one chosen.

    Integer formats (evenly spaced magnitudes 0, 1, ..., top) store ``round(x) + top`` (ties to
    even). Small floats (the magnitudes of their exponent/mantissa grid) store a sign bit above
    the index of the nearest magnitude (ties to the larger magnitude). Two 4-bit codes share a
    byte, the first in the low nibble. Encoding rounds through fp32 bit patterns, without
    comparisons (``_quantize``); decoding looks each byte up in a table of its values.
    """

    error_feedback_pays = True

    def __init__(self, name: str, bits: int, magnitudes: list[float], block_size: int):
        if bits not in (4, 8) or len(magnitudes) != 1 << (bits - 1) or magnitudes[0] != 0:
            raise ValueError("magnitudes: 2**(bits-1) ascending values from 0")
        self.name, self.bits, self.block_size = name, bits, block_size
        self.magnitudes = torch.tensor(magnitudes, dtype=torch.float32)
        self.top = float(self.magnitudes[-1])
        self._integer = torch.equal(self.magnitudes, torch.arange(len(magnitudes), dtype=torch.float32))
        codes = torch.arange(1 << bits, dtype=torch.float32)
        if self._integer:  # code c holds c - top (the one spare code decodes to top)
            values = (codes - self.top).clamp_(max=self.top)
        else:  # code = sign << (bits-1) | index
            values = torch.cat([self.magnitudes, -self.magnitudes])
            self._shift, self._encode_table = _float_encode_table(tuple(magnitudes), bits)
            if bits == 4 and self._shift < 20:
                raise ValueError("4-bit floats: midpoints of at most 12 leading bits (a table of 2**24 bytes)")
        # 8 bits: one value per byte; 4 bits: both values of a byte as one 64-bit word.
        self._decode_table = values if bits == 8 else \
            torch.stack([values.repeat(16), values.repeat_interleave(16)], 1).view(torch.int64).reshape(-1)

    @property
    def rounding(self) -> Rounding:
        gaps = (self.magnitudes[1:] - self.magnitudes[:-1]).max()
        return Rounding(self.block_size, float(gaps) / self.top, 0.0)

    @functools.cached_property
    def _constants(self) -> dict[str, torch.Tensor]:
        out = {"top": torch.tensor(self.top), "0xFF": torch.tensor(0xFF, dtype=torch.uint8),
               "4": torch.tensor(4, dtype=torch.int16)}
        if self._integer:
            out["rounder"] = torch.tensor(_ROUNDER + (1 << (self.bits - 1)))
        else:
            key_bits = 32 - self._shift
            out["shift"] = torch.tensor(self._shift, dtype=torch.int32)
            out["pair shifts"] = _pair_shifts(self._shift, self.CHUNK)
            out["pair shift"] = torch.tensor(16 - key_bits, dtype=torch.int32)
            out["key mask"] = torch.tensor((1 << key_bits * (8 // self.bits)) - 1, dtype=torch.int32)
        return out

    def _quantize(self, blocks, scale, values, work):
        c, n = self._constants, blocks.numel()
        w = work[:n]
        torch.div(blocks, scale, out=w.view_as(blocks))
        if self._integer:
            # |x| <= top (1 + 2**-10) (at the largest, clamped, scale), so |round(x)| <= top = 2**(bits-1) - 1.
            # x - R, for R = 1.5 * 2**23 + 2**(bits-1), rounds to -(R - round(x)) (ties to even: R is even). The
            # low byte of its fp32 bits is p = 2**(bits-1) - round(x), in [1, 2**bits - 1], and the code
            # round(x) + top is 2**bits - 1 - p: p with its bits flipped.
            w.sub_(c["rounder"])
            if self.bits == 8:
                values.copy_(w.view(torch.int32))  # to uint8: the low byte
                values.bitwise_xor_(c["0xFF"])
                return
            p = work[n : n + n // 4].view(torch.uint8)
            p.copy_(w.view(torch.int32))
            pairs = p.view(torch.int16)  # p_low | p_high << 8 (little-endian, as the wire format)
            packed = work[n + n // 4 : n + n // 2].view(torch.int16)
            torch.bitwise_right_shift(pairs, c["4"], out=packed).bitwise_or_(pairs)  # low byte p_low | p_high << 4
            values.copy_(packed)
            values.bitwise_xor_(c["0xFF"])  # 15 - p in each nibble
            return
        keys = w.view(torch.int32)
        if self.bits == 8:
            keys.bitwise_right_shift_(c["shift"]).bitwise_and_(c["key mask"])  # sign-extended: keep the key's bits
            torch.index_select(self._encode_table, 0, keys, out=values)
            return
        # A byte's two values: the low one's bits shifted by 16, the high one's by the key's shift. As 16-bit
        # halves, the first holds the low key in its top bits, the second the high key in its low bits: their
        # 32-bit word has both keys side by side, from bit 16 - key_bits.
        keys.bitwise_right_shift_(c["pair shifts"][:n])
        halves = work[n : n + n // 2].view(torch.int16)
        halves.copy_(keys)
        index = halves.view(torch.int32)
        index.bitwise_right_shift_(c["pair shift"]).bitwise_and_(c["key mask"])
        torch.index_select(self._encode_table, 0, index, out=values)

    def _dequantize(self, out, values, scale, work):
        if self.bits == 8 and self._integer:
            out.copy_(values.view_as(out)).sub_(self._constants["top"]).clamp_(max=self.top)
        else:
            index = work[out.numel() : out.numel() + values.numel()].view(torch.int32)
            index.copy_(values)
            flat = out.view(-1)
            if self.bits == 8:
                torch.index_select(self._decode_table, 0, index, out=flat)
            elif flat.storage_offset() % 2 == 0:  # an int64 view needs an even offset
                torch.index_select(self._decode_table, 0, index, out=flat.view(torch.int64))
            else:
                flat.copy_(torch.index_select(self._decode_table, 0, index).view(torch.float32))
        out.mul_(scale)


_ROUNDER = 1.5 * 2**23
"""From 2**23 to 2**24 fp32 holds exactly the integers: R + x, for |x| < 2**22, is R + round(x)."""


@functools.cache
def _float_encode_table(magnitudes: tuple[float, ...], bits: int) -> tuple[int, torch.Tensor]:
    """(shift, table) of a small float: a value's key is its fp32 bits >> shift (the top 32 - shift bits), and
    the table holds the code of each key (4 bits: the byte of each pair, at low key + high key << key bits).

    ``shift`` keeps every midpoint's nonzero bits, so the values with the same key lie between the
    same two midpoints: the code of the smallest one (by comparisons) holds for all.
    """
    mags = torch.tensor(magnitudes, dtype=torch.float32)
    mids = (mags[1:] + mags[:-1]) / 2
    shift = min((b & -b).bit_length() - 1 for b in mids.view(torch.int32).tolist())  # fewest trailing zeros
    smallest = (torch.arange(1 << (32 - shift), dtype=torch.int64) << shift).to(torch.int32).view(torch.float32)
    index = (smallest.abs()[:, None] >= mids[None, :]).sum(1)
    codes = (index | (torch.signbit(smallest).long() << (bits - 1))).to(torch.uint8)
    if bits == 4:
        codes = (codes[None, :] | (codes[:, None] << 4)).reshape(-1)  # [high key, low key]
    return shift, codes


@functools.cache
def _pair_shifts(shift: int, chunk: int) -> torch.Tensor:
    """16, shift, 16, shift, ...: per value of a chunk, the right shift that puts its key in place."""
    return torch.tensor([16, shift], dtype=torch.int32).repeat(chunk // 2)


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


def int8() -> SmallFormat:  # revision 2: offset codes in blocks of 256 (revision 1: two's complement in blocks of 1024)
    codec = SmallFormat("int8", 8, [float(i) for i in range(128)], block_size=256)
    codec.revision = 2
    return codec


def int4() -> SmallFormat:
    return SmallFormat("int4", 4, [float(i) for i in range(8)], block_size=64)


def e2m1() -> SmallFormat:  # OCP MX FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    return SmallFormat("e2m1", 4, _float_magnitudes(2, 1, 1, 8), block_size=64)


def e3m0() -> SmallFormat:  # powers of two, 2^-6 .. 2^0, and zero
    return SmallFormat("e3m0", 4, [0.0] + [2.0**-k for k in range(6, -1, -1)], block_size=64)
