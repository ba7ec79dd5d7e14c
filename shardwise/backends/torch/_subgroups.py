"""torch process groups that only their members create: splits and duplicates of sub-groups.

``torch.distributed.new_group`` needs every rank of the job, in the same order: it names
a group by a job-wide counter, so a group made by a few ranks alone would leave their
counters ahead of the others', and every group the job made after that would carry
different names on different ranks (its members then wait for each other forever).
A split or duplicate of a sub-group is made by that sub-group's ranks only, so its
groups go through ``new_group(..., use_local_synchronization=True)``, which leaves the
counter alone and names the group by a hash of its ranks and of how many groups the
calling rank holds. Members that joined different groups before hold different
numbers of them; so they first agree: a member holding fewer registers one-rank
groups (which connect nothing) until it holds as many as the member with most, and
all members then compare the names they will use before any of them creates one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ...core.errors import BackendError

__all__ = ["member_group"]

Gather = Callable[[Any], list]


def _held() -> Optional[int]:
    """How many process groups this rank holds, as torch counts them for a hashed name.

    ``None`` where torch cannot make a group with its members alone: it names groups
    otherwise than this module knows, or it makes every group by splitting the job's
    (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``).
    """
    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None)
    if names is None or not hasattr(distributed_c10d, "_hash_ranks_to_str"):
        return None
    if getattr(distributed_c10d, "_use_torchcomms_enabled", lambda: False)():
        return None
    return len(names)


def member_group(mine: Optional[Sequence[int]], gather: Gather) -> Optional[Any]:
    """The torch group over the global ranks ``mine``, created by its members alone.

    Collective over a parent group that contains every member: each parent rank passes
    the sorted global ranks of the group it joins (``None``: none), and ``gather`` is the
    parent's object allgather. Groups of different ranks must not overlap. Returns this
    rank's group (``None`` when it joins none); raises :class:`BackendError` on every
    rank when torch names groups in a way this cannot agree on.
    """
    mine = sorted(int(r) for r in mine) if mine is not None else None
    held = gather((mine, _held()))
    if any(count is None for members, count in held if members is not None):
        raise BackendError(f"torch {_torch_version()} cannot make a group with its members alone here (its group "
                           "names are unknown to shardwise, or TORCH_DISTRIBUTED_USE_TORCHCOMMS is set): split the "
                           "world instead of a sub-group")
    if mine is not None:
        most = max(count for members, count in held if members == mine)
        while _held() < most:
            dist.new_group([dist.get_rank()], use_local_synchronization=True)
    name = distributed_c10d._hash_ranks_to_str(mine) if mine is not None else None
    named = gather((mine, name))
    clash = sorted({tuple(members) for members, n in named if members is not None
                    and n != next(m for g, m in named if g == members)})
    if clash:
        raise BackendError(f"the members of the torch group(s) {clash} computed different group names after "
                           f"agreeing on their group counts (torch {_torch_version()}); no group was created")
    if mine is None:
        return None
    return dist.new_group(mine, use_local_synchronization=True)


def _torch_version() -> str:
    import torch

    return torch.__version__
