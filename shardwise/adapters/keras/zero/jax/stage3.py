"""ZeRO stage 3 for Keras on JAX, inside ``fit``'s compiled train step.

Between steps each rank holds a 1/N flat shard of every trainable variable: one
partition unit per variable, its ``shard`` variable the only copy (the model's
variable delegates its storage to it, see :mod:`.variables`), and the inner
optimizer is built over the shards, so its slots are shard-sized. ``fit``'s state
tuple therefore carries shards; shardwise's own train step (:mod:`.steps`),
which Keras jits as usual, gathers each layer's variables where the layer runs
and again in the backward pass, and reduce-scatters their gradients
(:mod:`.layers`); the inner optimizer then steps the shards statelessly.
Collectives are ordered ``io_callback``s (:mod:`...bridges.jax`): every rank runs
the same ones in program order.

``evaluate`` and ``predict`` run the same way (a gather per layer and batch, so
every rank must call them with the same number of batches); ``get_weights()`` and
``numpy()`` all-gather on demand (collectives too). Initial values are rank 0's:
at build each rank keeps its range of rank 0's variables, as a broadcast would.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import keras
import numpy as np

from .....core.comm import ReduceOp
from .....core.errors import ConfigError
from .....core.zero import PartitionPlan
from ...bridges import bridge
from ...jax_heap import trim_heap_after_compiles
from ...ops import world
from ..units import ZeroUnit
from ..access import register_layer
from .layers import LayerGather, owning_layers
from .steps import Zero3Steps
from .variables import ShardedVariable, shard_of, unshard

__all__ = ["JaxStage3"]


class JaxStage3:
    """The JAX :class:`~.stage3.Stage3Engine`: shards the variables of ``var_list`` at construction."""

    def __init__(self, optimizer: Any, var_list: Sequence[Any]) -> None:
        _check_runtime(var_list)
        trim_heap_after_compiles()  # from the initializers compiled below to fit's step
        self._optimizer = optimizer
        self._comm = world(optimizer._comm)
        self._variables = list(var_list)
        self._model: Optional[Any] = None
        self.steps: Optional[Zero3Steps] = None
        comm, rank = self._comm, self._comm.rank
        units = []
        with bridge().init_scope():
            for i, var in enumerate(self._variables):
                dtype = keras.backend.standardize_dtype(var.dtype)
                plan = PartitionPlan.build([(f"{i}:{_path(var)}", tuple(var.shape))], comm.size,
                                           alignment=optimizer.alignment)
                full = _initial_value(var, dtype)
                if comm.size > 1:
                    full = np.asarray(comm.broadcast(full, 0)).reshape(full.shape)
                shard = keras.Variable(_numpy_shard(full, plan, rank), dtype=dtype,
                                       name=f"zero3_shard_{i}", trainable=False)
                del full
                units.append(ZeroUnit(i, (i,), plan, shard, dtype))
        self.units = units
        self._by_id = {id(v): u for v, u in zip(self._variables, units)}
        for var, unit in zip(self._variables, units):
            _take_over(var, unit, rank, self._gather_now, self._is_fit_state)
        inner = optimizer.inner_optimizer
        if not inner.built:
            inner.build([u.shard for u in units])
        self.layers = LayerGather(self._by_id, self._gather, self._reduce, self._gather_now)

    # -- Stage3Engine -----------------------------------------------------------------------
    def attach(self, model: Any) -> None:
        """Wrap the layers that own sharded variables and give ``model`` shardwise's steps."""
        if self._model is model:
            return
        if self._model is not None:
            raise ConfigError("this ZeroOptimizer stage 3 already trains another model")
        _check_model(model, self._variables)
        for layer in owning_layers(model, set(self._by_id)):
            self.layers.wrap(layer)
        steps = Zero3Steps(model, self.layers)
        model.train_step, model.test_step, model.predict_step = steps.train_step, steps.test_step, steps.predict_step
        model.train_function = model.test_function = model.predict_function = None  # built over Keras's steps
        register_layer(model, self)  # full_weights(model), and get_weights() gathering once
        self._model, self.steps = model, steps

    def apply(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        """Not on JAX: the step is ``fit``'s compiled one (:meth:`stateless_apply`)."""
        raise ConfigError("ZeroOptimizer stage 3 on JAX steps inside fit/evaluate/predict's compiled step; "
                          "optimizer.apply() with full gradients is not supported (use model.fit or "
                          "model.train_on_batch)")

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Step the shards: ``grads`` are already this rank's averaged shard gradients (see :mod:`.layers`)."""
        own_count = len(self._optimizer._variables)
        values = [keras.ops.convert_to_tensor(v) for v in optimizer_variables]  # a LossScaleOptimizer passes variables
        own, inner_values = values[:own_count], values[own_count:]
        shards = [keras.ops.convert_to_tensor(s) for s in trainable_variables]
        if len(grads) != len(shards):
            raise ConfigError(f"got {len(grads)} gradients for {len(shards)} sharded variables")
        grads = [jax.numpy.zeros_like(s) if g is None else g for g, s in zip(grads, shards)]
        new_shards, new_inner = self._optimizer.inner_optimizer.stateless_apply(inner_values, grads, shards)
        return list(new_shards), own + list(new_inner)

    def shards_changed(self) -> None:
        """Nothing is cached: gathered values live only inside a step, and the variables read the shards."""

    @property
    def sharded_variables(self) -> list[Any]:
        """The model's trainable variables (their values are shards), the shards and the inner slots."""
        inner = self._optimizer.inner_optimizer
        replicated = {id(getattr(inner, "_iterations", None)), id(getattr(inner, "_learning_rate", None))}
        slots = [v for v in inner.variables if id(v) not in replicated]
        return list(self._variables) + [u.shard for u in self.units] + slots

    # -- whole values for users (..access.full_weights) ---------------------------------
    def units_of(self, variables: Sequence[Any]) -> list[ZeroUnit]:
        """The units of those of ``variables`` that are sharded."""
        return [self._by_id[id(v)] for v in variables if id(v) in self._by_id]

    def gather(self, units: Sequence[ZeroUnit]) -> list[Any]:
        """Collective: give ``units``' variables their full value until :meth:`release`; returns those gathered now."""
        gathered = []
        for unit in units:
            var = self._variables[unit.index]
            if var.__dict__.get("_zero_full") is None:  # not already inside an enclosing full_weights
                var._zero_full = self._gather_now(var)
                gathered.append(var)
        return gathered

    def release(self, gathered: Sequence[Any], write_back: bool) -> None:
        """Drop the full values :meth:`gather` gave; with ``write_back``, keep this rank's range of them."""
        for var in gathered:
            full = var.__dict__.pop("_zero_full", None)
            if write_back and full is not None:
                var._value = full

    # -- collectives ------------------------------------------------------------------------
    def _gather(self, unit: ZeroUnit, shard: Any) -> Any:
        """The full value of ``unit``'s variable from every rank's shard (traceable)."""
        if self._comm.size == 1:
            return unshard(shard, unit.plan)
        comm = self._comm
        full = bridge().run(lambda a: comm.allgather(a), shard, (unit.plan.padded_numel,))
        return unshard(full, unit.plan)

    def _reduce(self, unit: ZeroUnit, grad: Any) -> Any:
        """This rank's shard of the rank-averaged full gradient ``grad`` (traceable)."""
        flat = jax.numpy.reshape(grad, (-1,)).astype(unit.dtype)
        if unit.plan.padded_numel > unit.plan.numel:
            flat = jax.numpy.pad(flat, (0, unit.plan.padded_numel - unit.plan.numel))
        if self._comm.size == 1:
            return flat
        comm = self._comm
        return bridge().run(lambda a: comm.reduce_scatter(a, ReduceOp.AVERAGE), flat, (unit.plan.shard_numel,))

    def _gather_now(self, variable: Any) -> Any:
        """Eager gather of ``variable``'s full value from the current shards (a collective)."""
        unit = self._by_id[id(variable)]
        state = getattr(self._model, "_jax_state", None) if self._model is not None else None
        if state and not getattr(self._model, "_jax_state_synced", True):
            self._model.jax_state_sync()  # fit holds newer shards than the variables
        shard = unit.shard._value
        if shard is None:
            raise ConfigError(f"{_path(variable)}: its shard is held by a running fit/evaluate step")
        return self._gather(unit, shard)

    def _is_fit_state(self, value: Any) -> bool:
        """Is ``value`` one of the arrays Keras's ``fit`` holds as state (its ``jax_state_sync``)?"""
        state = getattr(self._model, "_jax_state", None) if self._model is not None else None
        if not state:
            return False
        return any(value is a for a in state.get("trainable_variables", ()) or ())


def _initial_value(var: Any, dtype: str) -> np.ndarray:
    """``var``'s value, computed from its initializer when it was created uninitialized (``sharded_build``)."""
    value = var.__dict__.get("_value")
    if value is None:
        value = var._initializer(var._shape, dtype=var._dtype)
    return np.asarray(value, dtype=dtype)


def _numpy_shard(full: np.ndarray, plan: PartitionPlan, rank: int) -> np.ndarray:
    """``rank``'s range of ``full``, a copy: numpy, since a jnp slice compiles one program per shape."""
    start, end = plan.owned_range(rank)
    flat = full.reshape(-1)
    shard = np.zeros(end - start, dtype=full.dtype)
    have = flat[start:min(end, plan.numel)]
    shard[:len(have)] = have
    return shard


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "variable"))


def _take_over(var: Any, unit: ZeroUnit, rank: int, gather: Any, trusted: Any) -> None:
    """Make ``var`` a :class:`ShardedVariable` over ``unit`` and drop its full value."""
    var.__dict__.pop("_value", None)
    var.__class__ = ShardedVariable
    var._zero_unit, var._zero_rank = unit, rank
    var._zero_gather, var._zero_trusted = gather, trusted


def _check_runtime(var_list: Sequence[Any]) -> None:
    """Refuse what a sharded variable cannot honour, naming it."""
    from keras.src.backend.config import is_nnx_enabled
    from keras.src.backend import Variable as KerasVariable

    if is_nnx_enabled():
        raise ConfigError("ZeroOptimizer stage 3 does not support Keras's NNX mode (KERAS_NNX_ENABLED)")
    if keras.distribution.distribution() is not None:
        raise ConfigError("ZeroOptimizer stage 3 shards the variables itself: unset the keras.distribution "
                          f"({type(keras.distribution.distribution()).__name__}) first")
    for var in var_list:
        if type(var) is not KerasVariable:
            raise ConfigError(f"ZeroOptimizer stage 3 shards plain Keras JAX variables; {_path(var)} is a "
                              f"{type(var).__name__}")
        if getattr(var, "constraint", None) is not None:
            raise ConfigError(f"ZeroOptimizer stage 3 cannot apply the constraint of {_path(var)}: "
                              "this rank holds only a flat shard of it")


def _check_model(model: Any, variables: Sequence[Any]) -> None:
    """The model must be one Keras JAX trainer whose trainable variables are the optimizer's."""
    from keras.src.backend.jax.trainer import JAXTrainer

    for name in ("train_step", "test_step", "predict_step"):
        if getattr(type(model), name) is not getattr(JAXTrainer, name):
            raise ConfigError(f"ZeroOptimizer stage 3 runs its own {name} (it gathers each layer's variables "
                              f"where it runs); {type(model).__name__} overrides {name}, which is not supported")
    ours = {id(v) for v in variables}
    mine = [v for v in model.trainable_variables]
    if {id(v) for v in mine} != ours:
        raise ConfigError(f"ZeroOptimizer stage 3 was built over {len(ours)} variables, but the model has "
                          f"{len(mine)} trainable variables that differ from them (build the optimizer "
                          "through model.fit, or over model.trainable_variables)")
