"""Horovod's collectives as coordinator requests over numpy arrays (what the TF ops run).

Each function builds the :class:`~shardwise.core.negotiation.RequestMeta` of one
named request from the arrays this rank holds, submits it to the process set's
:class:`~shardwise.adapters.horovod.coordinator.Coordinator` with the data movement to run
once every rank agreed, and returns the resulting arrays (or raises the negotiated
:class:`~shardwise.core.errors.CollectiveMismatchError`). Nothing here knows about
TensorFlow: :mod:`.runtime` calls these eagerly or from inside a graph op.

Scaling follows Horovod on the CPU: integers are scaled in float64 and truncated
back, float16 in float32, other floats in their own precision; ``Average`` is a
``Sum`` whose post-scale factor is divided by the set size.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from shardwise.core.adasum import adasum_allreduce
from shardwise.core.comm import Communicator, ReduceOp
from shardwise.core.negotiation import RequestMeta, Response

from ..horovod.coordinator import Coordinator
from ..horovod.ops import Adasum

__all__ = ["ADASUM", "scale", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
           "barrier", "check_splits"]

#: Horovod's Adasum reduction, next to the :class:`ReduceOp` members.
ADASUM = Adasum  # Horovod's name, shared by every framework module

Op = Union[ReduceOp, str]


def scale(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` as Horovod computes it on the CPU, in ``array``'s dtype."""
    if factor == 1.0:
        return array
    if array.dtype.kind in "iub":
        return (array.astype(np.float64) * factor).astype(array.dtype)
    if array.dtype == np.float16:
        return (array.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return array * array.dtype.type(factor)


def _meta(name: str, kind: str, arrays: Sequence[np.ndarray], device: str, **fields) -> RequestMeta:
    return RequestMeta(name, kind, tuple(a.dtype.name for a in arrays), tuple(tuple(a.shape) for a in arrays),
                       device=device, **fields)


def allreduce(coordinator: Coordinator, name: str, arrays: Sequence[np.ndarray], op: Op,
              prescale: float = 1.0, postscale: float = 1.0, device: str = "cpu") -> list[np.ndarray]:
    """Reduce every array over the set as one request (one flat buffer per dtype)."""
    if op == ADASUM:
        return _adasum(coordinator, name, arrays, device)
    wire, post = ReduceOp.parse(op), float(postscale)
    if wire is ReduceOp.AVERAGE:
        wire, post = ReduceOp.SUM, post / coordinator.comm.size

    def execute(comm: Communicator, response: Response) -> list[np.ndarray]:
        results: list[Optional[np.ndarray]] = [None] * len(arrays)
        for dtype in dict.fromkeys(a.dtype for a in arrays):  # in order of first appearance
            idx = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            flat = np.concatenate([scale(arrays[i], prescale).reshape(-1) for i in idx])
            flat = np.asarray(comm.allreduce(flat, wire, inplace=True))
            offset = 0
            for i in idx:
                n = arrays[i].size
                results[i] = scale(flat[offset:offset + n].reshape(arrays[i].shape), post)
                offset += n
        return results  # type: ignore[return-value]

    meta = _meta(name, "allreduce", arrays, device, op=wire.value, prescale=float(prescale), postscale=post)
    return coordinator.submit(meta, execute).wait()


def _adasum(coordinator: Coordinator, name: str, arrays: Sequence[np.ndarray], device: str) -> list[np.ndarray]:
    for a in arrays:
        if a.dtype.kind != "f":
            raise ValueError(f"Adasum reduces floating-point tensors only, got {a.dtype}")

    def execute(comm: Communicator, response: Response) -> list[np.ndarray]:
        return [adasum_allreduce(comm, a.astype(np.float64).reshape(-1)).reshape(a.shape).astype(a.dtype)
                for a in arrays]

    return coordinator.submit(_meta(name, "adasum", arrays, device, op=ADASUM), execute).wait()


def allgather(coordinator: Coordinator, name: str, arrays: Sequence[np.ndarray],
              device: str = "cpu") -> list[np.ndarray]:
    """Concatenate every rank's arrays along dim 0 (first dimensions may differ)."""
    for a in arrays:
        if a.ndim == 0:
            raise ValueError("allgather needs tensors of at least one dimension, got a scalar")

    def execute(comm: Communicator, response: Response) -> list[np.ndarray]:
        return [np.asarray(comm.allgather(np.ascontiguousarray(a))) for a in arrays]

    return coordinator.submit(_meta(name, "allgather", arrays, device), execute).wait()


def broadcast(coordinator: Coordinator, name: str, arrays: Sequence[np.ndarray], root: int,
              device: str = "cpu") -> list[np.ndarray]:
    """Every rank gets set rank ``root``'s arrays (``root`` outside the set fails negotiation)."""
    def execute(comm: Communicator, response: Response) -> list[np.ndarray]:
        return [np.asarray(comm.broadcast(np.array(a), root, inplace=True)) for a in arrays]

    return coordinator.submit(_meta(name, "broadcast", arrays, device, root=int(root)), execute).wait()


def check_splits(rows: Optional[int], splits: Optional[Sequence[int]], size: int) -> list[int]:
    """The rows sent to each rank; raises ``ValueError`` as Horovod's alltoall checks them."""
    if rows is None:
        raise ValueError("alltoall needs a tensor of at least one dimension, got a scalar")
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the process set "
                             f"size {size}, got {rows}")
        return [rows // size] * size
    values = [int(s) for s in splits]
    if len(values) != size:
        raise ValueError(f"alltoall needs one split per rank of the process set ({size}), got {values}")
    if any(v < 0 for v in values):
        raise ValueError(f"alltoall splits must be non-negative, got {values}")
    if sum(values) != rows:
        raise ValueError(f"alltoall splits {values} must sum to the first dimension of the tensor, {rows}")
    return values


def alltoall(coordinator: Coordinator, name: str, array: np.ndarray, splits: Optional[Sequence[int]],
             device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows to set rank ``i``; return the received rows and the splits received."""
    sent = check_splits(array.shape[0] if array.ndim else None, splits, coordinator.comm.size)

    def execute(comm: Communicator, response: Response) -> tuple[np.ndarray, np.ndarray]:
        received = np.array([m.splits[comm.rank] for m in response.metas], dtype=np.int32)
        return np.asarray(comm.alltoall(np.ascontiguousarray(array), sent)), received

    meta = _meta(name, "alltoall", [array], device, splits=tuple(sent))
    return coordinator.submit(meta, execute).wait()


def reducescatter(coordinator: Coordinator, name: str, arrays: Sequence[np.ndarray], op: Op,
                  prescale: float = 1.0, postscale: float = 1.0, device: str = "cpu") -> list[np.ndarray]:
    """Reduce over the set, keep this rank's rows of dim 0 (lowest ranks get the extra rows)."""
    if op == ADASUM:
        raise ValueError("reducescatter does not support op=Adasum")
    for a in arrays:
        if a.ndim == 0:
            raise ValueError("reducescatter needs tensors of at least one dimension, got a scalar")
    wire, post = ReduceOp.parse(op), float(postscale)
    if wire is ReduceOp.AVERAGE:
        wire, post = ReduceOp.SUM, post / coordinator.comm.size

    def execute(comm: Communicator, response: Response) -> list[np.ndarray]:
        return [scale(np.asarray(comm.reduce_scatter(np.array(scale(a, prescale)), wire)), post) for a in arrays]

    meta = _meta(name, "reducescatter", arrays, device, op=wire.value, prescale=float(prescale), postscale=post)
    return coordinator.submit(meta, execute).wait()


def barrier(coordinator: Coordinator, name: str) -> None:
    """Wait until every rank of the set reaches the barrier."""
    def execute(comm: Communicator, response: Response) -> None:
        comm.barrier()

    coordinator.submit(RequestMeta(name, "barrier"), execute).wait()
