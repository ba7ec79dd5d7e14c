"""Sharded-checkpoint pieces without processes: flat ranges written by N ranks read back as any range,
and Keras optimizer slots found by name whatever the optimizer class."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.checkpoint.flat import FlatReader, PieceWriter, even_range, merge_tables
from shardwise.core.errors import CheckpointError
from shardwise.core.zero import PartitionPlan


def _written(tensor: np.ndarray, size: int, zero: bool) -> tuple[dict, list[dict]]:
    """``tensor`` as ``size`` ranks write it: even slices, or a ZeRO plan's pieces (with padding)."""
    writers = [PieceWriter(r) for r in range(size)]
    flat = tensor.reshape(-1)
    for r, w in enumerate(writers):
        if zero:
            plan = PartitionPlan.build([("0:t", tensor.shape)], size, alignment=4)
            w.declare("t", tensor.shape, "float32")
            for p in plan.rank_params(r):
                w.add("t", tensor.shape, "float32", p.param_offset, flat[p.param_offset:p.param_offset + p.length])
        else:
            a, b = even_range(flat.size, r, size)
            w.add("t", tensor.shape, "float32", a, flat[a:b])
    return merge_tables([w.table for w in writers]), [w.arrays for w in writers]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("zero", [False, True])
def test_any_range_reads_back_exactly(size: int, zero: bool) -> None:
    tensor = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    tensors, arrays = _written(tensor, size, zero)
    reader = FlatReader(tensors, lambda r: arrays[r])
    np.testing.assert_array_equal(reader.read_whole("t"), tensor)
    for a, b in [(0, 1), (3, 17), (10, 35), (34, 35), (12, 12)]:
        np.testing.assert_array_equal(reader.read("t", a, b), tensor.reshape(-1)[a:b])
    # Re-split for another world size, as loading into a ZeRO plan of 3 ranks does.
    plan = PartitionPlan.build([("0:t", (5, 7))], 3)
    for r in range(3):
        out = np.zeros(plan.shard_numel, np.float32)
        reader.read_into(out, [("t", p.param_offset, p.shard_offset, p.length) for p in plan.rank_params(r)])
        start, end = plan.owned_range(r)
        want = np.zeros(plan.padded_numel, np.float32)
        want[:35] = tensor.reshape(-1)
        np.testing.assert_array_equal(out, want[start:end])


def test_gaps_overlaps_and_disagreements_are_refused() -> None:
    a, b = PieceWriter(0), PieceWriter(1)
    a.add("t", (10,), "float32", 0, np.zeros(4))
    b.add("t", (10,), "float32", 5, np.zeros(5))
    with pytest.raises(CheckpointError, match="gap at element 4"):
        merge_tables([a.table, b.table])
    b = PieceWriter(1)
    b.add("t", (10,), "float32", 3, np.zeros(7))
    with pytest.raises(CheckpointError, match="overlap"):
        merge_tables([a.table, b.table])
    b = PieceWriter(1)
    b.add("t", (5, 2), "float32", 4, np.zeros(6))
    with pytest.raises(CheckpointError, match="disagree"):
        merge_tables([a.table, b.table])
    b = PieceWriter(1)
    b.add("t", (10,), "float32", 4, np.zeros(5))
    with pytest.raises(CheckpointError, match="cover 9 of its 10"):
        merge_tables([a.table, b.table])


def test_a_missing_array_is_a_damaged_checkpoint() -> None:
    tensors, arrays = _written(np.ones((4, 4), np.float32), 2, False)
    reader = FlatReader(tensors, lambda r: {} if r == 1 else arrays[r], origin="ckpt-9")
    np.testing.assert_array_equal(reader.read("t", 0, 8), np.ones(8))
    with pytest.raises(CheckpointError, match="ckpt-9: rank 1's file lacks array"):
        reader.read("t", 6, 10)


@pytest.fixture
def keras():
    return pytest.importorskip("keras")


@pytest.mark.parametrize("name,expected", [("sgd", ["momentum"]), ("adam", ["momentum", "velocity"]),
                                           ("rmsprop", ["momentum", "velocity"]), ("adamw", ["momentum", "velocity"])])
def test_slots_are_found_by_name_for_each_optimizer(keras, name: str, expected: list[str]) -> None:
    from shardwise.adapters.keras.slots import scalar_state, set_scalar_state, slot_variables

    make = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: keras.optimizers.Adam(),
            "rmsprop": lambda: keras.optimizers.RMSprop(momentum=0.5), "adamw": lambda: keras.optimizers.AdamW()}
    # dense_1 and dense_10 share a prefix: the longest matching reference wins.
    variables = [keras.Variable(np.zeros((i + 2,), "float32"), name=f"dense_{n}")
                 for i, n in enumerate([1, 10, 11])]
    opt = make[name]()
    opt.build(variables)
    slots = slot_variables(opt)
    assert [sorted(s) for s in slots] == [expected] * 3
    for var, var_slots in zip(variables, slots):
        assert all(tuple(s.shape) == tuple(var.shape) for s in var_slots.values())
    opt.iterations.assign(7)
    state = scalar_state(opt)
    assert state["iterations"] == 7 and state["learning_rate"] == pytest.approx(float(opt.learning_rate))
    other = make[name]()
    other.build(variables)
    set_scalar_state(other, state)
    assert int(other.iterations) == 7
