"""The ZeRO partition plan: tiling, padding, serialisation and resharding."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.core.errors import ConfigError
from shardwise.core.zero import (PartitionError, PartitionPlan, flatten, reshard, shard_of, unflatten,
                                 unshard)

shapes = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8)
worlds = st.integers(1, 9)
aligns = st.integers(1, 8)
FAST = settings(max_examples=60, deadline=None)


def build(shape_list, world, align=1):
    return PartitionPlan.build([(f"p{i}", s) for i, s in enumerate(shape_list)], world, alignment=align)


def random_arrays(plan, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(dtype) for s in plan.params}


@FAST
@given(shapes, worlds, aligns)
def test_sizes_and_padding(shape_list, world, align):
    plan = build(shape_list, world, align)
    assert plan.numel == sum(math.prod(s) for s in shape_list)
    assert plan.padded_numel % (world * align) == 0
    assert plan.numel <= plan.padded_numel < plan.numel + world * align
    assert plan.shard_numel * world == plan.padded_numel
    assert plan.shard_numel % align == 0
    assert sum(plan.padding(r) for r in range(world)) == plan.padded_numel - plan.numel


@FAST
@given(shapes, worlds, aligns)
def test_owned_ranges_tile_buffer(shape_list, world, align):
    plan = build(shape_list, world, align)
    ranges = [plan.owned_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == plan.padded_numel
    for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):
        assert e0 == s1  # contiguous, hence disjoint
    assert {e - s for s, e in ranges} == {plan.shard_numel}


@FAST
@given(shapes, worlds, aligns)
def test_segments_tile_each_param(shape_list, world, align):
    plan = build(shape_list, world, align)
    for slot in plan.params:
        segs = plan.segments(slot.name)
        assert sum(s.length for s in segs) == slot.numel
        pos = 0
        for seg in segs:
            assert seg.param_offset == pos and seg.length > 0
            start, end = plan.owned_range(seg.rank)
            assert start + seg.shard_offset == slot.offset + seg.param_offset
            assert seg.shard_offset + seg.length <= end - start
            pos += seg.length
        assert [s.rank for s in segs] == sorted({s.rank for s in segs})


@FAST
@given(shapes, worlds, aligns)
def test_rank_params_match_segments(shape_list, world, align):
    plan = build(shape_list, world, align)
    from_segments = sorted((s.rank, slot.name, s.param_offset, s.shard_offset, s.length)
                           for slot in plan.params for s in plan.segments(slot.name))
    from_ranks = sorted((r, *piece) for r in range(world) for piece in plan.rank_params(r))
    assert from_segments == from_ranks
    for r in range(world):
        owned = sum(p.length for p in plan.rank_params(r))
        assert owned + plan.padding(r) == plan.shard_numel


@FAST
@given(shapes, worlds, aligns)
def test_flatten_unflatten_round_trip(shape_list, world, align):
    plan = build(shape_list, world, align)
    arrays = random_arrays(plan)
    flat = flatten(arrays, plan)
    assert flat.shape == (plan.padded_numel,) and flat.dtype == np.float32
    assert not flat[plan.numel:].any()
    back = unflatten(flat, plan)
    assert list(back) == [s.name for s in plan.params]
    for name, value in arrays.items():
        np.testing.assert_array_equal(back[name], value)
    shards = [shard_of(flat, plan, r) for r in range(world)]
    np.testing.assert_array_equal(unshard(shards, plan), flat)


def test_segments_known_layout():
    plan = PartitionPlan.build([("a", (2, 3)), ("b", 5), ("c", (1,))], 4)  # 12 elements, shard 3
    assert (plan.numel, plan.padded_numel, plan.shard_numel) == (12, 12, 3)
    assert [tuple(s) for s in plan.segments("a")] == [(0, 0, 0, 3), (1, 3, 0, 3)]
    assert [tuple(s) for s in plan.segments("b")] == [(2, 0, 0, 3), (3, 3, 0, 2)]
    assert [tuple(s) for s in plan.rank_params(3)] == [("b", 3, 0, 2), ("c", 0, 2, 1)]
    padded = PartitionPlan.build([("a", 10)], 4, alignment=2)
    assert (padded.padded_numel, padded.shard_numel) == (16, 4)
    assert [padded.padding(r) for r in range(4)] == [0, 0, 2, 4]
    assert padded.rank_params(3) == []


def test_plan_is_deterministic_and_serialisable():
    spec = [("w", (4, 3)), ("b", 3), ("emb", (7, 2))]
    a, b = PartitionPlan.build(spec, 3, alignment=4), PartitionPlan.build(dict(spec), 3, alignment=4)
    assert a == b and a.fingerprint() == b.fingerprint()
    data = json.loads(json.dumps(a.to_dict()))
    assert PartitionPlan.from_dict(data) == a
    data["shard_numel"] += 1
    with pytest.raises(PartitionError, match="shard_numel"):
        PartitionPlan.from_dict(data)


def test_fingerprint_changes():
    base = PartitionPlan.build([("w", (4, 3)), ("b", 3)], 2)
    assert base.fingerprint() != PartitionPlan.build([("w", (3, 4)), ("b", 3)], 2).fingerprint()
    assert base.fingerprint() != PartitionPlan.build([("w", (4, 3)), ("c", 3)], 2).fingerprint()
    assert base.fingerprint() != base.with_world_size(4).fingerprint()
    assert base.fingerprint() != PartitionPlan.build([("w", (4, 3)), ("b", 3)], 2, alignment=2).fingerprint()
    assert base.model_fingerprint() == base.with_world_size(4).model_fingerprint()
    assert base.fingerprint() == PartitionPlan.build([("w", [4, 3]), ("b", (3,))], 2).fingerprint()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_reshard_4_2_1_and_back_bit_exact(dtype):
    plan4 = PartitionPlan.build([("w", (5, 7)), ("b", 7), ("e", (3, 3))], 4, alignment=2)
    flat = flatten(random_arrays(plan4, seed=1, dtype=dtype), plan4)
    shards4 = [shard_of(flat, plan4, r).copy() for r in range(4)]
    shards2 = reshard(shards4, plan4, 2)
    plan2 = plan4.with_world_size(2)
    assert [s.shape for s in shards2] == [(plan2.shard_numel,)] * 2
    shards1 = reshard(shards2, plan2, 1)
    plan1 = plan4.with_world_size(1)
    assert shards1[0].dtype == flat.dtype
    assert shards1[0][:plan1.numel].tobytes() == flat[:plan4.numel].tobytes()
    again4 = reshard(shards1, plan1, 4)
    for old, new in zip(shards4, again4):
        assert old.tobytes() == new.tobytes()
    for name, value in unflatten(unshard(shards2, plan2), plan2).items():
        assert value.tobytes() == unflatten(flat, plan4)[name].tobytes()


def test_reshard_1_to_4_then_3():
    plan1 = PartitionPlan.build([("x", 13)], 1)
    flat = np.arange(13, dtype=np.float64)
    shards4 = reshard([flat], plan1, 4)
    assert np.concatenate(shards4)[:13].tobytes() == flat.tobytes()
    assert not np.concatenate(shards4)[13:].any()
    shards3 = reshard(shards4, plan1.with_world_size(4), 3)
    assert np.concatenate(shards3)[:13].tobytes() == flat.tobytes()


@pytest.mark.parametrize("params, world, align, match", [
    ([("a", 3), ("a", 4)], 2, 1, "duplicate parameter name 'a'"),
    ([], 2, 1, "empty list"),
    ([("a", 3)], 0, 1, "world_size must be >= 1, got 0"),
    ([("a", 3)], 2, 0, "alignment must be >= 1, got 0"),
    ([("a", -3)], 2, 1, "parameter 'a' has a negative size"),
    ([("a", (2, -1))], 2, 1, "parameter 'a' has a negative size"),
    ([("a", 2.5)], 2, 1, "size of parameter 'a' must be an integer"),
    ([("", 2)], 2, 1, "non-empty strings"),
])
def test_bad_plan_inputs(params, world, align, match):
    with pytest.raises(ConfigError, match=match):
        PartitionPlan.build(params, world, alignment=align)


def test_helpers_reject_mismatches():
    plan = PartitionPlan.build([("a", (2, 2)), ("b", 3)], 2)
    with pytest.raises(PartitionError, match="missing \\['b'\\]"):
        flatten({"a": np.zeros((2, 2))}, plan)
    with pytest.raises(PartitionError, match="shape"):
        flatten({"a": np.zeros(4), "b": np.zeros(3)}, plan)
    with pytest.raises(PartitionError, match="flat buffer"):
        unflatten(np.zeros(7), plan)
    with pytest.raises(PartitionError, match="expected 2 shards"):
        reshard([np.zeros(4)], plan, 1)
    with pytest.raises(ConfigError, match="rank must be in"):
        plan.owned_range(2)
    with pytest.raises(PartitionError, match="no parameter named 'z'"):
        plan.segments("z")
    assert issubclass(PartitionError, ValueError)
