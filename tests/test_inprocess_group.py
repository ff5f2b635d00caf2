"""InProcessGroup: the real in-process averaging that the optimizer tests rely on."""

from __future__ import annotations

import time

import pytest
import torch

from opendiloco import AveragingError, InProcessGroup, SingleWorker
from opendiloco.comm.formats import get_codec


def _average_all(run_replicas, group, inputs, weights, steps=None, timeout=10.0):
    steps = steps or [0] * group.size

    def member(rank):
        try:
            return group.members[rank].average(inputs[rank], weight=weights[rank], outer_step=steps[rank])
        except AveragingError as e:
            return e

    return run_replicas(member, group.size, timeout=timeout)


def test_weighted_average_is_exact(run_replicas):
    group = InProcessGroup(3)
    # small integers and weights whose fractions are dyadic: the exact answer is representable
    inputs = [[torch.full((2, 3), 8.0 * (r + 1)), torch.arange(4.0) * (r - 1)] for r in range(3)]
    weights = [1.0, 2.0, 5.0]
    results = _average_all(run_replicas, group, inputs, weights)
    want = [(1 * 8 + 2 * 16 + 5 * 24) / 8 * torch.ones(2, 3), torch.arange(4.0) * (1 * -1 + 2 * 0 + 5 * 1) / 8]
    for res in results:
        assert res.total_weight == 8.0 and res.group_size == 3
        assert res.peers == ("replica-0", "replica-1", "replica-2")
        for got, w in zip(res.tensors, want):
            assert got.dtype == torch.float32 and got.shape == w.shape
            assert torch.equal(got, w)
    assert group.rounds == 1


def test_average_of_random_tensors_matches_float64_and_is_identical_everywhere(run_replicas):
    group = InProcessGroup(4)
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(5, 7, generator=g), torch.randn(3, generator=g)] for _ in range(4)]
    weights = [1.0, 0.5, 3.0, 0.0]  # a weight-0 member takes part but contributes nothing
    results = _average_all(run_replicas, group, inputs, weights)
    for i in range(2):
        want = sum(w * x[i].double() for w, x in zip(weights, inputs)) / sum(weights)
        torch.testing.assert_close(results[0].tensors[i].double(), want, rtol=1e-6, atol=1e-7)
        for res in results[1:]:
            assert torch.equal(res.tensors[i], results[0].tensors[i])


def test_compressed_average_is_what_the_wire_would_give(run_replicas):
    group = InProcessGroup(2, compression="fp16")
    codec = get_codec("fp16")
    g = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(1000, generator=g) / 3] for _ in range(2)]
    results = _average_all(run_replicas, group, inputs, [1.0, 1.0])
    parts = [codec.roundtrip(x[0]) for x in inputs]
    want = codec.roundtrip(parts[0] * 0.5 + parts[1] * 0.5)
    assert torch.equal(results[0].tensors[0], want) and torch.equal(results[1].tensors[0], want)
    assert torch.equal(want, want.half().float())  # the result really went through fp16


def test_mismatched_outer_steps_fail_for_everyone(run_replicas):
    group = InProcessGroup(2, timeout=0.5)
    results = _average_all(run_replicas, group, [[torch.ones(3)]] * 2, [1.0, 1.0], steps=[4, 5])
    for res in results:  # rounds are matched by key: members at different outer steps never average
        assert isinstance(res, AveragingError) and "timed out" in str(res)
    # the group is usable again for the next round
    results = _average_all(run_replicas, group, [[torch.ones(3)], [torch.zeros(3)]], [1.0, 1.0], steps=[5, 5])
    assert all(torch.equal(r.tensors[0], torch.full((3,), 0.5)) for r in results)


def test_missing_peer_times_out_with_averaging_error():
    group = InProcessGroup(2, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(AveragingError, match="timed out"):
        group.members[0].average([torch.ones(2)], weight=1.0, outer_step=0)
    assert 0.15 < time.monotonic() - start < 5.0
    assert group.rounds == 0


def test_timed_out_contribution_is_withdrawn(run_replicas):
    """A member that gave up must not leave its stale tensor behind for the next round."""
    group = InProcessGroup(2, timeout=0.2)
    with pytest.raises(AveragingError):
        group.members[0].average([torch.full((2,), 100.0)], weight=1.0, outer_step=0)
    group.timeout = 10.0
    results = _average_all(run_replicas, group, [[torch.full((2,), 1.0)], [torch.full((2,), 3.0)]], [1.0, 1.0])
    assert all(torch.equal(r.tensors[0], torch.full((2,), 2.0)) for r in results)


def test_all_zero_weights_is_an_error(run_replicas):
    group = InProcessGroup(2)
    results = _average_all(run_replicas, group, [[torch.ones(2)]] * 2, [0.0, 0.0])
    assert all(isinstance(r, AveragingError) and "weight 0" in str(r) for r in results)


def test_group_validation_and_single_worker():
    with pytest.raises(ValueError):
        InProcessGroup(0)
    with pytest.raises(ValueError, match="unknown format"):
        InProcessGroup(2, compression="zip")
    x = [torch.tensor([1.0, 1e-5, 70000.0])]
    res = SingleWorker("fp16").average(x, weight=3.0, outer_step=7)
    assert res.peers == ("local",) and res.total_weight == 3.0
    assert torch.equal(res.tensors[0], torch.tensor([1.0, 1e-5, 70000.0]).clamp(max=65504).half().float())
    assert torch.equal(SingleWorker().average(x).tensors[0], x[0])
