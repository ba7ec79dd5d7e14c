"""ZeRO-3 on JAX: a layer's full variables exist only while it runs, forward and backward.

Each layer owning trainable variables gets its ``call`` wrapped (an attribute of
that layer object; the class is untouched). Inside shardwise's train step the
wrapper runs the layer as one ``jax.custom_vjp`` of (shards, inputs, other state):

* forward: all-gather the layer's shards, run ``call`` with the full values mapped
  in a stateless scope; only the shards, the inputs and the state are saved;
* backward: all-gather again, re-run ``call`` under ``jax.vjp`` (rematerialization),
  and reduce-scatter the full variable cotangents with AVERAGE, so autodiff hands
  the optimizer this rank's averaged shard gradient.

Why not ``jax.checkpoint``: it refuses ordered effects ("Effects not supported in
partial-eval of checkpoint/remat"), and the collectives must be ordered
``io_callback``s so every rank runs them in program order. A ``custom_vjp`` may
contain them in its forward and backward, and its residuals are exactly what it
returns, so the gathered values are never saved for the backward pass (XLA frees
them after their last use in each half of the step).

Outside a shardwise step (Keras's symbolic build, an eager ``model(x)``), the
wrapper gathers the layer's variables and calls through; in a stateless scope
that already maps them (full values), it calls straight through.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from keras.src.backend.common.global_state import get_global_attribute, set_global_attribute
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope

__all__ = ["LayerGather", "owning_layers"]

_WRAPPED = "__shardwise_zero3_call__"


def owning_layers(model: Any, sharded: set[int]) -> list[Any]:
    """The outermost layers (the model included) that own a sharded variable directly.

    Such a layer is gathered whole, its sublayers with it: their variables are
    mapped by the time they run, so their own wrappers call straight through.
    """
    out: list[Any] = []

    def visit(layer: Any) -> None:
        own = list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))
        if any(id(v) in sharded for v in own):
            out.append(layer)
            return
        for sub in getattr(layer, "_layers", []):
            visit(sub)

    visit(model)
    return out


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer))


def _zero_cotangent(x: Any) -> Any:
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros(jnp.shape(x), dtype)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


class LayerGather:
    """Wraps layers' ``call`` so that their sharded variables are gathered where they run.

    ``gather(unit, shard)`` and ``reduce(unit, grad)`` are the engine's collectives
    (ordered host callbacks, usable under ``jax.jit``); ``units`` maps a variable's
    ``id`` to its unit. :meth:`step` binds the shard values of the step being traced.
    """

    def __init__(self, units: dict[int, Any], gather: Callable[[Any, Any], Any],
                 reduce: Callable[[Any, Any], Any], eager_gather: Callable[[Any], Any]) -> None:
        self._units = units
        self._gather = gather
        self._reduce = reduce
        self._eager_gather = eager_gather
        self._shards: Optional[dict[int, Any]] = None
        self._penalties: dict[int, Any] = {}  # variable id -> its regularizer's value, this step

    @contextlib.contextmanager
    def step(self, variables: Sequence[Any], shards: Sequence[Any]) -> Iterator[None]:
        """While tracing a step: ``variables``' values are ``shards`` (tracers)."""
        previous, penalties = self._shards, self._penalties
        self._shards, self._penalties = {id(v): s for v, s in zip(variables, shards)}, {}
        try:
            yield
        finally:
            self._shards, self._penalties = previous, penalties

    def penalties(self, variables: Sequence[Any]) -> list[Any]:
        """The regularization terms of ``variables`` computed in this step's gathered calls, in that order."""
        return [self._penalties[id(v)] for v in variables if id(v) in self._penalties]

    def wrap(self, layer: Any) -> None:
        """Replace ``layer.call`` by the gathering wrapper (idempotent)."""
        if getattr(layer.__dict__.get("call"), _WRAPPED, False):
            return
        original = layer.call
        mine = [v for v in layer.trainable_variables + layer.non_trainable_variables if id(v) in self._units]

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(original, mine, args, kwargs)

        setattr(call, _WRAPPED, True)
        call.__wrapped__ = original  # type: ignore[attr-defined]
        layer.call = call

    # -- the three ways a wrapped layer runs ----------------------------------------------
    def _call(self, original: Callable[..., Any], mine: list[Any], args: tuple, kwargs: dict) -> Any:
        scope = get_stateless_scope()
        if scope is not None and all(scope.get_current_value(v) is not None for v in mine):
            return original(*args, **kwargs)  # full values already mapped (an enclosing gathered layer)
        if self._shards is None or any(id(v) not in self._shards for v in mine):
            full = [self._eager_gather(v) for v in mine]
            with _nested_scope(scope, list(zip(mine, full))):
                return original(*args, **kwargs)
        return self._remat_call(original, mine, args, kwargs, scope)

    def _remat_call(self, original: Callable[..., Any], mine: list[Any], args: tuple, kwargs: dict,
                    scope: Optional[StatelessScope]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn_at = [i for i, x in enumerate(leaves) if _is_array(x)]
        dyn = [leaves[i] for i in dyn_at]
        outer_ids = list(scope.state_mapping) if scope is not None else []
        outer_vals = [scope.state_mapping[k] for k in outer_ids] if scope is not None else []
        autocast = get_global_attribute("autocast_scope")
        collect_losses = bool(scope is not None and scope.collect_losses)
        units = [self._units[id(v)] for v in mine]
        shards = [self._shards[id(v)] for v in mine]
        out_tree: list[Any] = []

        def run(full: list[Any], dyn: list[Any], outer_vals: list[Any]) -> tuple[Any, dict, list]:
            values = list(leaves)
            for i, x in zip(dyn_at, dyn):
                values[i] = x
            a, kw = jax.tree_util.tree_unflatten(treedef, values)
            inner = StatelessScope(state_mapping=list(zip(mine, full)), collect_losses=collect_losses,
                                   initialize_variables=False)
            merged = dict(zip(outer_ids, outer_vals))
            merged.update(inner.state_mapping)
            inner.state_mapping = merged
            previous_cast = get_global_attribute("autocast_scope")
            set_global_attribute("autocast_scope", autocast)
            try:
                with inner:
                    out = original(*a, **kw)
            finally:
                set_global_attribute("autocast_scope", previous_cast)
            mine_ids = {id(v) for v in mine}
            updates = {k: v for k, v in inner.state_mapping.items()
                       if k not in mine_ids and (k not in outer_ids or v is not outer_vals[outer_ids.index(k)])}
            # Weight regularization needs the whole variable: computed here, where it is gathered.
            penalties = [v.regularizer(f) for v, f in zip(mine, full) if v.trainable and v.regularizer is not None]
            return out, updates, list(inner.losses), penalties

        def gather_all(shards: list[Any]) -> list[Any]:
            return [self._gather(u, s) for u, s in zip(units, shards)]

        @jax.custom_vjp
        def layer_fn(shards: list[Any], dyn: list[Any], outer_vals: list[Any]) -> Any:
            return run(gather_all(shards), dyn, outer_vals)

        def fwd(shards: list[Any], dyn: list[Any], outer_vals: list[Any]) -> tuple[Any, Any]:
            return run(gather_all(shards), dyn, outer_vals), (shards, dyn, outer_vals)

        def bwd(res: Any, cotangent: Any) -> tuple[list, list, list]:
            shards, dyn, outer_vals = res

            def differentiable(full: list[Any], dyn: list[Any]) -> tuple[Any, list, list]:
                out, _, losses, penalties = run(full, dyn, outer_vals)
                return out, losses, penalties  # all carry gradient; the state updates do not

            _, vjp = jax.vjp(differentiable, gather_all(shards), dyn)
            g_full, g_dyn = vjp((cotangent[0], cotangent[2], cotangent[3]))
            g_shards = [self._reduce(u, g) for u, g in zip(units, g_full)]
            return g_shards, g_dyn, [_zero_cotangent(v) for v in outer_vals]

        layer_fn.defvjp(fwd, bwd)
        out, updates, losses, penalties = layer_fn(shards, dyn, outer_vals)
        with_penalty = [v for v in mine if v.trainable and v.regularizer is not None]
        self._penalties.update({id(v): p for v, p in zip(with_penalty, penalties)})
        if scope is not None:
            scope.state_mapping.update(updates)
            if collect_losses:
                scope.losses.extend(losses)
        del out_tree
        return out


@contextlib.contextmanager
def _nested_scope(outer: Optional[StatelessScope], mapping: list[tuple[Any, Any]]) -> Iterator[None]:
    """A stateless scope with ``mapping`` over everything ``outer`` maps; its updates flow back to ``outer``."""
    inner = StatelessScope(state_mapping=mapping, collect_losses=bool(outer is not None and outer.collect_losses),
                           initialize_variables=outer is None)
    mine = set(inner.state_mapping)
    if outer is not None:
        merged = dict(outer.state_mapping)
        merged.update(inner.state_mapping)
        inner.state_mapping = merged
    with inner:
        yield
    if outer is not None:
        outer.state_mapping.update({k: v for k, v in inner.state_mapping.items() if k not in mine})
        outer.losses.extend(inner.losses)
