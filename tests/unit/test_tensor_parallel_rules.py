"""Tensor-parallel split rules: shard indices, vocab padding, collectives and numpy checks."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.core.errors import ConfigError
from shardwise.core.tensor_parallel import (
    COMMUNICATION, TensorParallelError, collectives_for, column_parallel_shard, merge_weight,
    padded_vocab_size, row_parallel_shard, split_weight, vocab_parallel_range,
)


def test_column_and_row_shards_tile_the_weight():
    out_f, in_f, tp = 12, 8, 4
    w = np.arange(out_f * in_f).reshape(out_f, in_f)
    col = [w[column_parallel_shard(out_f, in_f, tp, r)] for r in range(tp)]
    row = [w[row_parallel_shard(out_f, in_f, tp, r)] for r in range(tp)]
    assert all(s.shape == (3, 8) for s in col) and all(s.shape == (12, 2) for s in row)
    np.testing.assert_array_equal(np.concatenate(col, axis=0), w)
    np.testing.assert_array_equal(np.concatenate(row, axis=1), w)
    assert column_parallel_shard(12, 8, 4, 2) == (slice(6, 9), slice(0, 8))
    assert row_parallel_shard(12, 8, 4, 3) == (slice(0, 12), slice(6, 8))
    assert column_parallel_shard(5, 3, 1, 0) == (slice(0, 5), slice(0, 3))


def test_shards_agree_with_split_weight():
    w = np.random.default_rng(0).normal(size=(6, 4))
    for tp in (1, 2):
        for r, shard in enumerate(split_weight(w, "column", tp)):
            np.testing.assert_array_equal(shard, w[column_parallel_shard(6, 4, tp, r)])
        for r, shard in enumerate(split_weight(w, "row", tp)):
            np.testing.assert_array_equal(shard, w[row_parallel_shard(6, 4, tp, r)])


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", [1, 2, 3, 6])
def test_split_merge_round_trip(kind, tp):
    w = np.random.default_rng(tp).normal(size=(12, 18)).astype(np.float32)
    shards = split_weight(w, kind, tp)
    assert len(shards) == tp
    assert all(s.dtype == np.float32 for s in shards)
    merged = merge_weight(shards, kind)
    np.testing.assert_array_equal(merged, w)
    shards[0][...] = 0  # shards are copies, not views
    assert np.any(w != 0)


def test_column_bias_round_trip():
    b = np.arange(8.0)
    shards = split_weight(b, "column", 4)
    assert [s.tolist() for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    np.testing.assert_array_equal(merge_weight(shards, "column"), b)


def test_column_then_row_matmul_equals_full_mlp():
    rng = np.random.default_rng(7)
    batch, hidden, ffn, tp = 5, 8, 16, 4
    x = rng.normal(size=(batch, hidden))
    w1, b1 = rng.normal(size=(ffn, hidden)), rng.normal(size=ffn)
    w2, b2 = rng.normal(size=(hidden, ffn)), rng.normal(size=hidden)
    full = np.maximum(x @ w1.T + b1, 0.0) @ w2.T + b2
    partials = []
    for w1s, b1s, w2s in zip(split_weight(w1, "column", tp), split_weight(b1, "column", tp),
                             split_weight(w2, "row", tp)):
        h = np.maximum(x @ w1s.T + b1s, 0.0)  # 'f': identity forward, local activation
        partials.append(h @ w2s.T)             # row-parallel partial output
    np.testing.assert_allclose(sum(partials) + b2, full, rtol=1e-12, atol=1e-12)  # 'g': allreduce
    gathered = np.concatenate([x @ s.T for s in split_weight(w1, "column", tp)], axis=-1)
    np.testing.assert_allclose(gathered, x @ w1.T, rtol=1e-12, atol=1e-12)  # gather_output


def test_padded_vocab_and_ranges():
    assert padded_vocab_size(50257, 8) == 50264
    assert padded_vocab_size(50257, 8, multiple=128) == 51200  # Megatron's make-divisible-by
    assert padded_vocab_size(64, 4) == 64 and padded_vocab_size(1, 1) == 1
    ranges = [vocab_parallel_range(10, 4, r) for r in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 12)]  # ids 10, 11 are padding
    assert vocab_parallel_range(50257, 8, 7, multiple=128) == (44800, 51200)


def test_vocab_embedding_split_pads_and_lookup_allreduce_matches():
    rng = np.random.default_rng(3)
    vocab, hidden, tp = 10, 4, 4
    table = rng.normal(size=(vocab, hidden))
    shards = split_weight(table, "vocab_embedding", tp)
    assert [s.shape for s in shards] == [(3, 4)] * 4
    np.testing.assert_array_equal(shards[-1][1:], 0.0)  # zero padding rows
    np.testing.assert_array_equal(merge_weight(shards, "vocab_embedding", vocab_size=vocab), table)
    assert merge_weight(shards, "vocab_embedding").shape == (12, 4)
    ids = np.array([0, 9, 3, 5, 5, 2])
    out = np.zeros((len(ids), hidden))
    for r, shard in enumerate(shards):  # masked lookup per rank, then allreduce(sum)
        start, end = vocab_parallel_range(vocab, tp, r)
        mask = (ids >= start) & (ids < end)
        local = shard[np.where(mask, ids - start, 0)]
        out += np.where(mask[:, None], local, 0.0)
    np.testing.assert_array_equal(out, table[ids])


def test_parallel_cross_entropy_collectives_reproduce_full_loss():
    rng = np.random.default_rng(11)
    tokens, vocab, tp = 6, 12, 3
    logits = rng.normal(size=(tokens, vocab)) * 4
    target = rng.integers(0, vocab, size=tokens)
    shards = split_weight(logits.T, "vocab_embedding", tp)  # shard the vocab dim
    ops = [(c.op, c.reduce) for c in collectives_for("parallel_cross_entropy").forward]
    assert ops == [("allreduce", "max"), ("allreduce", "sum"), ("allreduce", "sum")]
    gmax = np.max([s.max(axis=0) for s in shards], axis=0)                # allreduce max
    tgt = np.zeros(tokens)
    for r, s in enumerate(shards):                                        # allreduce sum
        start, end = vocab_parallel_range(vocab, tp, r)
        mask = (target >= start) & (target < end)
        tgt += np.where(mask, s[np.clip(target - start, 0, end - start - 1), np.arange(tokens)], 0.0)
    sum_exp = sum(np.exp(s - gmax).sum(axis=0) for s in shards)           # allreduce sum
    loss = np.log(sum_exp) - (tgt - gmax)
    m = logits.max(axis=1, keepdims=True)
    full = (np.log(np.exp(logits - m).sum(axis=1)) + m[:, 0]) - logits[np.arange(tokens), target]
    np.testing.assert_allclose(loss, full, rtol=1e-12)


def test_communication_table():
    col = collectives_for("column")
    assert col.forward == () and [c.op for c in col.backward] == ["allreduce"]
    gat = collectives_for("column", gather_output=True)
    assert [c.op for c in gat.forward] == ["allgather"] and [c.op for c in gat.backward] == ["allreduce"]
    row = collectives_for("row")
    assert [(c.op, c.reduce) for c in row.forward] == [("allreduce", "sum")] and row.backward == ()
    emb = collectives_for("vocab_embedding")
    assert [c.op for c in emb.forward] == ["allreduce"] and emb.backward == ()
    assert set(COMMUNICATION) == {"column", "column_gather", "row", "vocab_embedding",
                                  "parallel_cross_entropy"}
    with pytest.raises(TypeError):
        COMMUNICATION["new"] = col  # read-only table


@pytest.mark.parametrize("call,match", [
    (lambda: column_parallel_shard(10, 4, 3, 0),
     r"column-parallel weight \[10, 4\]: out_features 10 is not divisible by tp_size 3"),
    (lambda: row_parallel_shard(8, 6, 4, 0),
     r"row-parallel weight \[8, 6\]: in_features 6 is not divisible by tp_size 4"),
    (lambda: column_parallel_shard(8, 4, 4, 4), r"tp_rank 4 is not in \[0, 4\)"),
    (lambda: column_parallel_shard(8, 4, 0, 0), r"tp_size must be an integer >= 1, got 0"),
    (lambda: row_parallel_shard(8, 0, 2, 0), r"in_features must be an integer >= 1, got 0"),
    (lambda: vocab_parallel_range(100, 4, -1), r"tp_rank -1 is not in \[0, 4\)"),
    (lambda: padded_vocab_size(0, 4), r"vocab_size must be an integer >= 1, got 0"),
    (lambda: padded_vocab_size(10, 4, multiple=0), r"multiple must be an integer >= 1, got 0"),
    (lambda: split_weight(np.zeros((6, 5)), "row", 2),
     r"row-parallel split of shape \(6, 5\): dim 1 \(5\) is not divisible by tp_size 2"),
    (lambda: split_weight(np.zeros((5, 4)), "column", 2),
     r"column-parallel split of shape \(5, 4\): dim 0 \(5\) is not divisible by tp_size 2"),
    (lambda: split_weight(np.zeros(4), "row", 2), r"needs a 2-D \[out, in\] weight, got shape \(4,\)"),
    (lambda: split_weight(np.zeros((4, 4)), "diagonal", 2), r"unknown split kind 'diagonal'"),
    (lambda: merge_weight([np.zeros((2, 3)), np.zeros((2, 4))], "column"), r"do not fit together"),
    (lambda: merge_weight([], "row"), r"at least one shard"),
    (lambda: merge_weight([np.zeros((2, 3))], "row", vocab_size=2), r"only applies to 'vocab_embedding'"),
    (lambda: merge_weight([np.zeros((2, 3))], "vocab_embedding", vocab_size=3),
     r"does not fit 2 merged rows"),
    (lambda: collectives_for("conv"), r"unknown layer kind 'conv'"),
    (lambda: collectives_for("row", gather_output=True), r"gather_output only applies to 'column'"),
])
def test_errors(call, match):
    with pytest.raises(TensorParallelError, match=match) as info:
        call()
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
