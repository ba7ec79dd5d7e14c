"""Unit tests of the gradient bucket plan (shardwise.core.buckets); no processes."""

from __future__ import annotations

import random

import pytest

from shardwise.core.buckets import (DEFAULT_BUCKET_CAP_BYTES, DEFAULT_SOLO_BYTES, Bucket, BucketPlan, plan_buckets,
                                    plan_fingerprint)
from shardwise.core.errors import ConfigError, ShardwiseError


def _plan(numels, cap, dtypes=None, itemsize=4, **kw) -> BucketPlan:
    dtypes = dtypes or ["float32"] * len(numels)
    return plan_buckets(numels, dtypes, [itemsize] * len(numels), cap, **kw)


def _check_invariants(plan: BucketPlan, numels, dtypes, itemsizes) -> None:
    seen = [p for b in plan.buckets for p in b.params]
    assert sorted(seen) == list(range(len(numels))), "every parameter in exactly one bucket"
    for i, b in enumerate(plan.buckets):
        assert b.index == i
        assert b.numels == tuple(numels[p] for p in b.params)
        assert b.offsets == tuple(sum(b.numels[:k]) for k in range(len(b.params)))
        assert {dtypes[p] for p in b.params} == {b.dtype}
        nbytes = sum(numels[p] * itemsizes[p] for p in b.params)
        assert nbytes <= plan.cap_bytes or len(b.params) == 1, "only a lone parameter may exceed the cap"


def test_default_cap_is_25_mib() -> None:
    assert DEFAULT_BUCKET_CAP_BYTES == 25 * 1024 * 1024
    assert plan_buckets([10], ["float32"], [4]).cap_bytes == DEFAULT_BUCKET_CAP_BYTES


def test_empty_model_has_no_buckets() -> None:
    plan = _plan([], 100)
    assert plan.buckets == () and plan.bucket_of() == {}


def test_small_params_share_one_bucket_in_reverse_order() -> None:
    plan = _plan([3, 5, 2], 1000)
    assert len(plan.buckets) == 1
    b = plan.buckets[0]
    assert b.params == (2, 1, 0)
    assert b.offsets == (0, 2, 7)
    assert b.numels == (2, 5, 3)
    assert b.numel == 10 and b.dtype == "float32"


def test_forward_order_when_not_reversed() -> None:
    b = _plan([3, 5, 2], 1000, reverse=False).buckets[0]
    assert b.params == (0, 1, 2) and b.offsets == (0, 3, 8)


def test_cap_splits_buckets_greedily() -> None:
    # 4-byte items, cap 40 bytes = 10 elements; reverse order visits 4, 3, 2, 1, 0.
    plan = _plan([4, 4, 4, 4, 4], 40)
    assert [b.params for b in plan.buckets] == [(4, 3), (2, 1), (0,)]
    assert all(b.numel * 4 <= 40 for b in plan.buckets)


def test_exactly_full_bucket_is_not_split() -> None:
    plan = _plan([5, 5], 40)
    assert [b.params for b in plan.buckets] == [(1, 0)]


def test_param_larger_than_cap_gets_its_own_bucket() -> None:
    plan = _plan([2, 100, 2], 40)
    assert [b.params for b in plan.buckets] == [(2,), (1,), (0,)]
    assert plan.buckets[1].numel == 100


def test_tiny_cap_gives_one_param_per_bucket() -> None:
    numels = [7, 1, 30, 4]
    plan = _plan(numels, 1)
    assert [b.params for b in plan.buckets] == [(3,), (2,), (1,), (0,)]
    assert all(b.offsets == (0,) for b in plan.buckets)


def test_zero_size_params_are_placed() -> None:
    plan = _plan([0, 3, 0], 1000)
    assert plan.buckets[0].params == (2, 1, 0)
    assert plan.buckets[0].offsets == (0, 0, 3)


def test_dtypes_never_share_a_bucket() -> None:
    dtypes = ["float32", "float16", "float32", "float16"]
    plan = plan_buckets([1, 1, 1, 1], dtypes, [4, 2, 4, 2], 1000)
    by_dtype = {b.dtype: b.params for b in plan.buckets}
    assert by_dtype == {"float16": (3, 1), "float32": (2, 0)}


def test_itemsize_counts_towards_the_cap() -> None:
    two = plan_buckets([10, 10], ["float64"] * 2, [8, 8], 100)
    assert len(two.buckets) == 2
    one = plan_buckets([10, 10], ["float16"] * 2, [2, 2], 100)
    assert len(one.buckets) == 1


def test_bucket_of_maps_params_to_bucket_and_position() -> None:
    plan = _plan([4, 4, 4], 40)
    assert plan.bucket_of() == {2: (0, 0), 1: (0, 1), 0: (1, 0)}


def test_plan_is_deterministic_and_frozen() -> None:
    a, b = _plan([3, 9, 1, 6], 24), _plan([3, 9, 1, 6], 24)
    assert a == b
    with pytest.raises(AttributeError):
        a.buckets[0].dtype = "float64"  # type: ignore[misc]
    assert isinstance(a.buckets[0], Bucket)


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(0, 40)
    numels = [rng.choice([0, 1, 3, 17, 256, 5000]) for _ in range(n)]
    kinds = [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float64", 8)]
    picked = [rng.choice(kinds) for _ in range(n)]
    dtypes, itemsizes = [d for d, _ in picked], [s for _, s in picked]
    cap = rng.choice([1, 64, 1024, 1 << 20])
    plan = plan_buckets(numels, dtypes, itemsizes, cap)
    _check_invariants(plan, numels, dtypes, itemsizes)
    # Within one dtype, parameters appear in reverse registration order across buckets.
    for dtype in set(dtypes):
        order = [p for b in plan.buckets if b.dtype == dtype for p in b.params]
        assert order == sorted(order, reverse=True)


def test_large_params_go_alone_and_small_ones_keep_filling() -> None:
    # 4-byte items; solo from 40 bytes: params 3 and 1 get their own buckets where visited, while
    # the small ones (4, 2, 0) keep filling one bucket that closes at the end.
    plan = _plan([2, 10, 3, 25, 1], 1000, solo_bytes=40)
    assert [b.params for b in plan.buckets] == [(3,), (1,), (4, 2, 0)]
    _check_invariants(plan, [2, 10, 3, 25, 1], ["float32"] * 5, [4] * 5)


def test_solo_threshold_is_inclusive_and_off_by_default() -> None:
    assert [b.params for b in _plan([10, 9], 1000, solo_bytes=40).buckets] == [(0,), (1,)]
    assert [b.params for b in _plan([10, 9], 1000).buckets] == [(1, 0)]
    assert DEFAULT_SOLO_BYTES == 4 * 1024 * 1024


def test_solo_params_follow_an_explicit_order() -> None:
    plan = _plan([50, 1, 60, 2], 1000, solo_bytes=100, order=[3, 2, 1, 0])
    assert [b.params for b in plan.buckets] == [(2,), (0,), (3, 1)]


@pytest.mark.parametrize("seed", range(10))
def test_random_plans_with_solo_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 17, 256, 5000]) for _ in range(rng.randint(0, 30))]
    dtypes, itemsizes = ["float32"] * len(numels), [4] * len(numels)
    solo = rng.choice([4, 1024, 20000])
    plan = plan_buckets(numels, dtypes, itemsizes, rng.choice([64, 1 << 20]), solo_bytes=solo)
    _check_invariants(plan, numels, dtypes, itemsizes)
    for b in plan.buckets:
        if any(numels[p] * 4 >= solo for p in b.params):
            assert len(b.params) == 1, "a parameter at or above solo_bytes is alone"


@pytest.mark.parametrize("kwargs, match", [
    (dict(numels=[1], dtypes=["float32"], itemsizes=[4], cap_bytes=10, solo_bytes=0), "solo_bytes"),
    (dict(numels=[1, 2], dtypes=["float32"], itemsizes=[4, 4], cap_bytes=10), "same length"),
    (dict(numels=[1], dtypes=["float32"], itemsizes=[4], cap_bytes=0), "positive"),
    (dict(numels=[1], dtypes=["float32"], itemsizes=[4], cap_bytes=-5), "positive"),
    (dict(numels=[-1], dtypes=["float32"], itemsizes=[4], cap_bytes=10), "negative"),
])
def test_bad_input_is_a_config_error(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        plan_buckets(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShardwiseError)


def test_fingerprint_is_stable_and_short() -> None:
    names, shapes, dtypes = ["a.weight", "a.bias"], [(4, 3), (4,)], ["float32", "float32"]
    fp = plan_fingerprint(names, shapes, dtypes)
    assert fp == plan_fingerprint(list(names), [list(s) for s in shapes], list(dtypes))
    assert len(fp) == 16 and int(fp, 16) >= 0


@pytest.mark.parametrize("change", ["name", "shape", "dtype", "order", "missing"])
def test_fingerprint_detects_differences(change: str) -> None:
    names, shapes, dtypes = ["a.weight", "a.bias"], [(4, 3), (4,)], ["float32", "float32"]
    base = plan_fingerprint(names, shapes, dtypes)
    if change == "name":
        names = ["a.weight", "b.bias"]
    elif change == "shape":
        shapes = [(4, 3), (5,)]
    elif change == "dtype":
        dtypes = ["float32", "float16"]
    elif change == "order":
        names, shapes, dtypes = names[::-1], shapes[::-1], dtypes[::-1]
    else:
        names, shapes, dtypes = names[:1], shapes[:1], dtypes[:1]
    assert plan_fingerprint(names, shapes, dtypes) != base


def test_explicit_order_is_followed_and_checked() -> None:
    plan = _plan([3, 5, 2, 4], 9 * 4, order=[1, 3, 0, 2])
    assert [b.params for b in plan.buckets] == [(1, 3), (0, 2)]
    _check_invariants(plan, [3, 5, 2, 4], ["float32"] * 4, [4] * 4)
    with pytest.raises(ConfigError, match="permutation"):
        _plan([3, 5], 100, order=[0, 0])
