"""The mpi backend's device route: which engine, which tensors, which groups (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.backends._mpi_device_route import ENGINE_ENV, DeviceRoute, device_engine, member_groups
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
