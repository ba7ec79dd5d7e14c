"""Device tensors of the ``mpi`` backend travel through a torch group, as Horovod's go through NCCL.

MPI reads host memory, so a CUDA tensor handed to the ``mpi`` backend would be copied
to the host and back for every collective. With a *device route* (set up by
:func:`shardwise.init` under mpirun/srun when CUDA is available), the data collectives
on CUDA tensors (allreduce, reduce-scatter, allgather, broadcast, all-to-all, send/recv)
run on a ``torch.distributed`` NCCL group over the same ranks in the same order, while
MPI keeps the control calls (barrier, split, object collectives) and host memory
(numpy arrays, CPU tensors). The NCCL group's rendezvous goes over MPI.

``SHARDWISE_DEVICE_ENGINE`` chooses the route:

* ``auto`` (default): ``nccl`` when torch is imported and CUDA is available, unless this
  node has more ranks than GPUs (NCCL needs one GPU per rank), else none;
* ``nccl``: route CUDA tensors through NCCL (an error without CUDA);
* ``gloo``: route *CPU* torch tensors through a gloo group; this exists so that the
  routing itself can be tested on machines without a GPU;
* ``off``: no route, everything goes through MPI (host staging for CUDA tensors).

Sub-communicators: :meth:`MPICommunicator.split` of a communicator that spans the
whole job creates the torch groups of every colour on every rank (torch's ``new_group``
takes every rank of the job), so the groups of a ``ParallelModel``'s mesh or of process
sets route too. Each such smaller group gets a spare torch group made at the same time,
which its first :meth:`duplicate` takes (the pipeline's private point-to-point channel);
NCCL builds a communicator only when a group is first used, so an unused spare costs
nothing on the GPU. Splits of smaller communicators, and later duplicates, get torch
groups that their members make alone (:mod:`shardwise.backends.torch._subgroups`).

Every rank of a collective must pass tensors on the same kind of device: one rank's
CUDA tensor and another's CPU tensor would go to different engines and hang.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional, Sequence

from ...core.comm import Handle, ReduceOp
from ...core.errors import ConfigError

__all__ = ["ENGINE_ENV", "DeviceRoute", "DeviceRouting", "device_engine", "member_groups"]

#: The environment variable that picks the device engine (see the module docstring).
ENGINE_ENV = "SHARDWISE_DEVICE_ENGINE"
_ENGINES = ("auto", "nccl", "gloo", "off")


def device_engine(cuda_available: bool, env: Optional[dict] = None, *, gpus_shared: bool = False) -> Optional[str]:
    """The torch engine that device tensors of the ``mpi`` backend use (``None``: plain MPI).

    ``gpus_shared``: more ranks on this node than GPUs. NCCL needs a GPU per rank, so
    ``auto`` then stays on MPI (with a warning); an explicit ``nccl`` is taken as asked.
    """
    env = os.environ if env is None else env
    raw = env.get(ENGINE_ENV, "auto").strip().lower() or "auto"
    if raw not in _ENGINES:
        raise ConfigError(f"{ENGINE_ENV}={raw!r}: expected one of {', '.join(_ENGINES)}")
    if raw == "auto":
        if cuda_available and gpus_shared:
            warnings.warn("more ranks on this node than GPUs: NCCL needs one GPU per rank, so CUDA tensors "
                          f"go through MPI via host memory ({ENGINE_ENV}=nccl forces NCCL)", RuntimeWarning,
                          stacklevel=2)
            return None
        return "nccl" if cuda_available else None
    if raw == "nccl" and not cuda_available:
        raise ConfigError(f"{ENGINE_ENV}=nccl but CUDA is not available to this process")
    return None if raw == "off" else raw


def member_groups(entries: Sequence[tuple[int, int, int]]) -> dict[int, list[int]]:
    """Colour -> the global ranks of its members in MPI's split order.

    ``entries[r]`` is ``(colour, key, global rank)`` of parent rank ``r``; MPI orders a
    colour's members by key, then by parent rank. Negative colours (``MPI_UNDEFINED``)
    form no group.
    """
    groups: dict[int, list[int]] = {}
    for _, (colour, _key, global_rank) in sorted(enumerate(entries), key=lambda e: (e[1][0], e[1][1], e[0])):
        if colour >= 0:
            groups.setdefault(colour, []).append(global_rank)
    return groups


class DeviceRoute:
    """Where one MPI communicator's device tensors go: a torch communicator over the same ranks."""

    def __init__(self, comm: Any, engine: str, spare: Optional[Any] = None) -> None:
        #: A :class:`~shardwise.backends.torch.TorchCommunicator` with our rank order.
        self.comm = comm
        #: Another torch communicator over the same ranks, for the first duplicate (or ``None``).
        self.spare = spare
        #: ``"nccl"`` (CUDA tensors) or ``"gloo"`` (CPU torch tensors, for tests).
        self.engine = engine
        self._device_type = "cuda" if engine == "nccl" else "cpu"
        self._tensor_type = __import__("torch").Tensor

    def takes(self, tensor: Any) -> bool:
        """True when ``tensor`` goes through the torch group."""
        return isinstance(tensor, self._tensor_type) and tensor.device.type == self._device_type

    def take_spare(self) -> Optional["DeviceRoute"]:
        """The route of this group's duplicate, once; ``None`` after that."""
        spare, self.spare = self.spare, None
        return None if spare is None else DeviceRoute(spare, self.engine)

    def free(self) -> None:
        self.comm.free()
        if self.spare is not None:
            self.spare.free()


class DeviceRouting:
    """Mixin for :class:`~shardwise.backends.mpi.MPICommunicator`: device tensors to ``self._route``.

    Listed first among the communicator's bases, so that each data collective looks at
    its tensor before the MPI implementation does.
    """

    _route: Optional[DeviceRoute] = None

    @property
    def device_route(self) -> Optional[DeviceRoute]:
        """The torch group this communicator's device tensors go through, or ``None``."""
        return self._route

    def _via(self, tensor: Any) -> Optional[Any]:
        route = self._route
        return route.comm if route is not None and route.takes(tensor) else None

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                  inplace: bool = False, name: Optional[str] = None) -> Any:
        via = self._via(tensor)
        if via is not None:
            return via.allreduce(tensor, op, inplace=inplace, name=name)
        return super().allreduce(tensor, op, inplace=inplace, name=name)  # type: ignore[misc]

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.allreduce_async(tensor, op, inplace=inplace, name=name)
        return super().allreduce_async(tensor, op, inplace=inplace, name=name)  # type: ignore[misc]

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                       name: Optional[str] = None) -> Any:
        via = self._via(tensor)
        if via is not None:
            return via.reduce_scatter(tensor, op, name=name)
        return super().reduce_scatter(tensor, op, name=name)  # type: ignore[misc]

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.reduce_scatter_async(tensor, op, name=name)
        return super().reduce_scatter_async(tensor, op, name=name)  # type: ignore[misc]

    def reduce_scatter_in_place_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                                      name: Optional[str] = None) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.reduce_scatter_in_place_async(tensor, op, name=name)
        return super().reduce_scatter_in_place_async(tensor, op, name=name)  # type: ignore[misc]

    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        via = self._via(tensor)
        if via is not None:
            return via.allgather(tensor, name=name, uniform=uniform)
        return super().allgather(tensor, name=name, uniform=uniform)  # type: ignore[misc]

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.allgather_async(tensor, name=name, uniform=uniform)
        return super().allgather_async(tensor, name=name, uniform=uniform)  # type: ignore[misc]

    def allgather_into(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Any:
        via = self._via(out)
        if via is not None:
            return via.allgather_into(out, tensor, name=name)
        return super().allgather_into(out, tensor, name=name)  # type: ignore[misc]

    def allgather_into_async(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Handle:
        via = self._via(out)
        if via is not None:
            return via.allgather_into_async(out, tensor, name=name)
        return super().allgather_into_async(out, tensor, name=name)  # type: ignore[misc]

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False, name: Optional[str] = None) -> Any:
        via = self._via(tensor)
        if via is not None:
            return via.broadcast(tensor, root, inplace=inplace, name=name)
        return super().broadcast(tensor, root, inplace=inplace, name=name)  # type: ignore[misc]

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.broadcast_async(tensor, root, inplace=inplace, name=name)
        return super().broadcast_async(tensor, root, inplace=inplace, name=name)  # type: ignore[misc]

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                 recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Any:
        via = self._via(tensor)
        if via is not None:
            return via.alltoall(tensor, splits, recv_splits=recv_splits, name=name)
        return super().alltoall(tensor, splits, recv_splits=recv_splits, name=name)  # type: ignore[misc]

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.alltoall_async(tensor, splits, recv_splits=recv_splits, name=name)
        return super().alltoall_async(tensor, splits, recv_splits=recv_splits, name=name)  # type: ignore[misc]

    def send(self, tensor: Any, dest: int, tag: int = 0) -> None:
        via = self._via(tensor)
        if via is not None:
            via.send(tensor, dest, tag)
            return
        super().send(tensor, dest, tag)  # type: ignore[misc]

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.send_async(tensor, dest, tag)
        return super().send_async(tensor, dest, tag)  # type: ignore[misc]

    def recv(self, tensor: Any, source: int, tag: int = 0) -> Any:
        via = self._via(tensor)
        if via is not None:
            return via.recv(tensor, source, tag)
        return super().recv(tensor, source, tag)  # type: ignore[misc]

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        via = self._via(tensor)
        if via is not None:
            return via.recv_async(tensor, source, tag)
        return super().recv_async(tensor, source, tag)  # type: ignore[misc]

    # -- sub-groups ---------------------------------------------------------------------------
    def _route_split(self, entries: list[tuple[int, int, int]], spans_job: bool) -> Optional[DeviceRoute]:
        """The torch group of this rank's colour of a split (collective over this communicator), or None.

        ``entries`` is every parent rank's ``(colour, key, global rank)``. When this
        communicator spans the job, every rank creates every colour's groups in one
        order, as torch's ``new_group`` asks, with a spare for the first duplicate; a
        split of a smaller communicator makes its groups with their members alone.
        """
        route = self._route
        if route is None:
            return None
        me = entries[self._rank][2]
        groups = member_groups(entries)
        members = next((g for g in groups.values() if me in g), None)
        if not spans_job:
            pg = self._member_group(sorted(members) if members else None)
            return None if pg is None or members is None else self._route_over(pg, members)
        import torch.distributed as dist

        mine, job = None, dist.get_world_size()
        for _colour, group in sorted(groups.items()):
            pgs = [dist.new_group(sorted(group)) for _ in range(2 if 1 < len(group) < job else 1)]
            if group is members:
                mine = self._route_over(pgs[0], group, pgs[1] if len(pgs) > 1 else None)
        return mine

    def _route_duplicate(self) -> Optional[DeviceRoute]:
        """A new torch group over this communicator's ranks, made by them alone (collective), or None."""
        from mpi4py import MPI

        members = self.allgather_object(MPI.COMM_WORLD.Get_rank())
        pg = self._member_group(sorted(members))
        return None if pg is None else self._route_over(pg, members)

    def _member_group(self, members: Optional[list[int]]) -> Optional[Any]:
        """:func:`~shardwise.backends.torch._subgroups.member_group` over this communicator; None (and a
        warning) where torch cannot make it."""
        from ...core.errors import BackendError
        from ..torch._subgroups import member_group

        try:
            return member_group(members, self.allgather_object)  # type: ignore[attr-defined]
        except BackendError as exc:
            if self._route is not None and self._route.engine == "nccl":
                warnings.warn(f"{exc}: this sub-communicator's CUDA tensors go through MPI via host memory",
                              RuntimeWarning, stacklevel=4)
            return None

    def _route_over(self, pg: Any, members: Sequence[int], spare_pg: Optional[Any] = None) -> DeviceRoute:
        """The route through ``pg`` for a communicator whose ranks are the global ranks ``members``, in order."""
        from ..torch import TorchCommunicator

        route = self._route
        by_torch = sorted(members)
        order = [by_torch.index(g) for g in members]
        comms = [TorchCommunicator(g, timeout=route.comm.timeout, order=order) for g in (pg, spare_pg) if g is not None]
        return DeviceRoute(comms[0], route.engine, comms[1] if len(comms) > 1 else None)
