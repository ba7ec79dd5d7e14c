"""The ``tf`` backend: collectives on TensorFlow's collective ops, the engine of tf.distribute.

It runs wherever ``MultiWorkerMirroredStrategy`` runs, MPI or not (TPU pods,
Kubernetes with ``TF_CONFIG``); :func:`shardwise.init` with ``backend="tf"``
starts the runtime (see :mod:`._runtime`). Every rank's collectives run on
its host CPU device. How the interface maps onto the engine:

* allreduce: ``CollectiveReduceV2`` (ring) for float16/bfloat16/float32/float64/
  int32/int64; average is a sum divided afterwards (floor division for
  integers); other dtypes are allgathered and reduced locally.
* allgather: ranks first share their row counts, then gather rows padded to the
  longest (the engine needs equal shapes). alltoall: ``CollectiveAllToAllV2`` on
  blocks padded to the largest. reduce_scatter: a full allreduce, then this
  rank's rows (twice the traffic of a true reduce-scatter).
* send/recv: the engine has no point-to-point op, so a message is a broadcast in
  a two-member group keyed by (sender, receiver, tag); it runs on a thread, and
  a send completes once the receiver has posted its recv (a synchronous send).
* ``*_async`` collectives complete before they return (the engine runs them
  eagerly, also when called while a TF1 graph is the default, as Horovod's tests
  do in their graph-mode pass); their handles are already done.
* Inputs: numpy arrays, TF tensors, ``tf.Variable``. TF tensors are immutable,
  so ``inplace=True`` and recv buffers need a numpy array or a variable.
* Errors in the engine are final for the process (TensorFlow aborts its
  collective executor): a timeout raises :class:`CollectiveTimeoutError` once,
  and later collectives fail too.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ...core.comm import CompletedHandle, Communicator, Handle, ReduceOp, split_sizes
from ...core.errors import BackendError, CollectiveTimeoutError, ShapeMismatchError
from .._arrays import alltoall_rows
from .._group import GroupMember, split_groups
from ._wire import KEY_HIGH, REDUCE_DTYPES, decode_rows, derive_key, encode_rows, reduce_stack, signature

try:
    import tensorflow as tf
    from tensorflow.python.eager import context as tf_context  # eager_mode(): no public equivalent
    from tensorflow.python.ops import collective_ops  # the ops tf.distribute is built on
except ImportError as exc:  # pragma: no cover
    raise BackendError("the 'tf' backend needs TensorFlow: pip install tensorflow") from exc

from ._p2p import start_recv, start_send  # noqa: E402 - these import TensorFlow too
from ._runtime import cluster_devices, collectives_enabled  # noqa: E402
from ._values import finish, is_numpy, to_numpy  # noqa: E402

_MERGE = {ReduceOp.SUM: "Add", ReduceOp.AVERAGE: "Add", ReduceOp.PRODUCT: "Mul",
          ReduceOp.MIN: "Min", ReduceOp.MAX: "Max"}
_HINT = "ring"


def _eager(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` with eager execution on: under ``context.graph_mode()`` the engine's ops would only be
    added to the default graph, and ranks whose calls then fail or pass unevenly fall out of step."""
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with tf_context.eager_mode():
            return method(*args, **kwargs)

    return run


class TFCommunicator(GroupMember, Communicator):
    """A :class:`Communicator` over TensorFlow collective ops; the world group by default."""

    backend = "tf"

    @_eager
    def __init__(self, *, timeout: Optional[float] = None) -> None:
        me, devices = cluster_devices()
        if len(devices) > 1 and not collectives_enabled():
            raise BackendError("TensorFlow's collective runtime is not running in this process: "
                               "call shardwise.init(backend='tf') before any TensorFlow op")
        self._setup(devices, list(range(len(devices))), me, None, timeout)

    @classmethod
    def _group(cls, devices: list[str], members: list[int], world_rank: int, key: int,
               timeout: Optional[float]) -> "TFCommunicator":
        comm = cls.__new__(cls)
        comm._setup(devices, members, world_rank, key, timeout)
        return comm

    def _setup(self, devices: list[str], members: list[int], world_rank: int, key: Optional[int],
               timeout: Optional[float]) -> None:
        self._devices, self._members = devices, members
        self._world_rank, self._rank, self._size = world_rank, members.index(world_rank), len(members)
        self._device = devices[world_rank]
        self.timeout = timeout
        self._instance = self._splits = 0
        self._p2p: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()
        self._key = key or 0
        self._tf_pos = list(range(self._size))  # engine group rank of each of our ranks
        if self._size > 1:
            self._key = key if key is not None else self._world_key()
            self._tf_pos = self._engine_order()

    @property
    def group_key(self) -> int:
        """The engine's group key of this communicator."""
        return self._key

    # -- engine plumbing -------------------------------------------------------------------------
    def _engine(self, what: str, run: Callable[[], Any]) -> Any:
        try:
            with tf.device(self._device):
                return run()
        except tf.errors.DeadlineExceededError as exc:
            raise CollectiveTimeoutError(f"{what} did not complete within {self.timeout} s: at least one "
                                         "rank never joined it (or a peer task failed)") from exc
        except tf.errors.OpError as exc:
            first = str(exc.message).strip().splitlines()[0][:400]
            if "hape mismatch" in first:
                raise ShapeMismatchError(f"{what}: ranks passed different shapes ({first})") from exc
            raise BackendError(f"{what} failed in TensorFlow's collective runtime: {first}") from exc

    def _next(self) -> int:
        self._instance += 1
        if self._instance >= KEY_HIGH:
            raise BackendError("this communicator ran 2**31 collectives; create a new one with split()")
        return self._instance

    def _kw(self) -> dict[str, Any]:
        return {"communication_hint": _HINT, "timeout": float(self.timeout or 0)}

    def _world_key(self) -> int:
        """A fresh key per world: rank 0's random nonce, summed in a fixed bootstrap group."""
        nonce = int.from_bytes(os.urandom(6), "big") if self._rank == 0 else 0
        boot = derive_key("shardwise-tf-boot", self._size)
        got = self._engine("tf backend start-up", lambda: collective_ops.all_reduce_v2(
            tf.constant([nonce, 1], tf.int64), self._size, boot, 1, merge_op="Add", final_op="Id",
            **self._kw())).numpy().tolist()
        if got[1] != self._size:
            raise BackendError(f"{got[1]} ranks joined the tf backend's start-up, expected {self._size}")
        return derive_key("shardwise-tf-world", got[0])

    def _engine_order(self) -> list[int]:
        """Where each of our ranks sits in the engine's group order (it sorts by task)."""
        inst = self._next()
        got = self._engine("group set-up", lambda: collective_ops.all_gather_v2(
            tf.constant([self._world_rank], tf.int64), self._size, self._key, inst, **self._kw()))
        order = [int(r) for r in got.numpy()]
        if sorted(order) != sorted(self._members):
            raise BackendError(f"group members {self._members} but the engine formed {order}")
        return [order.index(m) for m in self._members]

    def _ours(self, table: np.ndarray) -> np.ndarray:
        """Rows in engine group order -> rows in our rank order."""
        return table if self._tf_pos == list(range(self._size)) else table[self._tf_pos]

    def _gather_equal(self, flat: np.ndarray) -> np.ndarray:
        """(size, n) table of every rank's equal-length 1-D ``flat`` (n > 0), in our rank order."""
        inst = self._next()
        got = self._engine("allgather", lambda: collective_ops.all_gather_v2(
            tf.constant(flat), self._size, self._key, inst, **self._kw()))
        return self._ours(got.numpy().reshape(self._size, -1))

    def _gather_arrays(self, arr: np.ndarray, same_shape: bool = False) -> list[np.ndarray]:
        """Every rank's ``arr`` (first dims may differ unless ``same_shape``), in rank order."""
        arr = np.ascontiguousarray(arr).reshape(arr.shape or (1,))
        trailing, width = arr.shape[1:], int(np.prod(arr.shape[1:], dtype=np.int64))
        wire = encode_rows(arr.reshape(1, -1))[0]
        if same_shape:
            rows, lengths = [arr.shape[0]] * self._size, [wire.size] * self._size
        else:
            meta = self._gather_equal(np.array([arr.shape[0], wire.size, signature(trailing, arr.dtype.name)],
                                               np.int64))
            if len(set(meta[:, 2].tolist())) > 1:
                seen = self.allgather_object((tuple(trailing), arr.dtype.name))
                detail = ", ".join(f"rank {r}: trailing shape {s} {d}" for r, (s, d) in enumerate(seen))
                raise ShapeMismatchError(f"allgather: ranks disagree on trailing shape or dtype ({detail})")
            rows, lengths = meta[:, 0].tolist(), meta[:, 1].tolist()
        longest = max(lengths)
        if longest == 0:  # the engine crashes on empty gathers; every rank skips alike
            pieces = [wire[:0]] * self._size
        else:
            padded = np.zeros(longest, wire.dtype)
            padded[: wire.size] = wire
            table = self._gather_equal(padded)
            pieces = [table[i, :n] for i, n in enumerate(lengths)]
        return [decode_rows(p.reshape(1, -1), arr.dtype, n * width).reshape((n,) + trailing)
                for p, n in zip(pieces, rows)]

    def _check_peer(self, peer: int, what: str) -> int:
        if not 0 <= int(peer) < self._size:
            raise ValueError(f"{what}: rank {peer} is out of range for a group of size {self._size}")
        return int(peer)

    # -- reductions ----------------------------------------------------------------------------------
    def _reduce(self, t: tf.Tensor, op: ReduceOp) -> Any:
        if t.dtype.name not in REDUCE_DTYPES:  # allgather, then reduce here
            stack = np.stack(self._gather_arrays(t.numpy(), same_shape=True))
            return reduce_stack(stack.reshape((self._size,) + tuple(t.shape)), op.value, self._size)
        if t.shape.num_elements() == 0:
            return tf.identity(t)
        inst = self._next()
        y = self._engine("allreduce", lambda: collective_ops.all_reduce_v2(
            t, self._size, self._key, inst, merge_op=_MERGE[op], final_op="Id", **self._kw()))
        if op is ReduceOp.AVERAGE:
            y = y / self._size if y.dtype.is_floating else tf.math.floordiv(y, tf.cast(self._size, y.dtype))
        return y

    @_eager
    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                        inplace: bool = False, name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        was_numpy = is_numpy(tensor, inplace)
        t = tf.convert_to_tensor(tensor)
        result = t if self._size == 1 else self._reduce(t, op)
        return CompletedHandle(finish(tensor, was_numpy, result, inplace))

    @_eager
    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        op = ReduceOp.parse(op)
        was_numpy = is_numpy(tensor)
        t = tf.convert_to_tensor(tensor)
        if t.shape.rank == 0:
            raise ShapeMismatchError("reduce_scatter needs a tensor with at least one dimension")
        rows = split_sizes(int(t.shape[0]), self._size)
        start = sum(rows[: self._rank])
        full = t if self._size == 1 else self._reduce(t, op)
        return CompletedHandle(finish(tensor, was_numpy, full[start: start + rows[self._rank]], False))

    # -- data movement ---------------------------------------------------------------------------------
    @_eager
    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        was_numpy = is_numpy(tensor)
        arr = to_numpy(tensor)
        arr = arr.reshape(arr.shape or (1,))
        result = arr.copy() if self._size == 1 else np.concatenate(self._gather_arrays(arr, same_shape=uniform))
        return CompletedHandle(finish(tensor, was_numpy, result, False))

    @_eager
    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        was_numpy = is_numpy(tensor, inplace)
        root = self._check_peer(root, "broadcast")
        arr = to_numpy(tensor)
        result = arr.copy()
        if self._size > 1 and arr.size:  # empty tensors: every rank skips alike
            wire = encode_rows(arr.reshape(1, -1))[0]
            inst = self._next()
            if self._rank == root:
                self._engine("broadcast", lambda: collective_ops.broadcast_send_v2(
                    tf.constant(wire), self._size, self._key, inst, **self._kw()))
            else:
                got = self._engine("broadcast", lambda: collective_ops.broadcast_recv_v2(
                    [wire.size], tf.as_dtype(wire.dtype), self._size, self._key, inst, **self._kw()))
                result = decode_rows(got.numpy().reshape(1, -1), arr.dtype, arr.size).reshape(arr.shape)
        return CompletedHandle(finish(tensor, was_numpy, result, inplace))

    @_eager
    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       recv_splits: Optional[Sequence[int]] = None, name: Optional[str] = None) -> Handle:
        was_numpy = is_numpy(tensor)
        arr = to_numpy(tensor)
        send = alltoall_rows(tuple(arr.shape), splits, self._size)
        if self._size == 1:
            return CompletedHandle(finish(tensor, was_numpy, arr.copy(), False))
        counts = self._gather_equal(np.array(send, np.int64))  # counts[i, j]: rows rank i sends to rank j
        recv = counts[:, self._rank].tolist()
        most, trailing = int(counts.max()), arr.shape[1:]
        width = int(np.prod(trailing, dtype=np.int64))
        if most == 0 or width == 0:
            result = np.zeros((sum(recv),) + trailing, arr.dtype)
        else:
            padded = np.zeros((self._size, most) + trailing, arr.dtype)
            for j, block in enumerate(np.split(arr, np.cumsum(send)[:-1])):
                padded[self._tf_pos[j], : block.shape[0]] = block
            wire = encode_rows(padded.reshape(self._size, -1))
            inst = self._next()
            got = self._engine("alltoall", lambda: collective_ops.all_to_all_v2(
                tf.constant(wire), self._size, self._key, inst, **self._kw()))
            rows = decode_rows(self._ours(got.numpy().reshape(self._size, -1)), arr.dtype, most * width)
            rows = rows.reshape((self._size, most) + trailing)
            result = np.concatenate([rows[i, :n] for i, n in enumerate(recv)])
        return CompletedHandle(finish(tensor, was_numpy, result, False))

    # -- point to point ----------------------------------------------------------------------------------
    @_eager
    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        return start_send(self, tensor, self._check_peer(dest, "send"), int(tag))

    @_eager
    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return start_recv(self, tensor, self._check_peer(source, "recv"), int(tag))

    # -- control -----------------------------------------------------------------------------------------
    @_eager
    def barrier(self) -> None:
        if self._size > 1:
            self._reduce(tf.constant([1], tf.int32), ReduceOp.SUM)

    @_eager
    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional["TFCommunicator"]:
        groups = split_groups(self, color, key, ranks)
        self._splits += 1
        for index, c in enumerate(sorted(groups)):
            if self._rank in groups[c]:
                world = [self._members[r] for r in groups[c]]
                group_key = derive_key(self._key, "split", self._splits, index)
                return TFCommunicator._group(self._devices, world, self._world_rank, group_key, self.timeout)
        return None

    @_eager
    def allgather_object(self, obj: Any) -> list[Any]:
        if self._size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        return [pickle.loads(part.tobytes()) for part in self._gather_arrays(data)]

    @_eager
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        root = self._check_peer(root, "broadcast_object")
        if self._size == 1:
            return obj
        payload = pickle.dumps(obj) if self._rank == root else b""
        n = int(self.broadcast(np.array([len(payload)], np.int64), root)[0])
        buf = np.frombuffer(payload, np.uint8) if self._rank == root else np.zeros(n, np.uint8)
        data = self.broadcast(buf, root)
        return obj if self._rank == root else pickle.loads(data.tobytes())

    def abort(self, code: int = 1) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
