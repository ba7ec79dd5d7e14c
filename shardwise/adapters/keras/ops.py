"""TensorFlow <-> communicator bridge: collectives on TF tensors, eager or inside ``tf.function``.

Every collective is one ``tf.numpy_function`` that hands a numpy array to the
communicator, so it runs the same in eager code and in the graphs ``model.fit``
traces. Collectives issued together are chained with control dependencies so
every rank runs them in the same order. XLA cannot compile Python calls:
:func:`check_not_xla` turns that case into a clear error.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from ...context import current
from ...core.buckets import DEFAULT_BUCKET_CAP_BYTES, plan_buckets
from ...core.comm import Communicator, ReduceOp
from ...core.errors import ConfigError

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "world",
           "in_xla_context", "check_not_xla", "allreduce", "allgather", "broadcast",
           "allreduce_gradients", "broadcast_variables"]

XLA_MESSAGE = ("{what} cannot run inside an XLA-compiled function (jit_compile=True): shardwise "
               "collectives are Python calls (tf.numpy_function), which XLA cannot compile. Compile "
               "the model with model.compile(..., jit_compile=False), or pass one of the "
               "shardwise.keras.callbacks to fit() (they turn XLA off before the first step).")


class Compressor:
    """Casts tensors before a collective and back after it (identity by default)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Return the tensor to send and what :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Undo :meth:`compress`."""
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; restore their dtype afterwards."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Gradient compression choices (Horovod's names): ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def world(comm: Optional[Communicator] = None) -> Communicator:
    """``comm``, or the world communicator of the current shardwise context."""
    return comm if comm is not None else current().world


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util  # no public equivalent

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def check_not_xla(what: str) -> None:
    """Raise :class:`ConfigError` when called while tracing an XLA-compiled function."""
    if in_xla_context():
        raise ConfigError(XLA_MESSAGE.format(what=what))


def _call(fn: Callable[[np.ndarray], np.ndarray], tensor: tf.Tensor, dtype: tf.DType,
          after: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Run ``fn`` on ``tensor``'s numpy value as one graph op (ordered after ``after``)."""
    deps = [after] if after is not None else []
    with tf.control_dependencies(deps):
        out = tf.numpy_function(fn, [tensor], dtype, stateful=True)
    return out


def _reduce_fn(comm: Communicator, op: ReduceOp) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: np.asarray(comm.allreduce(a, op))


def allreduce(tensor: Any, op: ReduceOp | str = ReduceOp.AVERAGE, *, comm: Optional[Communicator] = None,
              compression: type[Compressor] = Compression.none) -> tf.Tensor:
    """Reduce a TF tensor (or array-like) over all ranks; every rank gets the result."""
    comm = world(comm)
    op = ReduceOp.parse(op)
    tensor = tf.convert_to_tensor(tensor)
    if comm.size == 1:
        return tf.identity(tensor)
    check_not_xla("allreduce")
    sent, ctx = compression.compress(tensor)
    out = _call(_reduce_fn(comm, op), sent, sent.dtype)
    out.set_shape(sent.shape)
    return compression.decompress(out, ctx)


def allgather(tensor: Any, *, comm: Optional[Communicator] = None) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ)."""
    comm = world(comm)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    if comm.size == 1:
        return tf.identity(tensor)
    check_not_xla("allgather")
    out = _call(lambda a: np.asarray(comm.allgather(a)), tensor, tensor.dtype)
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def broadcast(tensor: Any, root_rank: int = 0, *, comm: Optional[Communicator] = None) -> tf.Tensor:
    """Every rank gets ``root_rank``'s tensor (shapes must match)."""
    comm = world(comm)
    _check_root(root_rank, comm)
    tensor = tf.convert_to_tensor(tensor)
    if comm.size == 1:
        return tf.identity(tensor)
    check_not_xla("broadcast")
    out = _call(lambda a: np.asarray(comm.broadcast(a, root_rank)), tensor, tensor.dtype)
    out.set_shape(tensor.shape)
    return out


def _check_root(root_rank: int, comm: Communicator) -> None:
    if not 0 <= int(root_rank) < comm.size:
        raise ConfigError(f"root_rank {root_rank} is out of range for {comm.size} ranks")


def _dense(grad: Any) -> Optional[tf.Tensor]:
    """A dense tensor for a gradient (``IndexedSlices`` densified), ``None`` kept."""
    return None if grad is None else tf.convert_to_tensor(grad)


def _fused(tensors: Sequence[tf.Tensor], fn_for: Callable[[], Callable[[np.ndarray], np.ndarray]],
           cap_bytes: int) -> list[tf.Tensor]:
    """Apply an elementwise collective to ``tensors``, one op per bucket of the core plan.

    Tensors of unknown size travel alone. Results keep each input's shape and dtype.
    """
    known = [i for i, t in enumerate(tensors) if t.shape.is_fully_defined()]
    unknown = [i for i, t in enumerate(tensors) if not t.shape.is_fully_defined()]
    plan = plan_buckets([tensors[i].shape.num_elements() for i in known],
                        [tensors[i].dtype.name for i in known],
                        [tensors[i].dtype.size for i in known], cap_bytes)
    results: list[Optional[tf.Tensor]] = [None] * len(tensors)
    last: Optional[tf.Tensor] = None
    for bucket in plan.buckets:
        members = [known[p] for p in bucket.params]
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in members], axis=0)
        last = _call(fn_for(), flat, flat.dtype, last)
        last.set_shape(flat.shape)
        for i, piece in zip(members, tf.split(last, list(bucket.numels))):
            results[i] = tf.reshape(piece, tensors[i].shape)
    for i in unknown:
        last = _call(fn_for(), tensors[i], tensors[i].dtype, last)
        results[i] = tf.reshape(last, tf.shape(tensors[i]))
    return results  # type: ignore[return-value]


def allreduce_gradients(grads: Sequence[Any], *, comm: Optional[Communicator] = None,
                        op: ReduceOp | str = ReduceOp.AVERAGE,
                        compression: type[Compressor] = Compression.none,
                        cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> list[Optional[tf.Tensor]]:
    """Reduce a list of gradients (``None`` kept in place) with one collective per bucket.

    ``IndexedSlices`` are made dense first. Returned tensors have the inputs' dtypes.
    """
    comm = world(comm)
    op = ReduceOp.parse(op)
    dense = [_dense(g) for g in grads]
    if comm.size == 1:
        return dense
    check_not_xla("the shardwise gradient allreduce")
    present = [i for i, g in enumerate(dense) if g is not None]
    sent, ctxs = [], []
    for i in present:
        s, ctx = compression.compress(dense[i])
        sent.append(s)
        ctxs.append(ctx)
    reduced = _fused(sent, lambda: _reduce_fn(comm, op), cap_bytes)
    out: list[Optional[tf.Tensor]] = list(dense)
    for i, r, ctx in zip(present, reduced, ctxs):
        out[i] = compression.decompress(r, ctx)
    return out


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, *,
                        comm: Optional[Communicator] = None,
                        cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> Optional[tf.Operation]:
    """Overwrite ``variables`` (TF or Keras) with ``root_rank``'s values, fused into buckets.

    Eagerly it assigns at once and returns ``None``; in a graph it returns the grouped assign op.
    """
    comm = world(comm)
    _check_root(root_rank, comm)
    variables = list(variables)
    if comm.size == 1 or not variables:
        return None
    check_not_xla("broadcast_variables")
    values = [tf.convert_to_tensor(v) for v in variables]
    fn = lambda: (lambda a: np.asarray(comm.broadcast(a, root_rank)))  # noqa: E731
    synced = _fused(values, fn, cap_bytes)
    assigns = [v.assign(s) for v, s in zip(variables, synced)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])
