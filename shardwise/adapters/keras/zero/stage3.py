"""The seam between the Keras :class:`~.optimizer.ZeroOptimizer` and a backend's ZeRO stage 3.

Stages 1 and 2 only change what the optimizer does with gradients, so one
implementation serves every backend. Stage 3 changes how the model reads its
variables (a layer's full variables exist only while it runs), which each backend
does its own way: module hooks on torch, a train step of shardwise's own on JAX.
The optimizer therefore hands stage 3 to an engine, made by :func:`make_engine`
when the optimizer is built, that owns the units, the shards and the inner
optimizer's build.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from ....core.errors import ConfigError
from ..bridges import backend_name

__all__ = ["Stage3Engine", "make_engine"]


class Stage3Engine(Protocol):
    """What :class:`~.optimizer.ZeroOptimizer` needs from a backend's stage 3."""

    #: The partition units; each has ``plan`` (a :class:`~shardwise.core.zero.PartitionPlan`
    #: whose parameter names are ``"{index}:{variable path}"``), ``members`` (positions in the
    #: optimizer's variable list) and ``shard`` (the keras.Variable holding this rank's range,
    #: the variables' only up-to-date copy between steps; the inner optimizer is built over
    #: the shards, so its slots are shard-sized).
    units: Sequence[Any]

    def attach(self, model: Any) -> None:
        """Take over ``model`` (hooks, train step) before ``fit`` builds its train function."""

    def apply(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        """One optimizer step (eager backends)."""

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """One optimizer step as a pure function (JAX)."""

    def shards_changed(self) -> None:
        """The ``shard`` variables were assigned from outside (a checkpoint load): drop gathered copies."""

    @property
    def sharded_variables(self) -> list[Any]:
        """Variables whose value differs per rank (shards and the inner optimizer's slots)."""


def make_engine(optimizer: Any, var_list: Sequence[Any]) -> Stage3Engine:
    """The running backend's stage-3 engine for ``optimizer`` over ``var_list``."""
    name = backend_name()
    if name == "torch":
        from .torch.stage3 import TorchStage3

        return TorchStage3(optimizer, var_list)
    if name == "jax":
        from .jax.stage3 import JaxStage3

        return JaxStage3(optimizer, var_list)
    raise ConfigError(f"Keras ZeroOptimizer stage 3 runs on the torch and JAX backends, not on {name!r}")
