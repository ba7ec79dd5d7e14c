"""Keras pipeline parallelism (layer split over 2 ranks) checked against one-process training."""

from __future__ import annotations

import os

import numpy as np

import shardwise

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((5,), dtype="float64")]
    layers += [keras.layers.Dense(7, activation="tanh", dtype="float64") for _ in range(3)]
    return keras.Sequential(layers + [keras.layers.Dense(2, dtype="float64")])


def train(schedules: list[list]) -> None:
    """For each ``[schedule, microbatches]``: pipeline training equals full-batch training."""
    import keras
    import tensorflow as tf

    from shardwise.adapters.keras_pipeline import KerasPipeline

    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.config.set_floatx("float64")  # losses and optimizers too, for a tight tolerance
    comm = shardwise.init(backend="mpi").world
    rng = np.random.default_rng(5)
    for name, m in schedules:
        ref, model = _model(1), _model(2)
        model.set_weights(ref.get_weights())
        pipe = KerasPipeline(model, comm, keras.losses.MeanSquaredError(), keras.optimizers.SGD(0.1, momentum=0.9),
                             num_microbatches=m, schedule=name)
        ref_opt, loss_fn = keras.optimizers.SGD(0.1, momentum=0.9), keras.losses.MeanSquaredError()
        for step in range(3):
            x, y = rng.normal(size=(12, 5)), rng.normal(size=(12, 2))
            loss = pipe.train_step(x, y)
            with tf.GradientTape() as tape:
                ref_loss = loss_fn(y, ref(x, training=True))
            ref_opt.apply_gradients(zip(tape.gradient(ref_loss, ref.trainable_weights), ref.trainable_weights))
            if pipe.is_last:
                np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-9, err_msg=f"{name} m={m} step {step}")
            else:
                assert loss is None
        assert len(pipe.layers) >= 1
        mine = {id(w) for w in pipe.trainable_weights}
        checked = 0
        for w, r in zip(model.trainable_weights, ref.trainable_weights):
            if id(w) in mine:
                np.testing.assert_allclose(np.asarray(w), np.asarray(r), rtol=1e-9, atol=1e-12,
                                           err_msg=f"{name} m={m}: {w.path}")
                checked += 1
        assert checked == len(pipe.trainable_weights) > 0
