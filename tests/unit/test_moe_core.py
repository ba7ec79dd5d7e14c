"""Expert parallelism without processes: expert ownership, dispatch counts, the planner's maths, the layout's ep."""

import warnings

import numpy as np
import pytest

from shardwise.core.config import ConfigWarning, TrainingConfig
from shardwise.core.errors import ConfigError
from shardwise.core.layout import ParallelLayout
from shardwise.core.moe import (alltoall_bytes_per_step, check_divisible, dispatch_counts, experts_of,
                                expert_params_per_rank, local_expert_ids, owner_of, routing_imbalance, send_splits)


@pytest.mark.parametrize("ep, experts", [(1, 4), (2, 4), (4, 8), (8, 8), (3, 12)])
def test_each_expert_has_exactly_one_owner_in_contiguous_blocks(ep: int, experts: int) -> None:
    blocks = [experts_of(r, ep, experts) for r in range(ep)]
    assert [e for b in blocks for e in b] == list(range(experts))
    assert all(len(b) == experts // ep for b in blocks)
    ids = np.arange(experts)
    assert owner_of(ids, ep, experts).tolist() == [e // (experts // ep) for e in ids]
    assert all(blocks[o][l] == e for e, o, l in zip(ids, owner_of(ids, ep, experts),
                                                    local_expert_ids(ids, ep, experts)))


def test_experts_not_divisible_by_ep_name_the_module_and_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"model.layers.3.mlp.experts: 6 experts do not split over ep=4"):
        check_divisible(6, 4, "model.layers.3.mlp.experts")
    with pytest.raises(ConfigError, match="6 experts do not split over ep=4"):
        experts_of(0, 4, 6)
    with pytest.raises(ConfigError, match="rank 2 is not in an expert-parallel group of 2"):
        experts_of(2, 2, 4)
    with pytest.raises(ConfigError, match="ep must be a positive integer"):
        check_divisible(4, 0)


def test_dispatch_counts_and_send_splits_follow_the_owners() -> None:
    top_k = np.array([[0, 3], [1, 3], [7, 2], [3, 0]])  # 4 tokens, top-2, 8 experts
    counts = dispatch_counts(top_k, 8)
    assert counts.tolist() == [2, 1, 1, 3, 0, 0, 0, 1]
    assert counts.sum() == top_k.size
    assert send_splits(counts, 2) == [7, 1]
    assert send_splits(counts, 4) == [3, 4, 0, 1]
    assert send_splits(dispatch_counts(np.zeros((0, 2), dtype=np.int64), 8), 4) == [0, 0, 0, 0]
    with pytest.raises(ConfigError, match=r"expert ids must lie in \[0, 8\)"):
        dispatch_counts(np.array([[8, 0]]), 8)


def test_planner_maths() -> None:
    # 16 experts of 3 x 64 x 128 parameters over ep 4, 2 layers: 8 local experts, 16 B each
    out = expert_params_per_rank(16, 3 * 64 * 128, 4, layers=2)
    assert out["experts"] == 8 and out["params"] == 8 * 3 * 64 * 128
    assert out["bytes"] == out["params"] * 16
    assert expert_params_per_rank(16, 10, 4, zero_edp=2)["bytes"] == 4 * 10 * 16 / 2
    # 1024 tokens, top-2, hidden 64, fp32: 3/4 of the 2048 rows leave the rank, 4 exchanges a layer
    assert alltoall_bytes_per_step(1024, 2, 64, 4) == 2048 * 0.75 * 64 * 4 * 4
    assert alltoall_bytes_per_step(1024, 2, 64, 4, backward=False, layers=3) == 2048 * 0.75 * 64 * 4 * 2 * 3
    assert alltoall_bytes_per_step(1024, 2, 64, 1) == 0
    assert routing_imbalance([4, 4, 4, 4], 2) == 1.0
    assert routing_imbalance([8, 0, 0, 0], 2) == 2.0


def test_layout_ep_is_validated_described_and_round_trips() -> None:
    layout = ParallelLayout(dp=4, ep=2, gradient_clipping=1.0)
    assert layout.world_size == 4
    assert layout.describe() == "dp=4 tp=1 pp=1 ep=2 zero=0 clip=1"
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert ParallelLayout(dp=2).describe() == "dp=2 tp=1 pp=1 zero=0"  # no ep: unchanged
    with pytest.raises(ConfigError, match="ep=4 must divide dp=2"):
        ParallelLayout(dp=2, ep=4)
    with pytest.raises(ConfigError, match="ep=2 must divide dp=3"):
        ParallelLayout(dp=3, ep=2)
    with pytest.raises(ConfigError, match="ep must be >= 1, got 0"):
        ParallelLayout(dp=2, ep=0)
    for stage in (1, 2, 3):  # ZeRO composes with ep: expert state sharded over the edp group
        assert ParallelLayout(dp=4, ep=2, zero_stage=stage).describe() == f"dp=4 tp=1 pp=1 ep=2 zero={stage}"
    with pytest.raises(ConfigError, match="sequence_parallel with ep=2 is not supported yet"):
        ParallelLayout(dp=2, tp=2, ep=2, sequence_parallel=True)


def test_deepspeed_autoep_section_sets_ep() -> None:
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
          "expert_parallel": {"enabled": True, "autoep_size": 2}}
    config = TrainingConfig.from_deepspeed(ds)
    assert config.expert_parallel == 2
    layout = ParallelLayout.from_config(config, 4)
    assert (layout.dp, layout.ep) == (4, 2)
    assert ParallelLayout.from_config(config, 4, ep=2) == layout
    with pytest.raises(ConfigError, match="ep=4 was given, but the config's expert_parallel is 2"):
        ParallelLayout.from_config(config, 4, ep=4)
    with pytest.raises(ConfigError, match="ep=2 must divide dp=1"):
        ParallelLayout.from_config(config, 2, tp=2)
    # AutoEP's routing and kernel keys have no effect here: warned, not refused
    with pytest.warns(ConfigWarning, match="preset_model, use_grouped_mm"):
        TrainingConfig.from_deepspeed({"expert_parallel": {"enabled": True, "autoep_size": 2,
                                                           "preset_model": "mixtral", "use_grouped_mm": False}})
    # DeepSpeed's default is off: a size without enabled does nothing, and says so
    with pytest.warns(ConfigWarning, match="autoep_size=2 has no effect"):
        assert TrainingConfig.from_deepspeed({"expert_parallel": {"autoep_size": 2}}).expert_parallel == 1
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=2 is not supported"):
        TrainingConfig.from_deepspeed({"expert_parallel": {"enabled": True, "expert_tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match="unknown key 'autoep' in expert_parallel"):
        TrainingConfig.from_deepspeed({"expert_parallel": {"enabled": True, "autoep": 2}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainingConfig.from_deepspeed({}).expert_parallel == 1


def test_plan_candidates_carry_ep() -> None:
    layout = ParallelLayout.from_plan({"dp": 4, "tp": 1, "pp": 1, "ep": 4, "zero": 0, "micro_batches": 1,
                                       "checkpointing": False})
    assert layout.ep == 4
    assert ParallelLayout.from_plan({"dp": 4, "tp": 1, "pp": 1, "zero": 0, "micro_batches": 1,
                                     "checkpointing": False}).ep == 1
