"""Layer partitioning: optimality against brute force, tie-breaking and errors."""

from __future__ import annotations

import itertools
import random

import pytest

from shardwise.core.errors import ConfigError
from shardwise.core.layer_partition import PartitionError, partition_layers, stage_costs


def brute_force(costs, k):
    """All contiguous non-empty k-splits, as (max cost, sum of squares, starts, ranges)."""
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        ranges = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        sums = [sum(costs[r.start:r.stop]) for r in ranges]
        yield max(sums), sum(x * x for x in sums), bounds, ranges


def check_valid(ranges, n, k):
    assert len(ranges) == k
    assert ranges[0].start == 0 and ranges[-1].stop == n
    assert all(len(r) > 0 for r in ranges)
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


def test_float_costs_optimal_against_brute_force():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 9)
        costs = [rng.uniform(0.0, 10.0) for _ in range(n)]
        k = rng.randint(1, n)
        got = partition_layers(costs, k)
        check_valid(got, n, k)
        best = min(c[0] for c in brute_force(costs, k))
        assert max(stage_costs(costs, got)) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_integer_costs_match_brute_force_including_tie_break():
    rng = random.Random(99)
    for _ in range(300):
        n = rng.randint(1, 9)
        costs = [rng.randint(0, 6) for _ in range(n)]
        k = rng.randint(1, n)
        # (max, sum of squares, earliest boundaries) is exact with small integers
        expected = min(brute_force(costs, k), key=lambda c: c[:3])[3]
        assert partition_layers(costs, k) == expected, (costs, k)


def test_examples_and_tie_breaking():
    assert partition_layers([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    # equal balance either way: the earlier boundary wins
    assert partition_layers([1, 1, 1, 1, 1], 2) == [range(0, 2), range(2, 5)]
    # bottleneck 4 allows (4, 2, 4), (3, 3, 4), (4, 3, 3), (3, 4, 3): the balanced ones win
    # ((4, 2, 4) has a larger sum of squares), then the earliest boundaries
    assert partition_layers([3, 1, 1, 1, 1, 3], 3) == [range(0, 1), range(1, 4), range(4, 6)]
    assert partition_layers([5, 1, 1, 1, 5], 3) == [range(0, 1), range(1, 4), range(4, 5)]
    # a heavy layer forces the bottleneck; the rest is still balanced
    assert partition_layers([1, 1, 10, 1, 1], 3) == [range(0, 2), range(2, 3), range(3, 5)]
    assert partition_layers([0, 0, 0], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert partition_layers([3.5], 1) == [range(0, 1)]
    assert partition_layers((2, 2, 2, 2, 2, 2), 6) == [range(i, i + 1) for i in range(6)]


def test_deterministic_and_accepts_any_sequence():
    costs = [0.3, 1.7, 0.2, 0.9, 2.2, 0.1, 0.4, 1.1]
    first = partition_layers(costs, 3)
    assert partition_layers(tuple(costs), 3) == first
    assert all(partition_layers(costs, 3) == first for _ in range(5))


def test_larger_input_is_fast_and_balanced():
    costs = [1.0] * 96 + [4.0]  # transformer blocks plus a heavy head
    ranges = partition_layers(costs, 8)
    check_valid(ranges, 97, 8)
    assert max(stage_costs(costs, ranges)) == pytest.approx(13.0)  # ceil(100 / 8) blocks of cost 1


def test_stage_costs():
    assert stage_costs([1, 2, 3, 4], [range(0, 1), range(1, 4)]) == [1.0, 9.0]
    assert stage_costs([0.1] * 10, [range(0, 10)]) == [1.0]  # fsum: no drift
    with pytest.raises(PartitionError, match=r"outside the 4 layers"):
        stage_costs([1, 2, 3, 4], [range(2, 5)])
    with pytest.raises(PartitionError, match=r"ranges with step 1"):
        stage_costs([1, 2, 3, 4], [range(0, 4, 2)])


@pytest.mark.parametrize("costs,k,match", [
    ([1, 2, 3], 4, r"cannot split 3 layers into 4 non-empty stages"),
    ([], 1, r"cannot split 0 layers into 1 non-empty stages"),
    ([1, 2, 3], 0, r"num_stages must be an integer >= 1, got 0"),
    ([1, 2, 3], 1.5, r"num_stages must be an integer >= 1, got 1.5"),
    ([1, -2, 3], 2, r"costs must be >= 0; layer 1 costs -2"),
    ([1, float("nan")], 1, r"must be finite"),
    ([1, float("inf")], 1, r"must be finite"),
    (["a", 1], 1, r"sequence of numbers"),
    ([[1, 2], [3, 4]], 1, r"one-dimensional"),
])
def test_errors(costs, k, match):
    with pytest.raises(PartitionError, match=match) as info:
        partition_layers(costs, k)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
