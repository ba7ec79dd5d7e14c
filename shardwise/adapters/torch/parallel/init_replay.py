"""Initial weights of a model built on the meta device, one tensor at a time, as a normal build draws them.

``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)`` allocates
nothing and draws nothing. :func:`record_init` builds the same model once more under a
dispatch mode that keeps every tensor of ``threshold`` elements or more on the meta
device and logs, per tensor, the in-place operations that write it (``normal_``,
``zero_``, ``mul_``, ...). Each random operation is also run on a scratch CPU tensor of
the same size, so the global generator advances exactly as in a normal build, and the
generator state before it is kept. :meth:`InitRecord.full` then replays one tensor's
log on a fresh CPU tensor: the value the normal build would have given it, while the
rest of the model is never allocated. Smaller tensors (norms, biases, rotary
buffers) are built for real.

The replay is exact for code that writes large tensors only in place (every
``torch.nn.init`` function, Hugging Face's ``_init_weights``, ``reset_parameters``).
An out-of-place read of a large tensor during the build (``w.std()``) cannot be
replayed and raises :class:`UnreplayableInitError` naming the operation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ....core.errors import ConfigError

__all__ = ["InitRecord", "UnreplayableInitError", "record_init", "DEFAULT_THRESHOLD"]

#: Tensors with at least this many elements are kept on the meta device while recording.
DEFAULT_THRESHOLD = 1 << 16

_RANDOM = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_",
           "cauchy_"}
_RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like"}


class UnreplayableInitError(ConfigError):
    """The model's build does something to a large tensor that cannot be replayed one tensor at a time."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class _Write:
    """One in-place operation on (a view of) a tracked tensor."""

    view: tuple[tuple[int, ...], tuple[int, ...], int]
    func: Any
    args: tuple
    kwargs: dict
    rng: Optional[torch.Tensor]
    whole: bool


@dataclass
class _Tracked:
    shape: tuple[int, ...]
    dtype: torch.dtype
    writes: list[_Write] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold
        self.tracked: dict[int, _Tracked] = {}

    def _is_tracked(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_meta and _key(t) in self.tracked

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        flat = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        if not flat and "device" in {a.name for a in func._schema.arguments}:
            return self._factory(func, name, args, kwargs)
        if not any(self._is_tracked(a) for a in flat):
            return func(*args, **kwargs)
        first = args[0] if args else None
        writes_self = bool(func._schema.arguments and func._schema.arguments[0].alias_info is not None
                           and func._schema.arguments[0].alias_info.is_write)
        if writes_self and self._is_tracked(first):
            return self._in_place(func, name, first, args, kwargs)
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            return func(*args, **kwargs)  # a view (select, t, detach, alias): shares the tracked storage
        if name in ("_has_compatible_shallow_copy_type", "is_same_size"):
            return func(*args, **kwargs)
        raise UnreplayableInitError(
            f"the model's build reads a large tensor with {func._schema.name} out of place; it cannot be built "
            "one tensor at a time. Build it on the CPU, or raise threshold= above the tensor's size")

    def _factory(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        meta = func(*args, **{**kwargs, "device": torch.device("meta")})
        if not isinstance(meta, torch.Tensor) or meta.numel() < self.threshold:
            return func(*args, **kwargs)
        if name in _RANDOM_FACTORIES:
            raise UnreplayableInitError(f"the model's build draws a large tensor with {func._schema.name}; "
                                        "only in-place initialisation of large tensors can be replayed")
        self.tracked[_key(meta)] = _Tracked(tuple(meta.shape), meta.dtype)
        if name in ("zeros", "ones", "full"):
            value = {"zeros": 0, "ones": 1}.get(name, args[1] if len(args) > 1 else kwargs.get("fill_value"))
            self._log(meta, torch.ops.aten.fill_.Scalar, (value,), {}, None)
        return meta

    def _in_place(self, func: Any, name: str, target: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        if kwargs.get("generator") is not None:
            raise UnreplayableInitError(f"{func._schema.name} with an explicit generator cannot be replayed")
        rest = tuple(args[1:])
        for a in rest + tuple(kwargs.values()):
            if self._is_tracked(a):
                raise UnreplayableInitError(f"{func._schema.name} copies one large tensor into another during "
                                            "the build; it cannot be replayed one tensor at a time")
        rest = tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, rest)
        rng = None
        if name in _RANDOM:
            rng = torch.get_rng_state()
            scratch = torch.empty_strided(tuple(target.shape), tuple(target.stride()), dtype=target.dtype)
            func(scratch, *rest, **kwargs)  # advances the generator exactly as the real build does
        self._log(target, func, rest, kwargs, rng)
        return target

    def _log(self, target: torch.Tensor, func: Any, args: tuple, kwargs: dict, rng: Optional[torch.Tensor]) -> None:
        entry = self.tracked[_key(target)]
        numel = 1
        for s in entry.shape:
            numel *= s
        whole = target.numel() == numel and target.is_contiguous() and target.storage_offset() == 0
        view = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
        if whole and func._schema.name.split("::")[-1] in _RANDOM | {"fill_", "zero_", "copy_"}:
            entry.writes.clear()  # nothing written before survives this write
        entry.writes.append(_Write(view, func, args, kwargs, rng, whole))


class InitRecord:
    """A model built for real except its large tensors, whose initial values :meth:`full` replays."""

    def __init__(self, model: nn.Module, tracked: dict[int, _Tracked]) -> None:
        self.model = model
        self._by_name: dict[str, _Tracked] = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            if t is not None and t.is_meta and _key(t) in tracked:
                self._by_name.setdefault(name, tracked[_key(t)])
        self._tensors = dict(model.named_parameters(remove_duplicate=False))
        self._tensors.update(dict(model.named_buffers()))

    def names(self) -> list[str]:
        """Every parameter and buffer name of the model (tied parameters under each of their names)."""
        return list(self._tensors)

    def full(self, name: str) -> torch.Tensor:
        """The initial value of tensor ``name`` in full, on the CPU, as a normal build gives it."""
        if name not in self._tensors:
            raise ConfigError(f"the model has no parameter or buffer {name!r}")
        tracked = self._by_name.get(name)
        if tracked is None:
            return self._tensors[name].detach()
        out = torch.zeros(tracked.shape, dtype=tracked.dtype)
        saved = torch.get_rng_state()
        try:
            for w in tracked.writes:
                view = out.as_strided(*w.view)
                if w.rng is not None:
                    torch.set_rng_state(w.rng)
                w.func(view, *w.args, **w.kwargs)
        finally:
            torch.set_rng_state(saved)
        return out


def record_init(model: nn.Module, threshold: int = DEFAULT_THRESHOLD) -> InitRecord:
    """Record how ``model`` (built on the meta device) would have been initialised by a normal build.

    Advances the global CPU generator as that build would have. Hugging Face models are
    rebuilt from their config; other modules replay ``reset_parameters()`` of each layer.
    """
    recorder = _Recorder(threshold)
    config = getattr(model, "config", None)
    from_config: Optional[Callable[..., nn.Module]] = getattr(type(model), "_from_config", None)
    if config is not None and from_config is not None:
        with torch.device("cpu"), recorder:
            built = from_config(copy.deepcopy(config))
        return InitRecord(built, recorder.tracked)
    # A plain module: its layers drew their values in reset_parameters(), in registration order.
    built = copy.deepcopy(model)
    for t in list(built.parameters()) + list(built.buffers()):
        if not t.is_meta:
            raise ConfigError("record_init needs a model built on the meta device")
        recorder.tracked[_key(t)] = _Tracked(tuple(t.shape), t.dtype)
    with torch.device("cpu"), recorder:
        for m in built.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    return InitRecord(built, recorder.tracked)
