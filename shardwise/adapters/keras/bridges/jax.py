"""The JAX bridge: collectives run inside the compiled train step as ordered ``io_callback`` calls.

Why a callback rather than JAX's own collectives: Keras's JAX train step is one
``jax.jit`` over process-local arrays; JAX's cross-process collectives need a
global device mesh set up by ``jax.distributed`` (and a gloo/MPI CPU plugin), and
Keras's ``DataParallel`` distribution only spans the devices of one process. An
``io_callback`` hands the flat gradient buffer (host memory on CPU, no copy) to
the communicator the job already has, MPI shared memory or gloo, while the rest
of the step stays compiled. ``ordered=True`` keeps every rank's collectives in
program order, which the communicator needs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import io_callback

from .base import Bridge, CommFn

__all__ = ["JaxBridge"]


class JaxBridge(Bridge):
    """Collectives as ordered host callbacks, eager or under ``jax.jit``."""

    name = "jax"

    def run(self, fn: CommFn, tensor: Any, shape: Optional[Sequence[int]] = None, after: Any = None) -> Any:
        tensor = jax.numpy.asarray(tensor)
        result = jax.ShapeDtypeStruct(tensor.shape if shape is None else tuple(int(d) for d in shape),
                                      tensor.dtype)
        dtype = np.dtype(tensor.dtype)

        def host(a: Any) -> np.ndarray:
            return np.asarray(fn(np.asarray(a)), dtype=dtype)

        return io_callback(host, result, tensor, ordered=True)
