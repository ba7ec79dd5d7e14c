"""The ``mpi`` backend's device route, on CPU (run under mpirun with ``SHARDWISE_DEVICE_ENGINE=gloo``).

With the ``gloo`` engine, CPU torch tensors take the route that CUDA tensors take with
``nccl``: a ``torch.distributed`` group over the same ranks. Each collective runs twice,
once on a torch tensor (routed) and once on the same values as numpy (always MPI), and
both must agree; the torch profiler must show a ``c10d::`` operation for the routed call
and none for the MPI one. Sub-communicators (a reversed rank order, colours, their
duplicates and splits) route too, and with the route taken away the torch tensor goes
through MPI again. :func:`sub_groups_made_by_their_members` also runs on the torch
backend, where every collective is torch's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

import shardwise

torch.set_num_threads(1)


def _torch_ops(fn: Callable[[], Any]) -> tuple[Any, set[str]]:
    """``fn()``'s result and the ``c10d::`` operations torch ran meanwhile."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("c10d::")}


def _np(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _values(comm: Any, rows: int, cols: int = 3, salt: int = 0) -> torch.Tensor:
    base = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    return base * (comm.rank + 1) + 10 * salt + comm.rank


def _ops(comm: Any) -> dict[str, Callable[[Any], Any]]:
    """Collective name -> a function of a tensor factory (torch or numpy) returning the result."""
    n, me = comm.size, comm.rank
    odd = 2 * n + 1  # rows that do not split evenly

    def p2p(make: Callable[[torch.Tensor], Any]) -> Any:
        box = make(torch.zeros(2, 3))
        sent = comm.send_async(make(_values(comm, 2, salt=7)), (me + 1) % n, tag=3)
        got = comm.recv(box, (me - 1) % n, tag=3)
        sent.wait()
        return got

    def into(make: Callable[[torch.Tensor], Any]) -> Any:
        out = make(torch.zeros(2 * n, 3))
        return comm.allgather_into(out, make(_values(comm, 2, salt=5)))

    def in_place(make: Callable[[torch.Tensor], Any]) -> Any:
        t = make(_values(comm, odd, salt=6))
        comm.reduce_scatter_in_place_async(t, "sum").wait()
        return t

    return {
        "allreduce_sum": lambda m: comm.allreduce(m(_values(comm, 4)), "sum"),
        "allreduce_average_async": lambda m: comm.allreduce_async(m(_values(comm, 5)), "average").wait(),
        "allreduce_max_inplace": lambda m: comm.allreduce(m(_values(comm, 3)), "max", inplace=True),
        "reduce_scatter_uneven": lambda m: comm.reduce_scatter(m(_values(comm, odd, salt=1)), "sum"),
        "reduce_scatter_in_place": in_place,
        "allgather_uneven": lambda m: comm.allgather(m(_values(comm, me + 1, salt=2))),
        "allgather_uniform_async": lambda m: comm.allgather_async(m(_values(comm, 2)), uniform=True).wait(),
        "allgather_into": into,
        "broadcast_last": lambda m: comm.broadcast(m(_values(comm, 3, salt=3)), root=n - 1),
        "alltoall_splits": lambda m: comm.alltoall(m(_values(comm, sum(range(1, n + 1)), salt=4)),
                                                   list(range(1, n + 1))),
    } | ({"send_recv_ring": p2p} if n > 1 else {})  # gloo has no send to oneself


def _check(comm: Any, where: str, routed: Optional[bool]) -> None:
    """Each collective on a torch tensor equals it on numpy; ``routed``: whether the torch one went through
    torch and the numpy one did not (``None``: the torch backend, where both do)."""
    for name, op in _ops(comm).items():
        got, ops = _torch_ops(lambda: op(lambda t: t.clone()))
        want, mpi_ops = _torch_ops(lambda: op(lambda t: t.numpy().copy()))
        if routed is None:
            pass
        elif mpi_ops:
            raise AssertionError(f"{where} {name}: the numpy call ran torch operations {sorted(mpi_ops)}")
        elif routed != bool(ops):
            raise AssertionError(f"{where} {name}: expected {'a' if routed else 'no'} torch.distributed operation, "
                                 f"saw {sorted(ops)}")
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where} {name}: returned {type(got).__name__}, not a torch tensor")
        np.testing.assert_array_equal(_np(got), _np(want), err_msg=f"{where} {name}")


def routes_through_torch_group(backend: str) -> None:
    """Every data collective of the world and of its sub-groups goes through torch, with MPI's results."""
    ctx = shardwise.init(backend, check=False, monitor=False)
    world = ctx.world
    route = world.device_route
    if world.backend != "mpi" or route is None or route.engine != "gloo":
        raise AssertionError(f"expected the mpi backend with a gloo route, got {world!r} route {route}")
    if not dist.is_initialized() or dist.get_world_size() != world.size:
        raise AssertionError("the route's torch group is not the job's world")
    _check(world, "world", routed=True)

    backwards = world.split(ranks=list(reversed(range(world.size))))
    if backwards.rank != world.size - 1 - world.rank or backwards.device_route is None:
        raise AssertionError(f"reversed split: rank {backwards.rank}, route {backwards.device_route}")
    _check(backwards, "reversed", routed=True)
    _check(backwards.duplicate(), "reversed duplicate", routed=True)  # spans the job: routed

    halves = world.split(color=world.rank % 2)
    if halves.device_route is None:
        raise AssertionError("a colour split of the world has no route")
    _check(halves, "halves", routed=halves.size > 1)  # a group of one moves nothing
    if world.size >= 4:
        first = halves.duplicate()  # takes the spare group made with ``halves``
        if first.device_route is None:
            raise AssertionError("the first duplicate of a split of the world has no route")
        _check(first, "halves duplicate", routed=True)
        second = halves.split(color=0)  # groups made by these ranks alone
        again = halves.duplicate()  # the spare is taken: made by these ranks alone
        if second.device_route is None or again.device_route is None:
            raise AssertionError("a split or second duplicate of a sub-communicator got no route")
        _check(second, "halves split", routed=True)
        _check(again, "halves second duplicate", routed=True)

    world.set_device_route(None)
    _check(world, "world without route", routed=False)
    world.set_device_route(route)
    _check(world, "world with route again", routed=True)
    print(f"OK rank {world.rank}: device routing", flush=True)


def sub_groups_made_by_their_members(backend: str) -> None:
    """Splits and duplicates of sub-groups, on 4 ranks, after their members joined different groups.

    Only the first pair splits itself, so ranks 0 and 1 then hold more torch groups than
    ranks 2 and 3. Groups that the whole job makes afterwards (torch names them by a
    job-wide counter) must still meet, and a split of ``{0, 2}`` (members holding
    different numbers of groups) must agree on its group's name. ``mpi``: with the gloo
    route, each group's torch tensors go through torch; ``torch``: the torch backend.
    """
    ctx = shardwise.init(backend, check=False, monitor=False)
    world = ctx.world
    if world.size != 4:
        raise AssertionError(f"this scenario needs 4 ranks, got {world.size}")
    routed: Optional[bool] = True if backend == "mpi" else None
    if routed and world.device_route is None:
        raise AssertionError("expected the mpi backend with a gloo route")

    def check(comm: Any, where: str, members: list[int]) -> None:
        if comm.size != len(members) or comm.rank != members.index(world.rank):
            raise AssertionError(f"{where}: rank {comm.rank} of {comm.size}, expected {members}")
        if routed and comm.device_route is None:
            raise AssertionError(f"{where}: no route")
        if comm.size > 1:
            _check(comm, where, routed)
            total = comm.allreduce(torch.tensor([float(world.rank)]))
            if total.item() != sum(members):
                raise AssertionError(f"{where}: allreduce of global ranks {total.item()}, expected {sum(members)}")

    pairs = world.split(color=world.rank // 2)
    if world.rank < 2:
        pairs.split(color=pairs.rank)  # groups of one
        check(pairs.split(ranks=[1, 0]), "first pair reversed", [1, 0])
        check(pairs.duplicate(), "first pair duplicate", [0, 1])
    cross = world.split(color=world.rank % 2)  # every rank again: {0, 2} and {1, 3}
    check(cross, "cross", [0, 2] if world.rank % 2 == 0 else [1, 3])
    inner = cross.split(ranks=[1, 0])  # rank 0 holds more groups than rank 2
    check(inner, "cross reversed", [2, 0] if world.rank % 2 == 0 else [3, 1])
    check(inner.duplicate(), "its duplicate", [2, 0] if world.rank % 2 == 0 else [3, 1])
    three = world.split(ranks=[3, 1, 0])
    if three is not None:
        check(three, "three", [3, 1, 0])
        split = three.split(color=three.rank % 2, key=-three.rank)  # {0, 3} by descending key, and {1}
        check(split, "three by colour", [0, 3] if world.rank != 1 else [1])
    check(world.split(color=0), "world again", [0, 1, 2, 3])
    print(f"OK rank {world.rank}: sub-groups made by their members", flush=True)
