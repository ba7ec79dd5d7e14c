"""Pick a ``tf.distribute`` strategy for how the job was launched.

Order: a TPU if one is found, ``MultiWorkerMirroredStrategy`` when several ranks
run (``TF_CONFIG`` derived from the MPI ranks), ``MirroredStrategy`` for several
local GPUs, else the default strategy. Detection (:func:`detect`) is separate
from the decision (:func:`choose_strategy`) so the logic is testable without devices.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from ... import context as _context
from ...backends._network import free_port as _free_port
from ...backends._network import host_address as _address
from ...core.comm import Communicator
from ...core.errors import BackendError
from ...core.launch_env import detect_launch

__all__ = ["Detection", "StrategyChoice", "detect", "detect_tpu", "choose_strategy", "tf_config",
           "worker_endpoints", "strategy"]

#: How many times ranks re-pick ports when two workers of one host drew the same one.
_PORT_ATTEMPTS = 5


@dataclass(frozen=True)
class Detection:
    """What the strategy choice depends on."""

    tpu_resolver: Any = None
    world_size: int = 1
    local_gpus: int = 0

    @property
    def tpu_found(self) -> bool:
        return self.tpu_resolver is not None


@dataclass(frozen=True)
class StrategyChoice:
    """The chosen kind (``tpu``, ``multi_worker``, ``mirrored`` or ``default``) and why."""

    kind: str
    reason: str


def _default_tpu_resolver() -> Any:
    resolver_cls = tf.distribute.cluster_resolver.TPUClusterResolver
    try:
        return resolver_cls()  # TPU_NAME, a Cloud TPU node, or GCE metadata
    except ValueError:
        if os.path.exists("/dev/accel0"):  # a TPU VM: the chips are local
            return resolver_cls(tpu="local")
        raise


def detect_tpu(factory: Optional[Callable[[], Any]] = None) -> Any:
    """A ``TPUClusterResolver`` when a TPU is reachable, else ``None`` (never raises)."""
    try:
        resolver = (factory or _default_tpu_resolver)()
        if not resolver.master():
            return None
        return resolver
    except Exception:  # noqa: BLE001 - any failure means "no TPU here"
        return None


def detect(comm: Optional[Communicator] = None, *,
           tpu_factory: Optional[Callable[[], Any]] = None) -> Detection:
    """Probe for a TPU, the number of ranks and the local GPUs."""
    if comm is not None:
        world_size = comm.size
    elif _context.is_initialized():
        world_size = _context.current().world.size
    else:
        world_size = detect_launch().size
    gpus = len(tf.config.list_physical_devices("GPU"))
    return Detection(detect_tpu(tpu_factory), int(world_size), gpus)


def choose_strategy(found: Detection) -> StrategyChoice:
    """Decide the strategy kind from a :class:`Detection`."""
    if found.tpu_found:
        return StrategyChoice("tpu", "a TPU cluster resolver connected")
    if found.world_size > 1:
        return StrategyChoice("multi_worker", f"{found.world_size} ranks")
    if found.local_gpus > 1:
        return StrategyChoice("mirrored", f"{found.local_gpus} local GPUs")
    return StrategyChoice("default", "one process, at most one GPU, no TPU")


def tf_config(rank: int, endpoints: Sequence[str]) -> dict[str, Any]:
    """The ``TF_CONFIG`` of worker ``rank`` in a cluster of ``endpoints`` (``host:port``)."""
    if not 0 <= rank < len(endpoints):
        raise BackendError(f"rank {rank} is outside a cluster of {len(endpoints)} workers")
    return {"cluster": {"worker": list(endpoints)}, "task": {"type": "worker", "index": int(rank)}}


def worker_endpoints(entries: Sequence[tuple[str, str, int]]) -> list[str]:
    """``host:port`` per rank from (hostname, address, port); ``localhost`` when all share one host."""
    single_host = len({name for name, _, _ in entries}) == 1
    return [f"{'localhost' if single_host else addr}:{port}" for _, addr, port in entries]


def _exchange_endpoints(comm: Communicator) -> list[str]:
    """Every rank picks a free port on its host; the communicator shares (host, address, port)."""
    for _ in range(_PORT_ATTEMPTS):
        entries = comm.allgather_object((socket.gethostname(), _address(), _free_port()))
        endpoints = worker_endpoints(entries)
        if len(set(endpoints)) == len(endpoints):
            return endpoints
    raise BackendError(f"could not pick distinct worker ports after {_PORT_ATTEMPTS} attempts: {endpoints}")


def _check_given_tf_config(raw: str, world_size: int) -> None:
    """A user's ``TF_CONFIG`` is kept, but it must describe as many tasks as there are ranks."""
    try:
        cluster = json.loads(raw).get("cluster", {})
        tasks = sum(len(cluster[job]) for job in cluster if job not in ("ps", "evaluator"))
    except (ValueError, AttributeError, TypeError):
        raise BackendError(f"TF_CONFIG is set but is not a valid cluster description: {raw[:200]!r}") from None
    if tasks != world_size:
        raise BackendError(f"TF_CONFIG describes {tasks} tasks but {world_size} ranks run; unset TF_CONFIG "
                           "to let shardwise derive it from the MPI ranks")


def strategy(detection: Optional[Detection] = None, *, comm: Optional[Communicator] = None) -> Any:
    """Build the ``tf.distribute`` strategy that fits this job (see the module docstring).

    For several ranks shardwise must be initialised; call this early, before other
    TensorFlow work, since ``MultiWorkerMirroredStrategy`` must configure the runtime.
    The tf.distribute strategies reduce gradients themselves: use them instead of,
    not together with, DistributedOptimizer / DistributedGradientTape.
    """
    found = detection if detection is not None else detect(comm)
    choice = choose_strategy(found)
    if choice.kind == "tpu":
        tf.config.experimental_connect_to_cluster(found.tpu_resolver)
        tf.tpu.experimental.initialize_tpu_system(found.tpu_resolver)
        return tf.distribute.TPUStrategy(found.tpu_resolver)
    if choice.kind == "multi_worker":
        comm = comm if comm is not None else _context.current().world
        if "TF_CONFIG" in os.environ:
            _check_given_tf_config(os.environ["TF_CONFIG"], comm.size)
        else:
            os.environ["TF_CONFIG"] = json.dumps(tf_config(comm.rank, _exchange_endpoints(comm)))
        return tf.distribute.MultiWorkerMirroredStrategy()
    if choice.kind == "mirrored":
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()
