"""What Keras must do around a multi-rank DistributedOptimizer: one finite decision for all ranks, no XLA.

* Loss scaling: under ``mixed_float16`` Keras's ``compile`` wraps the
  :class:`~.optimizer.DistributedOptimizer` in a ``LossScaleOptimizer`` whose
  inf/nan check sees only this rank's gradients; ranks could then take different
  branches (one reduces, the other skips) and hang. The check is made global.
* ZeRO stage 3: before the train function is built, a stage-3
  :class:`~.zero.optimizer.ZeroOptimizer` is given the model (:meth:`~.zero.optimizer.ZeroOptimizer.attach_model`),
  whose layers its engine must reach.
* XLA: TensorFlow's XLA cannot compile the collectives, so ``jit_compile`` is
  turned off before the train function is built (JAX keeps its compiled step;
  the collectives are host callbacks inside it; torch needs nothing).

:func:`install_hooks` is called by every ``DistributedOptimizer`` when it is made,
so ``fit`` with no shardwise callback, or with a custom ``train_step``, is covered.
The hooks sit on two Keras classes, not on instances, because the optimizer never
sees its wrapper or its model: ``compile`` creates the ``LossScaleOptimizer`` after
the optimizer exists and gives it no reference to it, and the train function is
the model's. Both wrappers do exactly what Keras does unless a multi-rank
``DistributedOptimizer`` is involved. A ``LossScaleOptimizer`` subclass that
overrides ``check_finite`` itself bypasses the hook.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import keras

from .bridges import backend_name, bridge
from .ops import world

__all__ = ["DistributedBase", "unwrap_optimizer", "distributed_in", "find_distributed_optimizer", "install_hooks",
           "disable_xla", "share_finite_check"]

_MARK = "__shardwise_hook__"


class DistributedBase:
    """What the hooks look for: the base of :class:`~.optimizer.DistributedOptimizer` (and so of ZeRO's).

    It stands here, below the optimizer, so that the optimizer installs the hooks
    when it is made while this module never imports it.
    """


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under any ``inner_optimizer`` wrappers (ours, loss scaling)."""
    seen = 0
    while optimizer is not None and "inner_optimizer" in getattr(optimizer, "__dict__", {}) and seen < 16:
        optimizer = optimizer.__dict__["inner_optimizer"]
        seen += 1
    return optimizer


def distributed_in(optimizer: Any) -> Optional[DistributedBase]:
    """``optimizer`` if it is a DistributedOptimizer, else the first one among its ``inner_optimizer``s."""
    for _ in range(16):
        if optimizer is None or isinstance(optimizer, DistributedBase):
            return optimizer
        optimizer = getattr(optimizer, "__dict__", {}).get("inner_optimizer")
    return None


def find_distributed_optimizer(model: Any) -> Optional[DistributedBase]:
    """``model.optimizer`` if it is, or wraps, a :class:`DistributedOptimizer`; else ``None``."""
    return distributed_in(getattr(model, "optimizer", None))


def _multi_rank(optimizer: Any) -> Optional[DistributedBase]:
    dist = distributed_in(optimizer)
    return dist if dist is not None and world(dist._comm).size > 1 else None


def _wrap_once(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``make(original)`` unless that was done already."""
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _MARK, True)
    setattr(cls, name, wrapped)


def _global_check_finite(original: Callable[..., Any]) -> Callable[..., Any]:
    def check_finite(self: Any, grads: Any) -> Any:
        finite = original(self, grads)
        dist = _multi_rank(self)
        return finite if dist is None else dist.all_finite(finite)

    return check_finite


def _before_train_function(original: Callable[..., Any]) -> Callable[..., Any]:
    def make_train_function(self: Any, force: bool = False) -> Any:
        if _turn_xla_off(self):
            force = True  # a train function built before was XLA-compiled
        dist = distributed_in(getattr(self, "optimizer", None))
        if dist is not None and getattr(dist, "stage", None) == 3 and dist.built:
            dist.attach_model(self)  # ZeRO-3 takes the model over before its step is built
        return original(self, force=force)

    return make_train_function


def _before_step_function(original: Callable[..., Any]) -> Callable[..., Any]:
    def make_function(self: Any, force: bool = False) -> Any:
        dist = distributed_in(getattr(self, "optimizer", None))
        if dist is not None and getattr(dist, "stage", None) == 3 and dist.built:
            dist.attach_model(self)  # evaluate/predict before fit run the sharded layers too
        return original(self, force=force)

    return make_function


def install_hooks() -> None:
    """Install the shared finite check, the ZeRO-3 model hand-over and (TensorFlow) the XLA switch-off; idempotent."""
    _wrap_once(keras.optimizers.LossScaleOptimizer, "check_finite", _global_check_finite)
    _wrap_once(keras.Model, "make_train_function", _before_train_function)
    _wrap_once(keras.Model, "make_test_function", _before_step_function)
    _wrap_once(keras.Model, "make_predict_function", _before_step_function)


def share_finite_check(model: Any) -> bool:
    """Make sure a ``LossScaleOptimizer`` around a multi-rank DistributedOptimizer decides finiteness globally.

    Its ``check_finite`` then means "finite on every rank" (one scalar MIN-allreduce
    per step, see :meth:`DistributedOptimizer.all_finite`), so every rank takes the
    same branch: all apply the averaged update or all halve the loss scale and skip.
    Returns True when ``model``'s optimizer is such a ``LossScaleOptimizer``.
    """
    install_hooks()
    outer = getattr(model, "optimizer", None)
    return (isinstance(outer, keras.optimizers.LossScaleOptimizer) and not isinstance(outer, DistributedBase)
            and _multi_rank(outer) is not None)


def _turn_xla_off(model: Any) -> bool:
    """Set ``jit_compile`` False (with a warning) for a multi-rank DistributedOptimizer on TensorFlow."""
    if model is None or not getattr(model, "jit_compile", False) or bridge().compiles:
        return False
    if _multi_rank(getattr(model, "optimizer", None)) is None:
        return False
    warnings.warn("shardwise: turning jit_compile off for this model: DistributedOptimizer's collectives "
                  "are Python calls (tf.numpy_function) that XLA cannot compile. Pass jit_compile=False "
                  "to model.compile() to silence this warning.", stacklevel=3)
    model.jit_compile = False
    return True


def disable_xla(model: Any) -> bool:
    """Turn TensorFlow's ``jit_compile`` off (with a warning) for a multi-rank DistributedOptimizer.

    Returns True when it changed something; the train function is rebuilt if it
    existed. Nothing changes on JAX (the step stays compiled) or torch. ``fit``
    does this by itself (see :func:`install_hooks`); call it for a model whose
    train function is built some other way.
    """
    install_hooks()
    if not _turn_xla_off(model):
        return False
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
    return True
