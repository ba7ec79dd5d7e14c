"""Whole variable values of a Keras-torch model trained with ZeRO stage 3, when a user reads or writes them.

Between uses a stage-3 layer's variables are empty Parameters: only their shards
exist. ``get_weights``, ``set_weights`` and the saving entry points
(``save_own_variables`` / ``load_own_variables``, which ``save_weights``,
``load_weights``, ``model.save`` and ``ModelCheckpoint`` call layer by layer) gather
the variables they touch for the duration of the call, write assignments back into
the shards, and free them again: the whole model exists only for ``model.get_weights()``,
a saved file one layer at a time. ``evaluate`` and ``predict`` need nothing: the
forward hooks gather each layer where it runs.

Gathering is a collective: every rank must make the same call (``model.get_weights()``
on every rank, ``model.save_weights(path)`` on every rank, or inside
:func:`full_weights`, where the whole model is gathered once on every rank and
anything, a rank-0-only save included, reads it). Other reads of a variable's value
outside a forward (``layer.kernel.numpy()``) also belong inside :func:`full_weights`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import keras

from ....core.errors import ConfigError

__all__ = ["engine_of", "full_weights", "install_access", "register_layer", "register_variables"]

_ATTR = "_shardwise_zero3"
_MARK = "__shardwise_zero3_access__"
#: Method -> (which variables it touches, whether assignments must reach the shards).
_METHODS: dict[str, tuple[str, bool]] = {"get_weights": ("all", False), "set_weights": ("all", True),
                                         "save_own_variables": ("own", False), "load_own_variables": ("own", True)}


def register_layer(layer: Any, engine: Any) -> None:
    """Route ``layer``'s weight reads and writes through ``engine`` (its class is wrapped if it was not)."""
    layer.__dict__[_ATTR] = engine
    _wrap_class(type(layer))


def register_variables(variables: Any, engine: Any) -> None:
    """Mark ``variables`` as held by ``engine``: any layer reading or writing them gathers them first."""
    for v in variables:
        v.__dict__[_ATTR] = engine


def engine_of(obj: Any) -> Optional[Any]:
    """The stage-3 engine a layer or variable was registered with, or ``None``."""
    return obj.__dict__.get(_ATTR)


def install_access() -> None:
    """Wrap the weight methods of :class:`keras.layers.Layer` and of every subclass overriding them (idempotent)."""
    stack = [keras.layers.Layer]
    while stack:
        cls = stack.pop()
        _wrap_class(cls)
        stack.extend(cls.__subclasses__())


def _wrap_class(cls: type) -> None:
    for name in _METHODS:
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is not None:
            _wrap(owner, name)


def _wrap(cls: type, name: str) -> None:
    original = cls.__dict__[name]
    if getattr(original, _MARK, False):
        return
    touches, write_back = _METHODS[name]
    wrapped = functools.wraps(original)(_gathering(original, touches, write_back))
    setattr(wrapped, _MARK, True)
    setattr(cls, name, wrapped)


def _gathering(original: Callable[..., Any], touches: str, write_back: bool) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        variables = (list(self.weights) if touches == "all"
                     else list(self._trainable_variables) + list(self._non_trainable_variables))
        engine = next((v.__dict__[_ATTR] for v in variables if _ATTR in v.__dict__), None)
        if engine is None:
            return original(self, *args, **kwargs)
        gathered = engine.gather(engine.units_of(variables))
        try:
            return original(self, *args, **kwargs)
        finally:
            engine.release(gathered, write_back)

    return method


@contextlib.contextmanager
def full_weights(model: Any) -> Iterator[Any]:
    """Collective: every variable of ``model`` whole on every rank inside the block, assignments kept.

    Like FSDP's ``summon_full_params(writeback=True)``: on entry the whole model is
    gathered (one layer at a time), on exit the values are cut back into this rank's
    shards and freed. Every rank enters it; inside, one rank alone may read or save.
    Do not run the model inside (its forward frees what it gathers). A model not
    trained with a stage-3 ``ZeroOptimizer`` passes through unchanged.
    """
    engine = model.__dict__.get(_ATTR) or next(
        (v.__dict__[_ATTR] for v in getattr(model, "weights", []) if _ATTR in v.__dict__), None)
    if engine is None:
        if not isinstance(model, keras.layers.Layer):
            raise ConfigError(f"full_weights takes a Keras model, got {type(model).__name__}")
        yield model
        return
    gathered = engine.gather(engine.units)
    try:
        yield model
    finally:
        engine.release(gathered, True)
