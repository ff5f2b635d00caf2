"""A state cut into a skeleton and parts (what several donors serve a joiner): exact round trip, and a
manifest or skeleton that does not fit is refused before anything large is allocated."""

from __future__ import annotations

import io

import pytest
import torch

from opendiloco.errors import ProtocolError
from opendiloco.swarm.state_layout import (
    DIGEST_BYTES,
    MIN_PART_BYTES,
    assemble,
    part_digest,
    read_manifest,
    snapshot,
)

PART = MIN_PART_BYTES


def odd_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"outer_step": 7, "local_step": 3,
            "outer": {"global_params": [torch.randn(300_000, generator=g), torch.randn(3, 4, generator=g)],
                      "optimizer": {"state": {0: {"momentum_buffer": torch.randn(300_000, generator=g)}},
                                    "param_groups": [{"lr": 0.4, "params": [0, 1]}]}},
            "flags": torch.tensor([True, False, True]),  # 3 bytes: what follows is not aligned
            "half": torch.randn(5, generator=g).half(), "empty": torch.empty(0, 3), "step": torch.tensor(3.0),
            "pair": (1, torch.arange(3)), "strided": torch.arange(12.0).reshape(3, 4).t()}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def roundtrip(state: dict) -> dict:
    snap = snapshot(state, PART)
    manifest = read_manifest({"outer_step": snap.outer_step, "size": snap.size}, snap.manifest_payload(),
                             part_bytes=PART, max_bytes=1 << 30)
    flat = bytearray()
    for i, digest in enumerate(manifest.digests):
        part = snap.part(i)
        assert part_digest(part) == digest and len(part) == manifest.part_size(i)
        flat += part
    return assemble(manifest, flat)


def test_a_state_comes_back_exactly_from_its_skeleton_and_parts():
    state = odd_state()
    snap = snapshot(state, PART)
    assert len(snap.digests) == 3 and len(snap.skeleton) < 16 << 10  # the bytes travel in parts, not the skeleton
    assert same(roundtrip(state), state)


def test_workers_with_the_same_outer_state_cut_the_same_parts_whatever_their_own_tail():
    a, b = odd_state(), odd_state()
    b["inner"] = {"exp_avg": torch.ones(10)}  # a warm start's moments: after the outer state
    b["local_step"] = 9
    da, db = snapshot(a, PART).digests, snapshot(b, PART).digests
    assert da[:-1] == db[:-1] and da[-1] != db[-1]


@pytest.mark.parametrize("meta, payload_parts, message", [
    ({"outer_step": 7, "size": 2 << 30}, 1, "at most"),
    ({"outer_step": "7", "size": 10}, 1, "integer"),
    ({"outer_step": 7}, 1, "integer"),
    ({"outer_step": 7, "size": 3 * PART}, 1, "does not fit 3 parts"),  # digests missing
])
def test_a_manifest_that_does_not_fit_is_refused(meta, payload_parts, message):
    with pytest.raises(ProtocolError, match=message):
        read_manifest(meta, b"\0" * (payload_parts * DIGEST_BYTES), part_bytes=PART, max_bytes=1 << 30)


def test_a_skeleton_of_megabytes_is_refused():
    with pytest.raises(ProtocolError, match="does not fit"):
        read_manifest({"outer_step": 1, "size": 10}, b"\0" * (DIGEST_BYTES + (9 << 20)), part_bytes=PART,
                      max_bytes=1 << 30)


def manifest_of(skeleton: dict, size: int):
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    digests = b"\0" * DIGEST_BYTES * max(1, -(-size // PART))
    return read_manifest({"outer_step": 1, "size": size}, digests + buf.getvalue(), part_bytes=PART,
                         max_bytes=1 << 40)


def test_a_skeleton_whose_tensors_do_not_add_up_to_the_parts_is_refused_without_allocating():
    # A stride-0 placeholder of 10**12 values: a view of one value, so loading it costs nothing.
    liar = {"outer_step": 1, "x": torch.zeros(()).expand(10**6, 10**6)}
    with pytest.raises(ProtocolError, match="take 4000000000000 bytes; 16 announced"):
        assemble(manifest_of(liar, 16), bytearray(16))
    with pytest.raises(ProtocolError, match="take 16 bytes; 20 announced"):
        assemble(manifest_of({"x": torch.zeros(()).expand(4)}, 20), bytearray(20))


def test_a_skeleton_that_is_not_a_state_is_refused():
    with pytest.raises(ProtocolError, match="not a dict"):
        assemble(manifest_of([torch.zeros(()).expand(4)], 16), bytearray(16))
    bad = manifest_of({"x": torch.zeros(()).expand(4)}, 16)
    garbage = type(bad)(bad.outer_step, bad.size, bad.part_bytes, bad.digests, b"not a torch file")
    with pytest.raises(ProtocolError, match="skeleton does not load"):
        assemble(garbage, bytearray(16))
