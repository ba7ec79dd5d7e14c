"""The ``horovod`` backend: Horovod's torch ops, sub-groups as Horovod process sets.

:func:`init` runs ``hvd.init()`` (with dynamic process sets) and :func:`shutdown_engine`
stops it; :class:`HorovodCommunicator` runs shardwise's collectives on it.
"""

from ._engine import init, shutdown_engine
from .communicator import HorovodCommunicator

__all__ = ["HorovodCommunicator", "init", "shutdown_engine"]
