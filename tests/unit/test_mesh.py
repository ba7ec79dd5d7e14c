"""Unit tests of :class:`shardwise.core.mesh.Mesh`: pure rank arithmetic, no processes."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from shardwise.core.errors import ConfigError, MeshError
from shardwise.core.mesh import AXES, Mesh

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]
COMBINED = ["dp", "pp", "tp", "dp-tp", "tp-dp", "dp-pp", "pp-tp", "dp-pp-tp"]

MESHES = [
    Mesh(1),
    Mesh(8, dp=2, pp=2, tp=2),
    Mesh(8, dp=2, pp=2, tp=2, order="pp-dp-tp"),
    Mesh(12, dp=-1, pp=3, tp=2),
    Mesh(24, dp=2, pp=-1, tp=4, order="dp-tp-pp"),
    Mesh(16, dp=4, pp=1, tp=-1, order="pp-tp-dp"),
    Mesh(30, dp=5, pp=3, tp=2, order="dp-pp-tp"),
]


@pytest.fixture(params=MESHES, ids=repr)
def mesh(request: pytest.FixtureRequest) -> Mesh:
    return request.param


# --------------------------------------------------------------- construction


def test_infer_dp_by_default() -> None:
    m = Mesh(world_size=8, dp=-1, tp=2)
    assert (m.dp, m.pp, m.tp) == (4, 1, 2)
    assert Mesh(8).dp == 8


@pytest.mark.parametrize("axis", AXES)
def test_infer_any_one_axis(axis: str) -> None:
    degrees = {"dp": 2, "pp": 3, "tp": 4}
    degrees[axis] = -1
    m = Mesh(24, **degrees)
    assert m.degree(axis) == {"dp": 2, "pp": 3, "tp": 4}[axis]
    assert m.dp * m.pp * m.tp == 24
    assert Mesh(12, dp=3, pp=4, tp=-1).tp == 1


def test_explicit_degrees_and_positional_form() -> None:
    m = Mesh(8, 2, 2, 2)
    assert (m.world_size, m.dp, m.pp, m.tp, m.order) == (8, 2, 2, 2, "tp-dp-pp")


def test_resolved_meshes_compare_equal_and_are_frozen() -> None:
    a = Mesh(8, dp=-1, tp=2)
    b = Mesh(8, dp=4, pp=1, tp=2)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dp = 2  # type: ignore[misc]


def test_numpy_integers_accepted() -> None:
    m = Mesh(np.int64(8), dp=np.int32(-1), tp=np.int64(2))
    assert m.dp == 4 and type(m.dp) is int and type(m.world_size) is int


def test_order_is_normalised() -> None:
    assert Mesh(4, order=" TP - pp-dp").order == "tp-pp-dp"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=6, tp=4), r"world size 6 is not divisible by tp=4"),
        (dict(world_size=8, pp=2, tp=-1, dp=3), r"world size 8 is not divisible by dp=3"),
        (dict(world_size=12, pp=4, tp=6), r"not divisible by pp\*tp = 24 \(pp=4, tp=6\)"),
        (dict(world_size=6, dp=2, pp=2, tp=2), r"dp\*pp\*tp = 8 but world size is 6"),
        (dict(world_size=8, dp=1, pp=1, tp=1), r"dp\*pp\*tp = 1 but world size is 8"),
        (dict(world_size=8, pp=0), r"degree pp=0 must be a positive integer or -1"),
        (dict(world_size=8, tp=-2), r"degree tp=-2 must be a positive integer or -1"),
        (dict(world_size=8, tp=2.0), r"degree tp=2\.0 must be a positive integer or -1"),
        (dict(world_size=8, dp=True), r"degree dp=True must be a positive integer"),
        (dict(world_size=8, dp=-1, tp=-1), r"only one degree may be -1, got dp=-1, tp=-1"),
        (dict(world_size=0), r"world size 0 must be a positive integer"),
        (dict(world_size=-4), r"world size -4 must be a positive integer"),
        (dict(world_size="8"), r"world size '8' must be a positive integer"),
        (dict(world_size=8, order="tp-dp"), r"order 'tp-dp' must be a permutation .*dp, pp, tp"),
        (dict(world_size=8, order="tp-dp-dp"), r"order 'tp-dp-dp' must be a permutation"),
        (dict(world_size=8, order="tp-dp-pp-cp"), r"must be a permutation"),
        (dict(world_size=8, order="tp,dp,pp"), r"separated by '-'"),
        (dict(world_size=8, order=None), r"order None must be a permutation"),
    ],
)
def test_construction_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(MeshError, match=match):
        Mesh(**kwargs)


def test_mesh_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Mesh(6, tp=4)
    assert issubclass(MeshError, ConfigError)


def test_repr_and_str() -> None:
    m = Mesh(8, dp=-1, pp=2, tp=2)
    assert repr(m) == "Mesh(world=8, dp=2, pp=2, tp=2, order=tp-dp-pp)"
    assert str(m) == repr(m)


# -------------------------------------------------------------------- queries


def test_axes_shape_and_degree() -> None:
    m = Mesh(24, dp=2, pp=3, tp=4, order="pp-tp-dp")
    assert m.axes == ("pp", "tp", "dp")
    assert m.shape == (3, 4, 2)
    assert [m.degree(a) for a in AXES] == [2, 3, 4]
    assert m.degree("dp-tp") == 8 and m.degree("tp-dp-pp") == 24


def test_coords_round_trip(mesh: Mesh) -> None:
    seen = set()
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        assert list(c) == list(AXES)
        assert all(0 <= c[a] < mesh.degree(a) for a in AXES)
        assert mesh.rank_of(**c) == rank
        seen.add(tuple(c.values()))
    assert len(seen) == mesh.world_size  # coordinates are a bijection


def test_coords_follow_megatron_order() -> None:
    # "tp-dp-pp": tp fastest, then dp, then pp.
    m = Mesh(8, dp=2, pp=2, tp=2)
    assert m.coords(0) == {"dp": 0, "pp": 0, "tp": 0}
    assert m.coords(1) == {"dp": 0, "pp": 0, "tp": 1}
    assert m.coords(2) == {"dp": 1, "pp": 0, "tp": 0}
    assert m.coords(5) == {"dp": 0, "pp": 1, "tp": 1}
    assert m.rank_of(dp=1, pp=1, tp=1) == 7


@pytest.mark.parametrize("bad", [-1, 8, 100, 1.0, "0", None])
def test_rank_out_of_range(bad: object) -> None:
    m = Mesh(8, dp=2, pp=2, tp=2)
    with pytest.raises(MeshError, match=r"rank .* is out of range \[0, 8\)"):
        m.coords(bad)  # type: ignore[arg-type]
    with pytest.raises(MeshError, match=r"out of range"):
        m.group_of(bad, "tp")  # type: ignore[arg-type]
    with pytest.raises(MeshError, match=r"out of range"):
        m.color(bad, "dp")  # type: ignore[arg-type]


def test_rank_of_rejects_bad_coordinates() -> None:
    m = Mesh(8, dp=2, pp=2, tp=2)
    with pytest.raises(MeshError, match=r"coordinate tp=2 is out of range \[0, 2\)"):
        m.rank_of(dp=0, pp=0, tp=2)
    with pytest.raises(MeshError, match=r"coordinate dp=-1"):
        m.rank_of(dp=-1, pp=0, tp=0)
    with pytest.raises(TypeError):
        m.rank_of(dp=0, pp=0)  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", ["cp", "", "dp-", "dp-ep", "dp-dp", "data"])
def test_unknown_axis_lists_valid_axes(bad: str) -> None:
    m = Mesh(8, dp=2, pp=2, tp=2)
    for call in (m.groups, m.degree, lambda a: m.group_of(0, a), lambda a: m.color(0, a)):
        with pytest.raises(MeshError, match=r"valid axes are dp, pp, tp"):
            call(bad)


# --------------------------------------------------------------------- groups


@pytest.mark.parametrize("axis", COMBINED)
def test_groups_partition_the_world(mesh: Mesh, axis: str) -> None:
    groups = mesh.groups(axis)
    size = mesh.degree(axis)
    assert len(groups) == mesh.world_size // size
    assert all(len(g) == size for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    varying = set(axis.split("-"))
    for g in groups:
        assert g == sorted(g)
        cs = [mesh.coords(r) for r in g]
        # Only the named axes vary inside a group, and they take every combination.
        for a in AXES:
            if a not in varying:
                assert len({c[a] for c in cs}) == 1
        assert len({tuple(c[a] for a in sorted(varying)) for c in cs}) == size


@pytest.mark.parametrize("axis", AXES)
def test_single_axis_members_ordered_by_coordinate(mesh: Mesh, axis: str) -> None:
    for g in mesh.groups(axis):
        assert [mesh.coords(r)[axis] for r in g] == list(range(mesh.degree(axis)))


def test_tp_groups_contiguous_under_default_order() -> None:
    m = Mesh(16, dp=2, pp=2, tp=4)
    assert m.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert m.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert m.groups("pp")[0] == [0, 8]


def test_order_changes_adjacency() -> None:
    default = Mesh(8, dp=2, pp=2, tp=2)
    pp_first = Mesh(8, dp=2, pp=2, tp=2, order="pp-dp-tp")
    assert default.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp_first.groups("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp_first.groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert default.groups("tp") != pp_first.groups("tp")
    assert default.coords(1) != pp_first.coords(1)


def test_combined_axes_groups() -> None:
    m = Mesh(8, dp=2, pp=2, tp=2)
    # dp x tp at fixed pp: the first and the second half of the world.
    assert m.groups("dp-tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.groups("tp-dp") == m.groups("dp-tp")
    assert m.groups("pp-tp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert m.groups("dp-pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.groups("dp-pp-tp") == [list(range(8))]


def test_world_of_one() -> None:
    m = Mesh(1)
    assert (m.dp, m.pp, m.tp) == (1, 1, 1)
    assert m.groups("dp") == [[0]] and m.group_of(0, "dp-tp") == [0] and m.color(0, "tp") == 0


@pytest.mark.parametrize("axis", COMBINED)
def test_group_of_and_color_agree_with_groups(mesh: Mesh, axis: str) -> None:
    groups = mesh.groups(axis)
    for index, group in enumerate(groups):
        for rank in group:
            assert mesh.group_of(rank, axis) == group
            assert mesh.color(rank, axis) == index


@pytest.mark.parametrize("axis", COMBINED)
def test_color_splits_like_comm_split(mesh: Mesh, axis: str) -> None:
    # Emulate MPI Comm_Split(color, key=rank): ranks sharing a color, in rank order.
    split: dict[int, list[int]] = {}
    for rank in range(mesh.world_size):
        split.setdefault(mesh.color(rank, axis), []).append(rank)
    assert sorted(split) == list(range(len(split)))
    assert sorted(split.values()) == mesh.groups(axis)


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_is_consistent(order: str) -> None:
    m = Mesh(24, dp=2, pp=3, tp=4, order=order)
    fastest, _, slowest = m.axes
    assert m.groups(fastest)[0] == list(range(m.degree(fastest)))
    stride = 24 // m.degree(slowest)
    assert m.groups(slowest)[0] == list(range(0, 24, stride))
    for rank in range(24):
        assert m.rank_of(**m.coords(rank)) == rank
