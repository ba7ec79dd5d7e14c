"""Vocabulary parallelism for a causal LM: the token table and the LM head split by vocabulary over tp.

Megatron's ``VocabParallelEmbedding`` and its parallel LM head: tensor-parallel rank
``r`` keeps the rows of token ids ``[start, end)`` (:func:`~shardwise.core.placement.uneven_range`:
blocks of ``ceil(V / tp)``, so a vocabulary the degree does not divide needs no padding
row). A lookup of an id another rank owns gives zeros and the tp group sums the rows; the
head computes only this rank's slice of the logits, and :func:`vocab_parallel_lm_loss`
takes the cross-entropy across the slices without ever forming the full ``[tokens x V]``
logits. A head tied to the token table keeps sharing its (sharded) weight.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ....core.comm import Communicator
from ....core.errors import ConfigError
from ....core.placement import Placement, uneven_range
from ....core.tp_rules import FamilyRules
from .module_paths import get_module, set_module
from .tensor_parallel import copy_to_tp_region, reduce_from_tp_region, vocab_parallel_cross_entropy
from .tp_apply import set_placement, set_tp_sharded

__all__ = ["VocabShardedEmbedding", "VocabShardedHead", "apply_vocab_parallel", "vocab_parallel_lm_loss"]


class VocabShardedEmbedding(nn.Module):
    """Token embedding holding the rows of ids ``[start, end)``; lookups are summed over the tp group."""

    def __init__(self, weight: nn.Parameter, start: int, end: int, tp_comm: Communicator,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        self.weight, self.start, self.end, self.tp_comm = weight, start, end, tp_comm
        self.padding_idx = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight, self.padding_idx)
        return reduce_from_tp_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_comm)

    def extra_repr(self) -> str:
        return f"rows=[{self.start}, {self.end}), tp={self.tp_comm.size}"


class VocabShardedHead(nn.Module):
    """LM head computing the logits of ids ``[start, end)`` only (its input's gradient is summed over tp)."""

    def __init__(self, weight: nn.Parameter, start: int, end: int, tp_comm: Communicator) -> None:
        super().__init__()
        self.weight, self.start, self.end, self.tp_comm = weight, start, end, tp_comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp_region(hidden, self.tp_comm), self.weight)

    def extra_repr(self) -> str:
        return f"logits of ids [{self.start}, {self.end}), tp={self.tp_comm.size}"


def vocab_parallel_lm_loss(logits: torch.Tensor, ids: torch.Tensor, *, tp_comm: Communicator, start: int,
                           vocab_size: int) -> torch.Tensor:
    """Mean next-token cross-entropy of this rank's logits slice (ids ``[start, start + slice)``)."""
    per_token = vocab_parallel_cross_entropy(logits[:, :-1].float(), ids[:, 1:], tp_comm, vocab_size, start)
    return per_token.mean()


def _rows(weight: torch.Tensor, start: int, end: int, placement: Placement) -> nn.Parameter:
    if weight.is_meta:
        local = nn.Parameter(torch.empty((end - start,) + tuple(weight.shape[1:]), device="meta", dtype=weight.dtype))
    else:
        local = nn.Parameter(weight.detach()[start:end].clone())
    set_tp_sharded(local)
    set_placement(local, placement)
    return local


@torch.no_grad()
def apply_vocab_parallel(model: nn.Module, rules: FamilyRules, tp_comm: Communicator) -> tuple[int, int, int]:
    """Split ``model``'s token table and LM head by vocabulary over ``tp_comm``, in place.

    Returns this rank's ids ``(start, end)`` and the vocabulary size.
    """
    embed_path, head_path = rules.embed[0], rules.final[-1]
    embed, head = get_module(model, embed_path), get_module(model, head_path)
    if type(embed) is not nn.Embedding or embed.max_norm is not None:
        raise ConfigError(f"vocab_parallel needs {embed_path} to be a plain nn.Embedding, got {type(embed).__name__}")
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ConfigError(f"vocab_parallel needs {head_path} to be a bias-free nn.Linear, got {head}")
    vocab = embed.weight.shape[0]
    if head.weight.shape[0] != vocab:
        raise ConfigError(f"vocab_parallel: {head_path} has {head.weight.shape[0]} outputs, the vocabulary "
                          f"{vocab} rows")
    start, end = uneven_range(vocab, tp_comm.size, tp_comm.rank)
    tied = head.weight is embed.weight
    def split(path: str, weight: torch.Tensor) -> nn.Parameter:
        return _rows(weight, start, end, Placement(f"{path}.weight", tuple(weight.shape), 0, 1, tp_comm.size,
                                                   tp_comm.rank, uneven=True))

    table = split(embed_path, embed.weight)
    head_weight = table if tied else split(head_path, head.weight)
    set_module(model, embed_path, VocabShardedEmbedding(table, start, end, tp_comm, embed.padding_idx))
    set_module(model, head_path, VocabShardedHead(head_weight, start, end, tp_comm))
    return start, end, vocab
