"""Horovod semantics of ``shardwise.tensorflow`` that Horovod's own suite checks, as the project's scenarios.

Every check runs eagerly, inside ``tf.function`` and in a TF1 graph (session), the
three ways Horovod's suite runs its tests. Each rank asserts; a failure aborts the
job with the rank's traceback (see mpi_harness).
"""

from __future__ import annotations

import os
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import shardwise.tensorflow as hvd  # noqa: E402

MODES = ("eager", "function", "graph")


def in_mode(mode: str, build: Callable[[], Any]) -> Any:
    """``build()``'s tensors as numpy values, built and run eagerly, in a tf.function or in a TF1 session."""
    if mode == "eager":
        return tf.nest.map_structure(lambda t: t.numpy(), build())
    if mode == "function":
        return tf.nest.map_structure(lambda t: t.numpy(), tf.function(build)())
    with tf.Graph().as_default():
        fetches = build()
        with tf.compat.v1.Session() as sess:
            return sess.run(fetches)


def raises(error: type, mode: str, build: Callable[[], Any], match: str = "") -> None:
    try:
        in_mode(mode, build)
    except error as exc:
        assert match in str(exc), f"{mode}: expected {match!r} in {exc}"
        return
    raise AssertionError(f"{mode}: expected {error.__name__}")


def eq(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    np.testing.assert_array_equal(got, want, err_msg=what)


def collectives() -> None:
    """Values of every collective, in the three modes, including scaling of integers and process sets."""
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    ints = np.arange(-3, 5, dtype=np.int32)
    for mode in MODES:
        out = in_mode(mode, lambda: {
            "sum": hvd.allreduce(tf.fill([3], float(r + 1)), op=hvd.Sum),
            "avg": hvd.allreduce(tf.fill([3], float(r + 1))),
            "min": hvd.allreduce(tf.constant([r, -r], tf.int64), op=hvd.Min),
            "max": hvd.allreduce(tf.constant([r, -r], tf.int64), op=hvd.Max),
            "prod": hvd.allreduce(tf.fill([2], float(r + 2)), op=hvd.Product),
            "pre": hvd.allreduce(tf.constant(ints), op=hvd.Sum, prescale_factor=0.37),
            "post": hvd.allreduce(tf.constant(ints, tf.float16), op=hvd.Sum, postscale_factor=0.37),
            "int_avg": hvd.allreduce(tf.constant(ints * 2), op=hvd.Average),
            "grouped": hvd.grouped_allreduce([tf.ones([2]), tf.ones([3], tf.int64)], op=hvd.Sum),
            "gathered": hvd.allgather(tf.fill([r + 1, 2], r)),
            "bcast": [hvd.broadcast(tf.fill([2], r), root) for root in range(p)],
            "a2a": hvd.alltoall(tf.repeat(tf.range(p), r + 1), tf.fill([p], r + 1)),
            "scatter": hvd.reducescatter(tf.ones([2 * p + 1]), op=hvd.Sum),
        })
        eq(out["sum"], np.full(3, p * (p + 1) / 2, np.float32), f"{mode} sum")
        eq(out["avg"], np.full(3, (p + 1) / 2, np.float32), f"{mode} average")
        eq(out["min"], np.array([0, 1 - p], np.int64), f"{mode} min")
        eq(out["max"], np.array([p - 1, 0], np.int64), f"{mode} max")
        eq(out["prod"], np.full(2, np.prod(np.arange(2, p + 2)), np.float32), f"{mode} product")
        eq(out["pre"], (ints * 0.37).astype(np.int32) * p, f"{mode} prescale on int32 (float64, truncated)")
        eq(out["post"], ((ints.astype(np.float16) * p).astype(np.float32) * np.float32(0.37)).astype(np.float16),
           f"{mode} postscale on float16 (in float32)")
        eq(out["int_avg"], ints * 2, f"{mode} int average")
        eq(out["grouped"][1], np.full(3, p, np.int64), f"{mode} grouped, second dtype")
        eq(out["gathered"], np.repeat(np.arange(p, dtype=np.int32), np.arange(1, p + 1))[:, None].repeat(2, 1),
           f"{mode} allgather with different first dimensions")
        for root, got in enumerate(out["bcast"]):
            eq(got, np.full(2, root, np.int32), f"{mode} broadcast from {root}")
        collected, received = out["a2a"]
        eq(collected, np.full(p * (p + 1) // 2, r, np.int32), f"{mode} alltoall rows")
        eq(received, np.arange(1, p + 1, dtype=np.int32), f"{mode} alltoall received splits")
        eq(out["scatter"], np.full(3 if r == 0 else 2, p, np.float32), f"{mode} uneven reducescatter")
    sparse = hvd.allreduce(tf.IndexedSlices(tf.fill([1, 2], float(r)), tf.constant([r]), tf.constant([p, 2])))
    eq(tf.convert_to_tensor(sparse).numpy(), np.repeat(np.arange(p, dtype=np.float32)[:, None] / p, 2, 1),
       "IndexedSlices averaged by allgather")
    variables = [tf.Variable(np.full(3, r, np.float32)), tf.Variable([r > 0])]
    hvd.broadcast_(variables, root_rank=p - 1)
    eq(variables[0].numpy(), np.full(3, p - 1, np.float32), "broadcast_ writes the variables")
    eq(variables[1].numpy(), np.array([p > 1]), "broadcast_ on a bool variable")
    _process_sets(r, p)
    hvd.shutdown()


def _process_sets(r: int, p: int) -> None:
    last = hvd.add_process_set([p - 1])
    both = hvd.add_process_set(list(range(p)))
    assert int(hvd.process_set_included_op(last.process_set_id)) == int(r == p - 1)
    assert int(hvd.size_op(both.process_set_id)) == p
    for mode in MODES:
        out = in_mode(mode, lambda: hvd.broadcast(tf.fill([2], r), p - 1, process_set=both))
        eq(out, np.full(2, p - 1, np.int32), f"{mode} broadcast in a process set")
    if r == p - 1:
        eq(hvd.allreduce(tf.ones(2), op=hvd.Sum, process_set=last).numpy(), np.ones(2, np.float32),
           "allreduce in a one-rank process set")
    assert hvd.remove_process_set(last) and hvd.remove_process_set(both)


#: The disagreements also checked in tf.function and TF1 graphs (every one is checked eagerly).
IN_GRAPHS = ("shape", "dtype", "average vs sum", "broadcast root", "alltoall dims")


def errors() -> None:
    """Each error case fails on every rank with the suite's exception type; the next collective works."""
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    mismatched: list[tuple[str, Callable[[], Any]]] = [
        ("shape", lambda: hvd.allreduce(tf.ones([3 + r, 2]))),
        ("rank", lambda: hvd.allreduce(tf.ones([6]) if r == 0 else tf.ones([2, 3]))),
        ("dtype", lambda: hvd.allreduce(tf.ones([3], tf.int32 if r % 2 else tf.float32))),
        ("op", lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum if r else hvd.Max)),
        ("average vs sum", lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum if r else hvd.Average)),
        ("prescale", lambda: hvd.allreduce(tf.ones([2]), prescale_factor=1.0 + r)),
        ("allgather dims", lambda: hvd.allgather(tf.ones([2, 3 + r]))),
        ("broadcast root", lambda: hvd.broadcast(tf.ones([3]), r)),
        ("alltoall dims", lambda: hvd.alltoall(tf.ones([2 * p, 1 + r]))),
        ("reducescatter dtype", lambda: hvd.reducescatter(tf.ones([2 * p], tf.int64 if r else tf.float32))),
        ("grouped", lambda: hvd.grouped_allreduce([tf.ones([2]), tf.ones([2 + r])])),
    ]
    for mode in MODES:
        # every case eagerly; in graphs the kinds of disagreement (shapes, dtypes, roots, per-op checks)
        for what, build in [(w, b) for w, b in mismatched if mode == "eager" or w in IN_GRAPHS]:
            raises(tf.errors.FailedPreconditionError, mode, build, "Mismatched" if "root" not in what else "root")
            eq(in_mode(mode, lambda: hvd.allreduce(tf.ones([3]), op=hvd.Sum)), np.full(3, p, np.float32),
               f"{mode}: allreduce after the {what} error")
        raises(tf.errors.InvalidArgumentError, mode, lambda: hvd.alltoall(tf.ones([p + 1])), "divisible")
        raises(tf.errors.InvalidArgumentError, mode, lambda: hvd.alltoall(tf.ones([p - 1]), tf.ones([p], tf.int32)),
               "sum")
        raises(tf.errors.InvalidArgumentError, mode, lambda: hvd.reducescatter(tf.constant(1.0)), "scalar")
    sparse = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    for kwargs in ({"op": hvd.Min}, {"op": hvd.Adasum}, {"op": hvd.Sum, "prescale_factor": 2.0}):
        try:
            hvd.allreduce(sparse, **kwargs)
        except NotImplementedError:
            continue
        raise AssertionError(f"IndexedSlices with {kwargs} must raise NotImplementedError")
    # Runtime split errors in a graph, where the splits are only known when the op runs.
    with tf.Graph().as_default():
        splits = tf.compat.v1.placeholder(tf.int32, [p])
        out = hvd.alltoall(tf.ones([p]), splits)
        with tf.compat.v1.Session() as sess:
            try:
                sess.run(out, {splits: [p] * p})
            except tf.errors.InvalidArgumentError as exc:
                assert "must sum" in str(exc), exc
            else:
                raise AssertionError("splits that do not sum to the rows must fail")
            eq(sess.run(out[1], {splits: [1] * p}), np.ones(p, np.int32), "the same op then works")
    _concurrent_graph_collectives(r, p)
    hvd.shutdown()


def _concurrent_graph_collectives(r: int, p: int) -> None:
    """A TF1 session runs many independent collectives at once; ranks start them in different orders."""
    with tf.Graph().as_default():
        outs = [hvd.allreduce(tf.fill([k + 1], float(r)), op=hvd.Sum) for k in range(24)]
        outs += [hvd.allgather(tf.fill([r + 1], k)) for k in range(8)]
        with tf.compat.v1.Session() as sess:
            values = sess.run(outs[::-1] if r % 2 else outs)
    values = values[::-1] if r % 2 else values
    for k in range(24):
        eq(values[k], np.full(k + 1, p * (p - 1) / 2, np.float32), f"concurrent allreduce {k}")


def gradients_and_training() -> None:
    """Horovod's gradients, DistributedGradientTape (local sources, sparse), join, objects, elastic state."""
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    for mode in MODES:
        def grads() -> Any:
            x = tf.constant(np.arange(2 * p, dtype=np.float32) + r)
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                outs = [hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, p - 1),
                        hvd.alltoall(x), hvd.reducescatter(x, op=hvd.Sum)]
            return [tape.gradient(o, x, tf.ones_like(o) * (k + 1)) for k, o in enumerate(outs)]

        g_sum, g_gather, g_bcast, g_a2a, g_scatter = in_mode(mode, grads)
        eq(g_sum, np.full(2 * p, p, np.float32), f"{mode} allreduce gradient")
        eq(g_gather, np.full(2 * p, 2, np.float32), f"{mode} allgather gradient (averaged, this rank's rows)")
        eq(g_bcast, np.full(2 * p, 3 if r == p - 1 else 0, np.float32), f"{mode} broadcast gradient")
        eq(g_a2a, np.full(2 * p, 4, np.float32), f"{mode} alltoall gradient")
        eq(g_scatter, np.full(2 * p, 5 * p, np.float32), f"{mode} reducescatter gradient (Sum: times the size)")
    _tape(r, p)
    _legacy_optimizer(r, p)
    _sync_batch_norm(r, p)
    for first in range(p):
        if r == first:
            last = int(hvd.join())
        else:
            eq(hvd.allreduce(tf.fill([4], 3), op=hvd.Sum).numpy(), np.full(4, 3 * (p - 1), np.int32),
               "allreduce with a joined rank")
            last = int(hvd.join())
        assert hvd.allgather_object(last) == [last] * p and (last != first or p == 1)
    assert hvd.broadcast_object({"a": r}, root_rank=p - 1) == {"a": p - 1}
    state = hvd.elastic.TensorFlowState([tf.Variable(float(r))], batch=r)
    state.sync()
    assert float(state.variables[0].numpy()) == 0.0 and state.batch == 0
    state.variables[0].assign(5.0)
    state.restore()
    assert float(state.variables[0].numpy()) == 0.0
    hvd.shutdown()


def _tape(r: int, p: int) -> None:
    table = tf.Variable(tf.fill([4, 2], float(r)))
    dense = tf.Variable(tf.fill([2], float(r)))
    local = tf.Variable(float(r + 1))

    def step() -> Any:
        with tf.GradientTape() as plain:
            rows = tf.gather(table, [r % 4])
            loss = tf.reduce_sum(rows) * float(r + 1) + tf.reduce_sum(dense * float(r + 1)) + local * local
        tape = hvd.DistributedGradientTape(plain)
        tape.register_local_source(local)
        return tape.gradient(loss, [table, dense, local])

    for traced in (False, True):
        g_table, g_dense, g_local = (tf.function(step) if traced else step)()
        assert isinstance(g_table, tf.IndexedSlices), type(g_table)
        want = np.zeros((4, 2), np.float32)
        for q in range(p):
            want[q % 4] += (q + 1) / p
        eq(tf.convert_to_tensor(g_table).numpy(), want, f"sparse gradient (traced={traced})")
        eq(g_dense.numpy(), np.full(2, (p + 1) / 2, np.float32), f"dense gradient (traced={traced})")
        eq(g_local.numpy(), np.float32(2 * (r + 1) / p), f"local gradient scaled by 1/size (traced={traced})")
    with hvd.DistributedGradientTape(tf.GradientTape(), sparse_as_dense=True, op=hvd.Sum) as tape:
        loss = tf.reduce_sum(tf.gather(table, [0])) * float(r + 1)
    g = tape.gradient(loss, table)
    assert isinstance(g, tf.Tensor)
    eq(g.numpy()[0], np.full(2, p * (p + 1) / 2, np.float32), "sparse_as_dense with op=Sum")


def _sync_batch_norm(r: int, p: int) -> None:
    """SyncBatchNormalization on this rank's rows equals BatchNormalization on every rank's (the suite's check)."""
    import keras

    x = np.stack([np.array([[q, q + 1], [2 * q, 2 * q + 1], [3 * q, 3 * q + 1]], np.float32) for q in range(p)])
    bn, sync_bn = keras.layers.BatchNormalization(axis=1), hvd.SyncBatchNormalization(axis=1)
    full = bn(tf.constant(x), training=True).numpy()
    mine = sync_bn(tf.constant(x[r:r + 1]), training=True).numpy()
    np.testing.assert_allclose(mine, full[r:r + 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sync_bn.moving_variance.numpy(), bn.moving_variance.numpy(), rtol=1e-5)


def _legacy_optimizer(r: int, p: int) -> None:
    """backward_passes_per_step=3 on a tf.compat.v1 optimizer: applied every 3rd step, global step every step."""
    with tf.Graph().as_default():
        var = tf.Variable([0.0])

        class AddGradient(tf.compat.v1.train.Optimizer):
            def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
                return [(tf.constant([float(r)]), var)]

            def _resource_apply_dense(self, grad: Any, handle: Any, apply_state: Any = None) -> Any:
                return handle.assign_add(grad)

        opt = hvd.DistributedOptimizer(AddGradient(False, "add"), backward_passes_per_step=3,
                                       average_aggregated_gradients=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.apply_gradients(opt.compute_gradients(), global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
            for i in range(7):
                sess.run(train)
                applied = (i + 1) // 3
                assert sess.run(var)[0] == applied * (p - 1) / 2, (i, sess.run(var))
            assert sess.run(step) == 7


def all_scenarios() -> None:
    """The three scenarios in one job (one TensorFlow start-up per rank), each between init and shutdown."""
    collectives()
    errors()
    gradients_and_training()
