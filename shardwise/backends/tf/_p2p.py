"""Point-to-point messages for the ``tf`` backend, built from two-member broadcasts.

TensorFlow's collective ops have no send/recv. A message from rank ``s`` to rank
``d`` with tag ``t`` is a broadcast in a two-member engine group keyed by
(communicator, ``s``, ``d``, ``t``); its instance key counts that stream's
messages, so messages with one tag arrive in order and tags do not block each
other, as in MPI. Each transfer blocks its own thread until the peer joins, so
a send completes only once the matching recv is posted (a synchronous send).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from ...core.comm import CompletedHandle, Handle
from ...core.errors import CollectiveTimeoutError
from ._values import finish, is_numpy, to_numpy
from ._wire import decode_rows, derive_key, encode_rows

if TYPE_CHECKING:  # pragma: no cover
    from .communicator import TFCommunicator

__all__ = ["ThreadHandle", "start_send", "start_recv"]


class ThreadHandle(Handle):
    """A transfer running on its own thread; :meth:`wait` joins it."""

    def __init__(self, what: str, run: Callable[[], Any], timeout: Optional[float]) -> None:
        self._what, self._timeout = what, timeout
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, args=(run,), daemon=True, name=f"shardwise {what}")
        self._thread.start()

    def _main(self, run: Callable[[], Any]) -> None:
        try:
            self._result = run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Any:
        timeout = self._timeout if timeout is None else timeout
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CollectiveTimeoutError(f"{self._what} did not complete within {timeout:g} s: the peer "
                                         "never posted the matching call")
        if self._error is not None:
            raise self._error
        return self._result


def _stream(comm: "TFCommunicator", src: int, dst: int, tag: int) -> tuple[int, int]:
    """(group key, instance key) of the next message from ``src`` to ``dst`` with ``tag``."""
    with comm._lock:
        seq = comm._p2p.get((src, dst, tag), 0) + 1
        comm._p2p[(src, dst, tag)] = seq
    return derive_key(comm.group_key, "p2p", src, dst, tag), seq


def start_send(comm: "TFCommunicator", tensor: Any, dest: int, tag: int) -> Handle:
    """Start sending ``tensor`` (copied now, so the caller may reuse it) to ``dest``."""
    if dest == comm.rank:
        raise ValueError("send: the tf backend cannot send a message to its own rank")
    is_numpy(tensor)
    wire = encode_rows(np.array(to_numpy(tensor)).reshape(1, -1))[0]
    if wire.size == 0:  # the receiver's buffer is empty too: nothing moves
        return CompletedHandle(None)
    key, inst = _stream(comm, comm.rank, dest, tag)
    value = tf.constant(wire)

    def run() -> None:
        comm._engine(f"send to rank {dest}", lambda: collective_ops.broadcast_send_v2(
            value, 2, key, inst, **comm._kw()))

    return ThreadHandle(f"send to rank {dest}", run, comm.timeout)


def start_recv(comm: "TFCommunicator", tensor: Any, source: int, tag: int) -> Handle:
    """Start receiving into ``tensor`` (a numpy array or ``tf.Variable``) from ``source``."""
    if source == comm.rank:
        raise ValueError("recv: the tf backend cannot receive a message from its own rank")
    was_numpy = is_numpy(tensor, inplace=True)
    template = to_numpy(tensor)
    wire = encode_rows(np.zeros((1, template.size), template.dtype))[0]
    if wire.size == 0:
        return CompletedHandle(tensor)
    key, inst = _stream(comm, source, comm.rank, tag)

    def run() -> Any:
        got = comm._engine(f"recv from rank {source}", lambda: collective_ops.broadcast_recv_v2(
            [wire.size], tf.as_dtype(wire.dtype), 2, key, inst, **comm._kw()))
        value = decode_rows(got.numpy().reshape(1, -1), template.dtype, template.size)
        return finish(tensor, was_numpy, value.reshape(template.shape), True)

    return ThreadHandle(f"recv from rank {source}", run, comm.timeout)
