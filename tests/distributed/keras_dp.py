"""Keras 3 / TF2 data-parallel scenarios, run on every rank (mpi backend, numpy through the communicator).

References are computed locally: every rank regenerates the global data and runs
plain single-process TensorFlow on the global batch from the same initial weights.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

import shardwise

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _setup(backend: str = "mpi"):
    """World communicator, with the Keras backend kept to few threads (2-core test machines)."""
    import keras

    if shardwise.is_initialized():
        return shardwise.current().world
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(2)
        except RuntimeError:  # TF already runs: an earlier scenario of this shared job set them
            pass
    elif keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)
    return shardwise.init(backend=backend).world


def _iterations(optimizer) -> int:
    import keras

    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _data(n: int, dim: int = 6, seed: int = 123):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(dim, 1))) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _rank_rows(steps: int, size: int, rank: int, b: int) -> np.ndarray:
    """Rows of rank ``rank`` when global batch ``s`` is rows [s*size*b, (s+1)*size*b)."""
    return np.concatenate([np.arange(s * size * b + rank * b, s * size * b + (rank + 1) * b)
                           for s in range(steps)])


def _model(seed: int = 7, dim: int = 6, linear: bool = False):
    import keras

    keras.utils.set_random_seed(seed)
    if linear:
        return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(1, use_bias=False)])
    return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _make_opt(kind: str):
    import keras

    return {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01)}[kind]()


def _same_on_all_ranks(comm, weights, what: str) -> None:
    every = comm.allgather_object([np.asarray(w) for w in weights])
    for r, theirs in enumerate(every):
        for a, b in zip(theirs, weights):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: rank {r} differs from rank {comm.rank}")


def _counting(comm):
    """A fresh sub-communicator whose allreduces, blocking or started async, are counted in ``.calls``."""
    sub = comm.split(color=0)
    sub.calls, inside = 0, [0]
    plain, plain_async = sub.allreduce, sub.allreduce_async

    def counted(*args, **kwargs):
        sub.calls += 1
        inside[0] += 1  # a blocking allreduce may be built on allreduce_async: count it once
        try:
            return plain(*args, **kwargs)
        finally:
            inside[0] -= 1

    def counted_async(*args, **kwargs):
        sub.calls += 0 if inside[0] else 1
        return plain_async(*args, **kwargs)

    sub.allreduce, sub.allreduce_async = counted, counted_async
    return sub


def fit_equivalence(optimizers: list[str], extras: bool = True, backend: str = "mpi") -> None:
    """DistributedOptimizer fit on N ranks with batch b == one-process fit with batch N*b."""
    import keras

    from shardwise.keras import Compression, DistributedOptimizer

    comm = _setup(backend)
    assert shardwise.current().backend == backend
    size, b, steps, epochs = comm.size, 4, 3, 2
    x, y = _data(steps * size * b)
    rows = _rank_rows(steps, size, comm.rank, b)

    def run(opt_kind: str, batch: int, dist_kwargs=None, xs=x, ys=y, cap=None, sub=None, jit="auto"):
        model = _model()
        opt = _make_opt(opt_kind)
        if dist_kwargs is not None:
            kwargs = dict(dist_kwargs, comm=sub) if sub is not None else dict(dist_kwargs)
            if cap is not None:
                kwargs["bucket_cap_bytes"] = cap
            opt = DistributedOptimizer(opt, **kwargs)
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)  # default: "auto"
        model.fit(xs, ys, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        return model

    refs = {}
    for kind in optimizers:
        ref = refs[kind] = run(kind, size * b)
        sub = _counting(comm)
        dist = run(kind, b, {}, x[rows], y[rows], sub=sub)
        for w_ref, w in zip(ref.get_weights(), dist.get_weights()):
            np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg=f"{kind}: weights")
        _same_on_all_ranks(comm, dist.get_weights(), kind)
        assert sub.calls == steps * epochs, f"{kind}: {sub.calls} allreduces, want one fused bucket per step"
        assert _iterations(dist.optimizer) == steps * epochs
        if keras.backend.backend() == "jax":
            assert dist.jit_compile is True, "the JAX train step must stay compiled"
    if not extras:
        return
    # Four tensors, a tiny bucket cap: one collective per tensor.
    sub = _counting(comm)
    run("sgd", b, {}, x[rows], y[rows], cap=1, sub=sub)
    assert sub.calls == 4 * steps * epochs, f"cap=1: {sub.calls} allreduces, want 4 per step"
    # Two accumulated passes (averaged) == one-process batch 2*N*b.
    steps2 = 4
    x2, y2 = _data(steps2 * size * b, seed=5)
    rows2 = _rank_rows(steps2, size, comm.rank, b)
    ref = run("sgd", 2 * size * b, None, x2, y2)
    acc = run("sgd", b, {"backward_passes_per_step": 2, "average_aggregated_gradients": True},
              x2[rows2], y2[rows2])
    for w_ref, w in zip(ref.get_weights(), acc.get_weights()):
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg="backward_passes_per_step=2")
    assert _iterations(acc.optimizer) == steps2 * epochs  # every pass counts
    # fp16 compression: close to the reference, not bitwise.
    ref = refs["sgd"] if "sgd" in refs else run("sgd", size * b)
    fp16 = run("sgd", b, {"compression": Compression.fp16}, x[rows], y[rows])
    for w_ref, w in zip(ref.get_weights(), fp16.get_weights()):
        np.testing.assert_allclose(w, w_ref, rtol=2e-3, atol=2e-3, err_msg="fp16 compression")
    assert keras.backend.backend() == os.environ.get("KERAS_BACKEND", "tensorflow")
    if keras.backend.backend() == "torch":
        # jit_compile=True: Keras runs the train step under torch.compile; each collective is a graph break.
        from compile_scenarios import CompiledFrames

        CompiledFrames.start()
        compiled = run("sgd", b, {}, x[rows], y[rows], jit=True)
        assert compiled.jit_compile is True
        for w_ref, w in zip(ref.get_weights(), compiled.get_weights()):
            np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg="jit_compile=True (torch.compile)")
        CompiledFrames.check("Keras on torch with jit_compile=True")


class _Recorder:
    """Make a callback that stores learning rates per batch and copies of epoch logs."""

    @staticmethod
    def make():
        import keras

        class Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.lrs, self.logs, self.epoch = [], [], 0

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_begin(self, batch, logs=None):
                lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
                self.lrs.append((self.epoch, batch, lr))

            def on_epoch_end(self, epoch, logs=None):
                self.logs.append(dict(logs or {}))

        return Recorder()


def callbacks(tmpdir: str) -> None:
    """Broadcast, metric averaging, warmup (with momentum correction), schedule, checkpoint, XLA."""
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    size, b, steps = comm.size, 4, 6
    x, y = _data(steps * size * b, seed=11)
    rows = _rank_rows(steps, size, comm.rank, b)
    xr, yr = x[rows], y[rows]

    # Broadcast: rank-dependent initial weights end up identical, equal to training rank 0's start.
    model = _model(seed=100 + comm.rank)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    model.fit(xr, yr, batch_size=b, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = _model(seed=100)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ref.fit(x, y, batch_size=size * b, epochs=2, shuffle=False, verbose=0)
    _same_on_all_ranks(comm, model.get_weights(), "broadcast callback")
    for w_ref, w in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg="broadcast then train")

    # Metric averaging: logs after the callback are the mean of every rank's raw logs.
    raw, averaged = _Recorder.make(), _Recorder.make()
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", metrics=["mae"])
    hist = model.fit(xr, yr, batch_size=b, epochs=2, shuffle=False, verbose=0,
                     callbacks=[raw, hvd.callbacks.MetricAverageCallback(), averaged])
    every = comm.allgather_object(raw.logs)
    for epoch, logs in enumerate(averaged.logs):
        for key in ("loss", "mae"):
            want = sum(r[epoch][key] for r in every) / size
            assert abs(logs[key] - want) <= 1e-9 * max(1.0, abs(want)), (key, logs[key], want)
            assert abs(hist.history[key][epoch] - want) <= 1e-9 * max(1.0, abs(want))
    assert len({round(r[0]["loss"], 12) for r in every}) == size, "per-rank losses should differ"

    # Warmup: Horovod's per-batch schedule, momentum correction checked against numpy.
    initial_lr, warmup, epochs = 0.2, 2, 3
    weights = {}
    for correction in (True, False):
        rec = _Recorder.make()
        model = _model(linear=True)
        w0 = model.get_weights()[0].astype(np.float64)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(initial_lr, momentum=0.9)),
                      loss="mse")
        hist = model.fit(xr, yr, batch_size=b, epochs=epochs, shuffle=False, verbose=0, callbacks=[
            hvd.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=warmup,
                                                     momentum_correction=correction), rec])
        weights[correction] = model.get_weights()[0]
    expected = []
    for epoch in range(epochs):
        for batch in range(steps):
            e = min(epoch + batch / steps, warmup - 1 + (steps - 1) / steps) + 1.0 / steps
            expected.append(initial_lr / size * (e * (size - 1) / warmup + 1))
    got = [lr for _, _, lr in rec.lrs]
    np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg="warmup learning rates")
    np.testing.assert_allclose(hist.history["lr"], [expected[steps * (e + 1) - 1] for e in range(epochs)],
                               rtol=1e-6)
    ref_w = {}
    for correction in (True, False):
        w, m, old = w0.copy(), np.zeros_like(w0), initial_lr
        for s, lr in enumerate(expected):
            xb = x[(s % steps) * size * b:(s % steps + 1) * size * b].astype(np.float64)
            yb = y[(s % steps) * size * b:(s % steps + 1) * size * b].astype(np.float64)
            grad = 2.0 / len(xb) * xb.T @ (xb @ w - yb)
            m = (m * lr / old if correction else m) * 0.9 - lr * grad
            w, old = w + m, lr
        ref_w[correction] = w
    np.testing.assert_allclose(weights[True], ref_w[True], rtol=1e-4, atol=1e-6, err_msg="momentum correction")
    np.testing.assert_allclose(weights[False], ref_w[False], rtol=1e-4, atol=1e-6, err_msg="no correction")
    assert np.abs(ref_w[True] - ref_w[False]).max() > 1e-3, "correction should matter in this setup"

    # Staircase schedule: lr = initial * 0.5**epoch during epochs [1, 3).
    rec = _Recorder.make()
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(xr, yr, batch_size=b, epochs=4, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1, end_epoch=3), rec])
    by_epoch = {e: lr for e, batch, lr in rec.lrs if batch == steps - 1}
    np.testing.assert_allclose([by_epoch[e] for e in range(4)], [0.1, 0.2, 0.1, 0.1], rtol=1e-6)

    # Checkpoint: rank 0 alone writes, atomically (no temp files left), a loadable model.
    path = os.path.join(tmpdir, "best.keras")
    ckpt = hvd.callbacks.BestModelCheckpoint(path, monitor="val_loss")
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(xr, yr, batch_size=b, epochs=3, shuffle=False, verbose=0, validation_data=(x[:8], y[:8]),
              callbacks=[hvd.callbacks.MetricAverageCallback(), ckpt])
    comm.barrier()
    assert bool(ckpt.saved) == (comm.rank == 0), f"rank {comm.rank} saved {ckpt.saved}"
    if comm.rank == 0:
        assert sorted(os.listdir(tmpdir)) == ["best.keras"], os.listdir(tmpdir)
        loaded = keras.models.load_model(path)
        assert type(loaded.optimizer).__name__ == "DistributedOptimizer"
    comm.barrier()

    if keras.backend.backend() == "jax":
        # JAX: the train step stays compiled; the collectives are host callbacks inside it.
        model = _model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
        model.fit(xr, yr, batch_size=b, epochs=1, verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback()])
        assert model.jit_compile is True
        _same_on_all_ranks(comm, model.get_weights(), "compiled JAX step")
    if keras.backend.backend() != "tensorflow":
        return
    # XLA: jit_compile=True is turned off by fit itself (keras_nonfinite.py) and again, harmlessly, by callbacks.
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(xr, yr, batch_size=b, epochs=1, verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback()])
    assert model.jit_compile is False and any("jit_compile" in str(w.message) for w in caught)


def tensorflow_api(with_strategy: bool = False) -> None:
    """shardwise.tensorflow: collectives (eager and traced), broadcast_variables, shard, DistributedGradientTape.

    With ``with_strategy`` the job first builds the multi-worker strategy (which must come before other TF work).
    """
    import keras
    import tensorflow as tf

    import shardwise.tensorflow as hvd

    if with_strategy:
        multi_worker_strategy()
    comm = _setup()
    size, rank = comm.size, comm.rank
    t = tf.constant([rank + 1.0, 2.0 * rank])
    want_sum = np.array([sum(r + 1.0 for r in range(size)), sum(2.0 * r for r in range(size))])
    np.testing.assert_allclose(hvd.allreduce(t).numpy(), want_sum / size)
    np.testing.assert_allclose(tf.function(lambda v: hvd.allreduce(v, average=False))(t).numpy(), want_sum)
    np.testing.assert_allclose(hvd.allreduce(t, op="max").numpy(), [size, 2.0 * (size - 1)])
    gathered = tf.function(hvd.allgather)(tf.fill([rank + 1, 2], float(rank)))
    assert gathered.shape == (size * (size + 1) // 2, 2), gathered.shape
    np.testing.assert_array_equal(gathered.numpy()[:, 0], np.repeat(np.arange(size), np.arange(1, size + 1)))
    assert int(hvd.broadcast(tf.constant([rank]), root_rank=size - 1).numpy()[0]) == size - 1
    tv, kv = tf.Variable(np.full(3, rank, np.float32)), keras.Variable(np.full((2, 2), rank, np.int64))
    hvd.broadcast_variables([tv, kv], root_rank=size - 1)
    assert (tv.numpy() == size - 1).all() and (kv.numpy() == size - 1).all()
    tv.assign(np.full(3, rank, np.float32))

    @tf.function
    def traced_broadcast():
        hvd.broadcast_variables([tv], root_rank=0)

    traced_broadcast()
    assert (tv.numpy() == 0).all()
    assert list(hvd.shard(tf.data.Dataset.range(10)).as_numpy_iterator()) == list(range(rank, 10, size))

    # Custom loop: DistributedGradientTape on batch b == plain tape on batch size*b.
    b, steps = 4, 3
    x, y = _data(steps * size * b, seed=3)
    rows = _rank_rows(steps, size, rank, b)
    model, ref = _model(), _model()
    ref.set_weights(model.get_weights())
    opt, ref_opt = keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.SGD(0.1, momentum=0.9)
    unused = tf.Variable(1.0)

    def dist_step(xb, yb, wrap_first: bool):
        if wrap_first:
            with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        else:
            with tf.GradientTape() as plain:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            tape = hvd.DistributedGradientTape(plain)
        grads = tape.gradient(loss, model.trainable_variables + [unused])
        assert grads[-1] is None, "a variable without gradient keeps None"
        opt.apply_gradients(zip(grads[:-1], model.trainable_variables))

    def ref_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ref(xb, training=True) - yb))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

    traced, ref_traced = tf.function(lambda a, c: dist_step(a, c, False)), tf.function(ref_step)
    for s in range(steps):
        mine = rows[s * b:(s + 1) * b]
        glob = slice(s * size * b, (s + 1) * size * b)
        if s == steps - 1:  # last step eagerly, tape wrapped before recording
            dist_step(x[mine], y[mine], True)
            ref_step(x[glob], y[glob])
        else:
            traced(x[mine], y[mine])
            ref_traced(x[glob], y[glob])
    for w_ref, w in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg="DistributedGradientTape")
    _same_on_all_ranks(comm, model.get_weights(), "DistributedGradientTape")


def multi_worker_strategy() -> None:
    """strategy() under mpirun builds a MultiWorkerMirroredStrategy whose reduce spans the ranks."""
    import json

    import tensorflow as tf

    import shardwise.tensorflow as hvd

    comm = _setup()
    strategy = hvd.strategy()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), type(strategy)
    config = json.loads(os.environ["TF_CONFIG"])
    assert config["task"] == {"type": "worker", "index": comm.rank} and len(config["cluster"]["worker"]) == comm.size
    assert strategy.num_replicas_in_sync == comm.size
    per_replica = strategy.run(lambda: tf.constant(float(comm.rank + 1)))
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    assert float(total) == comm.size * (comm.size + 1) / 2, float(total)
