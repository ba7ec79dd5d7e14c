"""The ``torch`` backend: collectives on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

:func:`init` creates the default process group under any launcher and
:func:`init_elastic` as a worker of an elastic job; :class:`TorchCommunicator`
runs shardwise's collectives on a process group.
"""

from .communicator import TorchCommunicator
from .engine import init, init_elastic

__all__ = ["TorchCommunicator", "init", "init_elastic"]
