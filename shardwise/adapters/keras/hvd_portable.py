"""Horovod's ``horovod.keras`` functions for Keras 3 on the torch and JAX backends.

Values are anything ``keras.ops.convert_to_tensor`` takes; results are tensors
of the running backend. The collectives run eagerly on the process set's
communicator (torch tensors are handed over as they are, JAX arrays as host
arrays); on TensorFlow :mod:`.hvd_api` is used instead, whose ops also work
inside ``tf.function``.
"""

from __future__ import annotations

from typing import Any, Optional

import keras

from ...core.errors import ConfigError
from ..horovod import basics as hvd_basics
from ..horovod.ops import Adasum, Average, OpLike, resolve_op
from ..horovod.process_sets import ProcessSet, comm_of, coordinator_of, global_process_set
from ..horovod.compression import Compression, Compressor
from .ops import broadcast_variables, call_eagerly, check_root

__all__ = ["init", "shutdown", "cuda_built", "nccl_built", "rocm_built", "allreduce", "allgather", "broadcast",
           "reducescatter", "alltoall", "barrier", "join", "broadcast_object", "allgather_object",
           "broadcast_global_variables"]


def init(comm: Any = None, process_sets: Any = None, *, backend: Optional[str] = None, **options: Any) -> None:
    """Initialise shardwise (backend from ``backend=``, ``SHARDWISE_BACKEND`` or the launcher)."""
    hvd_basics.start(comm, process_sets, backend=backend, at_exit=shutdown, **options)


def shutdown() -> None:
    """Release the distributed context (idempotent)."""
    hvd_basics.stop()


def cuda_built() -> bool:
    """True when the Keras backend's framework was built with CUDA."""
    if keras.backend.backend() == "torch":
        import torch

        return bool(torch.backends.cuda.is_built())
    import jax

    return any(d.platform == "gpu" for d in jax.devices())


def nccl_built() -> int:
    """0: the collectives run over shardwise's engines (Horovod returns NCCL's version)."""
    return 0


def rocm_built() -> bool:
    """False: shardwise does not build ROCm kernels of its own."""
    return False


def _op(op: Optional[OpLike], average: Optional[bool]) -> Any:
    resolved = resolve_op(op, average)
    if resolved == Adasum:
        raise ConfigError("op=Adasum is offered by shardwise.torch and shardwise.tensorflow, not by "
                          "shardwise.keras on the torch or JAX backend")
    return resolved


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Optional[OpLike] = None,
              compression: type[Compressor] = Compression.none,
              process_set: ProcessSet = global_process_set) -> Any:
    """``value`` reduced over the ranks (default: averaged)."""
    op, comm = _op(op, average), comm_of(process_set)
    tensor = keras.ops.convert_to_tensor(value)
    if prescale_factor != 1.0:
        tensor = tensor * prescale_factor
    sent, ctx = compression.compress(tensor)
    out = compression.decompress(call_eagerly(lambda a: comm.allreduce(a, op), sent), ctx)
    return out * postscale_factor if postscale_factor != 1.0 else out


def allgather(value: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's ``value`` concatenated along the first dimension (first dimensions may differ)."""
    comm = comm_of(process_set)
    tensor = keras.ops.convert_to_tensor(value)
    if len(tensor.shape) == 0:
        tensor = keras.ops.reshape(tensor, (1,))
    return call_eagerly(lambda a: comm.allgather(a), tensor)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``value`` on every rank."""
    comm = comm_of(process_set)
    check_root(root_rank, comm)
    return call_eagerly(lambda a: comm.broadcast(a, int(root_rank)), value)


def reducescatter(value: Any, name: Optional[str] = None, op: OpLike = Average,
                  process_set: ProcessSet = global_process_set) -> Any:
    """``value`` reduced over the ranks; each rank keeps its share of the first dimension."""
    op, comm = _op(op, None), comm_of(process_set)
    return call_eagerly(lambda a: comm.reduce_scatter(a, op), value)


def alltoall(value: Any, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Block ``i`` of the first dimension goes to rank ``i``; with ``splits``, also the received splits."""
    comm = comm_of(process_set)
    if splits is None:
        return call_eagerly(lambda a: comm.alltoall(a), value)
    sizes = [int(s) for s in keras.ops.convert_to_numpy(splits)]
    received = [row[comm.rank] for row in comm.allgather_object(sizes)]
    out = call_eagerly(lambda a: comm.alltoall(a, sizes), value)
    return out, keras.ops.convert_to_tensor(received, dtype="int32")


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` reaches the barrier."""
    comm_of(process_set).barrier()


def join() -> int:
    """This rank has no more data: take part in the others' collectives until all have joined.

    Returns the rank that joined last, the same on every rank.
    """
    return int(coordinator_of(global_process_set).join().wait())


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object on every rank of the set."""
    comm = comm_of(process_set)
    check_root(root_rank, comm)
    return comm.broadcast_object(obj, int(root_rank))


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order of the set."""
    return comm_of(process_set).allgather_object(obj)


def broadcast_global_variables(root_rank: int, model: Optional[keras.Model] = None) -> None:
    """Broadcast ``model``'s variables (and its optimizer's) from ``root_rank``, on any backend.

    Keras 3 has no global-variable collection, so the model must be given; inside
    ``fit`` use :class:`~shardwise.keras.callbacks.BroadcastGlobalVariablesCallback`.
    """
    if model is None:
        raise ValueError("Keras 3 has no global variables: call broadcast_global_variables(root_rank, model) "
                         "or use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    broadcast_variables(variables, root_rank)
