"""The ``mpi`` backend: collectives on mpi4py, device tensors optionally through a torch group.

Importing it starts MPI; :func:`init` is the start every backend shares and
:func:`attach_device_route` gives the world its torch group for device tensors;
:class:`MPICommunicator` runs shardwise's collectives.
"""

from .communicator import MPICommunicator
from .engine import attach_device_route, init

__all__ = ["MPICommunicator", "attach_device_route", "init"]
