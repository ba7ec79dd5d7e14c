"""Scenarios for the ``tf`` backend beyond the shared collective suite (run on every rank).

* ``extras``: dtypes the TF engine lacks (moved as bytes / reduced locally), TF
  variables and tensors, a 2-member group in reversed rank order (the engine
  orders members by task, so shardwise must reorder), errors that stay local,
  and a CheckedCommunicator with a timeout on top.
* ``keras``: the Keras DistributedOptimizer and the shardwise.tensorflow API on
  the tf backend, next to a MultiWorkerMirroredStrategy sharing its runtime.
* ``horovod_order``: a Horovod program's order with ``SHARDWISE_BACKEND=tf``:
  import shardwise.tensorflow, run TensorFlow ops, then ``hvd.init()`` (the
  import must have started the runtime); collectives eagerly and in
  ``tf.function``, across a shutdown/init cycle, and inside ``strategy.run`` of
  the user's own MultiWorkerMirroredStrategy.
"""

from __future__ import annotations

import os

import numpy as np

import shardwise

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _world():
    import tensorflow as tf

    if not shardwise.is_initialized():
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    ctx = shardwise.init(backend="tf")
    assert ctx.backend == "tf" and ctx.world.backend == "tf"
    return ctx.world


def _odd_dtypes(comm, world_rank: int, members: list[int]) -> None:
    import tensorflow as tf

    p, r = comm.size, comm.rank
    for dtype in ("uint8", "int16", "bool", "complex64"):
        base = {m: (np.arange(6) + 3 * m).astype(dtype) for m in members}
        mine = base[world_rank]
        stack = np.stack([base[m] for m in members])
        want_sum = np.add.reduce(stack, axis=0, dtype=stack.dtype)
        np.testing.assert_array_equal(comm.allreduce(mine, "sum"), want_sum, err_msg=f"allreduce {dtype}")
        np.testing.assert_array_equal(comm.allreduce(mine, "max"), np.maximum.reduce(stack), err_msg=dtype)
        got = comm.allgather(base[world_rank].reshape(3, 2)[: 1 + members.index(world_rank) % 3])
        want = np.concatenate([base[m].reshape(3, 2)[: 1 + i % 3] for i, m in enumerate(members)])
        assert got.dtype == np.dtype(dtype), got.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"allgather {dtype}")
        np.testing.assert_array_equal(comm.broadcast(mine, p - 1), base[members[-1]], err_msg=f"bcast {dtype}")
        got = comm.alltoall(np.repeat(mine[:2][None], p, axis=0).reshape(p * 2))
        np.testing.assert_array_equal(got, np.concatenate([base[m][:2] for m in members]), err_msg=dtype)
        buf = np.zeros_like(mine)
        right, left = (r + 1) % p, (r - 1) % p
        hs, hr = comm.send_async(mine, right, tag=5), comm.recv_async(buf, left, tag=5)
        assert hr.wait() is buf
        hs.wait()
        np.testing.assert_array_equal(buf, base[members[left]], err_msg=f"send/recv {dtype}")
    # TF inputs come back as TF tensors; variables can be written in place.
    t = tf.constant([float(world_rank + 1)] * 3)
    out = comm.allreduce(t, "product")
    assert tf.is_tensor(out) and float(out[0]) == float(np.prod([m + 1 for m in members]))
    v = tf.Variable([float(world_rank)] * 2)
    assert comm.broadcast(v, 0, inplace=True) is v and float(v[0]) == members[0]


def extras() -> None:
    import tensorflow as tf

    world = _world()
    assert world.size >= 2
    _odd_dtypes(world, world.rank, list(range(world.size)))
    # A group whose rank order is the reverse of the engine's task order.
    members = list(range(world.size - 1, -1, -1))
    rev = world.split(ranks=members)
    assert rev.rank == members.index(world.rank)
    np.testing.assert_array_equal(rev.allgather(np.array([world.rank])), members)
    assert rev.allgather_object(world.rank) == members
    assert rev.broadcast_object(("root", world.rank), root=0) == ("root", members[0])
    _odd_dtypes(rev, world.rank, members)
    by_key = world.split(color=0, key=-world.rank)
    np.testing.assert_array_equal(by_key.allgather(np.array([world.rank])), members)
    # Uneven alltoall in the reversed group: rank i sends i + j + 1 rows to rank j.
    p, r = rev.size, rev.rank
    splits = [r + j + 1 for j in range(p)]
    x = np.arange(sum(splits) * 2, dtype=np.float32).reshape(-1, 2) + 100 * world.rank
    got = rev.alltoall(x, splits=splits)
    pieces = []
    for i, m in enumerate(members):
        theirs = [i + j + 1 for j in range(p)]
        xs = np.arange(sum(theirs) * 2, dtype=np.float32).reshape(-1, 2) + 100 * m
        off = sum(theirs[:r])
        pieces.append(xs[off: off + theirs[r]])
    np.testing.assert_array_equal(got, np.concatenate(pieces))
    # Misuse is refused before any rank reaches the engine.
    for bad in (lambda: world.allreduce(tf.constant([1.0]), inplace=True),
                lambda: world.recv(tf.constant([1.0]), (world.rank + 1) % world.size),
                lambda: world.allreduce([1.0, 2.0])):
        try:
            bad()
        except TypeError:
            pass
        else:
            raise AssertionError("expected TypeError")
    _checked(world)
    world.barrier()


def _checked(world) -> None:
    """CheckedCommunicator over the tf backend, with a timeout: arrival handshakes go point-to-point."""
    from shardwise.backends.checked import CheckedCommunicator
    from shardwise.core.errors import CollectiveMismatchError

    checked = CheckedCommunicator(world, timeout=60)
    np.testing.assert_array_equal(checked.allreduce(np.ones(3), "sum"), np.full(3, world.size))
    try:
        checked.allreduce(np.ones(2 + world.rank), "sum")
    except CollectiveMismatchError:
        pass
    else:
        raise AssertionError("a shape mismatch must be caught before the engine sees it")
    np.testing.assert_array_equal(checked.allgather(np.array([world.rank])), np.arange(world.size))


def keras() -> None:
    """keras_dp's fit equivalence and TF API scenarios, with the world on the tf backend."""
    import keras_dp

    world = _world()
    keras_dp.fit_equivalence(["sgd"], extras=False, backend="tf")
    keras_dp.tensorflow_api(with_strategy=True)  # a second MWMS joins the runtime shardwise started
    assert shardwise.current().world is world and world.backend == "tf"


def horovod_order() -> None:
    """Import, TF ops, then init (Horovod's order); the import alone starts the collective runtime."""
    os.environ["SHARDWISE_BACKEND"] = "tf"  # as exported by the launcher, read on import and by init
    import tensorflow as tf

    from shardwise.backends.tf._runtime import collectives_enabled, tf_started

    assert not tf_started()
    import shardwise.tensorflow as hvd

    assert collectives_enabled(), "importing shardwise.tensorflow must start the runtime"
    rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    var = tf.Variable(np.arange(4, dtype=np.float32) + 10 * rank)  # TF runs ops before init
    assert tf.config.list_physical_devices("CPU")
    hvd.init()
    ctx = shardwise.current()
    assert ctx.backend == "tf" and ctx.world.backend == "tf" and (hvd.rank(), hvd.size()) == (rank, size)
    _horovod_collectives(hvd, rank, size)
    _in_graph_mode(hvd, rank, size)
    hvd.broadcast_variables([var], root_rank=size - 1)
    np.testing.assert_array_equal(var.numpy(), np.arange(4) + 10 * (size - 1))
    strategy = ctx.owned["tf_strategy"]
    hvd.shutdown()
    hvd.init()  # the runtime outlives the context: a new world joins the same one
    assert shardwise.current().owned["tf_strategy"] is strategy
    _horovod_collectives(hvd, rank, size)
    _inside_strategy(hvd, rank, size)
    hvd.shutdown()


def _rank_data(r: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``r``'s float and int inputs; rows of the float one differ per rank (uneven allgather)."""
    x = (np.arange(3 * (r + 1), dtype=np.float32).reshape(r + 1, 3) + 0.5) * (r + 1)
    return x, np.array([r + 1, 7 * r - 3, 2], np.int32)


def _horovod_collectives(hvd, rank: int, size: int) -> None:
    """allreduce, allgather and broadcast, eagerly and in tf.function, against numpy over all ranks' inputs."""
    import tensorflow as tf

    inputs = [_rank_data(r) for r in range(size)]
    x, n = (tf.constant(a) for a in inputs[rank])
    first_rows = np.stack([a[0] for a, _ in inputs])
    want = {"sum": first_rows.sum(0), "avg": first_rows.mean(0), "max": np.stack([b for _, b in inputs]).max(0),
            "gather": np.concatenate([a for a, _ in inputs]), "bcast": inputs[size - 1][1]}

    def step(x, n):
        return {"sum": hvd.allreduce(x[0], op=hvd.Sum), "avg": hvd.allreduce(x[0]),
                "max": hvd.allreduce(n, op=hvd.Max), "gather": hvd.allgather(x),
                "bcast": hvd.broadcast(n, root_rank=size - 1)}

    for how, fn in (("eager", step), ("tf.function", tf.function(step))):
        got = fn(x, n)
        for key, value in want.items():
            np.testing.assert_allclose(got[key].numpy(), value, rtol=1e-6, err_msg=f"{key} {how}")
            assert got[key].dtype.as_numpy_dtype == value.dtype, (key, how, got[key].dtype)


def _in_graph_mode(hvd, rank: int, size: int) -> None:
    """Object collectives called while a TF1 graph is the default (Horovod's tests run each test so too)."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    with tf.Graph().as_default(), context.graph_mode():
        assert hvd.allgather_object({"r": rank, "pad": "x" * rank}) == [{"r": r, "pad": "x" * r} for r in range(size)]
        assert hvd.broadcast_object(("root", rank), root_rank=size - 1) == ("root", size - 1)
    assert hvd.broadcast_object(("again", rank), root_rank=0) == ("again", 0)  # the ranks are still in step


def _inside_strategy(hvd, rank: int, size: int) -> None:
    """shardwise collectives inside strategy.run beside the strategy's own all_reduce, in one runtime."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # the user's: TF_CONFIG came from the import
    assert strategy.num_replicas_in_sync == size
    x = tf.constant([rank + 1.0, 10.0 * rank])
    want_sum = np.sum([[r + 1.0, 10.0 * r] for r in range(size)], axis=0)
    want_rows = np.array([[r + 1.0, 10.0 * r] for r in range(size)])

    def replica_step(v):
        own = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, v)
        return own, hvd.allreduce(v, op=hvd.Sum), hvd.allgather(v[None]), hvd.broadcast(v, root_rank=0)

    for how, run in (("eager", lambda: strategy.run(replica_step, args=(x,))),
                     ("tf.function", tf.function(lambda: strategy.run(replica_step, args=(x,))))):
        own, ours, rows, root = (strategy.experimental_local_results(t)[0].numpy() for t in run())
        np.testing.assert_allclose(own, want_sum, err_msg=f"strategy all_reduce {how}")
        np.testing.assert_allclose(ours, want_sum, err_msg=f"hvd.allreduce in strategy.run {how}")
        np.testing.assert_allclose(rows, want_rows, err_msg=f"hvd.allgather in strategy.run {how}")
        np.testing.assert_allclose(root, [1.0, 0.0], err_msg=f"hvd.broadcast in strategy.run {how}")
