"""ZeRO stages 1, 2 (TensorFlow, torch, JAX) and 3 (torch, JAX) for Keras 3 optimizers.

Trainable variables are grouped into partition units — the gradient buckets of
:func:`shardwise.core.buckets.plan_buckets`, as in the torch adapter — and each
unit is laid out flat by a :class:`~shardwise.core.zero.PartitionPlan`. The
wrapped optimizer is built over ONE flat variable per unit holding this rank's
shard, so Keras creates its slots (momentum, Adam's m and v) shard-sized. Each
step, per unit:

1. the shard variable takes this rank's slice of the current model variables
   (the model stays the source of truth, so ``set_weights`` and broadcasts work);
2. the local gradients are flattened (zero padding, ``None`` as zeros) and
   reduce-scattered: each rank receives the average of its own shard only;
3. the wrapped optimizer applies the shard gradient to the shard variable;
4. the updated shards are all-gathered and assigned back to the model variables.

Both stages run these same collectives, as DeepSpeed's stage 1 does with
``reduce_scatter`` on: a reduce-scatter plus an allgather move the bytes of one
allreduce, and nothing but the owned shard of the averaged gradient is ever
needed. Stage 2 differs from stage 1 only where a framework can free a full
gradient during backward, which Keras's train step cannot: it hands every full
local gradient to the optimizer at once. So here ``stage`` changes only the
per-rank bytes :meth:`ZeroOptimizer.expected_state_bytes` reports (the memory
model's accounting of the reduced gradients).

Every collective crosses to the communicator through the backend's bridge (see
:mod:`..bridges`), chained in a fixed order, so it runs eagerly, inside the graphs
TensorFlow traces (not under XLA) and inside JAX's compiled step.

Stage 3 also shards the model's variables between uses; how a layer's variables
are gathered where it runs is backend-specific, so the optimizer hands the whole
stage to a :class:`~.stage3.Stage3Engine` made for the running backend (see
:mod:`.stage3`). TensorFlow has none: see docs/keras.md for why.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np

from ....core.buckets import DEFAULT_BUCKET_CAP_BYTES, plan_buckets
from ....core.comm import Communicator, ReduceOp
from ....core.errors import ConfigError, ShardwiseError
from ....core.memory import ModelStateMemory, plan_state_bytes
from ....core.zero import PartitionPlan
from ..bridges import Bridge, backend_name, bridge
from ..ops import world
from ..optimizer import DistributedOptimizer
from .stage3 import make_engine
from .units import ZeroUnit

__all__ = ["ZeroOptimizer"]


@keras.saving.register_keras_serializable(package="shardwise")
class ZeroOptimizer(DistributedOptimizer):
    """ZeRO around ``optimizer``: sharded optimizer state and reduce-scattered gradients; stage 3 shards the variables too.

    ``optimizer`` is any Keras 3 optimizer whose update is elementwise (SGD,
    momentum, Adam, AdamW without exclusions, RMSprop, ...); it is built over one
    flat shard variable per unit. Use it like :class:`DistributedOptimizer`:
    ``model.compile(optimizer=ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=2))``.
    ``bucket_cap_bytes`` bounds each unit (one reduce-scatter and one allgather per
    unit and step); ``alignment`` pads each shard to a multiple of that many elements.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, stage: int = 1, *,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, alignment: int = 1,
                 comm: Optional[Communicator] = None, name: Optional[str] = None) -> None:
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            hint = " (stage 0 is plain data parallel: use DistributedOptimizer)" if stage == 0 else ""
            raise ConfigError(f"Keras ZeroOptimizer stage must be 1, 2 or 3, got {stage!r}{hint}")
        if stage == 3 and backend_name() == "tensorflow":
            raise ConfigError("Keras ZeroOptimizer stage 3 runs on the torch and JAX Keras backends, not on "
                              "TensorFlow (see docs/keras.md); use stage 1 or 2 there")
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        _check_inner(optimizer)
        super().__init__(optimizer, bucket_cap_bytes=bucket_cap_bytes, comm=comm,
                         name=name or f"Zero{stage}{type(optimizer).__name__}")
        self.stage = int(stage)
        self.alignment = int(alignment)
        if self.alignment < 1:
            raise ConfigError(f"alignment must be >= 1, got {alignment}")
        self._units: list[ZeroUnit] = []
        self._stage3: Optional[Any] = None  # the Stage3Engine, made by build() at stage 3

    # -- state ------------------------------------------------------------------------------
    @property
    def units(self) -> list[Any]:
        """The partition units (empty before :meth:`build`)."""
        return list(self._stage3.units) if self._stage3 is not None else list(self._units)

    @property
    def stage3_engine(self) -> Optional[Any]:
        """The backend's :class:`~.stage3.Stage3Engine` at stage 3 once built, else ``None``."""
        return self._stage3

    def attach_model(self, model: Any) -> None:
        """Stage 3: give the engine the model it shards (called before ``fit`` builds its train function)."""
        if self.stage == 3:
            if self._stage3 is None:
                raise ConfigError("ZeroOptimizer stage 3: build the optimizer before attaching the model")
            self._stage3.attach(model)

    def build(self, var_list: Sequence[Any]) -> None:
        """Plan the units, make one shard variable each and build the inner optimizer over them."""
        var_list = list(var_list)
        if not var_list:
            raise ConfigError("ZeroOptimizer: the model has no trainable variable")
        if self.stage == 3:
            _check_variables(var_list, self.inner_optimizer)
            _check_same_model(var_list, world(self._comm))
            self._stage3 = make_engine(self, var_list)
            keras.optimizers.Optimizer.build(self, var_list)
            return
        comm = world(self._comm)
        _check_variables(var_list, self.inner_optimizer)
        _check_same_model(var_list, comm)
        dtypes = [keras.backend.standardize_dtype(v.dtype) for v in var_list]
        numels = [int(np.prod(v.shape, dtype=np.int64)) for v in var_list]
        buckets = plan_buckets(numels, dtypes, [np.dtype(d).itemsize for d in dtypes], self.bucket_cap_bytes)
        units = []
        with bridge().init_scope():
            for bucket in buckets.buckets:
                members = tuple(sorted(bucket.params))
                plan = PartitionPlan.build([(f"{i}:{_path(var_list[i])}", tuple(var_list[i].shape))
                                            for i in members], comm.size, alignment=self.alignment)
                dtype = dtypes[members[0]]
                shard = keras.Variable(np.zeros(plan.shard_numel, dtype), dtype=dtype,
                                       name=f"zero_shard_{bucket.index}")
                units.append(ZeroUnit(bucket.index, members, plan, shard, dtype))
        self._units = units
        if not self.inner_optimizer.built:
            self.inner_optimizer.build([u.shard for u in units])
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def sharded_variables(self) -> list[Any]:
        """Variables whose value differs per rank (the shards and the inner optimizer's slots)."""
        if self._stage3 is not None:
            return self._stage3.sharded_variables
        inner = self.inner_optimizer
        replicated = {id(getattr(inner, "_iterations", None)), id(getattr(inner, "_learning_rate", None))}
        slots = [v for v in inner.variables if id(v) not in replicated]
        return [u.shard for u in self._units] + slots

    # -- updates ----------------------------------------------------------------------------
    def all_finite(self, finite: Any) -> Any:
        """Stage 3 on torch holds the real gradient shards (the loss-scale check sees empty ones): they count too."""
        local = getattr(self._stage3, "local_finite", None)
        if local is not None:
            finite = keras.ops.logical_and(finite, local())
        return super().all_finite(finite)

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """JAX's functional step: :meth:`apply` inside Keras's stateless scope.

        The shard variables are working buffers re-derived from the model every
        step, so they need no slot in the functional state.
        """
        if self._stage3 is not None:
            return self._stage3.stateless_apply(optimizer_variables, grads, trainable_variables)
        return keras.optimizers.Optimizer.stateless_apply(self, optimizer_variables, grads, trainable_variables)

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Reduce ``grads`` to this rank's shards, step the shards, all-gather the new values."""
        grads = list(grads)
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        if not self.built:
            raise ConfigError("pass trainable_variables on the first apply(), or call build() first")
        if self._stage3 is not None:
            self._stage3.apply(grads, trainable_variables)
            return
        variables = list(self._trainable_variables)
        if trainable_variables is not None:
            given = list(trainable_variables)
            if len(grads) != len(given):
                raise ConfigError(f"got {len(grads)} gradients for {len(given)} variables")
            self._check_variables_are_known(given)
            ordered: list[Optional[Any]] = [None] * len(variables)
            for g, v in zip(grads, given):
                ordered[self._get_variable_index(v)] = g
            grads = ordered
        elif len(grads) != len(variables):
            raise ConfigError(f"got {len(grads)} gradients for {len(variables)} variables")
        comm, via = world(self._comm), bridge()
        if comm.size > 1:
            via.check_compilable("ZeroOptimizer")
        shard_grads, last = [], None
        for unit in self._units:
            unit.shard.assign(unit.owned_slice(variables, comm.rank))
            grad, last = self._reduce(unit, unit.flat_grads(grads), comm, via, last)
            shard_grads.append(grad)
        self.inner_optimizer.apply(shard_grads, [u.shard for u in self._units])
        for unit in self._units:
            full, last = self._gather(unit, comm, via, last)
            offset = 0
            for slot, m in zip(unit.plan.params, unit.members):
                var = variables[m]
                piece = full[offset:offset + slot.numel]
                offset += slot.numel
                var.assign(keras.ops.cast(keras.ops.reshape(piece, slot.shape), var.dtype))
                if getattr(var, "constraint", None) is not None:
                    var.assign(var.constraint(var))

    def _reduce(self, unit: ZeroUnit, flat: Any, comm: Communicator, via: Bridge, last: Any) -> tuple[Any, Any]:
        """This rank's averaged gradient shard (a reduce-scatter), and the result later collectives must follow.

        The flat buffer is padded to ``size * shard_numel``, so the reduce-scatter's
        equal row blocks are exactly the plan's owned ranges.
        """
        if comm.size == 1:
            return flat, last
        out = via.run(lambda a: comm.reduce_scatter(a, ReduceOp.AVERAGE), flat, (unit.plan.shard_numel,), last)
        return out, out

    def _gather(self, unit: ZeroUnit, comm: Communicator, via: Bridge, last: Any) -> tuple[Any, Any]:
        """Every rank's updated shard, concatenated into the padded flat buffer."""
        shard = keras.ops.convert_to_tensor(unit.shard)
        if comm.size == 1:
            return shard, last
        full = via.run(lambda a: comm.allgather(a), shard, (unit.plan.padded_numel,), last)
        return full, full

    # -- memory -----------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes of the inner optimizer's variables on this rank (slots, plus its scalar counters)."""
        return sum(int(np.prod(v.shape, dtype=np.int64)) * _itemsize(v)
                   for v in self.inner_optimizer.variables)

    def expected_state_bytes(self, optimizer: str) -> ModelStateMemory:
        """The core memory model's per-rank bytes (fp32 training), summed over units.

        Not counted there: the shard variables themselves (``shard_numel`` elements
        per unit), a working copy Keras needs because a variable cannot alias a
        slice of others.
        """
        parts = [plan_state_bytes(u.plan, self.stage, optimizer, "fp32") for u in self._units]
        return ModelStateMemory(params=sum(p.params for p in parts), grads=sum(p.grads for p in parts),
                                optimizer_states=sum(p.optimizer_states for p in parts))

    # -- serialization ----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "stage": self.stage, "bucket_cap_bytes": self.bucket_cap_bytes, "alignment": self.alignment}


def _itemsize(variable: Any) -> int:
    return np.dtype(keras.backend.standardize_dtype(variable.dtype)).itemsize


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "variable"))


def _check_inner(optimizer: Any) -> None:
    """Refuse inner optimizers whose update is not elementwise over a flat shard."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"ZeroOptimizer wraps a Keras 3 optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError("ZeroOptimizer cannot wrap a LossScaleOptimizer: each rank would check only its "
                          "own gradient shard for inf/nan and ranks could take different branches")
    if getattr(optimizer, "use_ema", False):
        raise ConfigError("ZeroOptimizer does not support use_ema: the moving averages would be shards")
    for attr in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, attr, None) is not None:
            raise ConfigError(f"ZeroOptimizer does not support {attr}: the inner optimizer sees only this "
                              "rank's flat shard, so the norm would be wrong (clipvalue is fine)")


def _check_variables(var_list: Sequence[Any], inner: Any) -> None:
    """Refuse variables and settings a flat shard cannot honour."""
    if getattr(inner, "weight_decay", None) is not None and (
            getattr(inner, "_exclude_from_weight_decay", None)
            or getattr(inner, "_exclude_from_weight_decay_pattern", None) is not None):
        raise ConfigError("ZeroOptimizer: exclude_from_weight_decay cannot apply to a flat shard that "
                          "mixes variables; drop the exclusions or use DistributedOptimizer")
    special = [_path(v) for v in var_list if getattr(v, "overwrite_with_gradient", False)]
    if special:
        raise ConfigError(f"ZeroOptimizer does not support overwrite_with_gradient variables: {special[:4]}")


def _check_same_model(var_list: Sequence[Any], comm: Communicator) -> None:
    """Raise on ranks whose variable lists (paths, shapes, dtypes) differ from rank 0's."""
    if comm.size == 1:
        return
    mine = [(_path(v), tuple(v.shape), keras.backend.standardize_dtype(v.dtype)) for v in var_list]
    every = comm.allgather_object(mine)
    differing = [r for r, other in enumerate(every) if other != every[0]]
    if differing:
        diff = sorted(set(map(str, every[0])) ^ set(map(str, every[differing[0]])))[:6]
        raise ShardwiseError(f"ZeroOptimizer: ranks {differing} have a different model than rank 0 "
                             f"(differing variables: {', '.join(diff)})")
