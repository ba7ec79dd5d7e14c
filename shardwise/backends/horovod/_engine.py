"""Horovod engine plumbing for the ``horovod`` backend: init, process sets, handles, wire dtypes.

Horovod matches operations across ranks by *name*, runs sub-group operations on
*process sets* (created collectively by every process of the job, with
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` set before ``hvd.init()``) and completes them
through integer handles (``poll``/``synchronize``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ...core.comm import Handle
from .._handles import PollingHandle
from ...core.errors import BackendError, ConfigError
from ...core.launch_env import LaunchInfo

try:
    import torch
    import horovod.torch as hvd
    from horovod.common.process_sets import ProcessSet, _temp_process_set_object
    from horovod.torch.mpi_ops import _basics
except ImportError as exc:  # pragma: no cover - exercised only without Horovod
    raise BackendError("the 'horovod' backend needs Horovod built with PyTorch support: "
                       f"run bash scripts/horovod/build.sh ({exc})") from exc

__all__ = ["hvd", "init", "shutdown_engine", "HorovodHandle", "ThenHandle", "Engine", "as_torch", "publish",
           "to_wire", "from_wire", "divide", "p2p_max"]

#: torch dtypes Horovod's torch ops accept natively (bfloat16 is not among them).
_NATIVE = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                     torch.float16, torch.float32, torch.float64})


def init(launch: Optional[LaunchInfo] = None, timeout: Optional[float] = None) -> dict[str, Any]:
    """``hvd.init()`` with dynamic process sets; returns what the context owns.

    Horovod reads its ranks from its own launcher and has no start timeout: ``launch``
    and ``timeout`` are the signature every backend's ``init`` shares.
    """
    if hvd.is_initialized():
        return {}
    # Sub-groups are Horovod process sets added after init: that needs this flag at init time.
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init()
    return {"horovod": True}


def shutdown_engine() -> None:
    """Stop Horovod's background thread once every rank gets here (idempotent).

    One rank's ``hvd.shutdown()`` shuts Horovod down on every rank, so a rank that
    finishes early (e.g. outside a sub-group still at work) waits for the others.
    """
    if hvd.is_initialized():
        if hvd.size() > 1:
            try:
                hvd.barrier()
            except hvd.HorovodInternalError:
                pass  # another rank already failed: nothing left to wait for
        hvd.shutdown()


def HorovodHandle(what: str, handles: list[int], finish: Callable[[list[Any]], Any],  # noqa: N802
                  default_timeout: Optional[float] = None, keepalive: Any = None) -> Handle:
    """Horovod handles in flight, as a :class:`PollingHandle`; ``finish`` turns their outputs into the result."""
    outputs: list[Any] = []

    def wait_all() -> None:
        if outputs:
            return
        try:
            outputs.extend(hvd.synchronize(h) for h in handles)
        except hvd.HorovodInternalError as exc:
            raise BackendError(f"horovod {what} failed: {exc}") from exc

    def result() -> Any:
        wait_all()  # after polling, synchronize() returns at once and yields the outputs
        return finish(outputs)

    return PollingHandle(what, wait_all, lambda: all(hvd.poll(h) for h in handles), result,
                         default_timeout, keepalive=keepalive)


class ThenHandle(Handle):
    """A handle whose result is ``then(inner result)``."""

    def __init__(self, inner: Handle, then: Callable[[Any], Any]) -> None:
        self._inner, self._then = inner, then
        self._done, self._result = False, None

    def done(self) -> bool:
        return self._done or self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done:
            self._result, self._done = self._then(self._inner.wait(timeout)), True
        return self._result


def p2p_max() -> int:
    """Largest job whose pair process sets (for send/recv) are made at start-up."""
    raw = os.environ.get("SHARDWISE_HOROVOD_P2P_MAX", "16").strip()
    if not raw.isdigit():
        raise ConfigError(f"SHARDWISE_HOROVOD_P2P_MAX={raw!r} must be a non-negative integer")
    return int(raw)


def as_torch(x: Any) -> tuple[Any, bool]:
    """A torch view of a numpy array or torch tensor, and whether it was numpy."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)), True
    if isinstance(x, torch.Tensor):
        return x.detach(), False
    raise TypeError(f"unsupported tensor type {type(x).__name__}; the horovod backend takes numpy arrays "
                    "and torch tensors")


def publish(tensor: Any, t: Any, result: Any, was_np: bool) -> Any:
    """Write ``result`` into the caller's ``tensor`` (``t`` is its torch view) and return it."""
    if was_np:
        np.copyto(tensor, result.numpy(), casting="unsafe")
    elif result.data_ptr() != t.data_ptr() or result.dtype != t.dtype:
        t.copy_(result)
    return tensor


def divide(t: Any, size: int) -> Any:
    """In-place average over ``size`` ranks (floor division for integers)."""
    return t.div_(size) if t.is_floating_point() else t.floor_divide_(size)


def to_wire(t: Any, reduce: bool) -> Any:
    """A contiguous CPU tensor of a dtype Horovod takes (bfloat16: float32 to reduce, int16 bits to move)."""
    w = t.detach()
    if w.device.type != "cpu":
        w = w.cpu()
    w = w.contiguous()
    if w.dtype in _NATIVE:
        return w
    if w.dtype == torch.bfloat16:
        return w.float() if reduce else w.view(torch.int16)
    if w.dtype == torch.bool and not reduce:
        return w.view(torch.uint8)
    raise TypeError(f"the horovod backend cannot {'reduce' if reduce else 'move'} tensors of dtype {w.dtype}")


def from_wire(w: Any, like: Any) -> Any:
    """Undo :func:`to_wire`: ``like``'s dtype and device."""
    if w.dtype != like.dtype:
        w = w.view(like.dtype) if w.element_size() == like.element_size() and not w.is_floating_point() \
            else w.to(like.dtype)
    return w if w.device == like.device else w.to(like.device)


class Engine:
    """Per-process Horovod state shared by the world and its sub-communicators."""

    def __init__(self) -> None:
        if not hvd.is_initialized():
            raise BackendError("Horovod is not initialised; call shardwise.init(backend='horovod')")
        self.rank, self.size = hvd.rank(), hvd.size()
        self.pairs: dict[tuple[int, int], ProcessSet] = {}
        self.pairs_missing = (f"they are made at start-up for jobs of up to SHARDWISE_HOROVOD_P2P_MAX ranks "
                              f"(default 16), and this job has {self.size}")

    def process_set(self, members: Sequence[int]) -> ProcessSet:
        """The process set of these global ranks (made if new). Collective over the whole job."""
        ranks = sorted(int(r) for r in members)
        if ranks == list(range(self.size)):
            return hvd.global_process_set
        for set_id, existing in _basics._get_process_set_ids_and_ranks().items():
            if list(existing) == ranks:
                ps = _temp_process_set_object(set_id)
                ps.ranks = ranks
                return ps
        try:
            return hvd.add_process_set(ranks)
        except (ValueError, RuntimeError) as exc:
            raise BackendError(
                f"horovod could not add a process set of ranks {ranks}: {exc}. Sub-groups need "
                "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init(); shardwise.init(backend='horovod') "
                "sets it, a hvd.init() of your own must too") from exc

    def make_pairs(self) -> None:
        """Create the process set of every pair of ranks (send/recv run on them). Collective."""
        try:
            for a in range(self.size):
                for b in range(a + 1, self.size):
                    self.pairs[(a, b)] = self.process_set([a, b])
        except BackendError as exc:  # e.g. hvd.init() was called without dynamic process sets
            self.pairs.clear()
            self.pairs_missing = f"they could not be made: {exc}"

    def pair(self, a: int, b: int) -> ProcessSet:
        """The two-rank process set of global ranks ``a`` and ``b``."""
        key = (min(a, b), max(a, b))
        if key not in self.pairs:
            raise NotImplementedError(
                "send/recv on the horovod backend run as a two-rank alltoall on a process set of the "
                "pair, and Horovod creates process sets only collectively over the whole job: "
                f"{self.pairs_missing}. Use the mpi or torch backend for point-to-point plans "
                "(pipeline parallelism).")
        return self.pairs[key]
