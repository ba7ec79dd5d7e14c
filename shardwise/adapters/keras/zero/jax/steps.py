"""ZeRO-3 on JAX: the train, test and predict steps ``fit`` compiles for a sharded model.

They mirror Keras's own (``keras/src/backend/jax/trainer.py``) with one change:
the trainable state is the shards, which Keras's ``stateless_call`` cannot map
(it checks the full shapes), so the forward pass runs ``model.call`` under a
stateless scope of the non-trainable state only, and each layer finds its
gathered variables through :class:`~.layers.LayerGather`. Keras still
jits these steps itself (``make_train_function``: one ``jax.jit`` with the state
donated); loss scaling, metrics and the optimizer's ``stateless_apply`` are Keras's.
"""

from __future__ import annotations

from typing import Any

import jax
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.trainers.data_adapters import data_adapter_utils

from .layers import LayerGather

__all__ = ["Zero3Steps"]


class Zero3Steps:
    """``train_step`` / ``test_step`` / ``predict_step`` of ``model`` over sharded trainable state."""

    def __init__(self, model: Any, layers: LayerGather) -> None:
        self.model = model
        self.layers = layers
        self.traces = 0  # how many times the train step was traced (a compiled step traces once)
        self.traced_abstract = False  # the last trace saw abstract values (jax.jit), not arrays

    def _forward(self, shards: Any, non_trainable: Any, x: Any, training: bool) -> tuple[Any, list, list]:
        """The predictions, the new non-trainable state and the model's losses.

        The losses are those Keras's ``stateless_call`` reports: the ones the layers
        added in ``call``, then the weight penalties (computed where each layer is
        gathered, in the order of ``model.trainable_variables``).
        """
        model = self.model
        kwargs = {"training": training} if model._call_has_training_arg else {}
        with self.layers.step(model.trainable_variables, shards):
            with StatelessScope(state_mapping=list(zip(model.non_trainable_variables, non_trainable)),
                                collect_losses=True) as scope:
                y_pred = model.call(x, **kwargs)
            penalties = self.layers.penalties(model.trainable_variables)
        new_nt = [scope.get_current_value(v) for v in model.non_trainable_variables]
        return y_pred, new_nt, list(scope.losses) + penalties

    def _loss(self, shards: Any, non_trainable: Any, metrics: Any, x: Any, y: Any, sample_weight: Any,
              training: bool, optimizer_variables: Any = None) -> tuple[Any, tuple]:
        model = self.model
        y_pred, non_trainable, losses = self._forward(shards, non_trainable, x, training)
        if losses:
            model._losses_override.clear()
            model._losses_override = losses
        mapping = list(zip(model.non_trainable_variables, non_trainable)) + list(zip(model.metrics_variables, metrics))
        with StatelessScope(state_mapping=mapping) as scope:
            loss = model._compute_loss(x, y, y_pred, sample_weight=sample_weight, training=training)
        if losses:
            model._losses_override.clear()
        non_trainable = [scope.get_current_value(v) for v in model.non_trainable_variables]
        metrics = [scope.get_current_value(v) for v in model.metrics_variables]
        unscaled = loss
        if training and model.optimizer is not None:
            with StatelessScope(state_mapping=list(zip(model.optimizer.variables, optimizer_variables))):
                loss = model.optimizer.scale_loss(loss)
        return loss, (unscaled, y_pred, non_trainable, metrics)

    def train_step(self, state: Any, data: Any) -> tuple[Any, tuple]:
        """One step: gathered forward, rematerialized backward, reduce-scattered shard gradients, shard update."""
        self.traces += 1
        model = self.model
        shards, non_trainable, optimizer_variables, metrics = state
        self.traced_abstract = all(isinstance(s, jax.core.Tracer) for s in shards)
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        (_, aux), grads = grad_fn(shards, non_trainable, metrics, x, y, sample_weight, True, optimizer_variables)
        unscaled, y_pred, non_trainable, metrics = aux
        shards, optimizer_variables = model.optimizer.stateless_apply(optimizer_variables, grads, shards)
        logs, metrics = model._update_metrics_variables(metrics, unscaled, x, y, y_pred, sample_weight)
        return logs, (shards, non_trainable, optimizer_variables, metrics)

    def test_step(self, state: Any, data: Any) -> tuple[Any, tuple]:
        """Keras's test step over sharded state (each layer gathered where it runs)."""
        shards, non_trainable, metrics = state
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        _, (unscaled, y_pred, non_trainable, metrics) = self._loss(
            shards, non_trainable, metrics, x, y, sample_weight, False)
        logs, metrics = self.model._update_metrics_variables(metrics, unscaled, x, y, y_pred, sample_weight)
        return logs, (shards, non_trainable, metrics)

    def predict_step(self, state: Any, data: Any) -> tuple[Any, list]:
        """Keras's predict step over sharded state."""
        shards, non_trainable = state
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        y_pred, non_trainable, _ = self._forward(shards, non_trainable, x, False)
        return y_pred, non_trainable
