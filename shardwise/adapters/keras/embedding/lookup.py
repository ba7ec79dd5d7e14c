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
from typing import Any, Sequence

import numpy as np

from .host import HostEmbeddingEngine

__all__ = ["jax_lookup", "torch_lookup"]


def jax_lookup(engine: HostEmbeddingEngine, anchor: Any, ids: Sequence[Any]) -> Any:
    """Pooled rows ``[batch, width]`` of ``ids`` (JAX arrays or tracers); differentiable through ``anchor``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    ids = [jnp.asarray(i) for i in ids]
    batch = int(ids[0].shape[0])
    specs = (jax.ShapeDtypeStruct((batch, engine.width), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))

    def host_forward(save: bool) -> Any:
        def run(*arrays: Any) -> tuple[np.ndarray, np.ndarray]:
            pooled, handle = engine.lookup([np.asarray(a) for a in arrays], save=save)
            return pooled, np.asarray(handle, np.int32)

        return run

    def host_backward(handle: Any, grad: Any) -> np.ndarray:
        engine.backward(int(np.asarray(handle)), np.asarray(grad))
        return np.zeros((), np.float32)

    @jax.custom_vjp
    def lookup(anchor: Any, *ids: Any) -> Any:
        return io_callback(host_forward(False), specs, *ids, ordered=True)[0]

    def forward(anchor: Any, *ids: Any) -> tuple[Any, tuple]:
        pooled, handle = io_callback(host_forward(True), specs, *ids, ordered=True)
        return pooled, (handle, anchor)

    def backward(res: tuple, grad: Any) -> tuple:
        handle, anchor = res
        done = io_callback(host_backward, jax.ShapeDtypeStruct((), jnp.float32), handle, grad, ordered=True)
        zero = (done * 0).astype(anchor.dtype)  # the table update is the callback's effect; anchor's gradient is 0
        return (jnp.broadcast_to(zero, jnp.shape(anchor)),) + tuple(
            np.zeros(i.shape, dtype=jax.dtypes.float0) for i in ids)

    lookup.defvjp(forward, backward)
    return lookup(anchor, *ids)


@lru_cache(maxsize=None)
def _torch_function() -> Any:
    import torch

    class _Lookup(torch.autograd.Function):
        """Forward: the two all-to-alls and the owners' pooling; backward: gradients to the owners, rows updated."""

        @staticmethod
        def forward(ctx: Any, anchor: torch.Tensor, engine: HostEmbeddingEngine, save: bool,
                    *ids: torch.Tensor) -> torch.Tensor:
            pooled, handle = engine.lookup([i.detach().cpu().numpy() for i in ids], save=save)
            ctx.engine, ctx.handle, ctx.n_inputs = engine, handle, 3 + len(ids)
            return torch.from_numpy(pooled).to(ids[0].device)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            ctx.engine.backward(ctx.handle, grad.detach().cpu().float().numpy())
            return (None,) * ctx.n_inputs

    return _Lookup


def torch_lookup(engine: HostEmbeddingEngine, anchor: Any, ids: Sequence[Any]) -> Any:
    """Pooled rows ``[batch, width]`` of ``ids`` (torch tensors), with a backward that updates the rows.

    ``anchor`` is a leaf tensor requiring grad, so that autograd records the op; the exchange is kept
    for a backward whenever grad mode is on.
    """
    import torch

    ids = [torch.as_tensor(i) for i in ids]
    save = bool(torch.is_grad_enabled() and anchor.requires_grad)  # a backward may follow
    return _torch_function().apply(anchor, engine, save, *ids)
