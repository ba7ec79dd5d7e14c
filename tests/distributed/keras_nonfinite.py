"""Keras 3 mixed precision with no shardwise callback: one rank overflows, every rank skips that step.

Under ``mixed_float16`` a ``LossScaleOptimizer`` checks the gradients for inf/nan
and skips the step when it finds one. Each rank sees only its own gradients, so
without one decision for all ranks the overflowing rank skips while the others
wait in the gradient allreduce (a hang) or, without a collective, diverge. The
decision must come from the optimizer itself, not from a callback: here ``fit``
runs with ``callbacks=[]``. The reference is one process on the global batch,
with the same overflowing row, which skips the same step.
"""

from __future__ import annotations

import warnings

import numpy as np

from keras_dp import _data, _iterations, _rank_rows, _same_on_all_ranks, _setup

STEPS, BATCH, OVERFLOW_STEP = 6, 4, 2
#: float16's largest finite value is 65504: this input becomes inf when the layer casts it.
HUGE = 7e4


def _model(custom_step: bool = False):
    import keras

    keras.utils.set_random_seed(7)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1, dtype="float32")]
    return _CustomStep.make()(layers) if custom_step else keras.Sequential(layers)


class _CustomStep:
    """A Sequential model with its own ``train_step`` on each backend: the loss scaled by hand, mse."""

    @staticmethod
    def make():
        import keras

        backend = keras.backend.backend()

        def mse(pred, y):
            return keras.ops.mean(keras.ops.square(pred - y))

        class TensorFlowStep(keras.Sequential):
            def train_step(self, data):
                import tensorflow as tf

                x, y = data
                with tf.GradientTape() as tape:
                    loss = mse(self(x, training=True), y)
                    scaled = self.optimizer.scale_loss(loss)
                self.optimizer.apply(tape.gradient(scaled, self.trainable_variables), self.trainable_variables)
                return {"loss": loss}

        class TorchStep(keras.Sequential):
            def train_step(self, data):
                import torch

                x, y = data
                self.zero_grad()
                loss = mse(self(x, training=True), y)
                self.optimizer.scale_loss(loss).backward()
                with torch.no_grad():
                    self.optimizer.apply([v.value.grad for v in self.trainable_variables], self.trainable_variables)
                return {"loss": loss}

        class JaxStep(keras.Sequential):
            def train_step(self, state, data):
                import jax

                trainable, non_trainable, optimizer_values, metrics = state
                x, y = data

                def scaled_loss(values):
                    pred, _ = self.stateless_call(values, non_trainable, x, training=True)
                    loss = mse(pred, y)
                    with keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, optimizer_values))):
                        return self.optimizer.scale_loss(loss), loss

                (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trainable)
                trainable, optimizer_values = self.optimizer.stateless_apply(optimizer_values, grads, trainable)
                return {"loss": loss}, (trainable, non_trainable, optimizer_values, metrics)

        return {"tensorflow": TensorFlowStep, "torch": TorchStep, "jax": JaxStep}[backend]


def _optimizer(variant: str, distributed: bool):
    """The optimizer handed to ``compile`` (``distributed``: shardwise's, else the reference's)."""
    import keras

    from shardwise.keras import DistributedOptimizer, ZeroOptimizer

    sgd = keras.optimizers.SGD(0.05, momentum=0.9)
    if variant == "outer":  # the user wraps: LossScaleOptimizer(DistributedOptimizer(...))
        return keras.optimizers.LossScaleOptimizer(DistributedOptimizer(sgd) if distributed else sgd,
                                                   initial_scale=2.0 ** 12)
    if not distributed:
        return sgd
    return ZeroOptimizer(sgd, stage=1) if variant == "zero" else DistributedOptimizer(sgd)


def _train(variant: str, distributed: bool, x, y, batch: int):
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model(custom_step=variant == "custom_step")
        model.compile(optimizer=_optimizer(variant, distributed), loss="mse")
        lso = model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer), type(lso)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, float(keras.ops.convert_to_numpy(lso.dynamic_scale)), _iterations(lso.inner_optimizer)


def overflow_skipped_together(variants: list[str]) -> None:
    """For each variant: the step where the last rank overflows is skipped on every rank, as in one process.

    ``compiled``: ``compile`` wraps a DistributedOptimizer in a LossScaleOptimizer;
    ``outer``: the user does; ``zero``: ``compile`` wraps a ZeroOptimizer (stage 1);
    ``custom_step``: a model with its own ``train_step``.
    """
    comm = _setup()
    size = comm.size
    x, y = _data(STEPS * size * BATCH, seed=31)
    # Small values: at the default loss scale 2**15 no gradient overflows but the planted one (with the
    # data at full size, JAX's float16 backward overflowed on a 4-row batch where 8 rows did not).
    x, y = x * 0.25, y * 0.25
    x[(OVERFLOW_STEP * size + size - 1) * BATCH] = HUGE  # one row of the last rank's batch at that step
    rows = _rank_rows(STEPS, size, comm.rank, BATCH)
    for variant in variants:
        ref, ref_scale, ref_steps = _train(variant, False, x, y, size * BATCH)
        dist, scale, steps = _train(variant, True, x[rows], y[rows], BATCH)
        what = f"{variant} on {size} ranks"
        initial = 2.0 ** 12 if variant == "outer" else 2.0 ** 15
        # The reference skipped exactly the planted step (halving its scale once): the test means something.
        assert (ref_scale, ref_steps) == (initial / 2, STEPS - 1), (what, "reference", ref_scale, ref_steps)
        assert (scale, steps) == (ref_scale, ref_steps), (what, scale, steps)
        _same_on_all_ranks(comm, dist.get_weights() + [np.array(scale)], what)
        for w_ref, w in zip(ref.get_weights(), dist.get_weights()):
            assert np.isfinite(w).all(), what
            # float16 layers: the reference sums 2x as many rows per product, so not bitwise.
            np.testing.assert_allclose(w, w_ref, rtol=1e-3, atol=1e-4, err_msg=what)
        if comm.rank == 0:
            print(f"{what}: step {OVERFLOW_STEP} skipped on every rank, loss scale {scale:g}, "
                  f"{steps} steps applied", flush=True)


def xla_off_without_callbacks() -> None:
    """TensorFlow: ``jit_compile=True`` and no callback: fit turns XLA off itself and trains in step."""
    import keras

    from shardwise.keras import DistributedOptimizer

    assert keras.backend.backend() == "tensorflow", keras.backend.backend()
    comm = _setup()
    size = comm.size
    x, y = _data(STEPS * size * BATCH, seed=33)
    rows = _rank_rows(STEPS, size, comm.rank, BATCH)
    ref = _model()
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    ref.fit(x, y, batch_size=size * BATCH, epochs=1, shuffle=False, verbose=0)
    model = _model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse",
                  jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[rows], y[rows], batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[])
    assert model.jit_compile is False and any("jit_compile" in str(w.message) for w in caught)
    _same_on_all_ranks(comm, model.get_weights(), "XLA turned off")
    for w_ref, w in zip(ref.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6, err_msg="XLA turned off")
