"""Run a communicator call on the tensors of whichever backend Keras 3 runs on.

The Keras adapter does its tensor work (flattening, casting, splitting) with
``keras.ops``, which every backend implements; only the hand-over of one flat
tensor to the :class:`~shardwise.core.comm.Communicator` depends on the backend.
A :class:`Bridge` is that hand-over: TensorFlow (a ``tf.numpy_function`` op inside
the traced graph), PyTorch (the torch tensor itself, eagerly) and JAX (an ordered
``io_callback`` inside the compiled train step), one module each beside this one;
:func:`~shardwise.adapters.keras.bridges.bridge` picks the one for ``keras.backend.backend()``.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence

import keras


__all__ = ["Bridge", "CommFn", "backend_name"]

CommFn = Callable[[Any], Any]  # one collective: comm-native array in, comm-native array out


class Bridge(abc.ABC):
    """Moves one backend tensor through a communicator call and back."""

    name: str = ""
    #: whether a compiled train step (XLA, torch.compile) can contain the collective
    compiles: bool = True

    @abc.abstractmethod
    def run(self, fn: CommFn, tensor: Any, shape: Optional[Sequence[int]] = None, after: Any = None) -> Any:
        """``fn`` applied to ``tensor``'s data, as a tensor of ``tensor``'s dtype.

        ``shape`` is the result's shape when it differs from ``tensor``'s (it must be
        static). ``after`` is the previous collective's result: backends that build
        graphs order this call after it, so every rank issues collectives in one order.
        """

    def check_compilable(self, what: str) -> None:
        """Raise :class:`ConfigError` when ``what`` is being traced for a compiler that cannot run it."""

    def init_scope(self) -> ContextManager[Any]:
        """A scope in which variables are created outside any traced function."""
        return contextlib.nullcontext()

    def in_trace(self) -> bool:
        """True while a compiled step is being traced (values are symbolic)."""
        return False


def backend_name() -> str:
    """The running Keras backend: ``tensorflow``, ``torch`` or ``jax``."""
    return keras.backend.backend()
