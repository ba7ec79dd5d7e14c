"""Launcher detection, backend selection, launcher command lines and the local backend."""

from __future__ import annotations

import numpy as np
import pytest

import shardwise
from shardwise import cli
from shardwise.backends import check_backend
from shardwise.backends.local import LocalCommunicator
from shardwise.bench import bus_bandwidth, parse_size
from shardwise.context import resolve_backend
from shardwise.core.comm import ReduceOp, split_sizes
from shardwise.core.errors import BackendError, ConfigError, ShapeMismatchError
from shardwise.core.launch_env import LaunchInfo, detect_launch
from shardwise.cli.launch import MPILauncher, build_command, parse_hosts


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, LaunchInfo("openmpi", 3, 4, 1, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     LaunchInfo("mpich", 1, 2, 1, 2)),
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, LaunchInfo("torchrun", 5, 8, 1, 4)),
    ({"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1",
      "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}, LaunchInfo("slurm", 9, 16, 1, 8)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "64"}, LaunchInfo("none", 0, 1, 0, 1)),  # batch script, no srun
    ({}, LaunchInfo("none", 0, 1, 0, 1)),
])
def test_detect_launch(env, expected):
    assert detect_launch(env) == expected


def test_detect_launch_rejects_bad_values():
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK='x' is not an integer"):
        detect_launch({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="rank 4 of 4"):
        detect_launch({"PMI_RANK": "4", "PMI_SIZE": "4"})


def test_resolve_backend(monkeypatch):
    monkeypatch.delenv("SHARDWISE_BACKEND", raising=False)
    assert resolve_backend(None, LaunchInfo("none", 0, 1, 0, 1)) == "local"
    assert resolve_backend("auto", LaunchInfo("openmpi", 0, 2, 0, 2)) == "mpi"
    assert resolve_backend(None, LaunchInfo("torchrun", 0, 2, 0, 2)) == "torch"
    monkeypatch.setenv("SHARDWISE_BACKEND", "torch")
    assert resolve_backend(None, LaunchInfo("openmpi", 0, 2, 0, 2)) == "torch"
    assert resolve_backend("mpi", LaunchInfo("openmpi", 0, 2, 0, 2)) == "mpi"


def test_unknown_backend_names_what_is_installed():
    with pytest.raises(BackendError, match=r"unknown backend .nccl2.; known backends: local, mpi, torch.* \(installed: local, mpi"):
        check_backend("nccl2")
    with pytest.raises(BackendError, match="unknown backend"):
        shardwise.init(backend="nccl2")


def test_not_initialised_error():
    shardwise.shutdown()
    with pytest.raises(shardwise.NotInitializedError, match="call shardwise.init"):
        shardwise.rank()


def test_reduce_op_parse():
    assert ReduceOp.parse("avg") is ReduceOp.AVERAGE
    assert ReduceOp.parse("SUM") is ReduceOp.SUM
    with pytest.raises(ConfigError, match="unknown reduce op 'median'"):
        ReduceOp.parse("median")


def test_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(0, 3) == [0, 0, 0]
    with pytest.raises(ConfigError):
        split_sizes(3, 0)


OPENMPI = MPILauncher("/usr/bin/mpirun", "openmpi", "5.0.11")
MPICH = MPILauncher("/usr/bin/mpiexec", "mpich", "4.2")


def test_openmpi_command_uses_double_dash_options():
    argv = build_command(OPENMPI, 4, ["python", "train.py"], hosts="a:2,b:2",
                         env={"SHARDWISE_TIMEOUT": "5", "HOME": "/root", "PATH": "/bin"})
    assert argv[:3] == ["/usr/bin/mpirun", "-np", "4"]
    assert "--host" in argv and argv[argv.index("--host") + 1] == "a:2,b:2"
    assert "--bind-to" in argv and "-bind-to" not in argv
    assert ["-x", "SHARDWISE_TIMEOUT"] == argv[argv.index("SHARDWISE_TIMEOUT") - 1: argv.index("SHARDWISE_TIMEOUT") + 1]
    assert "HOME" not in argv
    assert argv[-2:] == ["python", "train.py"]


def test_mpich_command():
    argv = build_command(MPICH, 2, ["python", "x.py"], hostfile=__file__, env={"PATH": "/bin"})
    assert argv[:3] == ["/usr/bin/mpiexec", "-np", "2"]
    assert argv[argv.index("-f") + 1] == __file__
    assert argv[argv.index("-genvlist") + 1] == "PATH"
    assert "--oversubscribe" not in argv


@pytest.mark.parametrize("kwargs, message", [
    ({"np": 0, "command": ["python"]}, "-np must be at least 1"),
    ({"np": 2, "command": []}, "no command to run"),
    ({"np": 2, "command": ["python"], "hosts": "a", "hostfile": "h"}, "either -H or --hostfile"),
    ({"np": 2, "command": ["python"], "hostfile": "/nonexistent/hosts"}, "does not exist"),
])
def test_launcher_argument_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_command(OPENMPI, **kwargs)


def test_parse_hosts():
    assert parse_hosts("n1:4, n2") == [("n1", 4), ("n2", 1)]
    for bad in ("n1:x", ":4", "n1:0", ""):
        with pytest.raises(ConfigError):
            parse_hosts(bad)


def test_cli_run_dry_run_and_errors(capsys):
    assert cli.main(["run", "-np", "2", "--dry-run", "--", "python", "train.py"]) == 0
    printed = capsys.readouterr().out
    assert "-np 2" in printed and printed.strip().endswith("python train.py")
    assert cli.main(["run", "-np", "0", "--", "python", "x.py"]) == 2
    assert "-np must be at least 1" in capsys.readouterr().err


def test_sizes_and_bus_bandwidth():
    assert parse_size("4K") == 4096 and parse_size("64MiB") == 64 << 20 and parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("4 parsecs")
    assert bus_bandwidth(10.0, 2) == 10.0
    assert bus_bandwidth(10.0, 4) == 15.0


def test_local_backend_collectives():
    torch = pytest.importorskip("torch")
    comm = LocalCommunicator()
    x = np.arange(6.0).reshape(2, 3)
    y = comm.allreduce(x, "average")
    assert y is not x and np.array_equal(y, x)
    assert comm.allreduce(x, inplace=True) is x
    assert comm.allgather(x).shape == (2, 3)
    assert comm.reduce_scatter(x).shape == (2, 3)
    assert np.array_equal(comm.alltoall(x, splits=[2]), x)
    t = torch.ones(3, dtype=torch.bfloat16)
    assert torch.equal(comm.allreduce_async(t).wait(), t)
    comm.send(np.arange(3.0), 0, tag=1)
    buf = np.zeros(3)
    comm.recv(buf, 0, tag=1)
    assert np.array_equal(buf, [0, 1, 2])
    with pytest.raises(ShapeMismatchError, match="recv buffer holds 16 bytes"):
        comm.send(np.arange(3.0), 0)
        comm.recv(np.zeros(2), 0)
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(x, root=1)
    assert comm.split(ranks=[]) is None and comm.split(color=3).size == 1
    assert comm.allgather_object("a") == ["a"]


def test_init_local_context():
    shardwise.shutdown()
    ctx = shardwise.init(backend="local")
    try:
        assert ctx.backend == "local" and shardwise.size() == 1 and shardwise.rank() == 0
        assert shardwise.local_size() == 1
        with pytest.raises(BackendError, match="already initialised with backend 'local'"):
            shardwise.init(backend="mpi")
    finally:
        shardwise.shutdown()
    assert not shardwise.is_initialized()


def test_mpi_waits_yield_only_when_ranks_crowd_the_cores() -> None:
    from shardwise.core.launch_env import YIELD_WHEN_IDLE, yield_mpi_waits_when_crowded

    launched = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    env = dict(launched)
    assert yield_mpi_waits_when_crowded(env, cores=2) and env[YIELD_WHEN_IDLE] == "1"
    roomy = dict(launched)
    assert not yield_mpi_waits_when_crowded(roomy, cores=64) and YIELD_WHEN_IDLE not in roomy
    mine = dict(launched, **{YIELD_WHEN_IDLE: "0"})
    assert not yield_mpi_waits_when_crowded(mine, cores=2) and mine[YIELD_WHEN_IDLE] == "0"
    plain: dict = {}
    assert not yield_mpi_waits_when_crowded(plain, cores=1) and plain == {}
