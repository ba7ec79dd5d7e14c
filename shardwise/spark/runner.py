"""``shardwise.spark.run``: a training function on Spark tasks, as Horovod's ``horovod.spark.run``.

The job is one barrier stage of ``num_proc`` tasks, so Spark starts every rank at
once or none. Each task runs its rank in a fresh Python process with shardwise's
rendezvous in the environment (served by task 0, secret-protected), so
``shardwise.init()`` / ``hvd.init()`` inside ``fn`` joins the job on the torch
backend (gloo; NCCL when the ranks have GPUs). The results come back in rank order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

from ..backends.rendezvous import new_secret
from ..core.errors import ConfigError, JobFailedError
from ._mpi import mpi_partition
from ._task import FAILURE_CLOSE, FAILURE_OPEN, TaskSpec, barrier_partition

__all__ = ["run", "active_context", "max_concurrent_tasks", "worker_python"]

_LOG = logging.getLogger("shardwise.spark")
BACKENDS = {"gloo": "torch", "mpi": "mpi"}
#: What each task of the barrier stage runs, by backend (mpi: one mpirun, see ``_mpi``).
PARTITIONS = {"gloo": barrier_partition, "mpi": mpi_partition}


def active_context() -> Any:
    """The running ``SparkContext``; a clear error when there is none."""
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ConfigError("shardwise.spark needs pyspark: pip install 'shardwise[spark]' "
                          "(and a Java runtime, e.g. apt-get install openjdk-17-jre-headless)") from None
    sc = SparkContext._active_spark_context
    if sc is None:
        raise ConfigError("shardwise.spark needs a running Spark session: create one first, e.g. "
                          "SparkSession.builder.master('local[2]').getOrCreate()")
    return sc


def max_concurrent_tasks(sc: Any, wait: float = 0.0) -> int:
    """How many tasks Spark can run at the same time (executor cores / task CPUs).

    Executors register after the session starts: while none has, this waits up to
    ``wait`` seconds for the first. It does not wait for more than the cluster has.
    """
    jsc = sc._jsc.sc()
    deadline = time.monotonic() + wait
    while True:
        slots = int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
        if slots > 0 or time.monotonic() >= deadline:
            return slots
        time.sleep(0.25)


@contextlib.contextmanager
def worker_python(sc: Any) -> Iterator[str]:
    """Run the Spark Python work submitted inside this block with the driver's Python.

    Spark starts its Python workers with ``PYSPARK_PYTHON`` (or ``spark.pyspark.python``),
    else ``python3`` from the executor's PATH, which need not have the driver's
    packages. Where neither is set, the jobs submitted here use this interpreter,
    so the workers import what the driver imports. A configured Python is kept.
    """
    configured = os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python", None)
    if configured:
        yield configured
        return
    saved = sc.pythonExec
    sc.pythonExec = sys.executable
    try:
        yield sys.executable
    finally:
        sc.pythonExec = saved


def _failure(exc: BaseException) -> Optional[JobFailedError]:
    """The rank failure recorded in a Spark job's exception, if it is one of ours."""
    text = str(exc)
    start = text.find(FAILURE_OPEN)
    if start < 0:
        return None
    end = text.find(FAILURE_CLOSE, start)
    record = json.loads(text[start + len(FAILURE_OPEN):end])
    return JobFailedError(record["rank"], record["traceback"])


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: float = 600, env: Optional[dict[str, str]] = None,
        backend: str = "gloo", verbose: int = 1) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks as one shardwise job; results in rank order.

    ``num_proc`` defaults to Spark's default parallelism. ``fn`` calls
    ``shardwise.init()`` (or ``hvd.init()``) itself. ``env`` is added to every rank's
    environment. A job that asks for more tasks than Spark can run at once fails at
    once (:class:`ConfigError`); a rank that raises fails the job with its traceback
    (:class:`JobFailedError`).
    """
    import cloudpickle

    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r} for shardwise.spark.run; known: {sorted(BACKENDS)}")
    sc = active_context()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ConfigError(f"num_proc must be a positive integer, got {num_proc!r}")
    slots = max_concurrent_tasks(sc, wait=float(start_timeout))
    if num_proc > slots:
        raise ConfigError(f"shardwise.spark.run asked for {num_proc} processes but this Spark cluster runs at "
                          f"most {slots} tasks at once ({sc.master}): a barrier job would wait for slots "
                          f"that never come. Use num_proc <= {slots}, or give Spark more executor cores.")
    spec = TaskSpec(call=cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))), secret=new_secret(),
                    env={**(env or {}), "SHARDWISE_BACKEND": BACKENDS[backend]},
                    python_path=list(sys.path), start_timeout=float(start_timeout))
    group = f"shardwise-{uuid.uuid4().hex[:12]}"
    if verbose:
        _LOG.info("shardwise.spark.run: %d processes on %s (job group %s)", num_proc, sc.master, group)
    sc.setJobGroup(group, f"shardwise job of {num_proc} processes", interruptOnCancel=True)
    try:
        with worker_python(sc):
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(PARTITIONS[backend](spec))
            pairs = rdd.collect()
    except Exception as exc:  # noqa: BLE001 - Spark wraps a rank's failure in its own exception types
        failure = _failure(exc)
        if failure is None:
            raise
        raise failure from None
    finally:
        sc.cancelJobGroup(group)
    return [cloudpickle.loads(data) for _, data in sorted(pairs, key=lambda p: p[0])]
