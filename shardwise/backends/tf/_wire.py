"""Pieces of the ``tf`` backend that need no TensorFlow: dtype support, wire encoding, group keys.

TensorFlow's collective kernels take only some dtypes (TF 2.21, CPU):

* reductions: float16, bfloat16, float32, float64, int32, int64;
* gather, all-to-all: float16, float32, float64, int32, int64;
* broadcast: those plus bool.

Data movement of any other dtype (bfloat16, bool, 8/16-bit ints, complex, ...)
travels as raw bytes packed into int32 words, one row per destination, so the
bits arrive unchanged.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import numpy as np

__all__ = ["REDUCE_DTYPES", "MOVE_DTYPES", "KEY_LOW", "KEY_HIGH", "derive_key", "signature",
           "encode_rows", "decode_rows", "reduce_stack"]

#: dtypes TensorFlow's CollectiveReduceV2 accepts.
REDUCE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int32", "int64"})
#: dtypes CollectiveGatherV2 / CollectiveAllToAllV2 / broadcast accept (the common subset).
MOVE_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})

#: tf.distribute numbers its own groups upwards from 1; shardwise keys stay above this.
KEY_LOW = 1 << 24
#: Group and instance keys are int32.
KEY_HIGH = (1 << 31) - 1


def derive_key(*parts: Any) -> int:
    """A group key in ``[KEY_LOW, KEY_HIGH)`` from a hash of ``parts`` (the same on every rank).

    Keys are hashed because groups are created by their members only, with no
    cluster-wide allocator; two of a job's groups collide with probability about
    ``n**2 / 2**32`` for ``n`` groups (1e-5 for 300 groups).
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return KEY_LOW + int.from_bytes(digest, "big") % (KEY_HIGH - KEY_LOW)


def signature(trailing: tuple[int, ...], dtype: str) -> int:
    """A non-negative 31-bit int naming a trailing shape and dtype, to compare them across ranks."""
    return zlib.crc32(repr((tuple(trailing), dtype)).encode()) & 0x7FFFFFFF


def encode_rows(rows: np.ndarray) -> np.ndarray:
    """The 2-D array the engine moves for ``rows`` (2-D): itself, or its bytes as int32 words."""
    rows = np.ascontiguousarray(rows)
    if rows.dtype.name in MOVE_DTYPES:
        return rows
    raw = rows.view(np.uint8).reshape(rows.shape[0], -1) if rows.size else \
        np.zeros((rows.shape[0], 0), np.uint8)
    width = -(-raw.shape[1] // 4) * 4
    if width != raw.shape[1]:
        raw = np.concatenate([raw, np.zeros((raw.shape[0], width - raw.shape[1]), np.uint8)], axis=1)
    return np.ascontiguousarray(raw).view(np.int32)


def decode_rows(wire: np.ndarray, dtype: np.dtype, width: int) -> np.ndarray:
    """Undo :func:`encode_rows`: ``wire`` (2-D) back to rows of ``width`` elements of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.name in MOVE_DTYPES:
        return np.ascontiguousarray(wire.reshape(wire.shape[0], width))
    raw = np.ascontiguousarray(wire).view(np.uint8).reshape(wire.shape[0], -1)
    return np.ascontiguousarray(raw[:, : width * dtype.itemsize]).view(dtype).reshape(wire.shape[0], width)


def reduce_stack(stack: np.ndarray, op: str, size: int) -> np.ndarray:
    """Reduce per-rank arrays stacked on axis 0 with ``op`` (a ReduceOp value), keeping the dtype."""
    dtype = stack.dtype
    if op in ("sum", "average"):
        out = np.add.reduce(stack, axis=0, dtype=dtype)
        if op == "average":
            if dtype.kind in "fc":
                out = (out / size).astype(dtype)
            elif dtype.kind in "iu":
                out = out // size
            else:
                raise TypeError(f"cannot average tensors of dtype {dtype}")
        return out
    if op == "product":
        return np.multiply.reduce(stack, axis=0, dtype=dtype)
    return (np.minimum if op == "min" else np.maximum).reduce(stack, axis=0)
