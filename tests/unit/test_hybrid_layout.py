"""Hybrid sharding's layout, DeepSpeed keys and groups: what is derived and what is refused (issue 55)."""

from __future__ import annotations

import pytest

import shardwise
from shardwise.backends.local import LocalCommunicator
from shardwise.core.config import TrainingConfig
from shardwise.core.errors import ConfigError, MeshError
from shardwise.core.layout import ParallelLayout


@pytest.mark.parametrize("fields, dp, shard, replicate", [
    ({"dp_shard": 2, "dp_replicate": 4}, 8, 2, 4),   # dp from the two
    ({"dp": 8, "dp_replicate": 2}, 8, 4, 2),         # dp_shard from dp
    ({"dp": 8, "dp_shard": 2}, 8, 2, 4),             # dp_replicate from dp
    ({"dp": 8}, 8, 8, 1),                            # flat: one group of every rank
    ({"dp": 4, "dp_shard": 4}, 4, 4, 1),
])
def test_the_missing_degree_is_derived(fields: dict, dp: int, shard: int, replicate: int) -> None:
    layout = ParallelLayout(**fields, zero_stage=3)
    assert (layout.dp, layout.dp_shard, layout.dp_replicate) == (dp, shard, replicate)
    assert layout.hybrid == (replicate > 1)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout


def test_describe_names_both_degrees() -> None:
    text = ParallelLayout(dp_shard=2, dp_replicate=2, tp=2, zero_stage=2).describe()
    assert "dp=4 (dp_shard=2 x dp_replicate=2) tp=2" in text


@pytest.mark.parametrize("fields, needle", [
    ({"dp": 4, "dp_replicate": 3, "zero_stage": 1}, "dp_replicate=3 must divide dp=4"),
    ({"dp": 4, "dp_shard": 3, "zero_stage": 1}, "dp_shard=3 must divide dp=4"),
    ({"dp": 8, "dp_shard": 2, "dp_replicate": 2, "zero_stage": 1}, "dp_shard=2 x dp_replicate=2 must equal dp=8"),
    ({"dp": 4, "dp_replicate": 2}, "zero_stage=0 shards nothing"),
    ({"dp": 4, "dp_replicate": 2, "ep": 2, "zero_stage": 3}, "with ep=2 is not supported"),
    ({"dp": 4, "dp_shard": -1, "zero_stage": 1}, "dp_shard must be a non-negative integer"),
    ({"dp": 4, "dp_replicate": 0, "zero_stage": 1}, "dp_replicate"),
])
def test_bad_degrees_are_refused(fields: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout(**fields)


def _deepspeed(zero: dict) -> TrainingConfig:
    return TrainingConfig.from_deepspeed({"train_batch_size": 16, "zero_optimization": zero})


def test_deepspeed_mics_shard_size_is_hybrid_sharding() -> None:
    layout = ParallelLayout.from_config(_deepspeed({"stage": 3, "mics_shard_size": 2}), 8)
    assert (layout.dp, layout.dp_shard, layout.dp_replicate, layout.zero_stage) == (8, 2, 4, 3)
    assert ParallelLayout.from_config(_deepspeed({"stage": 3, "mics_shard_size": -1}), 8).dp_replicate == 1


def test_deepspeed_mics_shard_size_must_divide_dp() -> None:
    with pytest.raises(ConfigError, match="mics_shard_size"):
        ParallelLayout.from_config(_deepspeed({"stage": 3, "mics_shard_size": 3}), 8)


def test_deepspeed_hpz_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=2 .*mics_shard_size"):
        _deepspeed({"stage": 3, "zero_hpz_partition_size": 2})
    assert _deepspeed({"stage": 3, "zero_hpz_partition_size": 1}).zero.shard_size == 0  # DeepSpeed's "off"


def test_shard_size_needs_zero() -> None:
    with pytest.raises(ConfigError, match="zero stage 0 shards nothing"):
        _deepspeed({"stage": 0, "mics_shard_size": 2})


def test_build_groups_refuses_a_shard_size_that_does_not_divide_dp() -> None:
    world = LocalCommunicator()
    with pytest.raises(MeshError, match="dp_shard=2 must be 0 or a positive integer dividing dp=1"):
        shardwise.build_groups(world, dp=1, dp_shard=2)
    groups = shardwise.build_groups(world, dp=1, dp_shard=1)
    assert groups.dp_shard is None and groups.dp_replicate is None and groups.zero is groups.dp
