"""Control requests for the torch collectives: :func:`barrier` and :func:`join`.

Part of :mod:`shardwise.adapters.torch.ops` (import from there).
"""

from __future__ import annotations

from shardwise.core.comm import Communicator
from shardwise.core.negotiation import Response

from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from ..compiling import not_traced
from .requests import _submit

__all__ = ["barrier", "join"]


# -- barrier, join ----------------------------------------------------------------------------------
@not_traced
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` reaches the barrier (negotiated like other requests)."""
    def execute(comm: Communicator, response: Response) -> None:
        comm.barrier()

    _submit("barrier", None, [], process_set, execute).wait()


@not_traced
def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with zeros until all have joined.

    Returns the rank that joined last (the same on every rank).
    """
    return coordinator_of(global_process_set).join().wait()
