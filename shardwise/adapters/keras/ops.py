"""Collectives on Keras tensors of any backend: fused gradient allreduce, broadcast of variables.

Tensor work (flatten, cast, slice) is ``keras.ops``; each fused bucket crosses to
the communicator through the backend's :class:`~.bridges.base.Bridge`, so the same code
runs in TensorFlow graphs, eager torch and JAX's compiled train step. Collectives
issued together are chained (``after``) so that every rank runs them in one order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np

from ...context import current
from ...core.buckets import DEFAULT_BUCKET_CAP_BYTES, plan_buckets
from ...core.comm import Communicator, ReduceOp
from ...core.errors import ConfigError
from .bridges import Bridge, CommFn, bridge
from ..horovod.compression import Compression, Compressor, FP16Compressor, NoneCompressor, dtype_name

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "world", "static_shape",
           "itemsize", "check_root", "allreduce_gradients", "broadcast_variables", "fused", "sync_backend_state"]


def world(comm: Optional[Communicator] = None) -> Communicator:
    """``comm``, or the world communicator of the current shardwise context."""
    return comm if comm is not None else current().world


def static_shape(tensor: Any) -> Optional[tuple[int, ...]]:
    """``tensor``'s shape when every dimension is known (TensorFlow graphs may not know it)."""
    try:
        shape = tuple(tensor.shape)
    except (TypeError, ValueError):
        return None
    return None if any(d is None for d in shape) else tuple(int(d) for d in shape)


def itemsize(dtype: str) -> int:
    """Bytes per element of a Keras dtype name (``bfloat16`` included)."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def check_root(root_rank: int, comm: Communicator) -> None:
    """Raise :class:`ConfigError` unless ``root_rank`` names a rank of ``comm``."""
    if not 0 <= int(root_rank) < comm.size:
        raise ConfigError(f"root_rank {root_rank} is out of range for {comm.size} ranks")


def _flat(tensors: Sequence[Any]) -> Any:
    pieces = [keras.ops.reshape(t, (-1,)) for t in tensors]
    return pieces[0] if len(pieces) == 1 else keras.ops.concatenate(pieces, axis=0)


def fused(tensors: Sequence[Any], fn: CommFn, cap_bytes: int, *, via: Optional[Bridge] = None) -> list[Any]:
    """Apply an elementwise collective ``fn`` to ``tensors``, one call per bucket of the core plan.

    Tensors of unknown size (TensorFlow graphs only) travel alone. Results keep each
    input's shape and dtype.
    """
    via = via or bridge()
    shapes = [static_shape(t) for t in tensors]
    known = [i for i, s in enumerate(shapes) if s is not None]
    dtypes = [dtype_name(tensors[i]) for i in known]
    plan = plan_buckets([int(np.prod(shapes[i], dtype=np.int64)) for i in known], dtypes,
                        [itemsize(d) for d in dtypes], cap_bytes)
    results: list[Any] = [None] * len(tensors)
    last: Any = None
    for bucket in plan.buckets:
        members = [known[p] for p in bucket.params]
        last = via.run(fn, _flat([tensors[i] for i in members]), after=last)
        offset = 0
        for i, numel in zip(members, bucket.numels):
            results[i] = keras.ops.reshape(last[offset:offset + numel], shapes[i])
            offset += numel
    for i in (i for i, s in enumerate(shapes) if s is None):
        last = results[i] = via.run(fn, tensors[i], after=last)
    return results


def _reduce_fn(comm: Communicator, op: ReduceOp) -> CommFn:
    return lambda a: comm.allreduce(a, op)


def _dense(grad: Any) -> Any:
    """A dense tensor for a gradient (TensorFlow's ``IndexedSlices`` densified), ``None`` kept."""
    if grad is None:
        return None
    if type(grad).__name__ == "IndexedSlices":
        import tensorflow as tf

        return tf.convert_to_tensor(grad)
    return grad


def allreduce_gradients(grads: Sequence[Any], *, comm: Optional[Communicator] = None,
                        op: ReduceOp | str = ReduceOp.AVERAGE,
                        compression: type[Compressor] = Compression.none,
                        cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> list[Any]:
    """Reduce a list of gradients (``None`` kept in place) with one collective per bucket.

    Returned tensors have the inputs' dtypes.
    """
    comm = world(comm)
    op = ReduceOp.parse(op)
    dense = [_dense(g) for g in grads]
    if comm.size == 1:
        return dense
    via = bridge()
    via.check_compilable("the shardwise gradient allreduce")
    present = [i for i, g in enumerate(dense) if g is not None]
    sent, ctxs = [], []
    for i in present:
        s, ctx = compression.compress(dense[i])
        sent.append(s)
        ctxs.append(ctx)
    reduced = fused(sent, _reduce_fn(comm, op), cap_bytes, via=via)
    out: list[Any] = list(dense)
    for i, r, ctx in zip(present, reduced, ctxs):
        out[i] = compression.decompress(r, ctx)
    return out


def sync_backend_state(model: Any) -> None:
    """Write JAX's in-flight training state back into the model's variables (no-op elsewhere).

    JAX's ``fit`` re-reads the variables before the next step after this, so
    assignments made by a callback take effect.
    """
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None and getattr(model, "_jax_state", None) is not None:
        sync()


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, *,
                        comm: Optional[Communicator] = None,
                        cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> Any:
    """Overwrite ``variables`` (Keras, or TensorFlow ones on that backend) with ``root_rank``'s values.

    Fused into buckets. Eagerly it assigns at once and returns ``None``; in a
    TensorFlow graph it returns the grouped assign op.
    """
    comm = world(comm)
    check_root(root_rank, comm)
    variables = list(variables)
    if comm.size == 1 or not variables:
        return None
    via = bridge()
    via.check_compilable("broadcast_variables")
    values = [keras.ops.convert_to_tensor(v) for v in variables]
    synced = fused(values, lambda a: comm.broadcast(a, root_rank), cap_bytes, via=via)
    assigns = [v.assign(s) for v, s in zip(variables, synced)]
    if not via.in_trace():
        return None
    import tensorflow as tf

    return tf.group(*[a for a in assigns if a is not None])


def call_eagerly(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on an eager value of the running backend, the result as a backend tensor."""
    tensor = keras.ops.convert_to_tensor(value)
    out = bridge().run(fn, tensor) if keras.backend.backend() == "torch" else fn(keras.ops.convert_to_numpy(tensor))
    return keras.ops.convert_to_tensor(out)
