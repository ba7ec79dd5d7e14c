"""How a collective over numpy arrays becomes a TensorFlow op: eagerly, in ``tf.function``, in TF1 graphs.

* **Names.** Requests are matched across ranks by name. Eagerly an unnamed call is
  ``<kind>.noname.<n>`` (the coordinator's counter, the same on every rank as long as
  ranks make the same calls); in a graph the name is fixed when the op is built, from
  the graph's unique name for ``Horovod<Kind>_<input name>`` (or the user's name) under
  the current name scope, as Horovod names its ops. TF may run independent ops of one
  graph in any order, so an execution-time counter would differ between ranks. The
  set's coordinator is started while the op is built (its creation is collective).
* **Eager** calls run the collective at once on the tensors' numpy values.
* **Graph** calls are one stateful ``tf.numpy_function`` that submits the request and
  waits. ``tf.function`` orders stateful ops as written, so its collectives run in the
  same order everywhere. A TF1 session runs ready ops concurrently on TensorFlow's
  inter-op pool, each blocking collective holding a thread; :func:`reserve_inter_op_threads`
  (called on import) sizes the pool so that every collective of a step can be waiting
  at once instead of starving the ones the other ranks wait for; when TensorFlow had
  already started, building a TF1-graph collective warns once. Graphs must be built
  the same way on every rank, so that the names agree (as with Horovod).
* **Errors.** A request the ranks disagree on raises ``tf.errors.FailedPreconditionError``
  with the negotiated message on every rank, as Horovod does; bad arguments raise
  ``tf.errors.InvalidArgumentError``. TensorFlow reports any exception raised inside a
  Python op as ``UnknownError``, so a graph op returns a status instead, and a
  following op raises the right error (see :func:`_raise_unless_ok`).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from ... import context
from shardwise.core.errors import CollectiveMismatchError

from ..horovod.process_sets import ProcessSet, coordinator_of
from .xla import check_not_xla

__all__ = ["request_name", "call", "device_of", "reserve_inter_op_threads", "invalid_argument", "no_autograph",
           "INTER_OP_THREADS"]

#: Inter-op threads reserved when TensorFlow has not started yet and nobody chose a number.
INTER_OP_THREADS = 64
_ERROR_CONTAINER = "shardwise-collective-errors"

#: Decorator for every public entry point: AutoGraph must not rewrite shardwise's Python (when a
#: ``tf.function`` calls it) into graph control flow; it is plain Python that builds ops.
no_autograph = tf.autograph.experimental.do_not_convert

#: ``run(arrays) -> arrays``: the collective on this rank's numpy values.
Run = Callable[[list[np.ndarray]], Sequence[np.ndarray]]


def reserve_inter_op_threads(threads: int = INTER_OP_THREADS) -> bool:
    """Give TF's inter-op pool ``threads`` threads if TF has not started and no size was chosen.

    Returns True when the size was set. A size chosen by the user (the API or
    ``TF_NUM_INTEROP_THREADS``) is kept, and nothing changes once TensorFlow runs.
    """
    if os.environ.get("TF_NUM_INTEROP_THREADS") or tf.config.threading.get_inter_op_parallelism_threads():
        return False
    try:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # the runtime is already initialised
        return False
    return True


def _warn_if_few_threads() -> None:
    """Warn when TF1 graph collectives may outnumber the inter-op threads that run them.

    Python's default warning filter shows it once per calling line.
    """
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    threads = configured or int(os.environ.get("TF_NUM_INTEROP_THREADS") or 0) or os.cpu_count() or 1
    if threads >= INTER_OP_THREADS:
        return
    warnings.warn(f"TensorFlow runs TF1 graphs on {threads} inter-op threads: a session step that runs more "
                  f"than {threads} shardwise collectives at once waits forever. Import shardwise.tensorflow "
                  "before TensorFlow starts, or call tf.config.threading.set_inter_op_parallelism_threads("
                  f"{INTER_OP_THREADS}) first.", RuntimeWarning, stacklevel=4)


def _normalize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def request_name(kind: str, name: Optional[str], tensors: Sequence[tf.Tensor], process_set: ProcessSet,
                 ignore_name_scope: bool = False, prefix: Optional[str] = None) -> str:
    """The name that matches this call with the other ranks' (see the module docstring)."""
    if tf.executing_eagerly():
        return f"{kind}.{name}" if name else coordinator_of(process_set).auto_name(kind)
    if context.is_initialized():
        # Start the set's coordinator now, on the thread building the graph: it is created collectively,
        # which must not happen in ops that TensorFlow may run concurrently, in any order.
        coordinator_of(process_set)
    if not name:
        parts = [tensors[0].name] + ([tensors[-1].name] if len(tensors) > 1 else [])
        name = _normalize(f"{prefix or 'Horovod' + kind.capitalize()}_{'_'.join(parts)}")
    full = tf.compat.v1.get_default_graph().unique_name(name)
    if ignore_name_scope:
        full = full.rsplit("/", 1)[-1]
    return f"{kind}.{full}"


def device_of(tensor: tf.Tensor) -> str:
    """``"gpu"`` for a tensor placed on a GPU, else ``"cpu"`` (what negotiation compares)."""
    try:
        device = tensor.device or ""
    except AttributeError:
        device = ""
    return "gpu" if "GPU" in device.upper() else "cpu"


def invalid_argument(message: str) -> tf.errors.InvalidArgumentError:
    """The error of a bad argument, the same eagerly and while building a graph."""
    return tf.errors.InvalidArgumentError(None, None, message)


def call(run: Run, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType], op_name: str) -> list[tf.Tensor]:
    """Run ``run`` on the values of ``inputs``: now when eager, else as a graph op returning ``out_dtypes``."""
    if tf.executing_eagerly():
        return _eager(run, inputs)
    return _graph(run, inputs, out_dtypes, op_name)


def _eager(run: Run, inputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    arrays = [t.numpy() for t in inputs]
    try:
        outs = run(arrays)
    except CollectiveMismatchError as exc:
        raise tf.errors.FailedPreconditionError(None, None, str(exc)) from None
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    return [tf.convert_to_tensor(o) for o in outs]


def _graph(run: Run, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
           op_name: str) -> list[tf.Tensor]:
    check_not_xla(op_name)
    if not tf.compat.v1.get_default_graph().building_function:  # a TF1 graph (tf.function orders its ops)
        _warn_if_few_threads()
    np_dtypes = [d.as_numpy_dtype for d in out_dtypes]

    def body(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            outs = [np.asarray(o, dtype=d) for o, d in zip(run(list(arrays)), np_dtypes)]
        except CollectiveMismatchError as exc:
            return [np.zeros(0, d) for d in np_dtypes] + [np.int32(1), str(exc).encode()]
        return outs + [np.int32(0), b""]

    flat = tf.numpy_function(body, list(inputs), list(out_dtypes) + [tf.int32, tf.string], stateful=True,
                             name=op_name)
    outs, code, message = flat[:-2], flat[-2], flat[-1]
    with tf.control_dependencies([_raise_unless_ok(code, message)]):
        return [tf.identity(o) for o in outs]


def _raise_unless_ok(code: tf.Tensor, message: tf.Tensor) -> tf.Tensor:
    """An op that raises ``FailedPreconditionError(message)`` when ``code`` is not 0.

    No TF op raises that error with a message of our choosing, but reading a resource
    variable that does not exist raises it with the variable's name in the text: the
    failing branch names one after the message.
    """
    def fail() -> tf.Tensor:
        handle = tf.py_function(_missing_variable, [message], tf.resource)
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)

    return tf.cond(tf.equal(code, 0), lambda: tf.constant(0, tf.int32), fail)


def _missing_variable(message: tf.Tensor) -> tf.Tensor:
    text = f"[collective failed on every rank: {message.numpy().decode(errors='replace')}]"
    return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], container=_ERROR_CONTAINER, shared_name=text)
