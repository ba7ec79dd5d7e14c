"""Optimizers for sharded tables that touch only the rows looked up since the last step.

``sgd``: ``row -= lr * grad``. ``adagrad``: torch's ``Adagrad`` (one accumulator per element,
``row -= lr * grad / (sqrt(acc) + eps)``), which on a dense gradient leaves untouched rows alone
too, so a one-process ``torch.optim.Adagrad`` over the whole tables is the reference.
``rowwise_adagrad``: FBGEMM's and TorchRec's row-wise Adagrad, one accumulator per row holding
the mean of the squared gradient; with column-wise sharding each column block keeps its own
(as TorchRec does), so it equals the unsharded optimizer for table- and row-wise tables only.
The state lives with the rows, on the shard's rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ....core.embedding_plan import OPTIMIZER_STATE_PER_ELEMENT
from ....core.errors import ConfigError
from .collection import ShardedEmbeddingBagCollection

__all__ = ["SparseOptimizer"]


class SparseOptimizer:
    """Steps the shards of ``collection`` with the row gradients its backward kept."""

    def __init__(self, collection: ShardedEmbeddingBagCollection, kind: str = "sgd", *, lr: float = 0.01,
                 eps: float = 1e-10, initial_accumulator_value: float = 0.0) -> None:
        if kind not in OPTIMIZER_STATE_PER_ELEMENT:
            raise ConfigError(f"sparse optimizer must be one of {sorted(OPTIMIZER_STATE_PER_ELEMENT)}, got {kind!r}")
        if not lr > 0:
            raise ConfigError(f"lr must be > 0, got {lr!r}")
        self.collection, self.kind, self.lr, self.eps = collection, kind, float(lr), float(eps)
        self.state: dict[str, torch.Tensor] = {}
        for name in collection.shard_names():
            shard = collection.shard(name)
            if kind == "adagrad":
                self.state[name] = torch.full_like(shard, initial_accumulator_value)
            elif kind == "rowwise_adagrad":
                self.state[name] = torch.full((shard.shape[0],), initial_accumulator_value, dtype=shard.dtype,
                                              device=shard.device)

    @torch.no_grad()
    def step(self) -> None:
        """Apply and clear the pending row gradients (local work: the lookups already exchanged them)."""
        for name, (rows, grad) in self.collection.sparse_grads().items():
            weight = self.collection.shard(name)
            if self.kind == "sgd":
                weight.index_add_(0, rows, grad, alpha=-self.lr)
                continue
            acc = self.state[name]
            if self.kind == "adagrad":
                acc.index_add_(0, rows, grad * grad)
                update = grad / (acc[rows].sqrt() + self.eps)
            else:
                acc.index_add_(0, rows, (grad * grad).mean(dim=1))
                update = grad / (acc[rows].sqrt() + self.eps).unsqueeze(1)
            weight.index_add_(0, rows, update, alpha=-self.lr)
        self.zero_grad()

    def zero_grad(self) -> None:
        """Drop the pending row gradients."""
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
