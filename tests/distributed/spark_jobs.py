"""Driver for the Spark engine tests: ``python spark_jobs.py`` prints one JSON verdict per scenario.

One Spark session (``local[2]``) serves every scenario. The tests start this driver
with a PATH on which ``python3`` is not the driver's Python and no PYSPARK_PYTHON,
so the jobs only run if shardwise gives Spark's workers the driver's Python.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def report(name: str, **verdict: Any) -> None:
    print(json.dumps({"scenario": name, **verdict}), flush=True)


def placement() -> dict:
    import shardwise.torch as hvd

    hvd.init()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "host": socket.gethostname(), "pid": os.getpid()}


def collectives(seed: int) -> dict:
    import shardwise

    comm = shardwise.init().world
    r, n = comm.rank, comm.size
    x = np.random.default_rng(seed + r).standard_normal(5)
    return {"x": x, "sum": comm.allreduce(x, "sum"), "average": comm.allreduce(x, "average"),
            "max": comm.allreduce(x, "max"), "allgather": comm.allgather(np.full((r + 1, 2), float(r))),
            "broadcast": comm.broadcast(x.copy(), root=1), "alltoall": comm.alltoall(np.arange(2 * n) + 10.0 * r),
            "reduce_scatter": comm.reduce_scatter(np.arange(6, dtype=np.float64) * (r + 1))}


def fail_on(rank: int) -> None:
    import shardwise

    comm = shardwise.init().world
    if comm.rank == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    comm.allreduce(np.ones(3), "sum")  # the other rank waits here for the failed one
    time.sleep(600)


def through_torch_distributor(scale: float) -> dict:
    """A shardwise function as TorchDistributor runs it: under torchrun, in Spark's tasks."""
    import shardwise

    ctx = shardwise.init()
    comm = ctx.world
    total = comm.allreduce(np.array([comm.rank + 1.0]) * scale, "sum")
    out = {"rank": comm.rank, "size": comm.size, "sum": float(total[0]), "backend": ctx.backend}
    shardwise.shutdown()
    return out


def check_collectives(results: list) -> dict:
    xs = [r["x"] for r in results]
    n = len(xs)
    worst = 0.0
    for rank, got in enumerate(results):
        want = {"sum": sum(xs), "average": sum(xs) / n, "max": np.max(xs, axis=0),
                "allgather": np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)]),
                "broadcast": xs[1],
                "alltoall": np.array([(np.arange(2 * n) + 10.0 * k)[2 * rank + j] for k in range(n) for j in range(2)]),
                "reduce_scatter": np.array_split(sum(np.arange(6.0) * (k + 1) for k in range(n)), n)[rank]}
        for key, value in want.items():
            worst = max(worst, float(np.max(np.abs(np.asarray(got[key]) - value))))
    return {"max_abs_diff": worst, "distinct_inputs": not np.allclose(xs[0], xs[1])}


def main() -> None:
    from pyspark.sql import SparkSession

    import shardwise.spark
    from shardwise.core.errors import ConfigError, JobFailedError

    spark = (SparkSession.builder.master("local[2]").appName("shardwise-tests")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    report("setup", worker_python_on_path=os.popen("command -v python3").read().strip(), driver=sys.executable)

    started = time.monotonic()
    out = shardwise.spark.run(placement, num_proc=2)
    report("order", results=out, seconds=time.monotonic() - started)

    report("collectives", **check_collectives(shardwise.spark.run(collectives, args=(5,))))

    started = time.monotonic()
    try:
        shardwise.spark.run(fail_on, args=(1,), num_proc=2)
        report("failure", raised=None)
    except JobFailedError as exc:
        report("failure", raised="JobFailedError", rank=exc.rank, message=str(exc),
               seconds=time.monotonic() - started)

    started = time.monotonic()
    try:
        shardwise.spark.run(placement, num_proc=3)
        report("too_many", raised=None)
    except ConfigError as exc:
        report("too_many", raised="ConfigError", message=str(exc), seconds=time.monotonic() - started)

    out = shardwise.spark.run(placement, num_proc=2)
    report("after_failure", ranks=[r["rank"] for r in out], pids_differ=out[0]["pid"] != out[1]["pid"])

    from pyspark.ml.torch.distributor import TorchDistributor

    with shardwise.spark.worker_python(spark.sparkContext):
        out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(through_torch_distributor, 10.0)
    report("torch_distributor", result=out)

    import elastic_train

    # rank 1 SIGKILLs its Spark task's Python worker, then itself: Spark loses the task
    config = {"kill_rank": 1, "kill_parent": True, "final_size": 2,
              "stamp": os.path.join(tempfile.mkdtemp(), "killed_at")}
    started = time.monotonic()
    results = shardwise.spark.run_elastic(elastic_train.train, args=(config,), num_proc=2, min_num_proc=1,
                                          max_num_proc=2, discovery_interval=1.0, elastic_timeout=120,
                                          timeout=240)
    elastic_train.check_epochs(results[0]["log"])
    reference = elastic_train.replay(results[0]["log"])
    sizes = [w for _, w, _ in results[0]["log"]]
    report("elastic", sizes=[s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s],
           killed=os.path.exists(config["stamp"]), final_size=results[0]["size"],
           max_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(results[0]["params"], reference)),
           ranks_agree=all(all(np.array_equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
                           for r in results),
           resets=[r["resets"] for r in results], seconds=time.monotonic() - started)
    spark.stop()


if __name__ == "__main__":
    main()
