"""Run a communicator call on the tensors of whichever backend Keras 3 runs on (see :mod:`.base`).

:func:`bridge` picks the running backend's :class:`~.base.Bridge`; each backend's
module (:mod:`.tf`, :mod:`.torch`, :mod:`.jax`) imports its framework, so only the
running one is imported.
"""

from __future__ import annotations

from ....core.errors import ConfigError
from .base import Bridge, CommFn, backend_name

__all__ = ["Bridge", "CommFn", "bridge", "backend_name"]


def bridge() -> Bridge:
    """The bridge for the running Keras backend."""
    name = backend_name()
    if name == "tensorflow":
        from .tf import TensorFlowBridge

        return TensorFlowBridge()
    if name == "torch":
        from .torch import TorchBridge

        return TorchBridge()
    if name == "jax":
        from .jax import JaxBridge

        return JaxBridge()
    raise ConfigError(f"shardwise.keras supports the tensorflow, torch and jax Keras backends, not {name!r}")
