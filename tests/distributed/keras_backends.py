"""Scenarios that run on every Keras backend (KERAS_BACKEND=tensorflow, torch or jax), on every rank.

``portable_api``: Horovod's collectives of ``shardwise.keras`` on the torch and JAX
backends (TensorFlow has its own in keras_hvd.py). ``mixed_precision``: under
``mixed_float16`` one rank's gradients overflow; every rank must take the same
loss-scale branch, and the run must equal itself on every rank.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from keras_dp import _counting, _data, _iterations, _rank_rows, _same_on_all_ranks, _setup


def portable_api() -> None:
    import keras

    import shardwise.keras as hvd

    assert keras.backend.backend() in ("torch", "jax"), keras.backend.backend()
    assert "tensorflow" not in sys.modules, "shardwise.keras must not import TensorFlow on torch or JAX"
    _setup()
    hvd.init()
    r, p = hvd.rank(), hvd.size()

    np.testing.assert_allclose(_arr(hvd.allreduce(np.array([r, 1.0], np.float32))), [(p - 1) / 2, 1.0])
    np.testing.assert_allclose(_arr(hvd.allreduce(np.array([2.0], np.float32), op=hvd.Sum, prescale_factor=0.5)), [p])
    assert tuple(hvd.allgather(np.full((r + 1, 2), r, np.float32)).shape) == (p * (p + 1) // 2, 2)
    assert int(_arr(hvd.broadcast(np.array([r], np.int32), root_rank=p - 1))[0]) == p - 1
    np.testing.assert_allclose(_arr(hvd.reducescatter(np.ones((2 * p, 3), np.float32), op=hvd.Sum)),
                               np.full((2, 3), p))
    out, received = hvd.alltoall(np.arange(p, dtype=np.float32) + 10 * r, splits=[1] * p)
    np.testing.assert_allclose(_arr(out), [10 * k + r for k in range(p)])
    assert _arr(received).tolist() == [1] * p
    hvd.barrier()
    assert hvd.broadcast_object({"r": r}, root_rank=p - 1) == {"r": p - 1}
    assert hvd.allgather_object(r) == list(range(p))
    assert hvd.join() == p - 1 or p == 1

    check_broadcast_callback_keeps_local_variables(hvd, r)
    check_load_model_wraps_optimizer(hvd, r)
    hvd.shutdown()


def _arr(t):
    import keras

    return keras.ops.convert_to_numpy(t)


def check_broadcast_callback_keeps_local_variables(hvd, r: int) -> None:
    """The broadcast callback leaves ``local_variables`` alone; broadcast_global_variables does not."""
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    for v in model.variables:
        v.assign(np.full(v.shape, float(r), np.float32))
    keep = model.layers[1].kernel
    xs, ys = np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32)
    model.fit(xs, ys, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[keep])])
    assert (_arr(keep) == r).all() and (_arr(model.layers[0].kernel) == 0).all()
    hvd.broadcast_global_variables(0, model)
    assert (_arr(keep) == 0).all()


def check_load_model_wraps_optimizer(hvd, r: int) -> None:
    """A plain Keras save comes back with a DistributedOptimizer and its state, twice."""
    import keras

    xs, ys = np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(xs, ys, epochs=2, verbose=0)
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "m.keras"))
    if r == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer) and _iterations(loaded.optimizer) == 2
    loaded.fit(xs, ys, epochs=1, verbose=0)
    hvd.barrier()
    if r == 0:
        loaded.save(path)
    hvd.barrier()
    again = hvd.load_model(path)
    assert isinstance(again.optimizer, hvd.DistributedOptimizer) and _iterations(again.optimizer) == 3


def mixed_precision(steps: int = 6) -> None:
    """mixed_float16 with the LossScaleOptimizer compile() adds: an overflow on one rank skips everywhere."""
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    size, b = comm.size, 4
    x, y = _data(steps * size * b, seed=31)
    rows = _rank_rows(steps, size, comm.rank, b)
    xr, yr = x[rows].copy(), y[rows].copy()
    if comm.rank == size - 1:
        xr[2 * b] = 7e4  # float16 overflow in step 2 on the last rank only
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer), type(model.optimizer)
        model.fit(xr, yr, batch_size=b, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.MetricAverageCallback()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    lso = model.optimizer
    scale = float(keras.ops.convert_to_numpy(lso.dynamic_scale))
    skipped = int(round(np.log2(2.0 ** 15 / scale)))  # each overflow halves the initial 2**15
    assert skipped >= 1 and scale == 2.0 ** (15 - skipped), f"loss scale {scale}"
    # The inner optimizer stepped on the steps finite on every rank, and only on those.
    assert _iterations(lso.inner_optimizer) == steps - skipped, (_iterations(lso.inner_optimizer), skipped)
    _same_on_all_ranks(comm, model.get_weights(), "mixed precision")
    _same_on_all_ranks(comm, [np.array(scale)], "loss scale")
    assert all(np.isfinite(w).all() for w in model.get_weights())


def digits_example(argv: list[str]) -> None:
    """Run ``examples/keras_digits.py`` with ``argv`` (its ``--backend`` flag included)."""
    import runpy
    from pathlib import Path

    sys.argv = ["keras_digits.py", *argv]
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "keras_digits.py"), run_name="__main__")


def replaced_optimizer() -> None:
    """Recompiling with a plain optimizer ends data parallelism: the old optimizer's hooks stop (torch)."""
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    x, y = _data(8 * comm.size, seed=41)
    rows = _rank_rows(2, comm.size, comm.rank, 4)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    sub = _counting(comm)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), comm=sub), loss="mse")
    model.fit(x[rows], y[rows], batch_size=4, epochs=1, shuffle=False, verbose=0)
    _same_on_all_ranks(comm, model.get_weights(), "data parallel")
    before = sub.calls
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mine = x[rows] + comm.rank  # different data per rank: the weights must now drift apart
    model.fit(mine, y[rows], batch_size=4, epochs=2, shuffle=False, verbose=0)
    every = comm.allgather_object([np.asarray(w) for w in model.get_weights()])
    assert not np.allclose(every[0][0], every[-1][0]), "the replaced optimizer still averages gradients"
    # torch: the old optimizer's gradient hooks may reduce one more round, then must stop (4 passes ran).
    assert sub.calls - before <= 1, f"{sub.calls - before} allreduces after the optimizer was replaced"
