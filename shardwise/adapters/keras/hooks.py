"""What the shardwise callbacks do to a model before its first step: compile mode and loss scaling.

* :func:`disable_xla`: TensorFlow's XLA cannot compile the collectives, so
  ``jit_compile`` is turned off there (JAX keeps its compiled step; the
  collectives are host callbacks inside it).
* :func:`share_finite_check`: under ``mixed_float16`` Keras wraps the
  :class:`~.optimizer.DistributedOptimizer` in a ``LossScaleOptimizer`` whose
  inf/nan check sees only this rank's gradients; ranks could then take different
  branches (one reduces, the other skips) and hang. The check is made global.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Optional

import keras

from ...core.comm import ReduceOp
from .bridge import bridge
from .ops import world
from .optimizer import DistributedOptimizer

__all__ = ["unwrap_optimizer", "find_distributed_optimizer", "disable_xla", "share_finite_check"]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under any ``inner_optimizer`` wrappers (ours, loss scaling)."""
    seen = 0
    while optimizer is not None and "inner_optimizer" in getattr(optimizer, "__dict__", {}) and seen < 16:
        optimizer = optimizer.__dict__["inner_optimizer"]
        seen += 1
    return optimizer


def find_distributed_optimizer(model: Any) -> Optional[DistributedOptimizer]:
    """``model.optimizer`` if it is, or wraps, a :class:`DistributedOptimizer`; else ``None``."""
    optimizer = getattr(model, "optimizer", None)
    for _ in range(16):
        if optimizer is None or isinstance(optimizer, DistributedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "__dict__", {}).get("inner_optimizer")
    return None


def _multi_rank(model: Any) -> Optional[DistributedOptimizer]:
    optimizer = find_distributed_optimizer(model)
    return optimizer if optimizer is not None and world(optimizer._comm).size > 1 else None


def share_finite_check(model: Any) -> bool:
    """Make a ``LossScaleOptimizer`` around a multi-rank DistributedOptimizer decide finiteness globally.

    Its ``check_finite`` becomes "finite on every rank" (one scalar MIN-allreduce
    per step), so every rank takes the same branch: all apply the averaged update
    or all halve the loss scale and skip. Returns True when it installed the check.
    """
    dist = _multi_rank(model)
    outer = getattr(model, "optimizer", None)
    if dist is None or outer is dist or not isinstance(outer, keras.optimizers.LossScaleOptimizer):
        return False
    if getattr(outer, "_shardwise_global_finite", False):
        return False
    local_check = outer.check_finite

    def check_finite(self: Any, grads: Any) -> Any:
        finite = keras.ops.reshape(keras.ops.cast(local_check(grads), "float32"), (1,))
        # The world is looked up at each step, so the check follows an elastic job's new world.
        everywhere = bridge().run(lambda a: world(dist._comm).allreduce(a, ReduceOp.MIN), finite)
        return keras.ops.greater(keras.ops.reshape(everywhere, ()), 0.5)

    outer.check_finite = types.MethodType(check_finite, outer)
    outer._shardwise_global_finite = True
    return True


def disable_xla(model: Any) -> bool:
    """Turn TensorFlow's ``jit_compile`` off (with a warning) for a multi-rank DistributedOptimizer.

    Returns True when it changed something; the train function is rebuilt if it
    existed. Nothing changes on JAX (the step stays compiled) or torch.
    """
    if model is None or not getattr(model, "jit_compile", False) or bridge().compiles:
        return False
    if _multi_rank(model) is None:
        return False
    warnings.warn("shardwise: turning jit_compile off for this model: DistributedOptimizer's collectives "
                  "are Python calls (tf.numpy_function) that XLA cannot compile. Pass jit_compile=False "
                  "to model.compile() to silence this warning.", stacklevel=2)
    model.jit_compile = False
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
    return True
