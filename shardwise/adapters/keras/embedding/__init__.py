"""Sharded embedding tables for Keras 3 (torch and JAX backends).

:class:`~.layer.ShardedEmbeddingBag` is the Keras layer; its rows live on the
host, sharded over ranks, in a :class:`~.host.HostEmbeddingEngine`; :mod:`.lookup`
turns a lookup into the backend's differentiable op.
"""

from __future__ import annotations

from .host import SHARDING_TYPES
from .layer import ShardedEmbeddingBag

__all__ = ["ShardedEmbeddingBag", "SHARDING_TYPES"]
