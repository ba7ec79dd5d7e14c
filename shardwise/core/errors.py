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


class DivergenceError(CollectiveMismatchError):
    """Ranks ran different code paths: ZeRO-3 gathered different modules, or pipeline stages disagree.

    Raised on every rank, before the mismatched data moves, naming what each rank was about
    to exchange.
    """


class CollectiveTimeoutError(ShardwiseError, TimeoutError):
    """A collective did not complete within the configured timeout."""


class PeerFailedError(ShardwiseError, RuntimeError):
    """Another rank raised during an operation this rank was in (a pipeline step): this rank stops
    with this error instead of waiting for messages that will never come."""


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint is missing, corrupt or does not match the model."""


class WorkerLostError(CollectiveMismatchError):
    """A rank left the job mid-collective (its process died or its connection closed).

    Horovod calls this ``HorovodInternalError``; :func:`shardwise.elastic.run` catches
    it, restores the last committed state and continues on the remaining workers.
    """


#: How engines (gloo, MPI, NCCL) word a peer that went away mid-collective.
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset",
              "connection refused", "socket closed", "read error", "write error", "ncclremoteerror",
              "process group was aborted", "unknown peer")


def is_peer_loss(exc: BaseException) -> bool:
    """True when ``exc`` is a lost worker: :class:`WorkerLostError`, or an engine's words for it."""
    if isinstance(exc, WorkerLostError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in _PEER_LOSS)


class HostsUpdatedInterrupt(ShardwiseError, RuntimeError):
    """Workers were added to (or removed from) an elastic job: every rank stops at the same commit.

    ``skip_sync`` is True when no worker was added, so the state needs no broadcast.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of workers changed")
        self.skip_sync = skip_sync


class JobFailedError(ShardwiseError, RuntimeError):
    """A worker of a job started by an engine (Spark) raised: ``rank`` and its ``remote_traceback``."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback.rstrip()}")
        self.rank, self.remote_traceback = rank, remote_traceback


class RendezvousError(ShardwiseError, RuntimeError):
    """The elastic rendezvous refused this process, or gave it no place in time."""
