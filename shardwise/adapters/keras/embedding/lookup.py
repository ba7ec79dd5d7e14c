"""Backend glue of :class:`~.layer.ShardedEmbeddingBag`: the lookup as a differentiable op.

JAX: a ``jax.custom_vjp`` whose primal and forward rules are one ordered ``io_callback``
each (the forward rule keeps the exchange for the backward under an int32 handle, the
primal does not), and whose backward rule is an ordered ``io_callback`` that sends the
pooled gradients to the owners and updates the rows there. Every shape crossing a callback
is static: ``[batch, max_ids]`` ids in, ``[batch, width]`` pooled rows out. Torch: a
``torch.autograd.Function`` doing the same eagerly. Each framework is imported only when
its op is first used.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional, Sequence

import numpy as np

from .host import HostEmbeddingEngine

__all__ = ["jax_lookup", "torch_lookup"]


def _present(weights: Optional[Sequence[Any]], n: int) -> list[int]:
    """The features (indexes) that have per-id weights."""
    return [] if weights is None else [i for i in range(n) if weights[i] is not None]


def _spread(n: int, where: list[int], given: Sequence[Any]) -> Optional[list[Any]]:
    """Per feature its weights (None where it has none), from the weights of the features ``where``."""
    if not where:
        return None
    out: list[Any] = [None] * n
    for i, w in zip(where, given):
        out[i] = w
    return out


def jax_lookup(engine: HostEmbeddingEngine, anchor: Any, ids: Sequence[Any],
               weights: Optional[Sequence[Any]] = None) -> Any:
    """Pooled rows ``[batch, width]`` of ``ids`` (JAX arrays or tracers), with per-id ``weights`` (None, or
    per feature None or a float array of its ids' shape); differentiable through ``anchor`` (the weights
    are not differentiated: their gradient is zero)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    n = len(ids)
    where = _present(weights, n)
    args = [jnp.asarray(i) for i in ids] + [jnp.asarray(weights[i], jnp.float32) for i in where]
    batch = int(args[0].shape[0])
    specs = (jax.ShapeDtypeStruct((batch, engine.width), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))

    def host_forward(save: bool) -> Any:
        def run(*arrays: Any) -> tuple[np.ndarray, np.ndarray]:
            host = [np.asarray(a) for a in arrays]
            pooled, handle = engine.lookup(host[:n], save=save, weights=_spread(n, where, host[n:]))
            return pooled, np.asarray(handle, np.int32)

        return run

    def host_backward(handle: Any, grad: Any) -> np.ndarray:
        engine.backward(int(np.asarray(handle)), np.asarray(grad))
        return np.zeros((), np.float32)

    @jax.custom_vjp
    def lookup(anchor: Any, *arrays: Any) -> Any:
        return io_callback(host_forward(False), specs, *arrays, ordered=True)[0]

    def forward(anchor: Any, *arrays: Any) -> tuple[Any, tuple]:
        pooled, handle = io_callback(host_forward(True), specs, *arrays, ordered=True)
        return pooled, (handle, anchor)

    def backward(res: tuple, grad: Any) -> tuple:
        handle, anchor = res
        done = io_callback(host_backward, jax.ShapeDtypeStruct((), jnp.float32), handle, grad, ordered=True)
        zero = (done * 0).astype(anchor.dtype)  # the table update is the callback's effect; anchor's gradient is 0
        return ((jnp.broadcast_to(zero, jnp.shape(anchor)),)
                + tuple(np.zeros(a.shape, dtype=jax.dtypes.float0) for a in args[:n])
                + tuple(jnp.zeros(a.shape, a.dtype) for a in args[n:]))

    lookup.defvjp(forward, backward)
    return lookup(anchor, *args)


@lru_cache(maxsize=None)
def _torch_function() -> Any:
    import torch

    class _Lookup(torch.autograd.Function):
        """Forward: the two all-to-alls and the owners' pooling; backward: gradients to the owners, rows updated."""

        @staticmethod
        def forward(ctx: Any, anchor: torch.Tensor, engine: HostEmbeddingEngine, save: bool, n: int,
                    where: tuple, *arrays: torch.Tensor) -> torch.Tensor:
            host = [a.detach().cpu().numpy() for a in arrays]
            pooled, handle = engine.lookup(host[:n], save=save, weights=_spread(n, list(where), host[n:]))
            ctx.engine, ctx.handle, ctx.n_inputs = engine, handle, 5 + len(arrays)
            ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
            return torch.from_numpy(pooled).to(arrays[0].device)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            ctx.engine.backward(ctx.handle, grad.detach().cpu().float().numpy())
            shape, dtype, device = ctx.anchor
            return (torch.zeros(shape, dtype=dtype, device=device),) + (None,) * (ctx.n_inputs - 1)

    return _Lookup


def torch_lookup(engine: HostEmbeddingEngine, anchor: Any, ids: Sequence[Any],
                 weights: Optional[Sequence[Any]] = None) -> Any:
    """Pooled rows ``[batch, width]`` of ``ids`` (torch tensors), with per-id ``weights`` as
    :func:`jax_lookup`'s, and a backward that updates the rows.

    ``anchor`` is a leaf tensor requiring grad, so that autograd records the op (its gradient is 0);
    the exchange is kept for a backward whenever grad mode is on.
    """
    import torch

    n = len(ids)
    where = _present(weights, n)
    arrays = [torch.as_tensor(i) for i in ids] + [torch.as_tensor(weights[i]).float() for i in where]
    save = bool(torch.is_grad_enabled() and anchor.requires_grad)  # a backward may follow
    return _torch_function().apply(anchor, engine, save, n, tuple(where), *arrays)
