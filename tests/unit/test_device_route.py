"""The mpi backend's device route: which engine, which tensors, which groups (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.backends.mpi._device_route import ENGINE_ENV, DeviceRoute, device_engine, member_groups
from shardwise.core.errors import ConfigError


@pytest.mark.parametrize("value, cuda, engine", [
    (None, True, "nccl"), (None, False, None), ("auto", True, "nccl"), ("", False, None),
    ("nccl", True, "nccl"), ("gloo", False, "gloo"), ("gloo", True, "gloo"), ("off", True, None), (" OFF ", True, None),
])
def test_engine_follows_cuda_unless_the_environment_says(value, cuda, engine) -> None:
    env = {} if value is None else {ENGINE_ENV: value}
    assert device_engine(cuda, env) == engine


def test_engine_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="SHARDWISE_DEVICE_ENGINE=nccl but CUDA is not available"):
        device_engine(False, {ENGINE_ENV: "nccl"})
    with pytest.raises(ConfigError, match="expected one of auto, nccl, gloo, off"):
        device_engine(True, {ENGINE_ENV: "ucx"})


def test_member_groups_follow_mpi_split_order() -> None:
    # parent rank r: (colour, key, global rank); MPI orders by key, then parent rank
    entries = [(1, 5, 10), (0, 0, 11), (1, 5, 12), (0, -1, 13), (-32766, 0, 14), (1, 0, 15)]
    assert member_groups(entries) == {0: [13, 11], 1: [15, 10, 12]}


def test_route_takes_only_tensors_of_its_device_type() -> None:
    gloo = DeviceRoute(comm=None, engine="gloo")
    assert gloo.takes(torch.ones(2)) and not gloo.takes(np.ones(2)) and not gloo.takes(torch.ones(2, device="meta"))
    nccl = DeviceRoute(comm=None, engine="nccl")
    assert not nccl.takes(torch.ones(2)) and not nccl.takes(np.ones(2))


def test_auto_stays_on_mpi_when_ranks_share_gpus_but_nccl_is_forced() -> None:
    with pytest.warns(RuntimeWarning, match="more ranks on this node than GPUs"):
        assert device_engine(True, {}, gpus_shared=True) is None
    assert device_engine(True, {ENGINE_ENV: "nccl"}, gpus_shared=True) == "nccl"
    assert device_engine(False, {}, gpus_shared=True) is None


def _no_groups(monkeypatch) -> list:
    """Record (instead of make) the torch groups that member_group would create."""
    import torch.distributed as dist

    made: list = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append((a, k)))
    return made


def test_member_group_refuses_on_every_rank_where_torch_names_groups_unknowably(monkeypatch) -> None:
    from shardwise.backends.torch import _subgroups as _torch_subgroups
    from shardwise.core.errors import BackendError

    made = _no_groups(monkeypatch)
    # another member could not count its groups: every rank refuses, this one included
    gather = lambda mine: [mine, ([0, 1], None)]  # noqa: E731
    monkeypatch.setattr(_torch_subgroups, "_held", lambda: 3)
    with pytest.raises(BackendError, match="cannot make a group with its members alone"):
        _torch_subgroups.member_group([1, 0], gather)
    assert made == []


def test_member_group_creates_nothing_when_members_disagree_on_the_name(monkeypatch) -> None:
    from torch.distributed import distributed_c10d

    from shardwise.backends.torch import _subgroups as _torch_subgroups
    from shardwise.core.errors import BackendError

    made = _no_groups(monkeypatch)
    monkeypatch.setattr(_torch_subgroups, "_held", lambda: 3)
    monkeypatch.setattr(distributed_c10d, "_hash_ranks_to_str", lambda ranks: "mine")
    answers = iter([[([0, 1], 3), ([0, 1], 3), (None, None)], [([0, 1], "mine"), ([0, 1], "theirs"), (None, None)]])
    with pytest.raises(BackendError, match=r"torch group\(s\) \[\(0, 1\)\] computed different group names"):
        _torch_subgroups.member_group([0, 1], lambda obj: next(answers))
    assert made == []


def test_member_group_pads_to_the_member_holding_most_groups(monkeypatch) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from shardwise.backends.torch import _subgroups as _torch_subgroups

    held = {"n": 2}
    made: list = []

    def new_group(ranks, use_local_synchronization=False):
        assert use_local_synchronization, "a member-made group must not need the rest of the job"
        made.append(list(ranks))
        held["n"] += 1
        return f"pg{ranks}"

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda: 4)
    monkeypatch.setattr(_torch_subgroups, "_held", lambda: held["n"])
    monkeypatch.setattr(distributed_c10d, "_hash_ranks_to_str", lambda ranks: f"{ranks}-{held['n']}")
    # parent ranks: this one (global 4, holds 2 groups) and global 6 (holds 5) form one group,
    # global 5 (holds 9) another: only this group's own members count
    answers = iter([[([4, 6], 2), ([5], 9), ([4, 6], 5)], [([4, 6], "[4, 6]-5"), ([5], "x"), ([4, 6], "[4, 6]-5")]])
    assert _torch_subgroups.member_group([6, 4], lambda obj: next(answers)) == "pg[4, 6]"
    assert made == [[4], [4], [4], [4, 6]]
