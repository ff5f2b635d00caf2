"""Wire codecs: error bounds, determinism, declared fields, saturation."""

from __future__ import annotations

import pytest
import torch

from opendiloco.comm.compression import CODECS, FP16_MAX, get_codec

SIZES = [0, 1, 1023, 1024, 1025, 5000]


def _data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # mixed magnitudes, as pseudo-gradients have
    return torch.randn(n, generator=g) * torch.logspace(-3, 1, n if n else 1)[:n]


def _bytes(encoded: dict[str, torch.Tensor]) -> bytes:
    return b"".join(k.encode() + encoded[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(encoded))


def test_known_codecs():
    assert set(CODECS) == {"none", "fp16", "scaled-fp16", "int8"}
    with pytest.raises(ValueError, match="unknown compression 'gzip'"):
        get_codec("gzip")


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("n", SIZES)
def test_expected_fields_match_encode(name, n):
    codec = get_codec(name)
    encoded = codec.encode(_data(n))
    fields = codec.expected_fields(n)
    assert set(encoded) == set(fields)
    for key, (dtype, count) in fields.items():
        t = encoded[key]
        assert t.dtype == dtype and t.dim() == 1 and t.numel() == count and t.device.type == "cpu", key
    assert codec.wire_bytes(n) == sum(t.numel() * t.element_size() for t in encoded.values())
    decoded = codec.decode(encoded, n)
    assert decoded.dtype == torch.float32 and decoded.shape == (n,)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_deterministic(name):
    codec, x = get_codec(name), _data(3000, seed=3)
    a, b = codec.encode(x), codec.encode(x.clone())
    assert _bytes(a) == _bytes(b)
    assert torch.equal(codec.decode(a, x.numel()), codec.decode(b, x.numel()))
    # a roundtrip is idempotent: what arrives re-encodes to the same bytes (all peers agree)
    y = codec.roundtrip(x)
    assert torch.equal(codec.roundtrip(y), y)


def test_none_is_lossless():
    x = _data(5000)
    assert torch.equal(get_codec("none").roundtrip(x), x)


def test_fp16_relative_error():
    x = _data(5000, seed=1)
    x = x[x.abs() > 1e-4]  # fp16 normal range; below it the error is absolute (subnormals)
    err = (get_codec("fp16").roundtrip(x) - x).abs() / x.abs()
    assert err.max() <= 2.0**-11 + 1e-9  # half an ulp of a 10-bit mantissa
    assert err.max() > 1e-5  # and it is lossy


def test_fp16_saturates_instead_of_inf():
    x = torch.tensor([1e6, -1e6, 65504.0, 70000.0, float("inf"), 1.0])
    y = get_codec("fp16").roundtrip(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y, torch.tensor([FP16_MAX, -FP16_MAX, FP16_MAX, FP16_MAX, FP16_MAX, 1.0]))


def test_int8_error_within_half_a_step_of_block_absmax():
    codec = get_codec("int8")
    x = _data(5000, seed=2)
    y = codec.roundtrip(x)
    bs = codec.block_size
    for start in range(0, x.numel(), bs):
        xb, yb = x[start : start + bs], y[start : start + bs]
        step = xb.abs().max() / 127
        assert (yb - xb).abs().max() <= step / 2 * (1 + 1e-5)
        assert (yb.abs().max() - xb.abs().max()).abs() <= 1e-6 * xb.abs().max()  # the absmax survives


def test_scaled_fp16_relative_to_block_absmax_and_tiny_values():
    codec = get_codec("scaled-fp16")
    x = _data(5000, seed=4) * 1e-9  # far below fp16's range: plain fp16 would flush these to zero
    y = codec.roundtrip(x)
    bs = codec.block_size
    for start in range(0, x.numel(), bs):
        xb, yb = x[start : start + bs], y[start : start + bs]
        assert (yb - xb).abs().max() <= xb.abs().max() * 2.0**-11 * (1 + 1e-5)
    assert (get_codec("fp16").roundtrip(x) == 0).float().mean() > 0.5
    assert (y == 0).float().mean() < 0.01


@pytest.mark.parametrize("name", ["scaled-fp16", "int8"])
def test_blockwise_all_zero_block_decodes_to_zero(name):
    codec = get_codec(name)
    x = torch.zeros(2048)
    x[1500] = 3.0
    y = codec.roundtrip(x)
    assert torch.isfinite(y).all() and torch.equal(y[:1024], torch.zeros(1024))
    assert y[1500].item() == pytest.approx(3.0, rel=1e-3)
