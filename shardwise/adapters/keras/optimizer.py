"""Keras 3 ``DistributedOptimizer``: average gradients over ranks, then let the wrapped optimizer apply them.

A wrapper in the style of ``keras.optimizers.LossScaleOptimizer``: it is a Keras
optimizer (so ``model.compile`` accepts it) that owns the real optimizer and
delegates state (learning rate, iterations, slots) to it. Gradients are fused
into buckets by :func:`shardwise.core.buckets.plan_buckets`; each bucket is one
allreduce (see :mod:`.ops`), which runs on the running Keras backend's own tensors:
inside TensorFlow's traced graphs, eagerly on torch, and inside JAX's compiled
train step (:meth:`DistributedOptimizer.stateless_apply`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from ...core.buckets import DEFAULT_BUCKET_CAP_BYTES
from ...core.comm import Communicator, ReduceOp
from ...core.errors import ConfigError
from .bridges import backend_name, bridge
from .hooks import DistributedBase, install_hooks
from .ops import Compression, Compressor, FP16Compressor, allreduce_gradients, world

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]

_COMPRESSIONS = {"none": Compression.none, "fp16": Compression.fp16}


def _compression_name(compression: type[Compressor]) -> str:
    return "fp16" if issubclass(compression, FP16Compressor) else "none"


@keras.saving.register_keras_serializable(package="shardwise")
class DistributedOptimizer(keras.optimizers.Optimizer, DistributedBase):
    """Wrap ``optimizer`` so that ``apply``/``apply_gradients`` first average gradients over ranks.

    ``backward_passes_per_step`` accumulates that many local gradients before one
    allreduce and update (the sum, or the mean with ``average_aggregated_gradients``);
    ``iterations`` still counts every pass, as in Horovod. ``bucket_cap_bytes`` bounds
    each fused collective; ``comm`` defaults to the world communicator. Mixed
    precision works either way round: ``DistributedOptimizer(LossScaleOptimizer(opt))``
    checks the averaged gradients, and a ``LossScaleOptimizer`` around it (the one
    ``compile`` adds under ``mixed_float16``, or the user's) decides finiteness for
    all ranks at once (:meth:`all_finite`). Creating one installs that check and, on
    TensorFlow, turns XLA off in ``fit`` (see :mod:`.hooks`): no callback is needed.
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
        self._overlap: Any = None  # torch: buckets reduced during backward (see .torch_overlap)
        install_hooks()

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
        self._start_overlap(var_list)

    def _start_overlap(self, var_list: list[Any]) -> None:
        """On Keras-torch, reduce gradient buckets during backward (plain averaging of every gradient only)."""
        comm = world(self._comm)
        if (backend_name() != "torch" or comm.size == 1 or self.backward_passes_per_step > 1
                or self.compression is not Compression.none or self._local_vars or self._overlap is not None):
            return
        from .torch_overlap import BackwardOverlap

        self._overlap = BackwardOverlap(var_list, comm, self.op, self.bucket_cap_bytes)

    def drop_overlap(self) -> None:
        """Forget the torch backward overlap and its buckets in flight, without any collective."""
        if self._overlap is not None:
            self._overlap.abandon()
            self._overlap = None

    def rebind(self) -> None:
        """Follow a re-formed elastic job: the backward overlap is rebuilt on the new world."""
        if self._comm is not None:
            raise ConfigError("an elastic job's DistributedOptimizer must use the global process set "
                              "(its comm= / process_set= does not survive a reset)")
        self.drop_overlap()
        if self.built:
            self._start_overlap(list(self._trainable_variables))

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
    def all_finite(self, finite: Any) -> Any:
        """``finite`` (this rank's boolean scalar) AND-ed over every rank: one scalar MIN-allreduce.

        What a ``LossScaleOptimizer`` around this optimizer decides with, so that every
        rank applies the averaged step or every rank skips it. It runs where the
        check runs: eagerly, in TensorFlow's traced step, in JAX's compiled step.
        """
        if world(self._comm).size == 1:
            return finite
        ops = keras.ops
        flag = ops.reshape(ops.cast(finite, "float32"), (1,))
        # The world is looked up when the collective runs, so it follows an elastic job's new world.
        everywhere = bridge().run(lambda a: world(self._comm).allreduce(a, ReduceOp.MIN), flag)
        return ops.greater(ops.reshape(everywhere, ()), 0.5)

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
            bridge().check_compilable("DistributedOptimizer")
        if self.backward_passes_per_step == 1:
            reduced = self._overlap.take(grads) if self._overlap is not None else None
            self.inner_optimizer.apply(reduced if reduced is not None else self._reduce(grads, comm, variables),
                                       variables)
            return
        self._accumulate(grads, variables, comm)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local to this rank (Horovod's partial data parallelism).

        Its gradient is not reduced; with ``scale_local_gradients`` it is divided by
        the number of ranks, like the reduced ones are by averaging.
        """
        self._local_vars.add(id(var))
        if self._overlap is not None:  # its buckets would average this gradient too
            self._overlap.remove()
            self._overlap = None

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """JAX's functional step: average ``grads``, then the inner optimizer's ``stateless_apply``.

        Runs inside the compiled train step (the collectives are ordered host
        callbacks, see :mod:`.bridges.jax`); the inner optimizer's own
        ``stateless_apply`` is used so that a wrapped ``LossScaleOptimizer`` keeps
        its functional branches.
        """
        if not self.built:
            raise ConfigError("DistributedOptimizer.stateless_apply needs a built optimizer: call build() first")
        # An outer LossScaleOptimizer passes variables (read through its stateless scope), not values.
        own = [keras.ops.convert_to_tensor(v) for v in optimizer_variables[:len(self._variables)]]
        inner_values = list(optimizer_variables[len(self._variables):])
        grads, variables = list(grads), list(self._trainable_variables)
        comm = world(self._comm)
        if self.backward_passes_per_step == 1:
            new_vars, new_inner = self.inner_optimizer.stateless_apply(
                inner_values, self._reduce(grads, comm, variables), trainable_variables)
            return list(new_vars), own + list(new_inner)
        return self._accumulate_stateless(own, inner_values, grads, list(trainable_variables), comm)

    def _accumulate_stateless(self, own: list[Any], inner_values: list[Any], grads: list[Any],
                              trainable_values: list[Any], comm: Communicator) -> tuple[list[Any], list[Any]]:
        """Accumulation without stateful branches (JAX): collectives only on the reducing pass.

        Only the allreduce sits in a functional ``cond``; the update is computed
        every pass and kept by ``where`` on the reducing one, as Keras's own JAX
        optimizer does for gradient accumulation.
        """
        ops, steps = keras.ops, self.backward_passes_per_step
        slot = {id(v): i for i, v in enumerate(self._variables)}
        count_at, acc_at = slot[id(self._pass_count)], [slot[id(a)] for a in self._accumulators]
        count = own[count_at] + 1
        sync = ops.greater_equal(count, steps)
        accs = [own[i] if g is None else own[i] + ops.cast(g, own[i].dtype) for g, i in zip(grads, acc_at)]
        summed = [None if g is None else a for g, a in zip(grads, accs)]
        variables = list(self._trainable_variables)
        reduced = ops.cond(sync, lambda: self._reduce(summed, comm, variables), lambda: summed)
        if self.average_aggregated_gradients:
            reduced = [None if r is None else r / steps for r in reduced]
        new_vars, new_inner = self.inner_optimizer.stateless_apply(inner_values, reduced, trainable_values)
        iterations = next(i for i, v in enumerate(self.inner_optimizer.variables)
                          if v is self.inner_optimizer.iterations)
        kept_inner = [ops.where(sync, n, o) for n, o in zip(new_inner, inner_values)]
        kept_inner[iterations] = inner_values[iterations] + 1  # every pass counts, as in Horovod
        own = list(own)
        own[count_at] = ops.where(sync, ops.zeros_like(count), count)
        for i, a in zip(acc_at, accs):
            own[i] = ops.where(sync, ops.zeros_like(a), a)
        return [ops.where(sync, n, o) for n, o in zip(new_vars, trainable_values)], own + kept_inner

    def _reduce(self, grads: Sequence[Any], comm: Communicator, variables: Sequence[Any] = ()) -> list[Any]:
        local = [id(v) in self._local_vars for v in variables] if self._local_vars else [False] * len(grads)
        shared = [g for g, is_local in zip(grads, local) if not is_local]
        reduced = iter(allreduce_gradients(shared, comm=comm, op=self.op, compression=self.compression,
                                           cap_bytes=self.bucket_cap_bytes))
        out: list[Any] = []
        for g, is_local in zip(grads, local):
            if not is_local:
                out.append(next(reduced))
            elif g is None or not self.scale_local_gradients or comm.size == 1:
                out.append(None if g is None else keras.ops.convert_to_tensor(g))
            else:
                out.append(keras.ops.convert_to_tensor(g) / comm.size)
        return out

    def _accumulate(self, grads: list[Any], variables: list[Any], comm: Communicator) -> None:
        steps = self.backward_passes_per_step
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        for g, acc in zip(grads, accs):
            if g is not None:
                acc.assign_add(keras.ops.cast(g, acc.dtype))
        self._pass_count.assign_add(1)
        count = keras.ops.convert_to_tensor(self._pass_count)

        def sync() -> None:
            summed = [None if g is None else keras.ops.convert_to_tensor(a) for g, a in zip(grads, accs)]
            reduced = self._reduce(summed, comm, variables)
            if self.average_aggregated_gradients:
                reduced = [None if r is None else r / steps for r in reduced]
            self.inner_optimizer.apply(reduced, variables)
            for acc in accs:
                acc.assign(keras.ops.zeros(acc.shape, acc.dtype))
            self._pass_count.assign(0)

        def skip() -> None:
            self.inner_optimizer.iterations.assign_add(1)

        if backend_name() == "tensorflow":
            keras.ops.cond(count >= steps, sync, skip)  # a graph cond inside the traced step
        else:  # eager torch or eager JAX; JAX's compiled step goes through stateless_apply
            (sync if bool(keras.ops.convert_to_numpy(count >= steps)) else skip)()

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
