"""ZeRO for Keras 3 optimizers: stages 1 and 2 on every backend, stage 3 on torch and JAX.

:class:`~.optimizer.ZeroOptimizer` partitions the optimizer state over
:class:`~.units.ZeroUnit` shards; at stage 3 it hands the model to the running
backend's engine (:mod:`.stage3`: :mod:`.torch` or :mod:`.jax`), whose layers
reach their gathered variables through :mod:`.access`. :func:`~.build.sharded_build`
builds a model whose variables are never whole on any rank.
"""

from __future__ import annotations

from .access import full_weights
from .build import sharded_build
from .optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer", "sharded_build", "full_weights"]
