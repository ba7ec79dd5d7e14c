"""Data-, pipeline-, tensor- and expert-parallel sub-communicators of a :class:`~shardwise.core.mesh.Mesh`,
for every framework's pipeline and parallel model alike.

Every rank calls :func:`build_groups` (it is collective: one ``split`` per axis,
in the fixed order dp, pp, tp, and with more than one stage a second pipeline
group, ``pp_down``, that carries the messages towards earlier stages). Within each sub-communicator the ranks are
ordered by world rank, which is the order of their coordinate on that axis, so
``groups.pp.rank`` is this rank's pipeline stage and ``groups.tp.rank`` its
tensor-parallel shard.

With expert parallelism (``ep > 1``) the dp group is split twice more, in that order on
every rank: ``ep``, the ``ep`` consecutive dp ranks that share out the experts of each
Mixture-of-Experts layer (colour ``dp_rank // ep``), and ``edp``, the ``dp // ep`` ranks
that hold the same experts and average their gradients (colour ``dp_rank % ep``).

With hybrid sharding (``dp_shard`` smaller than dp) the dp group is split twice more instead:
``dp_shard``, the ``dp_shard`` consecutive dp ranks that share out ZeRO's state (colour
``dp_rank // dp_shard``), and ``dp_replicate``, the ranks holding the same shard in the other
groups, across which the reduced gradients are averaged (colour ``dp_rank % dp_shard``).

With context parallelism (``cp > 1``) the dp group is split once more, after those: ``cp``, the
``cp`` consecutive dp ranks that share each sample's sequence (colour ``dp_rank // cp``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from .comm import Communicator
from .errors import MeshError
from .mesh import AXES, Mesh

__all__ = ["ParallelGroups", "build_groups"]


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's view of a 3D mesh: its coordinates and one communicator per axis."""

    mesh: Mesh
    world: Communicator
    dp: Communicator
    pp: Communicator
    tp: Communicator
    #: The pipeline group again, with its own connections (the backward direction of a pipeline).
    pp_down: Optional[Communicator] = None
    #: The dp ranks that split the experts among them (None without expert parallelism).
    ep: Optional[Communicator] = None
    #: The dp ranks holding the same experts: expert gradients are averaged over it (None without ep).
    edp: Optional[Communicator] = None
    #: Hybrid sharding: the dp ranks ZeRO shards over (None: the whole dp group).
    dp_shard: Optional[Communicator] = None
    #: Hybrid sharding: the dp ranks holding this rank's shard in the other groups (None without).
    dp_replicate: Optional[Communicator] = None
    #: Context parallelism: the dp ranks that hold chunks of the same sequences (None without).
    cp: Optional[Communicator] = None
    #: Called (in order, once) by :meth:`free` before it frees the groups (see :meth:`on_free`).
    _before_free: list[Callable[[], None]] = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data-parallel replica."""
        return self.dp.rank

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.pp.rank

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel shard index."""
        return self.tp.rank

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree (1 without expert parallelism)."""
        return 1 if self.ep is None else self.ep.size

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group: which block of experts it owns."""
        return 0 if self.ep is None else self.ep.rank

    @property
    def cp_size(self) -> int:
        """Context-parallel degree (1 without context parallelism)."""
        return 1 if self.cp is None else self.cp.size

    @property
    def zero(self) -> Communicator:
        """The group ZeRO shards over: ``dp_shard`` with hybrid sharding, else ``dp``."""
        return self.dp_shard if self.dp_shard is not None else self.dp

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (it consumes the input batch)."""
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (it computes the loss)."""
        return self.pp.rank == self.pp.size - 1

    def on_free(self, callback: Callable[[], None]) -> None:
        """Have :meth:`free` call ``callback()`` first (e.g. to finish a background checkpoint save,
        which uses these groups' world)."""
        self._before_free.append(callback)

    def free(self) -> None:
        """Release the sub-communicators (not the world), after the :meth:`on_free` callbacks."""
        callbacks, self._before_free[:] = list(self._before_free), []
        for callback in callbacks:
            callback()
        for comm in (self.dp, self.pp, self.tp, self.pp_down, self.ep, self.edp, self.dp_shard, self.dp_replicate,
                     self.cp):
            if comm is not None:
                comm.free()


def build_groups(world: Communicator, mesh: Optional[Mesh] = None, *, dp: int = -1, pp: int = 1,
                 tp: int = 1, order: str = "tp-dp-pp", ep: int = 1, dp_shard: int = 0,
                 cp: int = 1) -> ParallelGroups:
    """Collective: split ``world`` into the dp, pp and tp groups of ``mesh``.

    Without ``mesh`` one is built from ``dp``, ``pp``, ``tp`` and ``order`` (one
    degree may be ``-1`` and is inferred from the world size). ``ep > 1`` (dividing
    the dp degree) also splits the dp group into the ``ep`` and ``edp`` groups; ``dp_shard``
    (dividing the dp degree, below it; 0 for none) into the ``dp_shard`` and ``dp_replicate`` groups;
    ``cp > 1`` (dividing the dp degree) into the context-parallel groups of ``cp`` consecutive dp ranks.
    """
    if mesh is None:
        mesh = Mesh(world.size, dp=dp, pp=pp, tp=tp, order=order)
    if mesh.world_size != world.size:
        raise MeshError(f"mesh {mesh} is for {mesh.world_size} ranks but the world has {world.size}")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or mesh.degree("dp") % ep:
        raise MeshError(f"ep={ep!r} must be a positive integer dividing dp={mesh.degree('dp')}")
    subs = {}
    for axis in AXES:  # the same order on every rank: split is collective
        sub = world.split(color=mesh.color(world.rank, axis))
        if sub is None or sub.size != mesh.degree(axis):  # pragma: no cover - backend bug
            raise MeshError(f"split along {axis} gave {None if sub is None else sub.size} ranks, "
                            f"expected {mesh.degree(axis)}")
        subs[axis] = sub
    coords = mesh.coords(world.rank)
    for axis in AXES:
        if subs[axis].rank != coords[axis]:  # pragma: no cover - backend bug
            raise MeshError(f"rank {world.rank} is {subs[axis].rank} in its {axis} group, "
                            f"expected coordinate {coords[axis]}")
    down = world.split(color=mesh.color(world.rank, "pp")) if mesh.degree("pp") > 1 else None
    ep_comm = edp_comm = None
    if ep > 1:  # the same two splits, in this order, on every rank
        dp_rank = subs["dp"].rank
        ep_comm = subs["dp"].split(color=dp_rank // ep)
        edp_comm = subs["dp"].split(color=dp_rank % ep)
        if ep_comm is None or edp_comm is None or ep_comm.size != ep or ep_comm.rank != dp_rank % ep \
                or edp_comm.size != mesh.degree("dp") // ep:  # pragma: no cover - backend bug
            raise MeshError(f"splitting dp={mesh.degree('dp')} by ep={ep} gave groups of "
                            f"{None if ep_comm is None else ep_comm.size} and "
                            f"{None if edp_comm is None else edp_comm.size} ranks")
    dp_size = mesh.degree("dp")
    if isinstance(dp_shard, bool) or not isinstance(dp_shard, int) or dp_shard < 0 \
            or (dp_shard and dp_size % dp_shard):
        raise MeshError(f"dp_shard={dp_shard!r} must be 0 or a positive integer dividing dp={dp_size}")
    if dp_shard and ep > 1 and dp_shard < dp_size:
        raise MeshError(f"hybrid sharding (dp_shard={dp_shard}) with ep={ep} is not supported yet")
    shard_comm = replicate_comm = None
    if 0 < dp_shard < dp_size:  # the same two splits, in this order, on every rank
        dp_rank = subs["dp"].rank
        shard_comm = subs["dp"].split(color=dp_rank // dp_shard)
        replicate_comm = subs["dp"].split(color=dp_rank % dp_shard)
        if shard_comm is None or replicate_comm is None or shard_comm.size != dp_shard \
                or shard_comm.rank != dp_rank % dp_shard \
                or replicate_comm.size != dp_size // dp_shard:  # pragma: no cover - backend bug
            raise MeshError(f"splitting dp={dp_size} into shard groups of {dp_shard} gave groups of "
                            f"{None if shard_comm is None else shard_comm.size} and "
                            f"{None if replicate_comm is None else replicate_comm.size} ranks")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or dp_size % cp:
        raise MeshError(f"cp={cp!r} must be a positive integer dividing dp={dp_size}")
    cp_comm = None
    if cp > 1:
        dp_rank = subs["dp"].rank
        cp_comm = subs["dp"].split(color=dp_rank // cp)
        if cp_comm is None or cp_comm.size != cp or cp_comm.rank != dp_rank % cp:  # pragma: no cover - backend bug
            raise MeshError(f"splitting dp={dp_size} into context-parallel groups of {cp} gave a group of "
                            f"{None if cp_comm is None else cp_comm.size} ranks")
    return ParallelGroups(mesh, world, subs["dp"], subs["pp"], subs["tp"], down, ep_comm, edp_comm,
                          shard_comm, replicate_comm, cp_comm)
