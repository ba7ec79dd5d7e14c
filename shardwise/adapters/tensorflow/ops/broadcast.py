"""broadcast for TensorFlow: of a tensor (differentiable) and into variables (``broadcast_``).

Part of :mod:`shardwise.adapters.tensorflow.ops` (import from there).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from ...horovod.ops import Average
from ...horovod.process_sets import ProcessSet, coordinator_of, global_process_set
from .. import requests, runtime
from .base import _allreduce_op, _tensor, _zeros_for_none
from ..runtime import no_autograph

__all__ = ["broadcast", "broadcast_"]


# -- broadcast ------------------------------------------------------------------------------------
def _set_root(root_rank: int, process_set: ProcessSet) -> int:
    """A world rank as the set's rank; a rank outside the set becomes a negative, rejected by negotiation."""
    if process_set.is_global():
        return int(root_rank)
    ranks = process_set.ranks
    return ranks.index(int(root_rank)) if int(root_rank) in ranks else -1 - int(root_rank)


def _broadcast_raw(tensors: list[tf.Tensor], root_rank: int, name: Optional[str], process_set: ProcessSet,
                   ignore_name_scope: bool, prefix: Optional[str] = None) -> list[tf.Tensor]:
    request = runtime.request_name("broadcast", name, tensors, process_set, ignore_name_scope, prefix)
    device, root = runtime.device_of(tensors[0]), _set_root(root_rank, process_set)

    def run(arrays: list) -> list:
        return requests.broadcast(coordinator_of(process_set), request, arrays, root, device)

    outs = runtime.call(run, tensors, [t.dtype for t in tensors], "HorovodBroadcast")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


@no_autograph
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` (a world rank) on every rank of the set."""
    root_rank = int(root_rank)

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        out = _broadcast_raw([x], root_rank, name, process_set, ignore_name_scope)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = _allreduce_op(_zeros_for_none([dy], [out]), Average, 1.0, 1.0, None, process_set,
                                    ignore_name_scope)[0]
            # The same ops on every rank, so that the names of later collectives in the graph agree.
            keep = float(coordinator_of(process_set).comm.rank == _set_root(root_rank, process_set))
            return reduced * tf.cast(keep, reduced.dtype)

        return out, grad

    return forward(_tensor(tensor))


def _is_ref(var: Any) -> bool:
    """True for a TF1 reference variable (``RefVariable``), which assigns through ``tf.compat.v1.assign``."""
    try:
        from tensorflow.python.ops.ref_variable import RefVariable
    except ImportError:  # TF < 2.13
        from tensorflow.python.ops.variables import RefVariable
    return isinstance(var, RefVariable)


def _assign(var: Any, value: tf.Tensor) -> tf.Tensor:
    """Write ``value`` into ``var`` and return the variable's new value."""
    if tf.executing_eagerly():
        var.assign(value)
        return tf.convert_to_tensor(var)
    if _is_ref(var):
        return tf.identity(tf.compat.v1.assign(var, value))
    if isinstance(var, tf.Variable):
        with tf.control_dependencies([var.assign(value, read_value=False)]):
            return tf.identity(var.read_value())
    var.assign(value)  # a Keras variable: tf.function orders the read after it (automatic control deps)
    return tf.convert_to_tensor(var)


@no_autograph
def broadcast_(variables: Sequence[Any], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Overwrite ``variables`` with ``root_rank``'s values (one request); returns their new values."""
    variables = list(variables)
    if not variables:
        return []
    kinds = {_is_ref(v) for v in variables}
    if len(kinds) > 1:
        raise ValueError("All variables passed to broadcast_() should be of the same kind, resource or reference")
    values = [tf.convert_to_tensor(v) for v in variables]
    outs = _broadcast_raw(values, int(root_rank), name, process_set, False, prefix="HorovodBroadcastInplace")
    return [_assign(v, o) for v, o in zip(variables, outs)]
