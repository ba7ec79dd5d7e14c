"""The ZeRO paper's model-state memory model, analytic and plan-exact."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.core.errors import ConfigError
from shardwise.core.memory import DtypePolicy, ModelStateMemory, model_state_bytes, plan_state_bytes
from shardwise.core.zero import PartitionPlan


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.875)])
def test_paper_worked_example(stage, expected_gb):
    # ZeRO paper, Figure 1: 7.5B parameters, N = 64, mixed-precision Adam (K = 12).
    mem = model_state_bytes(7_500_000_000, 64, stage, optimizer="adam", precision="fp16")
    assert mem.gb() == pytest.approx(expected_gb, abs=0.05)
    assert mem.total == mem.params + mem.grads + mem.optimizer_states


def test_paper_formulas_exactly():
    psi, n = 7_500_000_000, 64
    got = [model_state_bytes(psi, n, s).total for s in range(4)]
    assert got == [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 16 * psi // n]
    assert model_state_bytes(psi, n, 1) == ModelStateMemory(params=2 * psi, grads=2 * psi,
                                                            optimizer_states=12 * psi // n)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**12), st.integers(1, 1024),
       st.sampled_from(["sgd", "momentum", "adam", "adamw"]), st.sampled_from(["fp32", "bf16", "fp16"]))
def test_memory_never_grows_with_stage(num_params, world, optimizer, precision):
    totals = [model_state_bytes(num_params, world, s, optimizer, precision).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)
    if world == 1:
        assert len(set(totals)) == 1


def test_dtype_policies():
    assert DtypePolicy.of("bf16", "adam").k == 12
    assert DtypePolicy.of("fp32", "adam").k == 8
    assert DtypePolicy.of("fp32", "sgd").k == 0
    assert DtypePolicy.of("FP16", "momentum").k == 8
    fp32 = model_state_bytes(1000, 1, 0, optimizer="adamw", precision="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer_states) == (4000, 4000, 8000)
    custom = DtypePolicy(param_bytes=1, grad_bytes=2, master_bytes=4, optimizer_bytes=2)
    assert model_state_bytes(10, 2, 2, policy=custom).total == 10 + 5 * 2 + 5 * 6


def test_plan_exact_count_includes_padding():
    plan = PartitionPlan.build([("w", (1000, 1000)), ("b", 1001)], 8, alignment=64)
    exact = plan_state_bytes(plan, 2)
    assert exact.params == plan.padded_numel * 2
    assert exact.grads == plan.shard_numel * 2 and exact.optimizer_states == plan.shard_numel * 12
    analytic = model_state_bytes(plan.numel, 8, 2)
    assert exact.total >= analytic.total
    assert exact.total == pytest.approx(analytic.total, rel=0.05)
    # a sharded Adam's measured storage on one rank: fp32 master + two moments of one shard
    measured = 3 * plan.shard_numel * 4
    assert measured == pytest.approx(plan_state_bytes(plan, 1).optimizer_states, rel=0.05)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=4), "zero stage must be 0, 1, 2 or 3, got 4"),
    (dict(stage=True), "zero stage must be"),
    (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
    (dict(num_params=-1), "num_params must be a non-negative integer, got -1"),
    (dict(optimizer="lamb"), "optimizer must be one of .* got 'lamb'"),
    (dict(precision="fp8"), "precision must be one of .* got 'fp8'"),
])
def test_bad_memory_inputs(kwargs, match):
    args = dict(num_params=100, world_size=2, stage=1) | kwargs
    with pytest.raises(ConfigError, match=match):
        model_state_bytes(**args)


def test_bad_policy():
    with pytest.raises(ConfigError, match="grad_bytes must be a non-negative integer"):
        DtypePolicy(param_bytes=2, grad_bytes=-1, master_bytes=0, optimizer_bytes=0)
