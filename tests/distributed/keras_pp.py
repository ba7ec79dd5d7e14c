"""Keras pipeline parallelism (layer split over 2 ranks) checked against one-process training."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((5,), dtype="float64")]
    layers += [keras.layers.Dense(7, activation="tanh", dtype="float64") for _ in range(3)]
    return keras.Sequential(layers + [keras.layers.Dense(2, dtype="float64")])


def _mse(y_true, y_pred):
    """Mean squared error, exact in float64 on every backend (Keras-torch's ``ops.mean`` is not)."""
    import keras

    return keras.ops.sum(keras.ops.square(y_true - y_pred)) / float(np.prod(tuple(y_pred.shape)))


def _float64() -> None:
    """float64 everywhere (losses and optimizers too), for a tight tolerance; JAX with x64 arrays."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 arrays, as on the other backends
    keras.config.set_floatx("float64")


def _compare(where: Any, schedules: list[list], rows: int, mine: slice, what: str) -> None:
    """For each ``[schedule, microbatches]``: a KerasPipeline over ``where`` (a communicator or a mesh's
    groups) trains 3 steps on the ``mine`` rows of each ``rows``-sample batch; its loss and this rank's
    weights equal one-process training on the whole batches."""
    import keras

    from shardwise.adapters.keras.pipeline.stage_grad import forward_for_backward
    from shardwise.keras import KerasPipeline

    rng = np.random.default_rng(5)
    # Keras-torch computes a float64 Dense layer to about 1e-7 of float64 torch (float32-like), so a
    # micro-batched run and a full-batch one round differently there; TF and JAX (x64) are exact.
    rtol, atol = (1e-6, 1e-7) if keras.backend.backend() == "torch" else (1e-9, 1e-12)
    for name, m in schedules:
        ref, model = _model(1), _model(2)
        model.set_weights(ref.get_weights())
        pipe = KerasPipeline(model, where, _mse, keras.optimizers.SGD(0.1, momentum=0.9),
                             num_microbatches=m, schedule=name)
        ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
        for step in range(3):
            x, y = rng.normal(size=(rows, 5)), rng.normal(size=(rows, 2))
            loss = pipe.train_step(x[mine], y[mine])
            target = keras.ops.convert_to_tensor(y)
            ref_loss, backward = forward_for_backward(lambda a: _mse(target, ref(a, training=True)),
                                                      keras.ops.convert_to_tensor(x), ref.trainable_weights, False)
            ref_opt.apply(backward(None)[1], ref.trainable_weights)
            if pipe.is_last:
                np.testing.assert_allclose(loss, float(keras.ops.convert_to_numpy(ref_loss)), rtol=rtol,
                                           err_msg=f"{what} {name} m={m} step {step}")
            else:
                assert loss is None
        assert len(pipe.layers) >= 1
        held = {id(w) for w in pipe.trainable_weights}
        checked = 0
        for w, r in zip(model.trainable_weights, ref.trainable_weights):
            if id(w) in held:
                np.testing.assert_allclose(keras.ops.convert_to_numpy(w), keras.ops.convert_to_numpy(r),
                                           rtol=rtol, atol=atol, err_msg=f"{what} {name} m={m}: {w.path}")
                checked += 1
        assert checked == len(pipe.trainable_weights) > 0


def train(schedules: list[list]) -> None:
    """For each ``[schedule, microbatches]``: pipeline training equals one-process full-batch training."""
    from keras_dp import _setup

    _float64()
    _compare(_setup(), schedules, 12, slice(None), "pp2")


def train_dp(schedules: list[list]) -> None:
    """dp2 x pp2 on 4 ranks (the mesh's groups, as the torch pipeline takes them): each replica trains on
    its half of the batch, and the result equals one-process training on the whole batch."""
    from keras_dp import _setup
    from shardwise import build_groups

    _float64()
    groups = build_groups(_setup(), dp=2, pp=2)
    _compare(groups, schedules, 16, slice(8 * groups.dp_rank, 8 * groups.dp_rank + 8), "dp2 x pp2")
    print(f"OK keras dp2 x pp2 rank {groups.world.rank}", flush=True)
