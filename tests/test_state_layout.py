"""A state cut into a skeleton and parts (what several donors serve a joiner): exact round trip, and a
manifest or skeleton that does not fit is refused before anything large is allocated."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from opendiloco.errors import ProtocolError
from opendiloco.swarm.state.layout import (
    DIGEST_BYTES,
    MIN_PART_BYTES,
    assemble,
    part_digest,
    read_manifest,
    snapshot,
)
from tests.nested import same

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


def roundtrip(state: dict) -> dict:
    snap = snapshot(state, PART)
    manifest = read_manifest({"outer_step": snap.outer_step, "size": snap.size}, snap.manifest_payload(),
                             part_bytes=PART, max_bytes=1 << 30)
    assert same(snap.digests, manifest.digests)
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


def manifest_of(skeleton, size: int, outer_step: int = 1):
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    digests = b"\0" * DIGEST_BYTES * max(1, -(-size // PART))
    return read_manifest({"outer_step": outer_step, "size": size}, digests + buf.getvalue(), part_bytes=PART,
                         max_bytes=1 << 40)


def test_a_skeleton_whose_tensors_do_not_add_up_to_the_parts_is_refused_before_anything_is_allocated():
    # A stride-0 placeholder of 10**12 values: a view of one value, so loading it costs nothing.
    liar = {"outer_step": 1, "x": torch.zeros(()).expand(10**6, 10**6)}
    with pytest.raises(ProtocolError, match="take 4000000000000 bytes; 16 announced"):
        manifest_of(liar, 16)
    with pytest.raises(ProtocolError, match="take 16 bytes; 20 announced"):
        manifest_of({"outer_step": 1, "x": torch.zeros(()).expand(4)}, 20)
    manifest = manifest_of({"outer_step": 1, "x": torch.zeros(()).expand(4)}, 16)
    with pytest.raises(ProtocolError, match="12 bytes for a state of 16"):
        assemble(manifest, bytearray(12))


def test_a_skeleton_at_another_outer_step_than_its_manifest_is_refused():
    with pytest.raises(ProtocolError, match="skeleton says outer step 1000000, the manifest 3"):
        manifest_of({"outer_step": 10**6, "x": torch.zeros(()).expand(4)}, 16, outer_step=3)


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # torch calls its quantized tensors deprecated: an attacker still has them
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)


def nested(levels: int) -> list:
    node: list = [1]
    for _ in range(levels):
        node = [node]
    return node


def shared_list_bomb(levels: int) -> dict:
    node: list = []
    for _ in range(levels):
        node = [node, node]  # pickled once per level, walked 2**levels times
    return {"outer_step": 1, "bomb": node}


@pytest.mark.parametrize("skeleton, message", [
    ([torch.zeros(()).expand(4)], "not a dict"),
    ({"outer_step": 1, "q": quantized()}, "qint8"),
    ({"outer_step": 1, "c": torch.zeros(2, dtype=torch.complex64)}, "complex64"),
    ({"outer_step": 1, "s": torch.zeros(4).to_sparse()}, "sparse"),
    ({"outer_step": 1, "set": {1, 2}}, "holds a set"),
    ({"outer_step": 1, 2.5: 1}, "keys other than"),
    (shared_list_bomb(30), "reaches one object twice"),
    ({"outer_step": 1, "deep": nested(40)}, "levels"),
], ids=["list", "quantized", "complex", "sparse", "set", "float-key", "shared-list-bomb", "deep"])
def test_a_skeleton_that_is_not_a_plain_state_is_refused(skeleton, message):
    """A head's skeleton is any pickle torch loads: only plain trees of plain dense tensors are taken
    (a quantized placeholder crashed the process when filled; 30 levels of one shared list would
    take 2**30 steps to walk)."""
    with pytest.raises(ProtocolError, match=message):
        manifest_of(skeleton, 0)


def test_a_skeleton_that_does_not_load_is_refused():
    with pytest.raises(ProtocolError, match="skeleton does not load"):
        read_manifest({"outer_step": 1, "size": 16}, b"\0" * DIGEST_BYTES + b"not a torch file", part_bytes=PART,
                      max_bytes=1 << 30)


def test_a_real_optimizers_shareable_state_is_a_plain_state():
    from opendiloco import DiLoCoOptimizer, SingleWorker

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=SingleWorker(), module=model,
                          warm_start=True)
    for _ in range(4):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.shareable_state()
    assert "inner" in state  # the warm start's moments ride along
    assert same(roundtrip(state), state)
