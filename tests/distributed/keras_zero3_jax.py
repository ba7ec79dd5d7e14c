"""Keras ZeRO stage 3 on the JAX backend, run on every rank (mpi backend).

The reference is a one-process ``fit`` (plain Keras optimizer, no shardwise) on the
global batch, computed by every rank on its own: rank r's rows of global batch s
are rows ``[s*size*b + r*b, s*size*b + (r+1)*b)``.
"""

from __future__ import annotations

import numpy as np

from keras_dp import _data, _rank_rows, _same_on_all_ranks, _setup

RTOL, ATOL = 1e-5, 1e-6


def _model(seed: int = 7, dim: int = 6, width: int = 33):
    """Odd sizes, so every world size pads some shard (no batch statistics: they are per rank)."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(width, activation="tanh"),
                             keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(1)])


def _inner(kind: str, lr: float = None):
    import keras

    if kind == "sgd":
        return keras.optimizers.SGD(0.05 if lr is None else lr, momentum=0.9)
    return keras.optimizers.Adam(0.01 if lr is None else lr)


def _global_data(comm, steps: int, b: int):
    x, y = _data(steps * comm.size * b, seed=21)
    rows = _rank_rows(steps, comm.size, comm.rank, b)
    return x, y, x[rows], y[rows]


def _close(ref_weights, got_weights, what: str) -> None:
    assert len(ref_weights) == len(got_weights), what
    for w_ref, w in zip(ref_weights, got_weights):
        np.testing.assert_allclose(w, w_ref, rtol=RTOL, atol=ATOL, err_msg=what)


def _reference(kind: str, x, y, batch: int, epochs: int, **fit):
    model = _model()
    model.compile(optimizer=_inner(kind), loss="mse")
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, **fit)
    return model


def equivalence(optimizers: list[str], epochs: int = 2) -> None:
    """fit with ZeRO-3 == one-process fit on the global batch; the step is one compiled jax.jit."""
    from shardwise.keras import ZeroOptimizer
    from shardwise.adapters.keras.zero3_jax_vars import ShardedVariable

    comm = _setup()
    size, b, steps = comm.size, 4, 6
    x, y, xr, yr = _global_data(comm, steps, b)
    for kind in optimizers:
        what = f"{kind} ZeRO-3 on {size} ranks"
        ref = _reference(kind, x, y, size * b, epochs)
        model = _model()
        model.compile(optimizer=ZeroOptimizer(_inner(kind), stage=3), loss="mse")
        model.fit(xr, yr, batch_size=b, epochs=epochs, shuffle=False, verbose=0)
        engine = model.optimizer.stage3_engine
        # Between steps the variables hold only this rank's shard.
        for v, unit in zip(model.trainable_variables, engine.units):
            assert isinstance(v, ShardedVariable), what
            assert tuple(v.value.shape) == (unit.plan.shard_numel,), (what, v.path, v.value.shape)
            assert unit.plan.shard_numel * size == unit.plan.padded_numel
        # The train function is Keras's jax.jit over shardwise's step, traced once for all steps.
        assert engine.steps.traces == 1, (what, engine.steps.traces)
        slot_numel = [int(np.prod(s.shape)) for s in model.optimizer.inner_optimizer.variables if len(s.shape)]
        assert max(slot_numel) == max(u.plan.shard_numel for u in engine.units), (what, slot_numel)
        _close(ref.get_weights(), model.get_weights(), what)
        _same_on_all_ranks(comm, model.get_weights(), what)
        # evaluate / predict on the sharded model give the reference's numbers.
        np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0),
                                   ref.predict(x, batch_size=8, verbose=0), rtol=RTOL, atol=ATOL, err_msg=what)
        np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0),
                                   ref.evaluate(x, y, batch_size=8, verbose=0), rtol=RTOL, err_msg=what)
