"""Wire codecs: error bounds, determinism (also across processes), declared fields, saturation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from opendiloco.comm.codec import codec_label
from opendiloco.comm.compression import FP16_MAX, BlockScaled, SmallFormat
from opendiloco.comm.formats import CODECS, get_codec

SMALL = ["int8", "int4", "e2m1", "e3m0"]
BLOCK_SCALED = ["scaled-fp16"] + SMALL

SIZES = [0, 1, 1023, 1024, 1025, 5000]


def _data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # mixed magnitudes, as pseudo-gradients have
    return torch.randn(n, generator=g) * torch.logspace(-3, 1, n if n else 1)[:n]


def _bytes(encoded: dict[str, torch.Tensor]) -> bytes:
    return b"".join(k.encode() + encoded[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(encoded))


def test_known_codecs():
    assert set(CODECS) == {"none", "fp16", "scaled-fp16", "int8", "int4", "e2m1", "e3m0"}
    with pytest.raises(ValueError, match="unknown format 'gzip'"):
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
    x = torch.tensor([1e6, -1e6, 65504.0, 70000.0, 3e38, 1.0])
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


@pytest.mark.parametrize("name", BLOCK_SCALED)
def test_blockwise_all_zero_block_decodes_to_zero(name):
    codec = get_codec(name)
    bs = codec.block_size
    x = torch.zeros(4 * bs)
    x[bs * 2 + 7] = 3.0
    y = codec.roundtrip(x)
    assert torch.isfinite(y).all() and torch.equal(y[: 2 * bs], torch.zeros(2 * bs))
    assert y[bs * 2 + 7].item() == pytest.approx(3.0, rel=1e-3)


def test_small_formats_hold_their_documented_magnitudes():
    mags = {n: get_codec(n).magnitudes.tolist() for n in SMALL}
    assert mags["int8"] == list(range(128)) and mags["int4"] == list(range(8))
    assert mags["e2m1"] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert mags["e3m0"] == [0] + [2.0**-k for k in range(6, -1, -1)]


@pytest.mark.parametrize("name", SMALL)
def test_small_formats_round_to_the_nearest_magnitude_of_each_block(name):
    """Each value lands on the magnitude nearest to it once its block is scaled to the format's
    range: the error is at most that distance (half the gap around it), and the block's
    absolute maximum survives."""
    codec: SmallFormat = get_codec(name)
    x = _data(5000, seed=2)
    y = codec.roundtrip(x)
    bs, mags = codec.block_size, codec.magnitudes
    for start in range(0, x.numel(), bs):
        xb, yb = x[start : start + bs], y[start : start + bs]
        scale = xb.abs().max() / codec.top
        nearest = (xb.abs()[:, None] / scale - mags[None, :]).abs().min(dim=1).values
        assert ((yb - xb).abs() <= (nearest + 1e-5 * codec.top) * scale).all()
        assert (torch.sign(yb) * torch.sign(xb) >= 0).all()  # never the wrong sign
        assert (yb.abs().max() - xb.abs().max()).abs() <= 1e-6 * xb.abs().max()


@pytest.mark.parametrize("name", SMALL)
def test_four_bit_formats_are_a_quarter_of_fp16_on_the_wire(name):
    codec, fp16 = get_codec(name), get_codec("fp16")
    n = 1 << 20
    ratio = codec.wire_bytes(n) / fp16.wire_bytes(n)
    bits = codec.bits
    assert ratio == pytest.approx(bits / 16 + 4 / codec.block_size / 2)  # values + one fp32 scale per block
    assert ratio <= (0.3 if bits == 4 else 0.51)


@pytest.mark.parametrize("name", ["fp16"] + BLOCK_SCALED)
def test_finite_extremes_never_decode_to_inf_or_nan(name):
    big = float(torch.finfo(torch.float32).max)
    tiny = float(torch.finfo(torch.float32).tiny)
    x = torch.tensor([big, -big, 1.0, -1e-30, tiny, 1e-45, 0.0, -0.0] * 40)
    y = get_codec(name).roundtrip(x)
    assert torch.isfinite(y).all()
    if name != "fp16":  # fp16 saturates at 65504; the block-scaled formats keep the absmax
        assert y.abs().max().item() == pytest.approx(big, rel=1e-3)


@pytest.mark.parametrize("name", ["fp16"] + BLOCK_SCALED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused(name, bad):
    x = torch.ones(3000)
    x[1234] = bad
    with pytest.raises(ValueError, match="non-finite"):
        get_codec(name).to_bytes(x)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encoding_error_is_reported_exactly(name):
    codec, x = get_codec(name), _data(5000, seed=6)
    error = torch.full_like(x, float("nan"))
    payload = codec.to_bytes_with_error(x, error)
    decoded = codec.from_bytes(payload, x.numel())
    assert bytes(payload) == bytes(codec.to_bytes(x))
    assert torch.equal(error, x - decoded)


def test_codec_label_names_both_formats_only_when_they_differ():
    assert codec_label(get_codec("int4")) == "int4" == codec_label(get_codec("int4"), get_codec("int4"))
    assert codec_label(get_codec("int4"), get_codec("int8")) == "int4/int8.v2"  # int8's bytes changed once
    assert codec_label(get_codec("int8")) == "int8.v2" and get_codec("fp16").label == "fp16"


_OTHER_PROCESS = """
import sys, torch
from opendiloco.comm.formats import get_codec
name, n = sys.argv[1], int(sys.argv[2])
payload = open(sys.argv[3], "rb").read()
x = torch.load(sys.argv[4])
codec = get_codec(name)
sys.stdout.buffer.write(bytes(codec.to_bytes(x)))
sys.stdout.buffer.write(codec.from_bytes(payload, n).numpy().tobytes())
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCK_SCALED)
def test_another_process_encodes_and_decodes_the_same_bytes(tmp_path, name):
    """What every peer relies on: the same values give the same payload, and the same payload the
    same fp32 values, in any process (here: a fresh interpreter with its own thread count)."""
    codec, x = get_codec(name), _data(70001, seed=9)
    payload = bytes(codec.to_bytes(x))
    (tmp_path / "payload").write_bytes(payload)
    torch.save(x, tmp_path / "x.pt")
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, name, str(x.numel()), str(tmp_path / "payload"),
                          str(tmp_path / "x.pt")], capture_output=True, timeout=120, check=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).stdout
    assert out[: len(payload)] == payload
    assert out[len(payload):] == codec.from_bytes(payload, x.numel()).numpy().tobytes()


def test_block_scaled_codecs_share_one_implementation():
    for name in BLOCK_SCALED:
        codec = get_codec(name)
        assert isinstance(codec, BlockScaled)
        assert type(codec).encode is BlockScaled.encode and type(codec).decode is BlockScaled.decode
