"""Build a Keras model whose variables are never whole on any rank: initialized shard by shard by ZeRO-3.

Inside :func:`sharded_build` Keras creates variables without values (its deferred
initialization, the one a ``StatelessScope`` uses): each keeps its initializer, whose
random seed was drawn when the layer was made, exactly as in a normal build. A
stage-3 :class:`~.optimizer.ZeroOptimizer` then initializes them when it is built, one
layer (unit) at a time: the layer's variables are computed whole, this rank's shard
is cut, and they are freed before the next layer. Initializers draw from their own
per-variable seed (``keras.utils.set_random_seed`` fixes them all), so the values are
those of the one-process model built with the same seed, whatever the order.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import keras

from ....core.errors import ConfigError
from ..bridges import backend_name

__all__ = ["sharded_build"]


@contextlib.contextmanager
def sharded_build() -> Iterator[None]:
    """Build a model inside this block to create its variables uninitialized (torch and JAX backends).

    Train it with ``ZeroOptimizer(..., stage=3)``: building that optimizer (``fit``
    does it) initializes the trainable variables unit by unit into their shards, and
    ``fit``/``evaluate``/``predict`` initialize the few replicated ones (batch-norm
    statistics, dropout seeds) whole. Until then the model reads its variables' initial
    values recomputed on every read::

        keras.utils.set_random_seed(0)
        with shardwise.keras.sharded_build():
            model = make_model()
        model.compile(optimizer=shardwise.keras.ZeroOptimizer(keras.optimizers.Adam(), stage=3), loss=...)
    """
    if backend_name() not in ("torch", "jax"):
        raise ConfigError(f"sharded_build runs on the torch and JAX Keras backends, not on {backend_name()!r}")
    from keras.src.backend.common import global_state

    key = "uninitialized_variables"
    before = len(global_state.get_global_attribute(key) or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        # Keep this model's variables off Keras's list: the next StatelessScope to close would
        # initialize all of them at once, the whole model on every rank.
        pending = global_state.get_global_attribute(key) or []
        global_state.set_global_attribute(key, list(pending[:before]))
