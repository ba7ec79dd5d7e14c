"""Context parallelism without processes: the chunk plan, the layout's cp, groups, and the attention
functions on a one-rank group (issue 55). The multi-rank equality is tests/distributed."""

from __future__ import annotations

import pytest

import shardwise
from shardwise.backends.local import LocalCommunicator
from shardwise.core.context_plan import check_heads, chunk_plan, local_positions
from shardwise.core.errors import ConfigError, MeshError
from shardwise.core.layout import ParallelLayout


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_position_is_held_once_with_a_head_and_a_tail(cp: int) -> None:
    seq = 8 * cp
    held = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(p for mine in held for p in mine) == list(range(seq))
    for r, mine in enumerate(held):
        assert mine == sorted(mine)  # rising within a rank: the own block is causal
        c = seq // (2 * cp)
        assert mine[0] == r * c and mine[-1] == seq - 1 - r * c
    # causal work balanced: every rank attends to the same number of (query, key) pairs
    work = {sum(p + 1 for p in mine) for mine in held}
    assert len(work) == 1


def test_plan_refuses_a_sequence_2cp_does_not_divide() -> None:
    with pytest.raises(ConfigError, match=r"12 tokens does not split into 2 x cp=4 = 8"):
        chunk_plan(12, 4)
    with pytest.raises(ConfigError, match="cp must be a positive integer"):
        chunk_plan(8, 0)
    assert chunk_plan(16, 4).ranges(1) == [(2, 4), (12, 14)]


def test_ulysses_needs_cp_to_divide_the_heads() -> None:
    check_heads(8, 2, 4)  # key/value heads are repeated where cp does not divide them
    with pytest.raises(ConfigError, match="6 attention heads over cp=4"):
        check_heads(6, 3, 4)


def test_layout_cp_is_carved_out_of_dp() -> None:
    layout = ParallelLayout(dp=4, cp=2, zero_stage=3, cp_attention="ulysses")
    assert layout.world_size == 4 and layout.cp == 2
    assert "(cp=2 ulysses)" in layout.describe()
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert ParallelLayout.from_plan({"dp": 4, "tp": 1, "pp": 1, "zero": 0, "micro_batches": 1,
                                     "checkpointing": False, "cp": 2}).cp == 2


@pytest.mark.parametrize("fields, needle", [
    ({"dp": 4, "cp": 3}, "cp=3 must divide dp=4"),
    ({"dp": 2, "cp": 2, "pp": 2}, "cp=2 with pp=2 is not supported yet"),
    ({"dp": 2, "cp": 2, "tp": 2, "sequence_parallel": True}, "cp=2 with sequence_parallel is not supported yet"),
    ({"dp": 2, "cp": 2, "cp_attention": "bogus"}, "cp_attention"),
    ({"dp": 2, "cp": 0}, "cp"),
])
def test_bad_cp_is_refused(fields: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ParallelLayout(**fields)


def test_build_groups_cp() -> None:
    world = LocalCommunicator()
    with pytest.raises(MeshError, match="cp=2 must be a positive integer dividing dp=1"):
        shardwise.build_groups(world, dp=1, cp=2)
    groups = shardwise.build_groups(world, dp=1, cp=1)
    assert groups.cp is None and groups.cp_size == 1


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_attention_on_one_rank_is_causal_attention(mode: str) -> None:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from shardwise.adapters.torch.parallel.context import ring_attention, ulysses_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 8, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 8, 8, generator=gen, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    grads_want = torch.autograd.grad(want.sum(), (q, k, v))
    fn = ring_attention if mode == "ring" else ulysses_attention
    got = fn(q, k, v, LocalCommunicator(), 8 ** -0.5)
    assert torch.allclose(got, want, atol=1e-6)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)), grads_want):
        assert torch.allclose(g, w, atol=1e-5)


def test_block_maths_off_the_cpu_path_matches_flash() -> None:
    """The written-out forward/backward (used off the CPU) equals ATen's CPU flash kernels."""
    torch = pytest.importorskip("torch")
    from shardwise.adapters.torch.parallel.context import blocks

    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(4))
    for causal in (True, False):
        out, lse = blocks.attend(q, k, v, causal, 0.5)
        grads = blocks.attend_backward(dout, q, k, v, out, lse, causal, 0.5)
        s = blocks._causal_scores(q, k, causal, 0.5)
        m_lse = torch.logsumexp(s, -1)
        m_out = torch.softmax(s, -1) @ v
        assert torch.allclose(out, m_out, atol=1e-6) and torch.allclose(lse, m_lse, atol=1e-5)
        cpu = blocks._cpu
        try:
            blocks._cpu = lambda t: False
            m_grads = blocks.attend_backward(dout, q, k, v, out, lse, causal, 0.5)
            m_out2, m_lse2 = blocks.attend(q, k, v, causal, 0.5)
        finally:
            blocks._cpu = cpu
        assert torch.allclose(m_out2, out, atol=1e-6) and torch.allclose(m_lse2, lse, atol=1e-5)
        for a, b in zip(grads, m_grads):
            assert torch.allclose(a, b, atol=1e-5)


def _spec(seq: int = 32768) -> "object":
    from shardwise.core.cost_model import ModelSpec

    return ModelSpec(num_params=1_300_000_000, num_layers=24, hidden_size=2048, seq_len=seq, num_heads=16,
                     num_kv_heads=8)


def test_cost_model_cp_splits_the_sequence_and_counts_the_ring() -> None:
    from shardwise.core.cost_model import Hardware, estimate

    hw = Hardware(num_devices=8)
    # 4 sequences on 8 ranks: dp alone cannot split them; cp2 gives each rank half of one
    with pytest.raises(ConfigError, match="not divisible"):
        estimate(_spec(), hw, dp=8, zero=3, global_batch=4)
    cp = estimate(_spec(), hw, dp=8, cp=2, zero=3, global_batch=4)
    assert cp.cp == 2 and cp.strategy == "ZeRO-3+CP2" and "cp=2" in cp.describe()
    assert cp.micro_batch_size == 1 and cp.comm_bytes.context_parallel > 0
    whole = estimate(_spec(), Hardware(num_devices=4), dp=4, zero=3, global_batch=4)
    assert cp.memory.activations < 0.6 * whole.memory.activations  # half the tokens per rank
    with pytest.raises(ConfigError, match="cp=3 must divide dp=8"):
        estimate(_spec(), hw, dp=8, cp=3, zero=3, global_batch=4)


def test_planner_weighs_cp_where_the_batch_is_smaller_than_dp() -> None:
    from shardwise.core.cost_model import Hardware
    from shardwise.core.planner import plan

    result = plan(_spec(), Hardware(num_devices=8), global_batch=4)
    assert any(c.cp > 1 for c in result.candidates)
    assert all(c.cp == 1 for c in plan(_spec(), Hardware(num_devices=8), global_batch=8).candidates)
    best = result.best
    layout = ParallelLayout.from_plan(best)
    assert (layout.cp, layout.dp, layout.tp) == (best.cp, best.dp, best.tp)
