"""What one Spark task does for :func:`shardwise.spark.run`: place itself, start its rank, report.

The tasks of a job run in one barrier stage. They exchange their executor hosts
(``allGather``); ranks are numbered host by host (hosts in the order of their first
task, tasks by partition within a host), so that ``local_rank`` / ``local_size``
count the ranks of one machine. Task 0 serves the job's rendezvous store
(secret-protected, as for Ray) and publishes the ranks. Each task then runs its rank
as a child Python process with the rendezvous in its environment, waits for it,
and hands back ``(rank, pickled result)``. A rank that fails marks the job failed
in the store; the other tasks stop their ranks at once instead of leaving them in
a collective that will never complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from ..backends.rendezvous import ADDR_ENV, ID_ENV, SECRET_ENV, Membership, StoreServer
from ..backends.rendezvous.store import StoreClient

#: Surrounds the failure record in a task's exception, so the driver can find it in Spark's message.
FAILURE_OPEN, FAILURE_CLOSE = "<<shardwise-failure>>", "<<end-shardwise-failure>>"
_ABORT_KEY = "job/failed"
_POLL = 0.2
_ECHO_GRACE = 5.0


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped from the driver in the task's closure."""

    call: bytes                    # cloudpickle of (fn, args, kwargs)
    secret: str
    env: dict[str, str]            # the user's env plus what the backend needs
    python_path: Sequence[str]     # the driver's sys.path, put first on the ranks' PYTHONPATH
    start_timeout: float


class RankFailed(RuntimeError):
    """Raised by a task whose rank failed (or that stopped because another rank failed)."""

    def __init__(self, rank: int, traceback_text: str) -> None:
        record = json.dumps({"rank": rank, "traceback": traceback_text})
        super().__init__(f"shardwise rank {rank} failed {FAILURE_OPEN}{record}{FAILURE_CLOSE}")


def rank_order(hosts: Sequence[str]) -> list[int]:
    """Rank of each task (by partition index) when ranks are numbered host by host."""
    first: dict[str, int] = {}
    for i, h in enumerate(hosts):
        first.setdefault(h, i)
    order = sorted(range(len(hosts)), key=lambda i: (first[hosts[i]], i))
    ranks = [0] * len(hosts)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def child_env(spec: TaskSpec, rendezvous: dict[str, str]) -> dict[str, str]:
    """The environment of one rank's process: this task's, the job's, and ``rendezvous``."""
    env = dict(os.environ)
    env.update(spec.env)
    paths = [p for p in spec.python_path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["SHARDWISE_ELASTIC_TIMEOUT"] = str(spec.start_timeout)
    env.update(rendezvous)
    return env


class RankProcess:
    """One rank's child process, its files and its outcome."""

    def __init__(self, spec: TaskSpec, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="shardwise-spark-")
        self.call_path = os.path.join(self.dir, "call.pkl")
        self.result_path = os.path.join(self.dir, "result.pkl")
        with open(self.call_path, "wb") as f:
            f.write(spec.call)
        self.proc = subprocess.Popen([sys.executable, "-m", "shardwise.spark._child", self.call_path, self.result_path],
                                     env=env)

    def outcome(self) -> tuple[str, Any, int]:
        """``(status, value, rank)`` once the process has ended.

        ``("ok", pickled result)``, ``("failed", traceback text)`` when the function
        raised (``"peer_failed"`` when because another rank went away), or
        ``("lost", why)`` when the process died without a result.
        """
        import cloudpickle

        if not os.path.exists(self.result_path):
            return "lost", (f"its process ended with exit code {self.proc.returncode} and no result "
                            "(killed, or out of memory?)"), -1
        with open(self.result_path, "rb") as f:
            ok, value, rank, peer_lost = cloudpickle.loads(f.read())
        if ok:
            return "ok", cloudpickle.dumps(value), rank
        return ("peer_failed" if peer_lost else "failed"), value, rank

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)  # a rank killed mid-write leaves result.pkl.tmp too


@contextlib.contextmanager
def task_store(spec: TaskSpec, ctx: Any) -> Iterator[tuple[int, list[str], str, Optional[StoreServer]]]:
    """In a barrier task: (partition, every task's executor host, the job store's host:port, the store if
    this task serves it). Task 0 opens the secret-protected store and closes it when its task ends."""
    part = ctx.partitionId()
    hosts = [info.address.rpartition(":")[0] for info in ctx.getTaskInfos()]
    server = StoreServer(spec.secret, host=hosts[part]) if part == 0 else None
    try:
        addr = ctx.allGather(f"{hosts[0]}:{server.port}" if server else "")[0]
        yield part, hosts, addr, server
    finally:
        if server is not None:
            server.close()


def barrier_partition(spec: TaskSpec) -> Any:
    """The function a barrier stage maps over its partitions (one per rank)."""

    def run_partition(_: Iterator[Any]) -> Iterator[tuple[int, bytes]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        with task_store(spec, ctx) as (part, hosts, addr, server):
            ranks = rank_order(hosts)
            worker_ids = [f"t{p}" for p in range(len(hosts))]
            if server is not None:
                by_rank = sorted(range(len(hosts)), key=lambda p: ranks[p])
                Membership(server).publish([worker_ids[p] for p in by_rank])
            yield from _run_rank(spec, ctx, ranks[part], worker_ids[part], addr)

    return run_partition


def _run_rank(spec: TaskSpec, ctx: Any, rank: int, worker_id: str, addr: str) -> Iterator[tuple[int, bytes]]:
    host, _, port = addr.rpartition(":")
    control = StoreClient(host, int(port), spec.secret, timeout=spec.start_timeout)
    proc = RankProcess(spec, child_env(spec, {ADDR_ENV: addr, SECRET_ENV: spec.secret, ID_ENV: worker_id}))
    try:
        failed = _wait(proc, control)
        if failed is not None:
            raise RankFailed(*failed)
        status, value, _ = proc.outcome()
        if status != "ok":
            raise RankFailed(*_first_failure(control, rank, value, secondary=status == "peer_failed"))
        ctx.barrier()  # task 0 keeps the store up until every rank is done with it
        yield rank, value
    finally:
        proc.cleanup()
        control.close()


def _first_failure(control: StoreClient, rank: int, text: str, secondary: bool) -> tuple[int, str]:
    """Record this rank's failure unless one is recorded already; the job's first failure.

    A rank that failed only because another went away first gives that rank's
    failure a moment to be recorded, so the driver hears the cause, not its echo.
    """
    if secondary:
        deadline = time.monotonic() + _ECHO_GRACE
        while time.monotonic() < deadline and not control.check([_ABORT_KEY]):
            time.sleep(_POLL)
    first = control.compare_set(_ABORT_KEY, b"", json.dumps([rank, text]).encode())
    recorded_rank, recorded_text = json.loads(first)
    return recorded_rank, recorded_text


def _wait(proc: RankProcess, control: StoreClient) -> Optional[tuple[int, str]]:
    """Wait for the rank's process; (rank, traceback) of another rank if the job failed first."""
    while proc.proc.poll() is None:
        try:
            if control.check([_ABORT_KEY]):
                rank, text = json.loads(control.get(_ABORT_KEY, timeout=1.0))
                proc.kill()
                return rank, text
        except (ConnectionError, OSError):
            proc.kill()  # task 0 is gone: its rank failed and its task ended
            return -1, "the task serving the job's rendezvous (rank 0) ended"
        time.sleep(_POLL)
    return None

