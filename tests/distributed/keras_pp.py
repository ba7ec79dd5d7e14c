"""Keras pipeline parallelism (layer split over 2 ranks) checked against one-process training."""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((5,), dtype="float64")]
    layers += [keras.layers.Dense(7, activation="tanh", dtype="float64") for _ in range(3)]
    return keras.Sequential(layers + [keras.layers.Dense(2, dtype="float64")])


def train(schedules: list[list]) -> None:
    """For each ``[schedule, microbatches]``: pipeline training equals full-batch ``train_on_batch``."""
    import keras

    from keras_dp import _setup

    if keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 arrays, as on the other backends

    from shardwise.adapters.keras.pipeline import KerasPipeline

    keras.config.set_floatx("float64")  # losses and optimizers too, for a tight tolerance
    comm = _setup()
    rng = np.random.default_rng(5)
    for name, m in schedules:
        ref, model = _model(1), _model(2)
        model.set_weights(ref.get_weights())
        pipe = KerasPipeline(model, comm, keras.losses.MeanSquaredError(), keras.optimizers.SGD(0.1, momentum=0.9),
                             num_microbatches=m, schedule=name)
        ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=keras.losses.MeanSquaredError())
        for step in range(3):
            x, y = rng.normal(size=(12, 5)), rng.normal(size=(12, 2))
            loss = pipe.train_step(x, y)
            ref_loss = ref.train_on_batch(x, y)
            if pipe.is_last:
                # train_on_batch reports the loss through a float32 metric on some backends
                np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-6, err_msg=f"{name} m={m} step {step}")
            else:
                assert loss is None
        assert len(pipe.layers) >= 1
        mine = {id(w) for w in pipe.trainable_weights}
        checked = 0
        for w, r in zip(model.trainable_weights, ref.trainable_weights):
            if id(w) in mine:
                np.testing.assert_allclose(keras.ops.convert_to_numpy(w), keras.ops.convert_to_numpy(r),
                                           rtol=1e-9, atol=1e-12, err_msg=f"{name} m={m}: {w.path}")
                checked += 1
        assert checked == len(pipe.trainable_weights) > 0
