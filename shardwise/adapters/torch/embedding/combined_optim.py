"""Several optimizers stepped as one (TorchRec's ``CombinedOptimizer``): a recommendation model's dense
optimizer and its sharded tables' :class:`~.sparse_optim.SparseOptimizer`, so a training loop steps,
zeroes and checkpoints one object."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from ....core.errors import ConfigError

__all__ = ["CombinedOptimizer"]


def _kind(opt: Any) -> str:
    from .sparse_optim import SparseOptimizer

    return "sparse" if isinstance(opt, SparseOptimizer) else "dense"


class CombinedOptimizer:
    """Steps ``optimizers`` in the order given (a mapping ``{name: optimizer}``, or a sequence named
    ``dense``/``sparse`` by kind, numbered where a kind repeats).

    ``step()`` is collective where a part's step is (a data-parallel optimizer's all-reduce, the
    all-reduce of data_parallel tables): every rank steps the same parts in the same order.
    ``shardwise.checkpoint.save(dir, step, {"model": model, "optim": combined})`` saves every part,
    each as it saves alone (entries ``optim.<name>``).
    """

    def __init__(self, optimizers: Union[Mapping[str, Any], Sequence[Any]]) -> None:
        if isinstance(optimizers, Mapping):
            named = dict(optimizers)
        else:
            kinds = [_kind(o) for o in optimizers]
            named = {}
            for opt, kind in zip(optimizers, kinds):
                name = kind if kinds.count(kind) == 1 else f"{kind}{sum(1 for n in named if n.startswith(kind))}"
                named[name] = opt
        if not named:
            raise ConfigError("CombinedOptimizer needs at least one optimizer")
        bad = [n for n in named if not isinstance(n, str) or not n or any(c in n for c in "/#.")]
        if bad:
            raise ConfigError(f"optimizer names must be non-empty strings without '/', '#' or '.', got {bad}")
        for name, opt in named.items():
            if not callable(getattr(opt, "step", None)) or not callable(getattr(opt, "zero_grad", None)):
                raise ConfigError(f"optimizer {name!r} ({type(opt).__name__}) has no step()/zero_grad()")
        self.optimizers: dict[str, Any] = named

    def step(self, closure: Optional[Any] = None) -> None:
        """Step every optimizer, in order (``closure`` is not supported: sparse steps take none)."""
        if closure is not None:
            raise ConfigError("CombinedOptimizer.step takes no closure")
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every optimizer's gradients (the dense ones, the kept row gradients)."""
        for opt in self.optimizers.values():
            if _kind(opt) == "sparse":
                opt.zero_grad()
            else:
                opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        """The dense optimizers' parameter groups (what learning-rate schedules change)."""
        return [g for opt in self.optimizers.values() for g in getattr(opt, "param_groups", [])]

    def state_dict(self) -> dict[str, Any]:
        """``{name: that optimizer's state_dict()}``: this rank's view (sparse state is its shards')."""
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the same parts, plan and rank)."""
        if set(state) != set(self.optimizers):
            raise ConfigError(f"state of optimizers {sorted(state)}, but this CombinedOptimizer has "
                              f"{sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])
