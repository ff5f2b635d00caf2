"""Bounded and robust aggregation: what one member can do to an average, by hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from opendiloco.comm.aggregation import Aggregation, lower_median
from opendiloco.comm.formats import get_codec
from opendiloco.comm.reducer import ShardReducer


def honest(n: int = 3, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=gen)
    return [base + 0.3 * torch.randn(size, generator=gen) for _ in range(n)]


def test_lower_median():
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([5.0, 1.0]) == 1.0  # two members: the smaller
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0


def test_weights_are_capped_at_a_multiple_of_the_median():
    used, capped = Aggregation(max_weight_ratio=4).weights([1.0, 2.0, 1e9, 0.0])
    assert used == [1.0, 2.0, 4.0 * 2.0, 0.0] and capped == [2]  # 4x the median of (1, 2, 1e9)
    used, capped = Aggregation(max_weight_ratio=math.inf).weights([1.0, 1e9])
    assert used == [1.0, 1e9] and capped == []
    # Honest swarm-paced weights (a 3x faster worker) are left alone.
    assert Aggregation().weights([10.0, 30.0, 12.0]) == ([10.0, 30.0, 12.0], [])
    # CenteredClip counts every contributing member once, and still names an excessive claim.
    assert Aggregation("centered-clip").weights([10.0, 30.0, 12.0, 0.0]) == ([1.0, 1.0, 1.0, 0.0], [])
    assert Aggregation("centered-clip").weights([10.0, 1e9, 12.0]) == ([1.0, 1.0, 1.0], [1])


def test_bounded_mean_of_honest_parts_is_the_weighted_mean():
    parts = honest()
    acc, clipped = Aggregation().combine(parts, [1.0, 2.0, 1.0])
    expected = (parts[0] + 2 * parts[1] + parts[2]) / 4
    assert clipped == [] and torch.allclose(acc, expected, atol=1e-6)
    acc, _ = Aggregation().combine(parts, [1.0, 0.0, 1.0])  # weight 0: left out
    assert torch.allclose(acc, (parts[0] + parts[2]) / 2, atol=1e-6)


def test_a_huge_part_is_clipped_to_the_bound_and_named():
    parts = honest()
    norms = sorted(float(p.norm()) for p in parts)
    attack = torch.full_like(parts[0], 60000.0)
    agg = Aggregation(clip_ratio=4)
    acc, clipped = agg.combine([*parts, attack], [1.0, 1.0, 1.0, 1.0])
    assert clipped == [3]
    bound = 4 * lower_median([*norms, float(attack.norm())])
    expected = (sum(parts) + attack * (bound / float(attack.norm()))) / 4
    assert torch.allclose(acc, expected, rtol=1e-5, atol=1e-5)
    # The attacker moved the average by at most bound / 4, however large its values.
    assert float((acc - sum(parts) / 4).norm()) <= bound / 4 * 1.0001


def test_centered_clip_keeps_a_minority_attacker_close_to_the_honest_mean():
    parts = honest(4)
    clean = sum(parts) / 4
    attack = -50 * clean  # the opposite direction, far away, with an absurd claimed weight
    weights = [1.0, 1.0, 1.0, 1.0, 1e9]
    mean, _ = Aggregation(max_weight_ratio=math.inf, clip_ratio=math.inf).combine([*parts, attack], weights)
    bounded, _ = Aggregation().combine([*parts, attack], Aggregation().weights(weights)[0])
    robust_agg = Aggregation("centered-clip")
    robust, clipped = robust_agg.combine([*parts, attack], robust_agg.weights(weights)[0])
    err = {name: float((v - clean).norm() / clean.norm()) for name, v in
           (("mean", mean), ("bounded", bounded), ("robust", robust))}
    assert err["mean"] > 40  # the plain mean belongs to the attacker
    assert err["robust"] < err["bounded"] < err["mean"]
    assert err["robust"] < 0.35, err
    assert clipped == [4]


def test_aggregation_refuses_bad_settings():
    for kwargs in ({"method": "median"}, {"clip_ratio": 0.5}, {"max_weight_ratio": float("nan")},
                   {"iterations": 0}, {"clip_ratio": True}):
        with pytest.raises(ValueError):
            Aggregation(**kwargs)
    assert Aggregation().label != Aggregation("centered-clip").label != Aggregation(clip_ratio=2).label


def test_the_owner_reports_whom_it_cut_and_uses_capped_weights():
    codec = get_codec("none")
    members = ["a", "b", "c"]
    reducer = ShardReducer(codec, 8, members, part_numel=4)
    for m, w in zip(members, [1.0, 1.0, 1e9]):
        reducer.begin(m, w)
    assert reducer.capped == ["c"] and reducer.total_weight == 1.0 + 1.0 + 4.0
    values = {"a": torch.ones(8), "b": torch.ones(8) * 1.1, "c": torch.full((8,), 6e4)}
    for i in range(2):
        for m in members:
            reducer.add_part(m, i, codec.to_bytes(values[m][4 * i:4 * i + 4].contiguous()))
    assert reducer.done and reducer.clipped == {"c"}
    out = torch.empty(8)
    for i, payload in enumerate(reducer.results):
        codec.decode_into(payload, out[4 * i:4 * i + 4])
    assert out.abs().max() < 4 * 2.2  # bounded: nowhere near 6e4
