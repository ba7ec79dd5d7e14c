"""ZeRO-3 on JAX: a model variable whose storage is this rank's flat shard.

Keras's JAX ``fit`` passes ``[v.value for v in model.trainable_variables]`` into its
compiled step and assigns what comes back (``jax_state_sync``). For the step's
trainable state to be shards, a sharded variable's value *is* its shard: the
variable keeps its full ``shape`` (layers and saving read it) while its storage
delegates to the unit's ``shard`` variable, the only copy. Python gives a class
no other seam for this: Keras reads and writes ``_value`` directly, and checks
``assign`` against the full shape, so the variable's class is switched to
:class:`ShardedVariable` when the engine takes it over (both are plain
``keras.Variable`` layouts; nothing else of the object changes).

* ``value`` outside a step: the flat shard (``shard_numel`` elements); read by a
  layer in a stateless scope that does not map it (Keras building the model on a
  batch before ``fit`` takes the model over), the full value, all-gathered;
* ``assign(full)``: keeps this rank's range of ``full``; a shard-shaped value is
  taken only from Keras's own state sync (the arrays ``fit`` holds), so
  ``broadcast_variables`` and other rank-blind writers fail loudly instead of
  copying one rank's shard into every rank;
* ``numpy()`` / ``np.asarray(v)`` / ``get_weights()``: the full value, all-gathered
  on demand: a collective, so every rank must make the same calls; inside
  ``shardwise.keras.full_weights(model)`` the gathered value (``_zero_full``) is
  read and assigned instead, so one rank alone may read or save there.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from keras.src.backend.common.stateless_scope import get_stateless_scope, in_stateless_scope
from keras.src.backend import Variable as KerasVariable

from .....core.errors import ShardwiseError
from .....core.zero import PartitionPlan

__all__ = ["ShardedVariable", "shard_of", "unshard"]


def shard_of(full: Any, plan: PartitionPlan, rank: int) -> Any:
    """``rank``'s flat range of ``full`` under ``plan`` (zero-padded at the end of the buffer)."""
    flat = jnp.reshape(jnp.asarray(full), (-1,))
    if plan.padded_numel > plan.numel:
        flat = jnp.pad(flat, (0, plan.padded_numel - plan.numel))
    start, end = plan.owned_range(rank)
    return flat[start:end]


def unshard(gathered: Any, plan: PartitionPlan) -> Any:
    """The full value from every rank's shards concatenated (the padded flat buffer)."""
    return jnp.reshape(gathered[:plan.numel], plan.params[0].shape)


class ShardedVariable(KerasVariable):
    """A Keras JAX variable whose storage is this rank's shard (see the module docstring)."""

    # Set by JaxStage3 when it takes the variable over.
    _zero_unit: Any        # the ZeroUnit: plan, shard variable
    _zero_rank: int
    _zero_gather: Callable[[Any], Any]   # eager all-gather of one unit -> full value
    _zero_trusted: Callable[[Any], bool]  # is this array one of fit's own state arrays?

    @property
    def _value(self) -> Any:
        return self._zero_unit.shard._value

    @_value.setter
    def _value(self, value: Any) -> None:
        shard = self._zero_unit.shard
        if value is None or tuple(value.shape) == (self._zero_unit.plan.shard_numel,):
            shard._value = value
        else:
            shard._value = shard_of(value, self._zero_unit.plan, self._zero_rank).astype(shard.dtype)

    @property
    def value(self) -> Any:
        """The shard; inside a stateless scope the mapped full value, else the full value gathered."""
        if in_stateless_scope():
            mapped = get_stateless_scope().get_current_value(self)
            return self._maybe_autocast(self._zero_gather(self) if mapped is None else mapped)
        full = self.__dict__.get("_zero_full")
        return self._maybe_autocast(self._value if full is None else full)

    @property
    def shard_shape(self) -> tuple[int]:
        """The shape of this rank's storage: ``(shard_numel,)``."""
        return (self._zero_unit.plan.shard_numel,)

    def assign(self, value: Any) -> Any:
        trusted = self._zero_trusted(value)
        value = self._convert_to_tensor(value, dtype=self._dtype)
        shape = tuple(value.shape)
        if trusted and shape == self.shard_shape:
            if in_stateless_scope():
                raise ShardwiseError(f"{self.path}: a ZeRO-3 shard cannot be assigned inside a stateless scope")
            self._zero_unit.shard._value = value
            return value
        if shape != tuple(self.shape):
            raise ShardwiseError(
                f"{self.path} is a ZeRO-3 sharded variable of shape {tuple(self.shape)} (this rank holds "
                f"{self.shard_shape}); assign takes the full value, got shape {shape}. Rank-blind copies "
                "(broadcast_variables over model.variables) read shards: use BroadcastGlobalVariablesCallback, "
                "which skips sharded variables, or numpy() to gather the full value first")
        if in_stateless_scope():
            get_stateless_scope().add_update((self, value))
        elif self.__dict__.get("_zero_full") is not None:
            self._zero_full = value  # inside full_weights: cut into the shard when it ends
        else:
            self._value = value
        return value

    def assign_add(self, value: Any) -> Any:
        return self.assign(jnp.asarray(self.numpy()) + jnp.asarray(value))

    def assign_sub(self, value: Any) -> Any:
        return self.assign(jnp.asarray(self.numpy()) - jnp.asarray(value))

    def numpy(self) -> np.ndarray:
        """The full value, all-gathered from every rank's shard (a collective)."""
        full = self.__dict__.get("_zero_full")
        return np.asarray(self._zero_gather(self) if full is None else full)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        full = self.numpy()
        return full if dtype is None else full.astype(dtype)
