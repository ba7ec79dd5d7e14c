"""Optimizers for sharded tables that touch only the rows looked up since the last step.

``sgd``: ``row -= lr * grad``. ``adagrad``: torch's ``Adagrad`` (one accumulator per element,
``row -= lr * grad / (sqrt(acc) + eps)``), which on a dense gradient leaves untouched rows alone
too, so a one-process ``torch.optim.Adagrad`` over the whole tables is the reference.
``rowwise_adagrad``: FBGEMM's and TorchRec's row-wise Adagrad, one accumulator per row holding
the mean of the squared gradient; with column-wise sharding each column block keeps its own
(as TorchRec does), so it equals the unsharded optimizer for table- and row-wise tables only.
The state lives with the rows, on the shard's rank: for a collection that keeps its shards in one
buffer per width, in one state buffer per width too (:attr:`SparseOptimizer.state` holds views of it).
"""

from __future__ import annotations

from typing import Any

import torch

from ....core.embedding_plan import OPTIMIZER_STATE_PER_ELEMENT
from ....core.errors import ConfigError

__all__ = ["SparseOptimizer"]


class SparseOptimizer:
    """Steps the shards of ``collection`` with the row gradients its backward kept.

    ``collection`` is a :class:`~.collection.ShardedEmbeddingBagCollection` or any collection of
    shards with ``shard_names()``, ``shard(name)``, ``sparse_grads()`` and ``clear_grads()`` (a
    :class:`~.sequence.ShardedEmbeddingCollection`). ``step()`` is collective where the collection
    has ``data_parallel`` tables (their gradients are all-reduced then).
    """

    def __init__(self, collection: Any, kind: str = "sgd", *, lr: float = 0.01,
                 eps: float = 1e-10, initial_accumulator_value: float = 0.0) -> None:
        if kind not in OPTIMIZER_STATE_PER_ELEMENT:
            raise ConfigError(f"sparse optimizer must be one of {sorted(OPTIMIZER_STATE_PER_ELEMENT)}, got {kind!r}")
        if not lr > 0:
            raise ConfigError(f"lr must be > 0, got {lr!r}")
        self.collection, self.kind, self.lr, self.eps = collection, kind, float(lr), float(eps)
        self._fused = hasattr(collection, "fused_grads")
        #: shard name -> its accumulators (views of the per-width state buffers of a fused collection)
        self.state: dict[str, torch.Tensor] = {}
        self._fused_state: dict[str, torch.Tensor] = {}
        if kind == "sgd":
            return
        if self._fused:
            for buffer, values in collection.buffers_by_width().items():
                shape = values.shape if kind == "adagrad" else values.shape[:1]
                self._fused_state[buffer] = torch.full(shape, initial_accumulator_value, dtype=values.dtype,
                                                       device=values.device)
            for name in collection.shard_names():
                buffer, base, rows = collection.shard_rows(name)
                self.state[name] = self._fused_state[buffer][base:base + rows]
            return
        for name in collection.shard_names():
            shard = collection.shard(name)
            shape = shard.shape if kind == "adagrad" else shard.shape[:1]
            self.state[name] = torch.full(shape, initial_accumulator_value, dtype=shard.dtype, device=shard.device)

    @torch.no_grad()
    def step(self) -> None:
        """Apply and clear the pending row gradients (local work, but for data_parallel tables' all-reduce)."""
        if self._fused and self.kind == "sgd":  # repeated rows add up as they come: no need to merge them
            self.collection.add_grads(-self.lr)
        elif self._fused:
            weights = self.collection.buffers_by_width()
            for buffer, (rows, grad) in self.collection.fused_grads().items():
                rows, inverse = torch.unique(rows, return_inverse=True)
                grad = torch.zeros(rows.numel(), grad.shape[1], dtype=grad.dtype,
                                   device=grad.device).index_add_(0, inverse, grad)
                self._update(weights[buffer], self._fused_state[buffer], rows, grad)
        else:
            for name, (rows, grad) in self.collection.sparse_grads().items():
                weight = self.collection.shard(name)
                if self.kind == "sgd":
                    weight.index_add_(0, rows, grad, alpha=-self.lr)
                else:
                    self._update(weight, self.state[name], rows, grad)
        self.zero_grad()

    def _update(self, weight: torch.Tensor, acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """One Adagrad update of distinct ``rows`` with their summed gradients."""
        if self.kind == "adagrad":
            acc.index_add_(0, rows, grad * grad)
            update = grad / (acc[rows].sqrt() + self.eps)
        else:
            acc.index_add_(0, rows, (grad * grad).mean(dim=1))
            update = grad / (acc[rows].sqrt() + self.eps).unsqueeze(1)
        weight.index_add_(0, rows, update, alpha=-self.lr)

    def zero_grad(self) -> None:
        """Drop the pending row gradients."""
        clear = getattr(self.collection, "clear_grads", None)
        if clear is not None:
            clear()
        else:
            self.collection.pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """The accumulators of this rank's shards."""
        return {"kind": self.kind, "lr": self.lr, "eps": self.eps, "state": dict(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same plan and rank)."""
        if state.get("kind") != self.kind:
            raise ConfigError(f"optimizer state of {state.get('kind')!r}, but this optimizer is {self.kind!r}")
        for name, value in state["state"].items():
            self.state[name].copy_(value)
