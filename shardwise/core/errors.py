"""The exception hierarchy of shardwise.

Every error a user can provoke is a subclass of :class:`ShardwiseError`, and those
that come from bad input are also :class:`ValueError`, so ``except ValueError``
keeps working for code that does not know shardwise.
"""

from __future__ import annotations


class ShardwiseError(Exception):
    """Base class of all shardwise errors."""


class ConfigError(ShardwiseError, ValueError):
    """A configuration value or key is invalid."""


class MeshError(ConfigError):
    """Parallel degrees that do not fit the world size, or an unknown axis."""


class BackendError(ShardwiseError, RuntimeError):
    """A backend is unknown, not installed or not initialised."""


class NotInitializedError(BackendError):
    """A shardwise call that needs :func:`shardwise.init` came before it."""


class ShapeMismatchError(ShardwiseError, ValueError):
    """Tensors passed to a collective do not have compatible shapes or dtypes."""


class CollectiveMismatchError(ShardwiseError, RuntimeError):
    """Ranks called different collectives (op, name, dtype or shape) at the same point."""


class CollectiveTimeoutError(ShardwiseError, TimeoutError):
    """A collective did not complete within the configured timeout."""


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint is missing, corrupt or does not match the model."""
