"""``shardwise.spark.run_elastic``: an elastic job on Spark tasks, as Horovod's ``horovod.spark.run_elastic``.

Each worker is a Spark job of one task that runs its rank in a child process; the
driver (this process) hosts the rendezvous and decides the generations
(:class:`~shardwise.elastic.driver.ElasticDriver`, shared with Ray). A worker whose
process dies, or whose task Spark loses, is dropped: the others go on from their
last commit, and a replacement task is submitted while the job is below
``max_num_proc`` and resets are left. Workers beyond Spark's free slots wait in
Spark's queue and join when they start.
"""

from __future__ import annotations

import queue
import sys
import threading
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

from ..core.errors import ConfigError, JobFailedError
from ..elastic.driver import ElasticDriver, Ended, check_sizes
from ._task import RankProcess, TaskSpec, child_env
from .runner import active_context, max_concurrent_tasks, worker_python

__all__ = ["run_elastic"]


def _one_worker(spec: TaskSpec, rendezvous: dict[str, str]) -> Callable[[Iterator[Any]], Iterator[tuple]]:
    """The function of a worker's single Spark task: run the rank, hand back its outcome."""

    def run_partition(_: Iterator[Any]) -> Iterator[tuple]:
        proc = RankProcess(spec, child_env(spec, rendezvous))
        try:
            proc.proc.wait()
            yield proc.outcome()
        finally:
            proc.cleanup()

    return run_partition


class _SparkPool:
    """The driver's workers as single-task Spark jobs, each submitted from its own thread."""

    def __init__(self, sc: Any, spec: TaskSpec) -> None:
        self.sc, self.spec = sc, spec
        self.tag = uuid.uuid4().hex[:12]
        self.done: "queue.Queue[Ended | JobFailedError]" = queue.Queue()
        self.cancelled: set[str] = set()

    def _group(self, worker: str) -> str:
        return f"shardwise-{self.tag}-{worker}"

    def launch(self, worker: str, env: dict[str, str]) -> None:
        threading.Thread(target=self._job, args=(worker, env), name=f"shardwise-spark-{worker}",
                         daemon=True).start()

    def _job(self, worker: str, env: dict[str, str]) -> None:
        import cloudpickle

        self.sc.setJobGroup(self._group(worker), f"shardwise elastic worker {worker}", interruptOnCancel=True)
        try:
            [(status, value, rank)] = self.sc.parallelize([0], 1).mapPartitions(_one_worker(self.spec, env)).collect()
        except Exception as exc:  # noqa: BLE001 - the task itself was lost (or cancelled by kill)
            if worker not in self.cancelled:
                self.done.put(Ended(worker, True, f"its Spark task failed: {str(exc)[:2000]}"))
            return
        if status == "ok":
            self.done.put(Ended(worker, False, cloudpickle.loads(value)))
        elif status in ("lost", "peer_failed"):
            self.done.put(Ended(worker, True, value))
        else:
            self.done.put(JobFailedError(rank, value))

    def ended(self, timeout: float) -> list[Ended]:
        out = []
        try:
            item = self.done.get(timeout=timeout)
            while True:
                if isinstance(item, JobFailedError):
                    raise item
                out.append(item)
                item = self.done.get_nowait()
        except queue.Empty:
            return out

    def kill(self, worker: str) -> None:
        self.cancelled.add(worker)
        self.sc.cancelJobGroup(self._group(worker))


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: float = 600,
                elastic_timeout: float = 600, reset_limit: Optional[int] = None,
                env: Optional[dict[str, str]] = None, discovery_interval: float = 5.0,
                timeout: Optional[float] = None) -> list:
    """Run ``fn(*args, **kwargs)`` as an elastic job of Spark tasks; the final workers' results in rank order.

    ``fn`` trains inside ``hvd.elastic.run`` (see docs/elastic.md). The job starts
    with ``num_proc`` workers (Spark's default parallelism), goes on while at least
    ``min_num_proc`` live, and grows back up to ``max_num_proc``, starting at most
    ``reset_limit`` replacements (3 when not given). ``elastic_timeout`` bounds how
    long a worker waits for its place after a change; ``timeout`` the whole job.
    """
    import cloudpickle

    sc = active_context()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    low, high = check_sizes(num_proc, min_num_proc, max_num_proc, elastic=True)
    slots = max_concurrent_tasks(sc, wait=float(start_timeout))
    if num_proc > slots:
        raise ConfigError(f"shardwise.spark.run_elastic starts {num_proc} processes but this Spark cluster runs "
                          f"at most {slots} tasks at once ({sc.master}): the first generation would never form. "
                          f"Use num_proc <= {slots} (max_num_proc may be larger: those wait for free slots).")
    spec = TaskSpec(call=cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))), secret="",
                    env=dict(env or {}), python_path=list(sys.path), start_timeout=float(elastic_timeout))
    driver = ElasticDriver(_SparkPool(sc, spec), sc.getConf().get("spark.driver.host"), num_proc, elastic=True,
                           min_workers=low, max_workers=high, discovery_interval=discovery_interval,
                           max_failures=3 if reset_limit is None else reset_limit, start_timeout=start_timeout,
                           timeout=float("inf") if timeout is None else timeout, env=env, engine="Spark")
    with worker_python(sc):
        return driver.run()
