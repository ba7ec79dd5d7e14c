"""The group a communicator spans: this rank's place in it, and who goes with whom when it splits."""

from __future__ import annotations

from typing import Optional, Sequence

from ..core.comm import Communicator

__all__ = ["GroupMember", "split_members", "split_groups"]


class GroupMember:
    """Mixin (before :class:`Communicator`) for communicators that keep their ``_rank`` and ``_size``."""

    _rank: int
    _size: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size


def split_members(size: int, color: Optional[int], ranks: Optional[Sequence[int]]) -> Optional[list[int]]:
    """The checked ``ranks=`` of a split of a group of ``size`` ranks, or None when it splits by ``color``.

    Raises :class:`ValueError` unless exactly one of ``color`` and ``ranks`` is given, and when
    ``ranks`` repeats a rank or names one outside the group.
    """
    if (color is None) == (ranks is None):
        raise ValueError("split takes exactly one of color= or ranks=")
    if ranks is None:
        return None
    members = [int(r) for r in ranks]
    if len(set(members)) != len(members) or any(not 0 <= r < size for r in members):
        raise ValueError(f"split ranks {members} must be distinct ranks of a group of size {size}")
    return members


def split_groups(comm: Communicator, color: Optional[int], key: Optional[int],
                 ranks: Optional[Sequence[int]]) -> dict[int, list[int]]:
    """Colour -> the ranks of ``comm`` in that colour's group, ordered by (key, rank).

    ``ranks=`` makes the one group ``{0: ranks}`` without communicating; a colour split
    is collective (every rank shares its colour and key).
    """
    members = split_members(comm.size, color, ranks)
    if members is not None:
        return {0: members}
    entries = comm.allgather_object((int(color), comm.rank if key is None else int(key)))  # type: ignore[arg-type]
    groups: dict[int, list[int]] = {}
    for r, (c, _) in sorted(enumerate(entries), key=lambda e: (e[1][0], e[1][1], e[0])):
        groups.setdefault(c, []).append(r)
    return groups
