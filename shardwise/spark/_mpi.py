"""``shardwise.spark.run(..., backend="mpi")``: one ``mpirun`` whose processes all live inside Spark tasks.

As Horovod's ``horovod.spark.run`` with MPI: the tasks of one barrier stage find
their hosts, task 0 serves the job's store (secret-protected, as for the gloo path)
and runs ``mpirun`` with one slot per task, host by host. Where a host other than
task 0's takes part, ``mpirun`` starts its daemon through an rsh agent
(:mod:`shardwise.spark._mpi_rsh`) instead of ssh: the agent puts the command in the
store, and the first task on that host runs it as its own child and puts back its
exit code. So every MPI process descends from a Spark task and dies with it. Where
task 0's host is the only one, ``mpirun`` starts the ranks itself and no agent runs.

Each rank runs :func:`rank_main`: it takes ``(fn, args, kwargs)``
from the store, runs it with ``SHARDWISE_BACKEND=mpi`` and puts its pickled result
under ``result/<rank>``; task 0 hands every result back. A rank that raises records
``(rank, traceback)`` once in the store and exits without finalising MPI, which
makes ``mpirun`` stop the job; every task then fails with that record, which the
driver raises as :class:`~shardwise.core.errors.JobFailedError`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from ..backends.rendezvous.store import StoreClient
from ..core.errors import ConfigError, RendezvousError
from ..cli.launch import launch_env
from ._task import RankFailed, TaskSpec, child_env, task_store

__all__ = ["mpi_partition", "rank_main", "mpirun_command", "rank_hosts", "STORE_ENV", "SECRET_ENV", "TASK_ENV",
           "TASK_PID_ENV", "HOSTS_ENV"]

#: The store's ``host:port`` and the job's secret, in the environment of mpirun, the agent and the ranks.
STORE_ENV, SECRET_ENV = "SHARDWISE_SPARK_STORE", "SHARDWISE_SPARK_SECRET"
#: The partition and pid of the Spark task whose process tree holds this process (mpirun's or a daemon's).
TASK_ENV, TASK_PID_ENV = "SHARDWISE_SPARK_TASK", "SHARDWISE_SPARK_TASK_PID"
#: The name mpirun uses for each task's host, comma-separated by partition, in place of Spark's
#: executor addresses (set in ``run(env=...)``): for clusters where MPI must reach the hosts by
#: other names or networks than Spark's; the tests use it to let one machine play two hosts.
HOSTS_ENV = "SHARDWISE_SPARK_MPI_HOSTS"

CALL_KEY, HOSTS_KEY, STARTED_KEY = "mpi/call", "mpi/hosts", "mpi/started"
FAILED_KEY, END_KEY, ACK_KEY = "job/failed", "job/end", "job/acks"
_POLL = 0.1
#: What each rank runs (``-c``: ``-m`` would warn, the package having imported this module already).
#: It asks to die with its launcher first (PR_SET_PDEATHSIG), before the slow imports.
RANK_MAIN = ("import sys\nif sys.platform.startswith('linux'):\n    import ctypes\n    ctypes.CDLL(None).prctl(1, 9)\n"
             "from shardwise.spark._mpi import rank_main\nsys.exit(rank_main())")
_GRACE = 3.0  # after a rank's failure, how long mpirun gets to stop the job before it is killed


def result_key(rank: int) -> str:
    """Store key of one rank's pickled result."""
    return f"result/{rank}"


def rsh_key(host_index: int, what: str) -> str:
    """Store key of the agent exchange for one host: ``cmd``, ``exit`` or ``kill``."""
    return f"rsh/{host_index}/{what}"


def rank_hosts(spec: TaskSpec, spark_hosts: Sequence[str]) -> list[str]:
    """The host of each task (by partition): Spark's executor addresses, or :data:`HOSTS_ENV`'s list."""
    override = spec.env.get(HOSTS_ENV, "").strip()
    if not override:
        return list(spark_hosts)
    hosts = [h.strip() for h in override.split(",")]
    if len(hosts) != len(spark_hosts) or not all(hosts):
        raise ConfigError(f"{HOSTS_ENV}={override!r} must name one host per task ({len(spark_hosts)})")
    return hosts


def slots_by_host(hosts: Sequence[str]) -> list[tuple[str, int]]:
    """(host, number of tasks) in the order of each host's first task."""
    counts: dict[str, int] = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    return list(counts.items())


def mpirun_command(python: str, slots: Sequence[tuple[str, int]], mpirun: str = "mpirun") -> list[str]:
    """The ``mpirun`` command line: ranks host by host (task 0's host first), daemons via the agent.

    With one host only, the ranks are started by mpirun itself (``localhost``: task 0
    runs mpirun there) and no agent is named.
    """
    total = sum(n for _, n in slots)
    cmd = [mpirun, "-np", str(total), "--map-by", "slot", "--bind-to", "none"]
    if len(slots) == 1:
        cmd += ["--host", f"localhost:{total}"]
    else:
        cmd += ["--host", ",".join(f"{h}:{n}" for h, n in slots),
                "--prtemca", "plm_ssh_agent", f"{python} -m shardwise.spark._mpi_rsh",
                "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    return cmd + [python, "-c", RANK_MAIN]


def _set_pdeathsig() -> None:
    """In a child before exec: be killed when the Spark task's process ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop a process started in its own session, and everything in its process group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
    proc.wait()


def task_env(spec: TaskSpec, part: int, addr: str) -> dict[str, str]:
    """The environment of mpirun or a daemon started in task ``part`` (and so of its ranks)."""
    env = launch_env(child_env(spec, {STORE_ENV: addr, SECRET_ENV: spec.secret, TASK_ENV: str(part),
                                      TASK_PID_ENV: str(os.getpid()), "SHARDWISE_BACKEND": "mpi"}))
    env.pop(HOSTS_ENV, None)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir])
    return env


@dataclass
class _TaskState:
    """What one task runs and watches until the job ends."""

    store: StoreClient
    part: int
    host_index: Optional[int]            # the host whose daemon this task starts (first task of a host)
    mpirun: Optional[subprocess.Popen] = None
    mpirun_err: Optional[str] = None     # file with mpirun's stderr (task 0)
    daemon: Optional[subprocess.Popen] = None
    failed_at: Optional[float] = None
    start_timeout: float = 600.0
    started_at: float = 0.0
    command: Optional[list[str]] = None  # mpirun's command line and environment (task 0)
    env: Optional[dict[str, str]] = None
    launches: int = 0


def mpi_partition(spec: TaskSpec) -> Any:
    """The function a barrier stage maps over its partitions for the mpi backend."""

    def run_partition(_: Iterator[Any]) -> Iterator[tuple[int, bytes]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        with task_store(spec, ctx) as (part, spark_hosts, addr, _):
            yield from _run_task(spec, ctx, part, rank_hosts(spec, spark_hosts), addr)

    return run_partition


def _run_task(spec: TaskSpec, ctx: Any, part: int, hosts: list[str], addr: str) -> Iterator[tuple[int, bytes]]:
    host, _, port = addr.rpartition(":")
    store = StoreClient(host, int(port), spec.secret, timeout=spec.start_timeout)
    slots = slots_by_host(hosts)
    names = [h for h, _ in slots]
    first_task = hosts.index(hosts[part]) == part
    # Task 0 serves its host too, in case mpirun does not take that name for its own host.
    state = _TaskState(store, part, names.index(hosts[part]) if first_task else None,
                       start_timeout=spec.start_timeout, started_at=time.monotonic())
    env = task_env(spec, part, addr)
    try:
        if part == 0:
            store.set(CALL_KEY, spec.call)
            store.set(HOSTS_KEY, json.dumps(names).encode())
            mpirun = shutil.which("mpirun", path=env["PATH"]) or "mpirun"
            state.command, state.env = mpirun_command(sys.executable, slots, mpirun), env
            _start_mpirun(state)
        outcome = _watch(state, env, len(hosts))
        if outcome is not None:
            raise RankFailed(*outcome)
        ctx.barrier()  # task 0 keeps the store up until every task has seen the job end
        if part == 0:
            for rank in range(len(hosts)):
                yield rank, store.get(result_key(rank), timeout=1.0)
    finally:
        for proc in (state.mpirun, state.daemon):
            if proc is not None:
                _kill_tree(proc)
        if state.mpirun_err is not None:
            _echo_and_remove(state.mpirun_err)
        store.close()


#: Open MPI giving up before it starts any process, when PMIx cannot start its listener thread (seen
#: now and then on a busy machine); nothing ran, so mpirun is started again, at most _LAUNCH_TRIES times.
_LAUNCH_FAILED = "The PMIx server's listener thread failed to start"
_LAUNCH_TRIES = 3


def _start_mpirun(state: _TaskState) -> None:
    """Task 0: start (or start again) mpirun, its stderr in a fresh file."""
    if state.mpirun_err is not None:
        _echo_and_remove(state.mpirun_err)
    fd, state.mpirun_err = tempfile.mkstemp(prefix="shardwise-mpirun-", suffix=".err")
    with os.fdopen(fd, "wb") as err:
        state.mpirun = subprocess.Popen(state.command, env=state.env, stderr=err, preexec_fn=_set_pdeathsig,
                                        start_new_session=True)
    state.launches += 1


def _launcher_gave_up(state: _TaskState) -> bool:
    """mpirun ended before starting anything, for a reason worth one more try (:data:`_LAUNCH_FAILED`)."""
    return (state.launches < _LAUNCH_TRIES and int(state.store.add(STARTED_KEY, 0)) == 0
            and _LAUNCH_FAILED in _tail(state.mpirun_err))


def _echo_and_remove(path: str) -> None:
    """Copy mpirun's stderr to the task's (the executor log), then drop the file."""
    try:
        with open(path, "rb") as f:
            sys.stderr.write(f.read().decode(errors="replace"))
            sys.stderr.flush()
        os.remove(path)
    except OSError:
        pass


def _tail(path: Optional[str], lines: int = 30) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _failure(store: StoreClient) -> Optional[tuple[int, str]]:
    if store.check([FAILED_KEY]):
        rank, text = json.loads(store.get(FAILED_KEY, timeout=1.0))
        return int(rank), text
    return None


def _record_failure(store: StoreClient, rank: int, text: str) -> tuple[int, str]:
    """Record (rank, traceback) as the job's failure unless one is recorded already; the one kept."""
    kept = store.compare_set(FAILED_KEY, b"", json.dumps([rank, text]).encode())
    found, found_text = json.loads(kept)
    return int(found), found_text


def _watch(state: _TaskState, env: dict[str, str], num_tasks: int) -> Optional[tuple[int, str]]:
    """Run this task's part of the job until it ends; None on success, else (rank, traceback)."""
    store = state.store
    while True:
        try:
            if state.host_index is not None:
                _serve_agent(state, env)
            if state.part == 0:
                ended, failure = _watch_mpirun(state, num_tasks)
                if ended:
                    return failure
            elif store.check([END_KEY]):
                failure = _failure(store)
                if failure is not None:
                    store.add(ACK_KEY, 1)
                return failure
        except (RendezvousError, ConnectionError, OSError):
            return -1, "the task running mpirun (task 0) ended before the job did"
        time.sleep(_POLL)


def _watch_mpirun(state: _TaskState, num_tasks: int) -> tuple[bool, Optional[tuple[int, str]]]:
    """Task 0: (job ended?, (rank, traceback) of its failure or None)."""
    store, proc = state.store, state.mpirun
    assert proc is not None
    rc = proc.poll()
    failure = _failure(store)
    if rc is None and failure is None and time.monotonic() - state.started_at > state.start_timeout:
        started = int(store.add(STARTED_KEY, 0))
        if started < num_tasks:
            failure = _record_failure(store, -1, f"only {started} of {num_tasks} ranks started within "
                                                 f"start_timeout={state.start_timeout:g} s; mpirun's last "
                                                 f"output:\n{_tail(state.mpirun_err)}")
            state.failed_at = time.monotonic() - 2 * _GRACE  # nothing to wait for: stop mpirun now
    if rc is None:
        if failure is None or not _failed_long_ago(state):
            return False, None
        _kill_tree(proc)  # a rank failed and mpirun has not stopped the others in time
        rc = proc.returncode
    if failure is None and rc == 0:
        missing = [r for r in range(num_tasks) if not store.check([result_key(r)])]
        if not missing:
            store.set(END_KEY, b"ok")
            return True, None
        failure = _record_failure(store, -1, f"mpirun ended (exit code 0) without the results of ranks {missing}")
    elif failure is None and _launcher_gave_up(state):
        _start_mpirun(state)
        return False, None
    elif failure is None:
        failure = _record_failure(store, -1, f"mpirun ended with exit code {rc} before any rank reported a "
                                             f"failure; its last output:\n{_tail(state.mpirun_err)}")
    store.set(END_KEY, b"failed")
    deadline = time.monotonic() + 2.0  # let the other tasks read the failure before the store closes
    while time.monotonic() < deadline and int(store.add(ACK_KEY, 0)) < num_tasks - 1:
        time.sleep(_POLL)
    return True, failure


def _serve_agent(state: _TaskState, env: dict[str, str]) -> None:
    """First task of a host: run the daemon command mpirun's agent sent for it; report its exit code."""
    store, i = state.store, state.host_index
    assert i is not None
    if state.daemon is None:
        if store.check([rsh_key(i, "cmd")]):
            command = store.get(rsh_key(i, "cmd"), timeout=1.0).decode()
            state.daemon = subprocess.Popen(["/bin/sh", "-c", command], env=env, stdin=subprocess.DEVNULL,
                                            preexec_fn=_set_pdeathsig, start_new_session=True)
        return
    if state.daemon.returncode is not None:
        return
    if store.check([rsh_key(i, "kill")]) or (store.check([FAILED_KEY]) and _failed_long_ago(state)):
        _kill_tree(state.daemon)
    rc = state.daemon.poll()
    if rc is not None:
        store.set(rsh_key(i, "exit"), str(rc).encode())


def _failed_long_ago(state: _TaskState) -> bool:
    """Whether the job's failure was first seen by this task more than the grace period ago."""
    if state.failed_at is None:
        state.failed_at = time.monotonic()
    return time.monotonic() - state.failed_at > _GRACE


def _rank() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    raise RuntimeError("shardwise.spark._mpi runs as an MPI rank started by mpirun (no OMPI_COMM_WORLD_RANK)")


def _exit_when_job_ends(host: str, port: int, secret: str) -> None:
    """Rank thread: end this process if the job ends or its store goes while the rank still runs.

    The job ends (task 0 sets ``job/end``) only after mpirun has exited, so a rank still
    running then lost its launcher (mpirun or a daemon killed before the rank could
    tie its life to it) and would otherwise stay behind.
    """
    try:
        client = StoreClient(host, port, secret, connect_timeout=5.0)
        while not client.check([END_KEY]):
            time.sleep(1.0)
    except Exception:  # noqa: BLE001 - the store is gone: task 0 ended, and the job with it
        pass
    os._exit(1)


def rank_main() -> int:
    """One MPI rank: run the job's call, put the result (or the failure) in the store."""
    import cloudpickle

    from ._child import _die_with_parent

    _die_with_parent()
    rank = _rank()
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    store = StoreClient(host, int(port), os.environ[SECRET_ENV], connect_timeout=5.0)  # up before mpirun
    threading.Thread(target=_exit_when_job_ends, args=(host, int(port), os.environ[SECRET_ENV]),
                     name="shardwise-spark-job-watch", daemon=True).start()
    store.add(STARTED_KEY, 1)
    try:
        fn, args, kwargs = cloudpickle.loads(store.get(CALL_KEY))
        data = cloudpickle.dumps(fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - every failure goes back to the driver with its traceback
        _record_failure(store, rank, traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # without MPI_Finalize: mpirun stops the other ranks at once
    store.set(result_key(rank), data)
    store.close()
    try:
        from .. import context

        context.shutdown()
    except Exception:  # noqa: BLE001 - the result is in the store; a failing teardown must not lose it
        pass
    return 0

