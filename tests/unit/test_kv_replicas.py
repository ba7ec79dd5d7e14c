"""Key/value heads fewer than the tensor-parallel degree: each head replicated over tp / kv ranks (issue 53).

The placement maths in one process: which query and key/value heads a rank keeps, that each of its
query heads uses its key/value head, the replicated :class:`Placement` (slicing, reassembly from
every rank's piece, the piece one of its replicas saves), and the refusals naming both numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.adapters.torch.checkpoint.pieces import decode_placement, encode_placement
from shardwise.core.errors import ConfigError
from shardwise.core.hf_plan import hf_family
from shardwise.core.placement import Placement
from shardwise.core.tensor_parallel import TensorParallelError
from shardwise.core.tp_rules import check_tp_degree, kv_head_replicas, kv_rank_heads

LLAMA = hf_family({"model_type": "llama", "base_model_tp_plan": {
    "layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}}, base="model")


@pytest.mark.parametrize("kv, tp, want", [(8, 4, 1), (4, 4, 1), (2, 4, 2), (1, 4, 4), (1, 2, 2), (2, 8, 4)])
def test_replicas_per_key_value_head(kv: int, tp: int, want: int) -> None:
    assert kv_head_replicas(kv, tp) == want


@pytest.mark.parametrize("q, kv, tp", [(8, 2, 4), (4, 2, 4), (4, 1, 4), (16, 4, 8), (8, 8, 4), (4, 1, 2), (32, 8, 16)])
def test_each_query_head_of_a_rank_uses_the_rank_key_value_head(q: int, kv: int, tp: int) -> None:
    replicas = kv_head_replicas(kv, tp)
    seen_q: list[int] = []
    for rank in range(tp):
        queries, keys = kv_rank_heads(q, kv, tp, rank)
        seen_q += list(queries)
        assert len(queries) == q // tp
        assert len(keys) == max(kv // tp, 1)
        if replicas > 1:
            assert list(keys) == [rank // replicas]  # vLLM: head rank // num_kv_head_replicas
        per_kv = q // kv
        assert {h // per_kv for h in queries} <= set(keys)
        # the attention's query heads per local key/value head on the rank (num_key_value_groups)
        assert len(queries) // len(keys) == (q // kv) // replicas
    assert seen_q == list(range(q))


@pytest.mark.parametrize("kv, tp, needles", [(3, 4, ["num_key_value_heads=3", "tp=4"]),
                                             (6, 4, ["num_key_value_heads=6", "tp=4"]),
                                             (2, 3, ["num_key_value_heads=2", "tp=3"])])
def test_uneven_head_counts_are_refused_naming_both(kv: int, tp: int, needles: list[str]) -> None:
    with pytest.raises(TensorParallelError) as info:
        check_tp_degree(LLAMA, {"num_attention_heads": 12 * tp, "num_key_value_heads": kv}, tp)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_check_tp_degree_returns_the_replicas() -> None:
    assert check_tp_degree(LLAMA, {"num_attention_heads": 8, "num_key_value_heads": 2}, 4) == 2
    assert check_tp_degree(LLAMA, {"num_attention_heads": 8, "num_key_value_heads": 8}, 4) == 1
    assert check_tp_degree(LLAMA, {"num_attention_heads": 8, "num_key_value_heads": None}, 4) == 1
    with pytest.raises(TensorParallelError, match="num_attention_heads=6 is not divisible by tp=4"):
        check_tp_degree(LLAMA, {"num_attention_heads": 6, "num_key_value_heads": 2}, 4)
    with pytest.raises(TensorParallelError, match="not a multiple of num_key_value_heads=3"):
        kv_rank_heads(8, 3, 4, 0)


@pytest.mark.parametrize("kv, tp, transpose", [(2, 4, False), (1, 4, False), (1, 2, True), (2, 8, False)])
def test_replicated_placement_slices_and_reassembles(kv: int, tp: int, transpose: bool) -> None:
    head_dim, hidden = 3, 5
    full = np.arange(kv * head_dim * hidden, dtype=np.float64).reshape(kv * head_dim, hidden)
    replicas = tp // kv
    shape = full.shape[::-1] if transpose else full.shape
    source = full.T if transpose else full
    dim = 1 if transpose else 0
    places = [Placement("k.weight", tuple(shape), dim, 1, tp, r, transpose=transpose, replicas=replicas)
              for r in range(tp)]
    pieces = [p.take(source) for p in places]
    for r, (p, piece) in enumerate(zip(places, pieces)):
        head = r // replicas
        want = full[head * head_dim:(head + 1) * head_dim]
        assert np.array_equal(piece.T if transpose else piece, want.T if transpose else want)
        assert p.local_shape == piece.shape
        # one of the replicas saves it: its canonical form is the same on every replica
        assert p.canonical() == places[head * replicas].canonical()
        assert p.canonical().replicas == 1 and p.canonical().size == kv and p.canonical().rank == head
        assert np.array_equal(p.canonical().take(source), piece)
        back = decode_placement(p.name, p.full_shape, encode_placement(p))
        assert back == p.canonical()
    assert np.array_equal(places[0].merge(pieces), source)


def test_bad_replicas_are_refused() -> None:
    with pytest.raises(ConfigError, match="3 replicas do not divide a group of 4"):
        Placement("k", (8, 2), 0, 1, 4, 0, replicas=3)
    with pytest.raises(ConfigError, match="only an even split"):
        Placement("k", (8, 2), None, 1, 4, 0, replicas=2)
    with pytest.raises(ConfigError, match="only an even split"):
        Placement("k", (8, 2), 0, 1, 4, 0, uneven=True, replicas=2)


def test_planner_proposes_tp_only_where_key_value_heads_split_or_replicate() -> None:
    from shardwise.core.hardware import Hardware
    from shardwise.core.model_spec import ModelSpec
    from shardwise.core.planner import plan

    hardware = Hardware.parse(num_devices=8, memory_per_device="80GB", intra_node_bandwidth="600GB/s")

    def tps(kv: int) -> set[int]:
        model = ModelSpec(num_params=1_000_000_000, num_layers=16, hidden_size=1536, num_heads=24, num_kv_heads=kv)
        return {c.tp for c in plan(model, hardware, global_batch=64).candidates}

    assert tps(2) == {1, 2, 4, 8}  # 4 and 8: each of the 2 heads replicated 2 and 4 times
    assert tps(3) == {1}  # 3 key/value heads: tp 2, 4, 8 neither split nor replicate them
    assert tps(24) == {1, 2, 4, 8}


def test_cost_model_counts_the_replicated_key_value_weights() -> None:
    from shardwise.core.cost_model import estimate
    from shardwise.core.hardware import Hardware
    from shardwise.core.model_spec import ModelSpec

    hardware = Hardware.parse(num_devices=8, memory_per_device="80GB", intra_node_bandwidth="600GB/s")

    def params(kv: int, tp: int) -> int:
        model = ModelSpec(num_params=1_000_000_000, num_layers=16, hidden_size=1536, num_heads=24, num_kv_heads=kv)
        return estimate(model, hardware, dp=8 // tp, tp=tp, global_batch=64, precision="fp32").memory.params

    # (num_params is given, so only the replication changes the count) 2 key/value heads of width
    # 64 at tp8: each rank keeps one head's k and v rows of each of the 16 layers (1/2), not 1/8
    extra = 16 * 2 * 1536 * 128 * (1 / 2 - 1 / 8)
    assert params(2, 8) - params(8, 8) == pytest.approx(4 * extra, abs=4)  # fp32 bytes
    assert params(2, 2) == params(8, 2)  # tp2 splits 2 heads: nothing replicated
