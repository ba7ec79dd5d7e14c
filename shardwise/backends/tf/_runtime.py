"""Start TensorFlow's collective runtime for the ``tf`` backend and describe its cluster.

The cluster comes from ``TF_CONFIG`` when it is set (TPU pods, Kubernetes, any
TF launcher: no MPI needed). Under mpirun/srun without ``TF_CONFIG``, every rank
picks a free port and mpi4py shares the ``host:port`` list, from which each rank
writes its ``TF_CONFIG`` (task index = MPI rank). A
``tf.distribute.MultiWorkerMirroredStrategy`` then configures the runtime
(collective leader, coordination service, gRPC server) exactly as TensorFlow
does for its own training, so the strategy and shardwise share one runtime.

TensorFlow accepts that configuration only before its first op (which
initialises the process's eager context for good). Programs written for Horovod
run ops between ``import shardwise.tensorflow`` and ``hvd.init()``, so with
``SHARDWISE_BACKEND=tf`` that import starts the runtime (:func:`start_if_requested`);
the runtime lives as long as the process, and every later ``init`` (also after a
``shutdown``) joins the same one.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Optional

from ...core.errors import BackendError
from ...core.launch_env import LaunchInfo, detect_launch, env_timeout
from .._network import free_port, host_address

__all__ = ["start", "start_if_requested", "cluster_devices", "collectives_enabled", "tf_started"]

#: Jobs whose tasks are ranks, in rank order (tf.distribute numbers the chief first).
_RANK_JOBS = ("chief", "worker")
_PORT_ATTEMPTS = 5

#: The strategy that configured this process's collective runtime. TensorFlow keeps one runtime per
#: process that cannot be configured twice, so its owner is process-wide too.
_RUNTIME: dict[str, Any] = {}


def _config_from_mpi(launch: LaunchInfo) -> dict[str, Any]:
    """``TF_CONFIG`` for this rank from an mpi4py exchange of (host, address, free port)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise BackendError(f"the tf backend under {launch.launcher} needs mpi4py to build TF_CONFIG, "
                           "or TF_CONFIG set in the environment") from None
    comm = MPI.COMM_WORLD
    endpoints: list[str] = []
    for _ in range(_PORT_ATTEMPTS):
        entries = comm.allgather((socket.gethostname(), host_address(), free_port()))
        one_host = len({name for name, _, _ in entries}) == 1
        endpoints = [f"{'localhost' if one_host else addr}:{port}" for _, addr, port in entries]
        if len(set(endpoints)) == len(endpoints):
            return {"cluster": {"worker": endpoints}, "task": {"type": "worker", "index": comm.Get_rank()}}
    raise BackendError(f"could not pick distinct worker ports after {_PORT_ATTEMPTS} attempts: {endpoints}")


def _parse_config(raw: str) -> tuple[dict[str, list[str]], str, int]:
    """(cluster, task type, task index) of a ``TF_CONFIG`` string."""
    try:
        config = json.loads(raw)
        cluster = {job: list(tasks) for job, tasks in config.get("cluster", {}).items()}
        task = config.get("task", {})
        return cluster, str(task["type"]), int(task.get("index", 0))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BackendError(f"TF_CONFIG is not a valid cluster description: {raw[:200]!r}") from None


def cluster_devices() -> tuple[int, list[str]]:
    """(this process's rank, host CPU device of every rank) from ``TF_CONFIG``; one local rank without it."""
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        return 0, ["/job:localhost/replica:0/task:0/device:CPU:0"]
    cluster, task_type, index = _parse_config(raw)
    ranks = [(job, i) for job in _RANK_JOBS for i in range(len(cluster.get(job, [])))]
    if (task_type, index) not in ranks:
        raise BackendError(f"TF_CONFIG task {task_type}:{index} is not a chief or worker of the cluster; "
                           "the tf backend runs on chief and worker tasks only")
    devices = [f"/job:{job}/replica:0/task:{i}/device:CPU:0" for job, i in ranks]
    return ranks.index((task_type, index)), devices


def collectives_enabled() -> bool:
    """True once this process joined a multi-worker collective runtime."""
    from tensorflow.python.eager import context  # no public equivalent

    ctx = context.context()
    return any(getattr(ctx, attr, None) is not None for attr in ("_collective_ops_server_def", "_server_def"))


def tf_started() -> bool:
    """True once TensorFlow initialised its eager context: any op, even listing devices, does it."""
    from tensorflow.python.eager import context  # no public equivalent

    return context.context()._context_handle is not None


def start_if_requested() -> bool:
    """Start the runtime now when ``SHARDWISE_BACKEND=tf`` and several ranks run (launcher or ``TF_CONFIG``).

    Called on import of :mod:`shardwise.tensorflow`, before the program's first
    TensorFlow op; collective on every rank. Returns True when it started the
    runtime. Does nothing once TensorFlow runs: ``init`` then explains the failure.
    """
    if os.environ.get("SHARDWISE_BACKEND", "").strip().lower() != "tf" or _RUNTIME:
        return False
    launch = detect_launch()
    if (launch.size <= 1 and not os.environ.get("TF_CONFIG", "").strip()) or tf_started():
        return False
    return bool(start(launch, env_timeout()))  # the timeout init would use, as init has not run yet


def start(launch: LaunchInfo, timeout: Optional[float] = None) -> dict[str, Any]:
    """Join the TF collective runtime of every rank (idempotent); returns engine state for the context.

    Must run before any TensorFlow op: TensorFlow configures collectives only at
    startup. Once started, the runtime keeps the strategy's ``timeout`` of its
    first start (shardwise's own collectives take the communicator's).
    """
    if _RUNTIME:
        return dict(_RUNTIME)
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw and launch.size <= 1:
        return {}
    if not raw:
        raw = json.dumps(_config_from_mpi(launch))
        os.environ["TF_CONFIG"] = raw
    _, devices = cluster_devices()
    if launch.size > 1 and len(devices) != launch.size:
        raise BackendError(f"TF_CONFIG describes {len(devices)} chief/worker tasks but {launch.launcher} "
                           f"runs {launch.size} ranks; unset TF_CONFIG to derive it from the MPI ranks")
    if len(devices) <= 1:
        return {}
    if tf_started():
        raise BackendError("TensorFlow already ran an op in this process, and its collective runtime can only "
                           "be configured before the first one: export SHARDWISE_BACKEND=tf and import "
                           "shardwise.tensorflow before any TensorFlow op (the import starts the runtime), or "
                           "call shardwise.init(backend='tf') first")
    import tensorflow as tf

    impl = tf.distribute.experimental.CommunicationImplementation.RING
    options = tf.distribute.experimental.CommunicationOptions(implementation=impl, timeout_seconds=timeout)
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except (RuntimeError, ValueError) as exc:
        raise BackendError(f"could not start TensorFlow's collective runtime ({exc}); shardwise.init("
                           "backend='tf') must run before any other TensorFlow op") from exc
    _RUNTIME["tf_strategy"] = strategy
    return dict(_RUNTIME)
