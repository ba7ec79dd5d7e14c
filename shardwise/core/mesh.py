"""The device mesh: how ``world_size`` ranks split into data, pipeline and tensor parallel groups.

A :class:`Mesh` is pure arithmetic on rank numbers; it starts no processes and
talks to no backend. The ``order`` string lists the axes from the fastest-varying
(first) to the slowest (last), as Megatron-LM's ``RankGenerator`` does: with the
default ``"tp-dp-pp"`` and ``tp=2``, ranks 0 and 1 form a tensor-parallel group.

Several axes joined by ``-`` (``"dp-tp"``) name the group of ranks that differ
only along those axes, e.g. the ranks a ZeRO optimizer shards over when it spans
both data and tensor parallelism. The order inside such a name does not matter.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from .errors import MeshError

__all__ = ["AXES", "Mesh"]

#: The axis names a :class:`Mesh` knows, in the order :meth:`Mesh.coords` reports them.
AXES: tuple[str, ...] = ("dp", "pp", "tp")


def _as_int(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _parse_order(order: object) -> tuple[str, ...]:
    """The axes of an order string such as ``"tp-dp-pp"``, or :class:`MeshError`."""
    if isinstance(order, str):
        parts = tuple(p.strip().lower() for p in order.split("-"))
        if sorted(parts) == sorted(AXES):
            return parts
    raise MeshError(
        f"order {order!r} must be a permutation of the axis names "
        f"{', '.join(AXES)} separated by '-', e.g. 'tp-dp-pp'"
    )


@dataclasses.dataclass(frozen=True, repr=False)
class Mesh:
    """A validated 3D (data x pipeline x tensor) layout of ``world_size`` ranks.

    Exactly one of ``dp``, ``pp`` and ``tp`` may be ``-1``: it is inferred as
    ``world_size`` divided by the other two. After construction all three are
    the resolved positive degrees and ``order`` is normalised (``"tp-dp-pp"``).
    """

    world_size: int
    dp: int = -1
    pp: int = 1
    tp: int = 1
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        world = _as_int(self.world_size)
        if world is None or world <= 0:
            raise MeshError(f"world size {self.world_size!r} must be a positive integer")
        axes = _parse_order(self.order)

        degrees: dict[str, int] = {}
        for axis in AXES:
            raw = getattr(self, axis)
            value = _as_int(raw)
            if value is None or (value <= 0 and value != -1):
                raise MeshError(f"degree {axis}={raw!r} must be a positive integer or -1")
            degrees[axis] = value

        inferred = [a for a in AXES if degrees[a] == -1]
        if len(inferred) > 1:
            named = ", ".join(f"{a}=-1" for a in inferred)
            raise MeshError(f"only one degree may be -1, got {named}")

        known = [a for a in AXES if degrees[a] != -1]
        product = int(np.prod([degrees[a] for a in known]))
        if inferred:
            for axis in known:
                if world % degrees[axis]:
                    raise MeshError(
                        f"world size {world} is not divisible by {axis}={degrees[axis]}"
                    )
            if world % product:
                names = "*".join(known)
                values = ", ".join(f"{a}={degrees[a]}" for a in known)
                raise MeshError(
                    f"world size {world} is not divisible by {names} = {product} ({values})"
                )
            degrees[inferred[0]] = world // product
        elif product != world:
            values = ", ".join(f"{a}={degrees[a]}" for a in AXES)
            raise MeshError(
                f"dp*pp*tp = {product} but world size is {world} ({values})"
            )

        object.__setattr__(self, "world_size", world)
        for axis in AXES:
            object.__setattr__(self, axis, degrees[axis])
        object.__setattr__(self, "order", "-".join(axes))

    # ------------------------------------------------------------------ shape

    @property
    def axes(self) -> tuple[str, ...]:
        """The axis names from fastest-varying to slowest, as in ``order``."""
        return tuple(self.order.split("-"))

    @property
    def shape(self) -> tuple[int, ...]:
        """The degree of each axis in :attr:`axes` order."""
        return tuple(getattr(self, a) for a in self.axes)

    def degree(self, axis: str) -> int:
        """The number of ranks in one group along ``axis`` (a product for ``"dp-tp"``)."""
        return int(np.prod([getattr(self, a) for a in self._parse_axis(axis)]))

    # ------------------------------------------------------------ coordinates

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each axis, as ``{"dp": .., "pp": .., "tp": ..}``."""
        rest = self._check_rank(rank)
        found: dict[str, int] = {}
        for axis in self.axes:
            rest, found[axis] = divmod(rest, getattr(self, axis))
        return {axis: found[axis] for axis in AXES}

    def rank_of(self, *, dp: int, pp: int, tp: int) -> int:
        """The rank at the given coordinates; the inverse of :meth:`coords`."""
        given = {"dp": dp, "pp": pp, "tp": tp}
        rank = 0
        stride = 1
        for axis in self.axes:
            value = _as_int(given[axis])
            size = getattr(self, axis)
            if value is None or not 0 <= value < size:
                raise MeshError(
                    f"coordinate {axis}={given[axis]!r} is out of range [0, {size}) for {self}"
                )
            rank += value * stride
            stride *= size
        return rank

    # ----------------------------------------------------------------- groups

    def groups(self, axis: str) -> list[list[int]]:
        """All groups of ranks that differ only along ``axis`` (``"tp"``, ``"dp-tp"``, ...).

        The groups partition the world; they are sorted by their first rank and
        each lists its members in ascending rank (= ascending axis coordinate).
        """
        varying = set(self._parse_axis(axis))
        # C order: the last dimension varies fastest, so reverse the mesh order.
        slow_first = self.axes[::-1]
        grid = np.arange(self.world_size).reshape([getattr(self, a) for a in slow_first])
        fixed_dims = [i for i, a in enumerate(slow_first) if a not in varying]
        varying_dims = [i for i, a in enumerate(slow_first) if a in varying]
        size = self.degree(axis)
        return grid.transpose(fixed_dims + varying_dims).reshape(-1, size).tolist()

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The group along ``axis`` that contains ``rank``, in ascending rank."""
        varying = self._parse_axis(axis)
        here = self.coords(rank)
        base = self.rank_of(**{a: (0 if a in varying else here[a]) for a in AXES})
        members = [base]
        stride = 1
        for name in self.axes:
            size = getattr(self, name)
            if name in varying:
                members = [m + k * stride for k in range(size) for m in members]
            stride *= size
        return sorted(members)

    def color(self, rank: int, axis: str) -> int:
        """An id shared by exactly the ranks of one group along ``axis``, e.g. for ``Comm_Split``.

        It is the index of the group of ``rank`` in :meth:`groups`.
        """
        varying = self._parse_axis(axis)
        here = self.coords(rank)
        color = 0
        stride = 1
        for name in self.axes:
            if name not in varying:
                color += here[name] * stride
                stride *= getattr(self, name)
        return color

    # ---------------------------------------------------------------- helpers

    def _parse_axis(self, axis: str) -> tuple[str, ...]:
        """The distinct axes named by ``axis`` (``"tp"`` or ``"dp-tp"``) in mesh order."""
        parts = axis.split("-") if isinstance(axis, str) else [axis]
        names = [p.strip().lower() if isinstance(p, str) else p for p in parts]
        valid = ", ".join(AXES)
        for name in names:
            if name not in AXES:
                raise MeshError(
                    f"unknown axis {axis!r}; valid axes are {valid}, or several joined by '-'"
                )
        if len(set(names)) != len(names):
            raise MeshError(f"axis {axis!r} names an axis twice; valid axes are {valid}")
        return tuple(a for a in self.axes if a in names)

    def _check_rank(self, rank: int) -> int:
        """``rank`` as an ``int``, or :class:`MeshError` if it is not in ``[0, world_size)``."""
        value = _as_int(rank)
        if value is None or not 0 <= value < self.world_size:
            raise MeshError(f"rank {rank!r} is out of range [0, {self.world_size}) for {self}")
        return value

    def __repr__(self) -> str:
        return (
            f"Mesh(world={self.world_size}, dp={self.dp}, pp={self.pp}, "
            f"tp={self.tp}, order={self.order})"
        )

    __str__ = __repr__
