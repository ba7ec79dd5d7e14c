"""The planner's hybrid sharding: states over one node's ranks, the cross-node traffic only the gradient
all-reduce, and the choice between it and flat ZeRO following the intra- vs inter-node bandwidth (issue 55)."""

from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.core.errors import ConfigError
from shardwise.core.hardware import Hardware
from shardwise.core.layout import ParallelLayout
from shardwise.core.model_spec import ModelSpec
from shardwise.core.planner import estimate, plan

MODEL = ModelSpec.from_params("7B")


def _cluster(inter: str, intra: str = "300GB/s") -> Hardware:
    return Hardware.parse(num_devices=64, devices_per_node=8, inter_node_bandwidth=inter, intra_node_bandwidth=intra)


def test_hybrid_states_are_sharded_over_the_shard_group() -> None:
    hw = _cluster("100Gbps")
    flat = estimate(MODEL, hw, dp=64, zero=3, global_batch=64)
    hybrid = estimate(MODEL, hw, dp=64, zero=3, global_batch=64, dp_replicate=8)
    over8 = estimate(MODEL, Hardware.parse(num_devices=8), dp=8, zero=3, global_batch=8)
    states = lambda c: c.memory.params + c.memory.grads + c.memory.optimizer  # noqa: E731
    assert states(hybrid) == states(over8) == pytest.approx(8 * states(flat), rel=1e-3)
    assert hybrid.describe().startswith("dp=64 (shard 8 x replicate 8) tp=1")
    assert hybrid.strategy == "ZeRO-3+HSDP"


def test_hybrid_moves_fewer_bytes_and_less_of_them_between_nodes() -> None:
    hw = _cluster("25Gbps")
    flat = estimate(MODEL, hw, dp=64, zero=3, global_batch=64)
    hybrid = estimate(MODEL, hw, dp=64, zero=3, global_batch=64, dp_replicate=8)
    assert hybrid.comm_time < flat.comm_time / 3
    # per rank: 3 ring passes over 8 (7/8 of the model each) plus an all-reduce of 1/8 of the gradient
    # over 8 (2 x 7/8 x 1/8), against 3 passes over 64 (63/64 each)
    grad = MODEL.num_params * 2
    assert hybrid.comm_bytes.data_parallel == pytest.approx(3 * 7 / 8 * grad + 2 * 7 / 8 * grad / 8, rel=1e-3)
    assert flat.comm_bytes.data_parallel == pytest.approx(3 * 63 / 64 * grad, rel=1e-3)


def test_slow_links_between_nodes_choose_hybrid_and_fast_ones_need_not() -> None:
    slow = plan(MODEL, _cluster("25Gbps"), global_batch=512).best
    assert slow.dp_replicate > 1 and slow.dp // slow.dp_replicate * slow.tp == 8
    uniform = plan(MODEL, _cluster("300GB/s"), global_batch=512)
    flat = [c for c in uniform.fitting if c.zero and c.dp_replicate == 1]
    hybrid = [c for c in uniform.fitting if c.dp_replicate > 1]
    assert flat and hybrid  # both are weighed
    assert min(c.comm_time for c in hybrid) >= 0.5 * min(c.comm_time for c in flat)


def test_a_hybrid_plan_becomes_a_hybrid_layout(tmp_path) -> None:
    result = plan(MODEL, _cluster("25Gbps"), global_batch=512)
    layout = ParallelLayout.from_plan(result)
    assert layout.dp_replicate == result.best.dp_replicate > 1
    assert layout.dp_shard * layout.dp_replicate == layout.dp == result.best.dp


def test_hybrid_needs_zero_and_a_divisor() -> None:
    hw = _cluster("100Gbps")
    with pytest.raises(ConfigError, match="dp_replicate=8 needs ZeRO"):
        estimate(MODEL, hw, dp=64, zero=0, global_batch=64, dp_replicate=8)
    with pytest.raises(ConfigError, match="dp_replicate=3"):
        estimate(MODEL, hw, dp=64, zero=3, global_batch=64, dp_replicate=3)


def test_cli_takes_bandwidths_in_gbit_per_second(capsys) -> None:
    args = ["plan", "--params", "7B", "--devices", "64", "--global-batch", "512", "--json"]
    assert main(args + ["--inter-node-gbps", "25", "--intra-node-gbps", "2400"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hardware"]["inter_node_bandwidth"] == pytest.approx(25e9 / 8)
    assert doc["hardware"]["intra_node_bandwidth"] == pytest.approx(300e9)
    assert doc["best"]["dp_replicate"] > 1 and "HSDP" in doc["best"]["strategy"]
    assert main(args + ["--inter-node-gbps", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
