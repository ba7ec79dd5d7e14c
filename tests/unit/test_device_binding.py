"""Which CUDA device each rank binds, under every launcher, without a GPU (torch.cuda faked)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise.context as context
from shardwise.backends.torch import engine as torch_engine
from shardwise.core.launch_env import detect_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from device_guard import FactoryCallsWithoutDevice  # noqa: E402


class FakeCuda:
    """Stands in for ``torch.cuda``: ``count`` visible GPUs, and the order of what was called."""

    def __init__(self, count: int, calls: list) -> None:
        self.count, self.calls = count, calls

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Fakes torch.cuda with 4 GPUs and records set_device / init_process_group in order."""
    seen: list = []
    monkeypatch.setattr(torch, "cuda", FakeCuda(4, seen))
    monkeypatch.delenv(context.BIND_ENV, raising=False)
    return seen


LAUNCHERS = [
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 1),
    ({"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}, 2),
    ({"PMIX_RANK": "3", "PMIX_SIZE": "8", "PMIX_LOCAL_RANK": "3", "PMIX_LOCAL_SIZE": "4"}, 3),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, 1),
    ({"SLURM_PROCID": "7", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "6",
      "SLURM_STEP_TASKS_PER_NODE": "8"}, 2),  # 8 ranks on 4 GPUs: local rank 6 shares GPU 2
    ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "2", "HOROVOD_LOCAL_SIZE": "4"}, 2),
]


@pytest.mark.parametrize("env, device", LAUNCHERS, ids=["openmpi", "mpich", "pmix", "torchrun", "slurm", "horovodrun"])
def test_torch_backend_binds_the_local_rank_before_its_group_exists(calls, monkeypatch, env, device) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init_process_group", kw["backend"])))
    launch = detect_launch(env)
    torch_engine.init(launch, None)
    assert calls == [("set_device", device), ("init_process_group", "cpu:gloo,cuda:nccl")]


def test_bind_is_local_rank_modulo_visible_devices(calls) -> None:
    assert [context.bind_local_device(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert calls == [("set_device", i) for i in (0, 1, 2, 3, 0, 1)]


def test_bind_does_nothing_without_cuda_or_when_switched_off(calls, monkeypatch) -> None:
    monkeypatch.setenv(context.BIND_ENV, "0")
    assert context.bind_local_device(1) is None
    monkeypatch.delenv(context.BIND_ENV)
    torch.cuda.count = 0
    assert context.bind_local_device(1) is None
    assert calls == []


def test_init_binds_the_node_local_rank_on_every_non_torch_backend(calls, monkeypatch) -> None:
    """mpi/horovod/local: the local rank comes from every rank's host name (any launcher, even none)."""
    monkeypatch.setattr(context, "_node_layout", lambda world: (3, 4, 0, 1))
    monkeypatch.delenv("SHARDWISE_DEVICE_ENGINE", raising=False)
    ctx = context.init("local")
    try:
        assert ctx.local_rank == 3 and calls == [("set_device", 3)]
    finally:
        context.shutdown()


def test_elastic_and_ray_workers_find_their_local_rank_through_the_store() -> None:
    """Elastic (and Ray) workers have no launcher variables: the rendezvous store tells them who shares their host."""
    import socket

    store = dist.HashStore()
    store.set("shardwise/host/0", "other-node")
    store.set("shardwise/host/1", socket.gethostname())
    store.set("shardwise/host/3", socket.gethostname())
    assert torch_engine.store_node_layout(store, 2, 4) == (1, 3)  # ranks 1, 2, 3 share this host


def test_device_guard_reports_deviceless_factory_calls_from_the_watched_package() -> None:
    """The guard of tests/distributed/device_correct.py can fail: it names this file and line."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    with FactoryCallsWithoutDevice(here) as guard:
        torch.zeros(3)
        line = sys._getframe().f_lineno - 1
        torch.ones(2, device="cpu")
        torch.zeros_like(torch.empty(2, device="cpu"))
    assert guard.found == [f"unit/{os.path.basename(__file__)}:{line} torch.zeros"]
