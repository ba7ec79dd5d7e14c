"""``DistributedOptimizer``: Horovod's optimizer wrapper, as composition instead of a dynamic subclass.

The wrapper is a static subclass of ``torch.optim.Optimizer`` (so LR schedulers
accept it) that delegates ``param_groups``, ``state``, ``defaults``,
``state_dict``, ``load_state_dict`` and ``step`` to the wrapped optimizer.
Gradients are averaged by a :class:`GradientSynchronizer` whose allreduces start
during backward; :meth:`DistributedOptimizer.step` waits for them first.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from shardwise.backends.local import LocalCommunicator
from shardwise.core.buckets import DEFAULT_BUCKET_CAP_BYTES
from shardwise.core.errors import ConfigError, ShardwiseError

from .compiling import not_traced
from .compression import Compression, Compressor
from .grad_sync import GradientSynchronizer
from .ops import Average
from ..horovod.process_sets import ProcessSet, comm_of, global_process_set

__all__ = ["DistributedOptimizer"]


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters in param-group order, with Horovod's name checks."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ConfigError("named_parameters should be a sequence of (name, parameter) tuples, "
                          "usually model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"parameter names in named_parameters must be unique; duplicates: {', '.join(dups)}")
    by_id = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ConfigError(f"named_parameters was given but {len(unnamed)} optimizer parameter(s) have no name "
                          f"(positions {unnamed[:5]} in param-group order)")
    return [(by_id[id(p)], p) for p in params]


class DistributedOptimizer(torch.optim.Optimizer):
    """Average gradients over ``process_set`` before ``optimizer.step()`` (collective to build).

    Horovod's arguments: ``backward_passes_per_step=k`` accumulates ``k``
    backward passes locally (summed, as Horovod's torch optimizer does; set
    ``average_aggregated_gradients=True`` to divide by ``k``) before one
    allreduce; ``gradient_predivide_factor=f`` divides by ``f`` before the sum
    and multiplies by ``f/size`` after. ``op=Adasum`` is not supported.
    ``num_groups`` and ``groups`` are accepted and ignored: gradients are fused
    into buckets of at most ``bucket_cap_bytes``. Sparse gradients are reduced
    dense (as with ``sparse_as_dense=True``). A gradient that is ``None`` on every
    rank stays ``None``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                 compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                 op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set, *,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 average_aggregated_gradients: bool = False) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: all state lives in ``optimizer``.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("the optimizer is already a DistributedOptimizer")
        self._optimizer = optimizer
        # As in Horovod, a rank outside ``process_set`` steps on its own gradients.
        comm = comm_of(process_set) if process_set is None or process_set.included() else LocalCommunicator()
        self._synchronizer = GradientSynchronizer(
            _named(optimizer, named_parameters), comm, op=op, compression=compression,
            bucket_cap_bytes=bucket_cap_bytes, backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients)
        self._should_synchronize = True
        self._synchronized = False

    # -- delegation -----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(inner, name)

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each synchronised parameter's name (Horovod's attribute, read by its tests and tools)."""
        return {p: n for n, p in zip(self._synchronizer.names, self._synchronizer.params)}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def synchronizer(self) -> GradientSynchronizer:
        """The gradient synchroniser (bucket layout, hooks)."""
        return self._synchronizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``state_dict()``."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load into the wrapped optimizer (outside a step: no gradients may be pending)."""
        self._check_idle("load_state_dict()")
        self._optimizer.load_state_dict(state_dict)
        self._synchronized = False

    def rebind(self, comm: Any) -> None:
        """Reduce over ``comm`` from now on (an elastic job re-formed; collective over ``comm``)."""
        self._synchronizer.rebind(comm)
        self.drop_step()

    def drop_step(self) -> None:
        """Forget the step in flight and its gradients, without any collective."""
        self._synchronizer.drop_step()
        self._synchronized = False
        for p in self._synchronizer.params:
            p.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: parameter groups must be complete before wrapping."""
        raise ConfigError("add parameter groups to the optimizer before wrapping it in DistributedOptimizer")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    # -- Horovod API -------------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        if self._synchronizer.pending:
            raise ShardwiseError(f"optimizer.{what} was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(); this is prohibited as "
                                 "gradients are still being reduced")

    @not_traced
    def synchronize(self) -> None:
        """Wait for the gradient allreduces of this step (issuing those not yet started)."""
        self._synchronizer.synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make :meth:`step` skip synchronisation (after an explicit :meth:`synchronize`)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @not_traced  # inside a compiled train step: run eagerly, collectives and wrapped optimizer
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Synchronise gradients (unless already done) and step the wrapped optimizer."""
        if self._should_synchronize and self._synchronized:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(); the gradients are not reduced again, but use "
                          "optimizer.skip_synchronize() to say so", stacklevel=2)
        elif self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    @not_traced
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (refused while a step's gradients are being reduced)."""
        self._check_idle("zero_grad()")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated per step."""
        self._check_idle("set_backward_passes_per_step()")
        if int(passes) < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        self._synchronizer.passes_per_step = int(passes)

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally per allreduce."""
        return self._synchronizer.passes_per_step
