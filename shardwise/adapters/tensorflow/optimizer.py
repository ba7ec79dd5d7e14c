"""Horovod's ``hvd.DistributedOptimizer`` for legacy ``tf.compat.v1`` optimizers.

:func:`shardwise.tensorflow.DistributedOptimizer` picks the wrapper
(:mod:`shardwise.adapters.keras.tf_optimizer`): a Keras 3 optimizer goes to the Keras
adapter's; a legacy ``tf.compat.v1.train.Optimizer`` is wrapped by :class:`LegacyDistributedOptimizer`,
whose ``compute_gradients`` reduces the gradients (see :class:`.tape.GradientReducer`);
with ``backward_passes_per_step > 1`` (graph mode, as in Horovod) gradients are summed
locally in variables and reduced and applied every that many steps, while the global
step still counts every step.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from .runtime import no_autograph
from .tape import GradientReducer, source_key

__all__ = ["LegacyDistributedOptimizer", "LegacyOptimizer"]

LegacyOptimizer = tf.compat.v1.train.Optimizer


class LegacyDistributedOptimizer(LegacyOptimizer):
    """A ``tf.compat.v1.train.Optimizer`` that reduces gradients in ``compute_gradients``."""

    def __init__(self, optimizer: LegacyOptimizer, reducer: GradientReducer, name: Optional[str] = None,
                 use_locking: bool = False, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, scale_local_gradients: bool = True) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        if int(backward_passes_per_step) > 1 and tf.executing_eagerly():
            raise ValueError("backward_passes_per_step > 1 is not yet supported for LegacyOptimizer with "
                             "eager execution.")
        self._optimizer = optimizer
        self._reducer = reducer
        self._passes = int(backward_passes_per_step)
        self._average_aggregated = bool(average_aggregated_gradients)
        self.process_set = reducer.process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: set = set()
        self._counter: Optional[tf.Variable] = None

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: not reduced (and divided by the set size if scaling)."""
        self._local_vars.add(source_key(var))

    def _reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        shared = [i for i, v in enumerate(variables) if source_key(v) not in self._local_vars]
        out = list(grads)
        for i, r in zip(shared, self._reducer.reduce([grads[i] for i in shared], [variables[i] for i in shared])):
            out[i] = r
        if self.scale_local_gradients and self._local_vars:
            n = self.process_set.size()
            out = [g / n if g is not None and source_key(v) in self._local_vars else g
                   for g, v in zip(out, variables)]
        return out

    @no_autograph
    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced over ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [list(t) for t in zip(*pairs)] if pairs else ([], [])
        reduced = self._aggregate(grads, variables) if self._passes > 1 else self._reduce(grads, variables)
        return list(zip(reduced, variables))

    def _aggregate(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Sum ``grads`` into local variables; every ``passes``-th call, return them reduced."""
        dense = []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                if not self._reducer.sparse_as_dense:
                    raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                                     "`sparse_as_dense` is False.")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        present = [i for i, g in enumerate(dense) if g is not None]
        with tf.compat.v1.variable_scope(f"aggregation_variables_{self.get_name()}", reuse=tf.compat.v1.AUTO_REUSE):
            self._counter = tf.compat.v1.get_variable("aggregation_counter", shape=(), dtype=tf.int32,
                                                      trainable=False, initializer=tf.compat.v1.zeros_initializer(),
                                                      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
            sums = [tf.compat.v1.get_variable(str(i), initializer=tf.zeros(dense[i].shape, dense[i].dtype),
                                              trainable=False,
                                              collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
                    for i in present]
        clear = tf.cond(tf.equal(self._counter, 0), lambda: tf.group(*[s.assign(tf.zeros_like(s)) for s in sums]),
                        tf.no_op)
        with tf.control_dependencies([clear]):
            added = tf.group(*[s.assign_add(dense[i]) for s, i in zip(sums, present)])
        with tf.control_dependencies([added]):
            counted = self._counter.assign_add(1)
        divisor = float(self._passes if self._average_aggregated else 1)

        def reduce_sums() -> list[tf.Tensor]:
            totals = self._reduce([s.read_value() for s in sums], [variables[i] for i in present])
            with tf.control_dependencies([t for t in totals]):
                reset = self._counter.assign(0)
            with tf.control_dependencies([reset]):
                return [t / tf.cast(divisor, t.dtype) for t in totals]

        with tf.control_dependencies([counted]):
            ready = tf.cond(tf.equal(self._counter, self._passes), reduce_sums,
                            lambda: [tf.identity(dense[i]) for i in present])
        out: list[Any] = [None] * len(grads)
        for i, g in zip(present, ready if isinstance(ready, (list, tuple)) else [ready]):
            out[i] = g
        return out

    @no_autograph
    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        """Apply with the wrapped optimizer (every ``backward_passes_per_step``-th step when aggregating)."""
        if self._passes == 1 or self._counter is None:
            return self._optimizer.apply_gradients(*args, **kwargs)
        pairs = args[0] if args else kwargs["grads_and_vars"]
        global_step = kwargs.pop("global_step", None)
        grads = [g for g, _ in pairs if g is not None]
        with tf.control_dependencies(grads):
            applied = tf.cond(tf.equal(self._counter, 0),
                              lambda: tf.group(self._optimizer.apply_gradients(*args, **kwargs)), tf.no_op)
        if global_step is None:
            return applied
        with tf.control_dependencies([applied]):
            return tf.group(global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype)))

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
