"""Horovod's TensorFlow state helpers: broadcast variables and Python objects, gather objects."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from ..horovod.process_sets import ProcessSet, comm_of, global_process_set
from .ops import _set_root, broadcast_
from .runtime import no_autograph

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "allgather_object"]


@no_autograph
def broadcast_variables(variables: Sequence[Any], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Optional[Any]:
    """Overwrite ``variables`` (TF or Keras) with ``root_rank``'s values, in one request.

    Eagerly the variables are assigned at once and None is returned; while building a
    graph the grouped assign op is returned. ``inplace`` is accepted for Horovod
    compatibility (the values always travel through one host buffer per variable).
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.group()
    values = broadcast_(variables, int(root_rank), process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*values)


@no_autograph
def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast every global variable of the TF1 graph from ``root_rank`` (graph mode only, as in Horovod)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


@no_autograph
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s picklable object on every rank of the set (``session`` is not needed)."""
    return comm_of(process_set).broadcast_object(obj, _set_root(int(root_rank), process_set))


@no_autograph
def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (Horovod's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


@no_autograph
def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in rank order of the set."""
    return comm_of(process_set).allgather_object(obj)
