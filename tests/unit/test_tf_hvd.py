"""shardwise.tensorflow's Horovod layer in one process: scaling, split checks, names, error types, grouping."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from shardwise.adapters.tensorflow import requests, runtime  # noqa: E402
from shardwise.adapters.tensorflow.tape import GradientReducer, _split  # noqa: E402
from shardwise.core.errors import CollectiveMismatchError  # noqa: E402
from distributed.tf_hvd import in_mode as _run  # noqa: E402  (eager, tf.function, TF1 session)


@pytest.fixture()
def hvd():
    import shardwise.tensorflow as hvd

    hvd.init(backend="local")
    yield hvd
    hvd.shutdown()


def test_scale_like_horovod_on_cpu():
    ints = np.array([-7, 3, 100], np.int32)
    np.testing.assert_array_equal(requests.scale(ints, 0.37), (ints * 0.37).astype(np.int32))
    halves = np.array([0.1, 3.3], np.float16)
    want = (halves.astype(np.float32) * np.float32(0.3)).astype(np.float16)
    assert requests.scale(halves, 0.3).dtype == np.float16
    np.testing.assert_array_equal(requests.scale(halves, 0.3), want)
    assert requests.scale(np.ones(2, np.float32), 0.5).dtype == np.float32


@pytest.mark.parametrize("rows, splits, size, match", [
    (5, None, 2, "divisible"), (3, [1, 1], 2, "sum"), (2, [3, -1], 2, "non-negative"), (2, [2], 2, "one split"),
    (None, None, 2, "scalar")])
def test_alltoall_split_checks(rows, splits, size, match):
    with pytest.raises(ValueError, match=match):
        requests.check_splits(rows, splits, size)


def test_alltoall_splits_default_to_equal_blocks():
    assert requests.check_splits(6, None, 3) == [2, 2, 2]
    assert requests.check_splits(3, np.array([0, 3]), 2) == [0, 3]


def test_graph_names_come_from_the_graph_not_from_execution(hvd):
    def names():
        with tf.Graph().as_default():
            x = tf.ones([2], name="x")
            with tf.name_scope("layer"):
                return [runtime.request_name("allreduce", None, [x], hvd.global_process_set),
                        runtime.request_name("allreduce", None, [x], hvd.global_process_set),
                        runtime.request_name("alltoall", "a2a", [x], hvd.global_process_set),
                        runtime.request_name("alltoall", "a2a", [x], hvd.global_process_set, True)]

    first = names()
    assert first == names()
    assert first == ["allreduce.layer/HorovodAllreduce_x_0", "allreduce.layer/HorovodAllreduce_x_0_1",
                     "alltoall.layer/a2a", "alltoall.a2a_1"]
    eager = runtime.request_name("allgather", None, [tf.ones(1)], hvd.global_process_set)
    assert eager.startswith("allgather.noname.")
    assert runtime.request_name("allgather", "mine", [tf.ones(1)], hvd.global_process_set) == "allgather.mine"


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_negotiation_errors_are_failed_precondition_in_every_mode(mode):
    def rejected(arrays):
        raise CollectiveMismatchError("Mismatched allreduce tensor shapes for 'x'")

    def bad_argument(arrays):
        raise ValueError("splits must sum to 3")

    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched allreduce tensor shapes"):
        _run(mode, lambda: runtime.call(rejected, [tf.ones([2])], [tf.float32], "T"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="must sum"):
        _run(mode, lambda: runtime.call(bad_argument, [tf.ones([2])], [tf.float32], "T"))
    ok = _run(mode, lambda: runtime.call(lambda arrays: [arrays[0] * 2], [tf.ones([2])], [tf.float32], "T"))
    np.testing.assert_array_equal(ok[0], [2.0, 2.0])


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_one_rank_collectives_and_gradients(hvd, mode):
    def build():
        x = tf.constant([1.0, 2.0, 3.0, 4.0])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.allreduce(x, op=hvd.Sum, postscale_factor=2.0)
        out, received = hvd.alltoall(x, [4])
        return {"y": y, "grad": tape.gradient(y, x), "gathered": hvd.allgather(x), "a2a": out,
                "received": received, "scatter": hvd.reducescatter(x), "rank": hvd.rank_op(),
                "bcast": hvd.broadcast(x, 0), "grouped": hvd.grouped_allreduce([x, tf.ones([2], tf.int64)])}

    out = _run(mode, build)
    np.testing.assert_array_equal(out["y"], [2.0, 4.0, 6.0, 8.0])
    np.testing.assert_array_equal(out["grad"], [2.0] * 4)
    for key in ("gathered", "a2a", "scatter", "bcast"):
        np.testing.assert_array_equal(out[key], [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(out["received"], [4])
    assert out["rank"] == 0 and out["grouped"][1].dtype == np.int64


def test_sparse_allreduce_rejects_what_horovod_rejects(hvd):
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0]))
    for kwargs in ({"op": hvd.Max}, {"op": hvd.Adasum}, {"op": hvd.Sum, "postscale_factor": 0.5}):
        with pytest.raises(NotImplementedError):
            hvd.allreduce(slices, **kwargs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scalar"):
        hvd.allgather(tf.constant(1.0))


def test_gradient_groups():
    assert _split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    a, b, c = (tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0))
    reducer = GradientReducer(groups=[[c, a]])
    assert reducer._groups([0, 1, 2], [a, b, c]) == [[2, 0], [1]]
    assert GradientReducer(groups=2)._groups([0, 2], [a, b, c]) == [[0], [2]]
    assert GradientReducer()._groups([0, 1], [a, b]) == [[0, 1]]
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        GradientReducer(op="sum", gradient_predivide_factor=2.0)
