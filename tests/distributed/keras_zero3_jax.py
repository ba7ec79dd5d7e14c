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
    from shardwise.keras import ZeroOptimizer, full_weights
    from shardwise.adapters.keras.zero.jax.variables import ShardedVariable

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
        # Inside full_weights one rank alone may read (no collective there); writes reach the shards.
        with full_weights(model):
            if comm.rank == 0:
                _close(ref.get_weights(), model.get_weights(), what + " in full_weights")
            model.trainable_variables[-1].assign(np.full(model.trainable_variables[-1].shape, 0.5, "float32"))
        np.testing.assert_array_equal(model.trainable_variables[-1].numpy(), 0.5)


def regularized(epochs: int = 2) -> None:
    """Weight regularizers, and a layer adding a loss on its own kernel: fit equals one process.

    The penalties need whole variables, so they are computed inside each layer's
    gathered call; their gradients, and the added loss's, go back through its backward.
    """
    import keras
    from shardwise.keras import ZeroOptimizer

    comm = _setup()
    size, b, steps = comm.size, 4, 5
    x, y, xr, yr = _global_data(comm, steps, b)

    class Penalized(keras.layers.Dense):
        def call(self, inputs, training=None):
            self.add_loss(0.05 * keras.ops.sum(keras.ops.square(self.kernel)))
            return super().call(inputs, training=training)

    def regularized_model(own_loss: bool):
        keras.utils.set_random_seed(7)
        first = (Penalized if own_loss else keras.layers.Dense)(
            33, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05),
            bias_regularizer=keras.regularizers.L1(0.05))
        second = keras.layers.Dense(33, activation="tanh", kernel_regularizer=keras.regularizers.L1L2(0.01, 0.05))
        return keras.Sequential([keras.Input((6,)), first, second, keras.layers.Dense(1)])

    for own_loss in (False, True):
        what = f"ZeRO-3 on {size} ranks, {'a loss added in call' if own_loss else 'weight regularizers'}"
        ref = regularized_model(own_loss)
        ref.compile(optimizer=_inner("adam"), loss="mse")
        ref.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0)
        model = regularized_model(own_loss)
        model.compile(optimizer=ZeroOptimizer(_inner("adam"), stage=3), loss="mse")
        model.fit(xr, yr, batch_size=b, epochs=epochs, shuffle=False, verbose=0)
        _close(ref.get_weights(), model.get_weights(), what)
        # evaluate's loss includes the penalty (or the added loss) on the whole weights.
        np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0),
                                   ref.evaluate(x, y, batch_size=8, verbose=0), rtol=RTOL, err_msg=what)
        plain = _model()  # the same layers without any penalty train elsewhere
        plain.compile(optimizer=_inner("adam"), loss="mse")
        plain.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0)
        if comm.rank == 0:
            moved = max(float(np.abs(a - c).max()) for a, c in zip(ref.get_weights(), plain.get_weights()))
            print(f"{what}: equal to one process; the penalty moved the weights by up to {moved:.1e}", flush=True)


def compiled_step() -> None:
    """The train function is one jax.jit of shardwise's step: traced once, abstract shards in, collectives inside."""
    import jax
    import keras
    from shardwise.keras import ZeroOptimizer

    comm = _setup()
    size, b, steps = comm.size, 4, 5
    _, _, xr, yr = _global_data(comm, steps, b)
    model = _model()
    model.compile(optimizer=ZeroOptimizer(_inner("adam"), stage=3), loss="mse")
    model.fit(xr, yr, batch_size=b, epochs=3, shuffle=False, verbose=0)
    engine = model.optimizer.stage3_engine
    assert engine.steps.traces == 1 and engine.steps.traced_abstract, (engine.steps.traces,
                                                                       engine.steps.traced_abstract)
    assert int(keras.ops.convert_to_numpy(model.optimizer.inner_optimizer.iterations)) == 3 * steps
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    assert [tuple(s.shape) for s in state[0]] == [(u.plan.shard_numel,) for u in engine.units]
    jaxpr = str(jax.make_jaxpr(engine.steps.train_step)(tuple(state), (xr[:b], yr[:b])))
    calls = jaxpr.count("io_callback")
    variables = len(engine.units)
    if size > 1:
        # Per variable: a gather in the forward, a gather again in the backward, a reduce-scatter.
        assert calls == 3 * variables, (calls, variables)
    else:
        assert calls == 0, calls
    if comm.rank == 0:
        print(f"compiled ZeRO-3 step on {size} ranks: traced once over {3 * steps} steps, "
              f"{calls} ordered io_callbacks in its jaxpr", flush=True)


def callbacks(epochs: int = 3) -> None:
    """Broadcast (ranks built from different seeds), metric average and LR warm-up around a ZeRO-3 fit."""
    import keras
    from shardwise.keras import ZeroOptimizer
    from shardwise.keras import callbacks as hcb

    comm = _setup()
    size, b, steps = comm.size, 4, 6
    x, y, xr, yr = _global_data(comm, steps, b)

    def warmup():
        return hcb.LearningRateWarmupCallback(initial_lr=0.01, warmup_epochs=2, steps_per_epoch=steps,
                                              momentum_correction=False)

    ref = _model()
    ref.compile(optimizer=_inner("adam"), loss="mse")
    ref_hist = ref.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0, callbacks=[warmup()])
    model = _model(seed=7 + comm.rank)  # rank 0's weights must win
    model.compile(optimizer=ZeroOptimizer(_inner("adam"), stage=3), loss="mse")
    hist = model.fit(xr, yr, batch_size=b, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[hcb.BroadcastGlobalVariablesCallback(0), hcb.MetricAverageCallback(), warmup()])
    what = f"callbacks on {size} ranks"
    _close(ref.get_weights(), model.get_weights(), what)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=RTOL, err_msg=what)
    lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    np.testing.assert_allclose(lr, float(keras.ops.convert_to_numpy(ref.optimizer.learning_rate)), rtol=1e-6)


STEPS_MP, OVERFLOW_STEP, HUGE = 6, 2, 7e4


def _train_mixed(distributed: bool, x, y, batch: int):
    import keras
    from shardwise.keras import ZeroOptimizer

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(9, activation="tanh"),
                                  keras.layers.Dense(1, dtype="float32")])
        inner = keras.optimizers.Adam(0.01)
        model.compile(optimizer=ZeroOptimizer(inner, stage=3) if distributed else inner, loss="mse")
        lso = model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer), type(lso)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    inner_opt = lso.inner_optimizer.inner_optimizer if distributed else lso.inner_optimizer
    return (model, float(keras.ops.convert_to_numpy(lso.dynamic_scale)),
            int(keras.ops.convert_to_numpy(inner_opt.iterations)))


def mixed_precision() -> None:
    """mixed_float16: the LossScaleOptimizer compile adds decides finiteness for all ranks; one rank overflows."""
    comm = _setup()
    size = comm.size
    x, y = _data(STEPS_MP * size * 4, seed=31)
    x, y = x * 0.25, y * 0.25
    x[(OVERFLOW_STEP * size + size - 1) * 4] = HUGE  # one row of the last rank's batch at that step
    rows = _rank_rows(STEPS_MP, size, comm.rank, 4)
    ref, ref_scale, ref_steps = _train_mixed(False, x, y, size * 4)
    model, scale, steps = _train_mixed(True, x[rows], y[rows], 4)
    what = f"mixed_float16 ZeRO-3 on {size} ranks"
    assert (ref_scale, ref_steps) == (2.0 ** 14, STEPS_MP - 1), (what, "reference", ref_scale, ref_steps)
    assert (scale, steps) == (ref_scale, ref_steps), (what, scale, steps)
    weights = model.get_weights()
    _same_on_all_ranks(comm, weights + [np.array(scale)], what)
    for w_ref, w in zip(ref.get_weights(), weights):
        assert np.isfinite(w).all(), what
        # float16 layers: the reference sums 2x as many rows per product, so not bitwise.
        np.testing.assert_allclose(w, w_ref, rtol=1e-3, atol=1e-4, err_msg=what)


def refusals() -> None:
    """Bad input is refused with errors that name it, on every rank alike (no hang)."""
    import keras
    import pytest
    from shardwise.core.errors import ConfigError, ShardwiseError
    from shardwise.keras import ZeroOptimizer
    from shardwise.adapters.keras.ops import broadcast_variables

    comm = _setup()
    _, _, xr, yr = _global_data(comm, 2, 4)

    def fit(model):
        model.compile(optimizer=ZeroOptimizer(_inner("sgd"), stage=3), loss="mse")
        model.fit(xr, yr, batch_size=4, epochs=1, shuffle=False, verbose=0)
        return model

    def dense_model(**kw):
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, **kw), keras.layers.Dense(1)])

    with pytest.raises(ConfigError, match="constraint"):
        fit(dense_model(kernel_constraint="non_neg"))

    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    with pytest.raises(ConfigError, match="overrides train_step"):
        fit(OwnStep([keras.Input((6,)), keras.layers.Dense(1)]))
    model = fit(_model())
    kernel = model.trainable_variables[0]
    with pytest.raises(ShardwiseError, match="takes the full value"):
        kernel.assign(np.zeros((3, 3), "float32"))
    with pytest.raises(ShardwiseError, match="Rank-blind"):
        broadcast_variables(model.trainable_variables, 0)  # would copy rank 0's shard into every rank
    with pytest.raises(ConfigError, match="optimizer.apply"):
        model.optimizer.apply([np.zeros(v.shape, "float32") for v in model.trainable_variables])
    # A full assignment on every rank lands in each rank's own range.
    full = np.arange(np.prod(kernel.shape), dtype="float32").reshape(kernel.shape)
    kernel.assign(full)
    np.testing.assert_array_equal(kernel.numpy(), full)
    model.set_weights([w * 0 + 1 for w in model.get_weights()])
    assert all((w == 1).all() for w in model.get_weights())


def sharded_build_matches() -> None:
    """A model built inside sharded_build (no whole variable on any rank) trains like the one-process model."""
    from shardwise.keras import ZeroOptimizer, sharded_build

    comm = _setup()
    size, b, steps = comm.size, 4, 6
    x, y, xr, yr = _global_data(comm, steps, b)
    ref = _model()
    initial = ref.get_weights()
    ref.compile(optimizer=_inner("adam"), loss="mse")
    ref.fit(x, y, batch_size=size * b, epochs=1, shuffle=False, verbose=0)
    with sharded_build():
        model = _model()
    assert all(v.__dict__.get("_value") is None for v in model.trainable_variables)
    model.compile(optimizer=ZeroOptimizer(_inner("adam"), stage=3), loss="mse")
    model.optimizer.build(model.trainable_variables)
    _close(initial, model.get_weights(), f"sharded_build initial values on {size} ranks")
    model.fit(xr, yr, batch_size=b, epochs=1, shuffle=False, verbose=0)
    _close(ref.get_weights(), model.get_weights(), f"sharded_build fit on {size} ranks")
