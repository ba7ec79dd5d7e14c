"""Keras 3 sharded embedding bags for recommendation models, on the torch and JAX backends.

:class:`ShardedEmbeddingBag` holds this rank's shards of the tables (split by an
:class:`~shardwise.core.embedding_plan.EmbeddingPlan`) as host numpy arrays, outside Keras's
variables, so the dense optimizer (:class:`~shardwise.adapters.keras.optimizer.DistributedOptimizer`)
never sees them. Lookups are the collectives of :class:`~.host.HostEmbeddingEngine`;
the table update is sparse and fused into the layer's backward (TorchRec's fused optimizers),
with the gradients averaged over ranks as the dense ones are.

On JAX the lookup and its backward are ordered ``io_callback`` calls inside a ``jax.custom_vjp``,
so ``model.fit``'s jitted train step stays compiled (ids are padded to a static ``max_ids``,
so every shape crossing the callback is static). JAX differentiates only trainable variables,
so the layer owns one scalar trainable ``anchor`` (always 0, gradient always 0) through which
the backward is reached. On torch the lookup is a ``torch.autograd.Function``, run eagerly, reached
through the same anchor (so that the model has the same variables on both backends, and a Keras
checkpoint of it moves between them). Nothing of torch is imported on JAX.

The tables (and their optimizer state) are checkpointed through :mod:`shardwise.checkpoint`'s door,
beside the model: ``shardwise.checkpoint.save(dir, step, {"model": model, "tables": layer})`` and
``load(dir, {"model": model, "tables": layer})`` (kind ``keras.sharded_embeddings``,
:mod:`.checkpoint`); a checkpoint written with one plan on N ranks loads with another on M, on
either backend.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import keras
import numpy as np

from ....core.embedding_plan import EmbeddingPlan, TableConfig
from ....core.errors import ConfigError, ShapeMismatchError
from ..bridges import backend_name
from .host import HostEmbeddingEngine
from . import checkpoint as _checkpoint  # registers the door's handler of kind keras.sharded_embeddings

__all__ = ["ShardedEmbeddingBag"]


class ShardedEmbeddingBag(keras.layers.Layer):
    """Sum- or mean-pooled embedding bags over tables sharded across ranks (torch and JAX Keras backends).

    ``call(ids, weights=None)`` takes, per feature of ``tables`` (in their order), a dense integer tensor
    ``[batch, max_ids]`` padded with ``-1`` (a bag is a row's non-negative ids; a row of
    ``-1`` is an empty bag and pools to zeros), as a dict ``{feature: tensor}`` or a list in
    feature order. It returns one float32 tensor ``[batch, sum of embedding_dim]``: the pooled
    rows of every feature, concatenated in feature order (:attr:`feature_slices` gives each
    feature's columns). ``weights`` (optional, sum-pooled features only): per-id float weights
    of the ids' shape, as a dict ``{feature: tensor}`` of some features or a list in feature
    order (None where a feature has none); a bag is then the weighted sum of its rows (TorchRec's
    weighted features; the weights get no gradient). A table of ``weighted=False`` ignores them, one of
    ``weighted=True`` requires them. ``plan`` defaults to :func:`plan_tables` over the sharding types
    the layer runs (all but ``data_parallel``, which it refuses). Collective: every rank calls it, and its
    backward, in the same order, each with its own samples. ``optimizer`` (``"sgd"``,
    ``"adagrad"``: torch's element-wise Adagrad, or ``"rowwise_adagrad"``: FBGEMM's and TorchRec's,
    one accumulator per row) with ``learning_rate`` updates the looked-up rows during backward.
    Initial values
    are :func:`~shardwise.core.table_init.init_rows` of ``seed``, those of
    :func:`~shardwise.core.table_init.full_table` for one process.
    """

    def __init__(self, tables: Sequence[TableConfig], plan: Optional[EmbeddingPlan] = None, *, seed: int = 0,
                 optimizer: str = "sgd", learning_rate: float = 0.01, eps: float = 1e-10,
                 initial_accumulator_value: float = 0.0, comm: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._backend_name = backend_name()
        if self._backend_name not in ("torch", "jax"):
            raise ConfigError("ShardedEmbeddingBag runs on the torch and jax Keras backends, "
                              f"not {self._backend_name!r}")
        self.engine = HostEmbeddingEngine(tables, plan, comm=comm, seed=seed, optimizer=optimizer,
                                          learning_rate=learning_rate, eps=eps,
                                          initial_accumulator_value=initial_accumulator_value)
        self.features = self.engine.features
        #: each feature's columns ``(start, stop)`` in the output
        self.feature_slices = {f: (self.engine.offsets[f],
                                   self.engine.offsets[f] + self.engine.table_of[f].embedding_dim)
                               for f in self.features}
        self._anchor = self.add_weight(shape=(), initializer="zeros", trainable=True, name="anchor")

    @property
    def comm(self) -> Any:
        """The communicator the tables are sharded over."""
        return self.engine.comm

    @property
    def optimizer_state(self) -> dict[str, np.ndarray]:
        """This rank's optimizer state per shard (Adagrad: like the shard; row-wise Adagrad: one per row)."""
        return self.engine.state

    @property
    def shards(self) -> dict[str, np.ndarray]:
        """This rank's shards, ``{table__shardI: rows x cols}`` (see :meth:`shard_of`)."""
        return self.engine.shards

    def shard_of(self, key: str) -> Any:
        """The ``(TableConfig, TableShard)`` a key of :attr:`shards` holds."""
        return self.engine.shard_of(key)

    def _ordered(self, inputs: Union[Mapping[str, Any], Sequence[Any]]) -> list[Any]:
        if isinstance(inputs, Mapping):
            missing = [f for f in self.features if f not in inputs]
            extra = [k for k in inputs if k not in self.features]
            if missing or extra:
                raise ShapeMismatchError(f"ShardedEmbeddingBag: features {missing} missing, {extra} unknown; "
                                         f"expected {list(self.features)}")
            return [inputs[f] for f in self.features]
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(self.features):
            raise ShapeMismatchError(f"ShardedEmbeddingBag takes a dict or a list of {len(self.features)} id tensors "
                                     f"(features {list(self.features)})")
        return list(inputs)

    def _ordered_weights(self, weights: Union[None, Mapping[str, Any], Sequence[Any]]) -> Optional[list[Any]]:
        if weights is None:
            return None
        if isinstance(weights, Mapping):
            extra = [k for k in weights if k not in self.features]
            if extra:
                raise ShapeMismatchError(f"ShardedEmbeddingBag: weights for unknown features {extra}; "
                                         f"expected some of {list(self.features)}")
            out = [weights.get(f) for f in self.features]
        elif isinstance(weights, (list, tuple)) and len(weights) == len(self.features):
            out = list(weights)
        else:
            raise ShapeMismatchError(f"ShardedEmbeddingBag: weights must be a dict of features or a list of "
                                     f"{len(self.features)} (None where a feature has none)")
        return out if any(w is not None for w in out) else None

    def compute_output_spec(self, inputs: Any, weights: Any = None, training: Any = None) -> keras.KerasTensor:
        """``[batch, width]`` float32, without running the collective lookup (symbolic calls)."""
        ids = self._ordered(inputs)
        return keras.KerasTensor((ids[0].shape[0], self.engine.width), dtype="float32")

    def compute_output_shape(self, input_shape: Any) -> tuple:
        """``(batch, sum of embedding_dim)``."""
        shapes = list(input_shape.values()) if isinstance(input_shape, Mapping) else list(input_shape)
        return (shapes[0][0], self.engine.width)

    def call(self, inputs: Union[Mapping[str, Any], Sequence[Any]],
             weights: Union[None, Mapping[str, Any], Sequence[Any]] = None, training: Optional[bool] = None) -> Any:
        """The pooled rows of ``inputs``, weighted by ``weights`` if given (see the class docstring); collective."""
        ids = self._ordered(inputs)
        per_id = self._ordered_weights(weights)
        if self._backend_name == "jax":
            from .lookup import jax_lookup

            return jax_lookup(self.engine, self._anchor.value, ids, per_id)
        from .lookup import torch_lookup

        return torch_lookup(self.engine, self._anchor.value, ids, per_id)
