"""The process's distributed context: the one piece of module-level state in shardwise.

:func:`init` builds a :class:`Context` (backend, world communicator, rank layout)
and stores it in ``_STATE``; :func:`shutdown` releases it. Everything else takes
communicators explicitly and only falls back to ``current().world``.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from .backends import check_backend, create, engine
from .backends._device_binding import BIND_ENV, bind_local_device  # noqa: F401 - BIND_ENV: kept importable from here
from .backends.rendezvous import endpoint_from_env
from .core.comm import Communicator
from .core.errors import BackendError, ConfigError, NotInitializedError
from .core.launch_env import LaunchInfo, detect_launch
from .core.launch_env import env_stall_timeout as _env_stall_timeout
from .core.launch_env import env_timeout as _env_timeout

__all__ = ["Context", "init", "shutdown", "is_initialized", "current", "resolve_backend", "abort_connections",
           "bind_local_device"]


@dataclass
class Context:
    """Initialised distributed state of this process."""

    backend: str
    world: Communicator
    launch: LaunchInfo
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    #: Extra engine state owned by the context (e.g. a torch process group to destroy).
    owned: dict[str, Any] = field(default_factory=dict)
    #: Comm/compute accounting of the world's collectives (``None`` unless monitoring is on).
    monitor: Optional[Any] = None
    #: Called (last registered first) at :func:`shutdown`, before the world is freed.
    closers: list[Any] = field(default_factory=list)


class _State:
    """Holder of the current :class:`Context` (``None`` before :func:`init`).

    ``elastic_generation`` is the last generation of an elastic job this process
    was part of (-1 before the first): it outlives :func:`shutdown`, so that the
    next :func:`init` asks the driver for a newer one.
    """

    context: Optional[Context] = None
    previous_excepthook: Any = None
    atexit_registered = False
    elastic_generation = -1


_STATE = _State()


def resolve_backend(backend: Optional[str], launch: LaunchInfo) -> str:
    """The backend to use: the argument, else ``SHARDWISE_BACKEND``, else detected from the launcher."""
    name = backend if backend not in (None, "auto") else os.environ.get("SHARDWISE_BACKEND", "auto")
    name = name.strip().lower()
    if name != "auto":
        check_backend(name)
        return name
    if launch.size <= 1:
        return "local"
    if launch.launcher == "torchrun":
        check_backend("torch")
        return "torch"
    if launch.launcher == "horovodrun":
        check_backend("horovod")
        return "horovod"
    try:
        check_backend("mpi")
    except BackendError as exc:
        raise BackendError(f"launched by {launch.launcher} with {launch.size} ranks, but the 'mpi' "
                           f"backend cannot run: {exc}") from None
    return "mpi"


def abort_connections(ctx: Context) -> None:
    """Close every torch process group's connections now, so that peers blocked on this rank fail fast.

    Used when an elastic job lost a rank: objects the user keeps (an optimizer's
    communicator) would otherwise keep the old group, and its sockets, alive.
    """
    if ctx.owned.get("torch_process_group"):
        from .backends.torch.engine import abort_groups

        abort_groups()


def _joined(generation: int) -> None:
    """Remember the elastic generation this process joined (the next init asks for a newer one)."""
    _STATE.elastic_generation = generation


def _node_layout(world: Communicator) -> tuple[int, int, int, int]:
    """(local_rank, local_size, cross_rank, cross_size) from every rank's host name."""
    hosts = world.allgather_object(socket.gethostname())
    me = hosts[world.rank]
    local = [r for r, h in enumerate(hosts) if h == me]
    nodes = list(dict.fromkeys(hosts))
    return local.index(world.rank), len(local), nodes.index(me), len(nodes)


def _abort_on_exception(world: Communicator) -> None:
    """Make an unhandled exception on any rank end the whole job instead of a hang."""
    previous = sys.excepthook

    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        sys.stderr.write(f"[shardwise rank {world.rank}/{world.size}] unhandled exception, aborting the job:\n")
        traceback.print_exception(exc_type, exc, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        world.abort(1)

    _STATE.previous_excepthook = previous
    sys.excepthook = hook


def _want_check(check: Optional[bool], timeout: Optional[float]) -> tuple[bool, int]:
    """(wrap the world in a CheckedCommunicator?, check every N-th call) from arguments and env."""
    every_raw = os.environ.get("SHARDWISE_CHECK_EVERY", "1").strip() or "1"
    if not every_raw.isdigit() or int(every_raw) < 1:
        raise ConfigError(f"SHARDWISE_CHECK_EVERY={every_raw!r} must be a positive integer")
    if check is None:
        raw = os.environ.get("SHARDWISE_CHECK", "").strip().lower()
        if raw in ("1", "true", "yes", "on"):
            check = True
        elif raw in ("0", "false", "no", "off"):
            check = False
        elif raw:
            raise ConfigError(f"SHARDWISE_CHECK={raw!r}: expected 1 or 0")
        else:
            check = timeout is not None  # a timeout needs the arrival handshake to name missing ranks
    return check, int(every_raw)


def init(backend: Optional[str] = None, *, timeout: Optional[float] = None, check: Optional[bool] = None,
         monitor: Optional[bool] = None, abort_on_exception: bool = True, stall_timeout: Optional[float] = None,
         **backend_options: Any) -> Context:
    """Initialise shardwise for this process and return the :class:`Context`.

    ``backend`` is ``"auto"`` (default: from ``SHARDWISE_BACKEND`` or the launcher),
    ``"mpi"``, ``"torch"``, ``"horovod"``, ``"tf"`` (TensorFlow collective ops; init before any
    other TensorFlow op) or ``"local"``. ``timeout`` (seconds, default
    ``SHARDWISE_TIMEOUT``) bounds every wait. ``check`` wraps the world in a
    :class:`~shardwise.backends.checked.CheckedCommunicator` (default: ``SHARDWISE_CHECK``,
    else on exactly when a timeout is set, so that a timeout names the missing ranks).
    ``monitor`` times every collective against compute (default: on when
    ``SHARDWISE_MONITOR=1`` or ``SHARDWISE_TIMELINE=trace.json`` is set; the
    timeline is written at :func:`shutdown`).
    ``stall_timeout`` (seconds, default ``SHARDWISE_STALL_TIMEOUT``; off when unset) keeps a
    flight recorder of each communicator's last 32 collectives and, when one has not finished
    within that time, makes every rank print its Python stacks and rings and names the ranks
    that never reached it (:mod:`shardwise.backends.stall_watch`).
    Calling it again returns the existing context if the backend matches.
    """
    timeout = _env_timeout() if timeout is None else timeout
    stall_timeout = _env_stall_timeout() if stall_timeout is None else stall_timeout
    if stall_timeout is not None and not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
        raise ConfigError(f"stall_timeout must be positive seconds, got {stall_timeout!r}")
    check, every = _want_check(check, timeout)
    endpoint = endpoint_from_env()
    elastic = endpoint is not None
    launch = detect_launch()
    name = resolve_backend(backend if backend not in (None, "auto") or not elastic else "torch", launch)
    if elastic and name != "torch":
        raise BackendError(f"an elastic job runs on the 'torch' backend, not {name!r}")
    if _STATE.context is not None:
        if _STATE.context.backend != name:
            raise BackendError(f"shardwise is already initialised with backend "
                               f"{_STATE.context.backend!r}; call shutdown() before init({name!r})")
        return _STATE.context
    if elastic:
        from .backends.torch import init_elastic

        launch, owned = init_elastic(endpoint, _STATE.elastic_generation, timeout, _joined)
        abort_on_exception = False  # a failing worker leaves; the others go on without it
    else:
        owned = engine(name).init(launch, timeout)
    world = create(name, timeout=timeout, **backend_options) if name != "local" else create(name)
    if launch.size > 1 and world.size != launch.size:
        raise BackendError(f"{launch.launcher} announced {launch.size} ranks but the {name} backend sees "
                           f"{world.size}: is mpi4py built against the MPI that launched the job?")
    local_rank, local_size, cross_rank, cross_size = _node_layout(world)
    if name not in ("torch", "tf"):  # the torch paths bound their device before their group existed
        bind_local_device(local_rank)
    if name == "mpi":
        from .backends.mpi import attach_device_route

        owned.update(attach_device_route(world, timeout, local_size))
    if check and world.size > 1:
        from .backends.checked import CheckedCommunicator

        world = CheckedCommunicator(world, every=every, timeout=timeout)
    if stall_timeout is not None and world.size > 1:
        from .backends.recorded import RecordedCommunicator
        from .backends.stall_watch import StallWatch

        owned["stall_watch"] = StallWatch.for_world(world, stall_timeout)
        world = RecordedCommunicator(world, owned["stall_watch"])
    comm_monitor = None
    if monitor or (monitor is None and (os.environ.get("SHARDWISE_MONITOR", "") in ("1", "true", "on")
                                        or os.environ.get("SHARDWISE_TIMELINE"))):
        from .backends.monitored import MonitoredCommunicator
        from .core.monitor import CommMonitor

        comm_monitor = CommMonitor(rank=world.rank)
        world = MonitoredCommunicator(world, comm_monitor)
    ctx = Context(name, world, launch, local_rank, local_size, cross_rank, cross_size, owned, comm_monitor)
    if "stall_watch" in owned:
        ctx.closers.insert(0, owned["stall_watch"].close)  # closers run last first: the watch stops last
    _STATE.context = ctx
    if abort_on_exception and world.size > 1:
        _abort_on_exception(world)
    if not _STATE.atexit_registered:
        atexit.register(shutdown)
        _STATE.atexit_registered = True
    return ctx


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _STATE.context is not None


def current() -> Context:
    """The current context; raises :class:`NotInitializedError` before :func:`init`."""
    if _STATE.context is None:
        raise NotInitializedError("shardwise is not initialised: call shardwise.init() first")
    return _STATE.context


def shutdown() -> None:
    """Release the context (and the torch process group it created). Idempotent."""
    ctx = _STATE.context
    if ctx is None:
        return
    _STATE.context = None
    if _STATE.previous_excepthook is not None:
        sys.excepthook = _STATE.previous_excepthook
        _STATE.previous_excepthook = None
    for close in reversed(ctx.closers):
        close()
    ctx.world.free()
    if ctx.monitor is not None:
        ctx.monitor.close()
    # Objects still holding engine work (autograd hooks, handles) must go before the
    # process group: torch aborts at exit otherwise ("terminate called without an
    # active exception").
    gc.collect()
    if ctx.owned.get("horovod"):
        from .backends.horovod import shutdown_engine

        shutdown_engine()
    if ctx.owned.get("torch_process_group"):
        import torch.distributed as dist

        if dist.is_initialized():
            if ctx.owned.get("elastic") is not None:
                abort_connections(ctx)
            dist.destroy_process_group()
    if ctx.owned.get("elastic") is not None:
        ctx.owned["elastic"].close()
