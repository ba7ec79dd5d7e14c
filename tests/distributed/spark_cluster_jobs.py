"""Driver for the Spark tests on a local cluster: ``python spark_cluster_jobs.py`` prints one JSON verdict per scenario.

One Spark session on a local cluster (``local-cluster[2,1,1024]``: two executor JVMs
of one core each, as on a real cluster) serves every scenario of
``shardwise.spark.run(..., backend="mpi")``: placement, collectives against numpy,
a failing rank, a run after it, the same placement and collectives with
``backend="gloo"``, and the rsh-agent path, where the two tasks play two
hosts (``127.0.0.1`` and ``127.0.0.2``, which PRRTE takes for a remote host), so
mpirun starts rank 1's daemon through ``shardwise.spark._mpi_rsh`` inside task 1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import numpy as np  # noqa: F401 - the ranks' functions use it

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spark_jobs import check_collectives, collectives, fail_on, report  # noqa: E402
from spark_jobs import placement as gloo_placement  # noqa: E402


def ancestors() -> list[int]:
    """The pids above this process, parent first (from /proc)."""
    pids, pid = [], os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rpartition(")")[2].split()[1])
        pids.append(pid)
    return pids


def placement() -> dict:
    import shardwise

    ctx = shardwise.init()
    return {"rank": ctx.world.rank, "size": ctx.world.size, "local_rank": ctx.local_rank,
            "local_size": ctx.local_size, "backend": ctx.backend, "host": socket.gethostname(),
            "pid": os.getpid(), "task": os.environ.get("SHARDWISE_SPARK_TASK"),
            "in_task_tree": int(os.environ["SHARDWISE_SPARK_TASK_PID"]) in ancestors()}


def remote_placement() -> dict:
    """MPI's view of the ranks and whether each lives in the process tree of the Spark task it says.

    No messages between the two 'hosts': they are one machine, and on it a point-to-point
    message between ranks that PRRTE places on two nodes with the same address was seen
    to hang (Open MPI 5.0.11, TCP transport), with or without Spark.
    """
    from mpi4py import MPI

    task_pid = int(os.environ["SHARDWISE_SPARK_TASK_PID"])
    return {"rank": MPI.COMM_WORLD.Get_rank(), "size": MPI.COMM_WORLD.Get_size(),
            "task": os.environ.get("SHARDWISE_SPARK_TASK"), "in_task_tree": task_pid in ancestors()}


def remote_fail_on(rank: int) -> None:
    """Rank ``rank`` raises after MPI is up; the other sleeps until mpirun stops it."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == rank:
        raise ValueError(f"deliberate failure on remote rank {rank}")
    time.sleep(600)


def leftovers() -> list[str]:
    """Command lines of processes still running a rank or an agent of these jobs."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "shardwise.spark._mpi" in cmd and int(pid) != os.getpid():
            found.append(cmd)
    return found


def main() -> None:
    from pyspark.sql import SparkSession

    import shardwise.spark
    from shardwise.core.errors import JobFailedError

    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("shardwise-mpi-tests")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    started = time.monotonic()
    out = shardwise.spark.run(placement, num_proc=2, backend="mpi")
    report("order", results=out, seconds=time.monotonic() - started)

    out = shardwise.spark.run(collectives, args=(5,), num_proc=2, backend="mpi")
    report("collectives", **check_collectives(out))

    started = time.monotonic()
    try:
        shardwise.spark.run(fail_on, args=(1,), num_proc=2, backend="mpi")
        report("failure", raised=None)
    except JobFailedError as exc:
        report("failure", raised="JobFailedError", rank=exc.rank, message=str(exc),
               seconds=time.monotonic() - started)

    out = shardwise.spark.run(placement, num_proc=2, backend="mpi")
    report("after_failure", ranks=[r["rank"] for r in out], sizes=[r["size"] for r in out],
           backends=[r["backend"] for r in out])

    out = shardwise.spark.run(gloo_placement, num_proc=2, backend="gloo")
    report("gloo_order", results=out)
    report("gloo_collectives", **check_collectives(shardwise.spark.run(collectives, args=(6,), backend="gloo")))

    started = time.monotonic()
    out = shardwise.spark.run(remote_placement, num_proc=2, backend="mpi",
                              env={"SHARDWISE_SPARK_MPI_HOSTS": "127.0.0.1,127.0.0.2"})
    report("remote", results=out, seconds=time.monotonic() - started)

    started = time.monotonic()
    try:
        shardwise.spark.run(remote_fail_on, args=(1,), num_proc=2, backend="mpi",
                            env={"SHARDWISE_SPARK_MPI_HOSTS": "127.0.0.1,127.0.0.2"})
        report("remote_failure", raised=None)
    except JobFailedError as exc:
        report("remote_failure", raised="JobFailedError", rank=exc.rank, message=str(exc),
               seconds=time.monotonic() - started)
    time.sleep(1.0)
    report("leftovers", processes=leftovers())
    spark.stop()


if __name__ == "__main__":
    main()
