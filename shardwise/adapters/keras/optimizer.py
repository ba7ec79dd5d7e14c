"""Keras 3 ``DistributedOptimizer``: average gradients over ranks, then let the wrapped optimizer apply them.

A wrapper in the style of ``keras.optimizers.LossScaleOptimizer``: it is a Keras
optimizer (so ``model.compile`` accepts it) that owns the real optimizer and
delegates state (learning rate, iterations, slots) to it. Gradients are fused
into buckets by :func:`shardwise.core.buckets.plan_buckets`; each bucket is one
allreduce (see :mod:`.ops`), so it works inside the graphs ``model.fit`` traces.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import keras
import tensorflow as tf

from ...core.buckets import DEFAULT_BUCKET_CAP_BYTES
from ...core.comm import Communicator, ReduceOp
from ...core.errors import ConfigError
from .ops import Compression, Compressor, FP16Compressor, allreduce_gradients, check_not_xla, world

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "unwrap_optimizer", "find_distributed_optimizer", "disable_xla",
           "warn_outer_loss_scaling"]

_COMPRESSIONS = {"none": Compression.none, "fp16": Compression.fp16}


def _compression_name(compression: type[Compressor]) -> str:
    return "fp16" if issubclass(compression, FP16Compressor) else "none"


@keras.saving.register_keras_serializable(package="shardwise")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wrap ``optimizer`` so that ``apply``/``apply_gradients`` first average gradients over ranks.

    ``backward_passes_per_step`` accumulates that many local gradients before one
    allreduce and update (the sum, or the mean with ``average_aggregated_gradients``);
    ``iterations`` still counts every pass, as in Horovod. ``bucket_cap_bytes`` bounds
    each fused collective; ``comm`` defaults to the world communicator. With mixed
    precision put the loss scaling inside, ``DistributedOptimizer(LossScaleOptimizer(opt))``
    with ``compile(auto_scale_loss=False)``, so that every rank takes the same
    finite / non-finite branch after the allreduce.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer,
                 compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, *,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 comm: Optional[Communicator] = None, name: Optional[str] = None,
                 op: Any = ReduceOp.AVERAGE, process_set: Any = None,
                 scale_local_gradients: bool = True) -> None:
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a Keras 3 optimizer, got {type(optimizer).__name__} "
                              "(tf_keras / tf.keras.optimizers.legacy optimizers are not supported)")
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("the optimizer is already a DistributedOptimizer")
        if isinstance(compression, str):
            compression = _COMPRESSIONS.get(compression.lower(), None)  # type: ignore[assignment]
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise ConfigError("compression must be Compression.none or Compression.fp16")
        if int(backward_passes_per_step) < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if int(backward_passes_per_step) > 1 and getattr(optimizer, "gradient_accumulation_steps", None):
            raise ConfigError("use either backward_passes_per_step or the inner optimizer's "
                              "gradient_accumulation_steps, not both")
        if int(bucket_cap_bytes) <= 0:
            raise ConfigError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self.compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        if process_set is not None:
            if comm is not None:
                raise ConfigError("pass either comm= or process_set=, not both")
            comm = None if process_set.is_global() else process_set.comm
        self._comm = comm
        self.op = ReduceOp.parse(op)
        if self.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ConfigError(f"DistributedOptimizer reduces gradients with op=Average or Sum, got {op!r}")
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_vars: set[int] = set()
        self._pass_count: Any = None
        self._accumulators: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        # Public attributes the wrapper lacks (momentum, beta_1, ...) come from the inner optimizer.
        inner = self.__dict__.get("inner_optimizer")
        if name.startswith("_") or inner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    # -- state ------------------------------------------------------------------------------
    def build(self, var_list: Sequence[Any]) -> None:
        """Build the inner optimizer and, with accumulation, one accumulator per variable."""
        var_list = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        if self.backward_passes_per_step > 1:
            self._pass_count = self.add_variable(shape=(), dtype="int32", initializer="zeros",
                                                 name="backward_passes")
            self._accumulators = [self.add_variable_from_reference(v, name="grad_accumulator")
                                  for v in var_list]
        super().build(var_list)

    @property
    def variables(self) -> list[Any]:
        return self._variables[:] + list(self.inner_optimizer.variables)

    def save_own_variables(self, store: Any) -> None:
        """Save the inner optimizer's state only, so that the file also loads without shardwise.

        The wrapper's own variables (gradient accumulators between two reductions)
        are transient and start again from zero after loading.
        """
        self.inner_optimizer.save_own_variables(store)

    def load_own_variables(self, store: Any) -> None:
        """Restore the inner optimizer's state saved by :meth:`save_own_variables` (or by Keras itself)."""
        self.inner_optimizer.load_own_variables(store)

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- updates ----------------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars: Any) -> Any:
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Average ``grads`` over ranks (after local accumulation), then apply them."""
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ConfigError("pass trainable_variables on the first apply(), or call build() first")
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            if not self.built:
                self.build(variables)
        if len(grads) != len(variables):
            raise ConfigError(f"got {len(grads)} gradients for {len(variables)} variables")
        comm = world(self._comm)
        if comm.size > 1:
            check_not_xla("DistributedOptimizer")
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(self._reduce(grads, comm, variables), variables)
            return
        self._accumulate(grads, variables, comm)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local to this rank (Horovod's partial data parallelism).

        Its gradient is not reduced; with ``scale_local_gradients`` it is divided by
        the number of ranks, like the reduced ones are by averaging.
        """
        self._local_vars.add(id(var))

    def _reduce(self, grads: Sequence[Any], comm: Communicator,
                variables: Sequence[Any] = ()) -> list[Optional[tf.Tensor]]:
        local = [id(v) in self._local_vars for v in variables] if self._local_vars else [False] * len(grads)
        shared = [g for g, is_local in zip(grads, local) if not is_local]
        reduced = iter(allreduce_gradients(shared, comm=comm, op=self.op, compression=self.compression,
                                           cap_bytes=self.bucket_cap_bytes))
        out: list[Optional[tf.Tensor]] = []
        for g, is_local in zip(grads, local):
            if not is_local:
                out.append(next(reduced))
            elif g is None or not self.scale_local_gradients or comm.size == 1:
                out.append(None if g is None else tf.convert_to_tensor(g))
            else:
                out.append(tf.convert_to_tensor(g) / comm.size)
        return out

    def _accumulate(self, grads: list[Any], variables: list[Any], comm: Communicator) -> None:
        steps = self.backward_passes_per_step
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for g, acc in zip(grads, accs):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
        self._pass_count.assign_add(1)
        count = tf.convert_to_tensor(self._pass_count)

        def sync() -> None:
            summed = [None if g is None else tf.convert_to_tensor(a) for g, a in zip(grads, accs)]
            reduced = self._reduce(summed, comm, variables)
            if self.average_aggregated_gradients:
                reduced = [None if r is None else r / steps for r in reduced]
            self.inner_optimizer.apply(reduced, variables)
            for acc in accs:
                acc.assign(tf.zeros(acc.shape, acc.dtype))
            self._pass_count.assign(0)

        def skip() -> None:
            self.inner_optimizer.iterations.assign_add(1)

        tf.cond(count >= steps, sync, skip)

    # -- serialization ----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {"name": self.name,
                "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "compression": _compression_name(self.compression),
                "backward_passes_per_step": self.backward_passes_per_step,
                "average_aggregated_gradients": self.average_aggregated_gradients,
                "bucket_cap_bytes": self.bucket_cap_bytes, "op": self.op.value,
                "scale_local_gradients": self.scale_local_gradients}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> "DistributedOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, *, local_layers: Any = None,
                                **kwargs: Any) -> DistributedOptimizer:
    """A :class:`DistributedOptimizer` that keeps the gradients of ``local_layers`` local (Horovod's name).

    ``local_layers`` is a layer or a list of layers whose variables each rank trains
    on its own data only; every other gradient is averaged over ranks.
    """
    dist = DistributedOptimizer(optimizer, **kwargs)
    layers = [] if local_layers is None else local_layers if isinstance(local_layers, (list, tuple)) \
        else [local_layers]
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ConfigError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for var in layer.trainable_weights:
            dist.register_local_var(var)
    return dist


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under any ``inner_optimizer`` wrappers (ours, loss scaling)."""
    seen = 0
    while optimizer is not None and "inner_optimizer" in getattr(optimizer, "__dict__", {}) and seen < 16:
        optimizer = optimizer.__dict__["inner_optimizer"]
        seen += 1
    return optimizer


def find_distributed_optimizer(model: Any) -> Optional[DistributedOptimizer]:
    """``model.optimizer`` if it is, or wraps, a :class:`DistributedOptimizer`; else ``None``."""
    optimizer = getattr(model, "optimizer", None)
    for _ in range(16):
        if optimizer is None or isinstance(optimizer, DistributedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "__dict__", {}).get("inner_optimizer")
    return None


def warn_outer_loss_scaling(model: Any) -> bool:
    """Warn when a LossScaleOptimizer wraps a multi-rank DistributedOptimizer (returns True then)."""
    outer = getattr(model, "optimizer", None)
    inner = find_distributed_optimizer(model)
    if inner is None or outer is inner or world(inner._comm).size == 1:
        return False
    warnings.warn("shardwise: a loss-scaling optimizer wraps the DistributedOptimizer, so each rank checks "
                  "its own gradients for inf/nan before the allreduce; ranks can disagree and hang. Use "
                  "DistributedOptimizer(LossScaleOptimizer(opt)) and compile(auto_scale_loss=False).",
                  stacklevel=2)
    return True


def disable_xla(model: Any) -> bool:
    """Turn ``jit_compile`` off (with a warning) on a model trained by a multi-rank DistributedOptimizer.

    Returns True when it changed something; the train function is rebuilt if it existed.
    """
    if model is None or not getattr(model, "jit_compile", False):
        return False
    optimizer = find_distributed_optimizer(model)
    if optimizer is None or world(optimizer._comm).size == 1:
        return False
    warnings.warn("shardwise: turning jit_compile off for this model: DistributedOptimizer's collectives "
                  "are Python calls (tf.numpy_function) that XLA cannot compile. Pass jit_compile=False "
                  "to model.compile() to silence this warning.", stacklevel=2)
    model.jit_compile = False
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
    return True
