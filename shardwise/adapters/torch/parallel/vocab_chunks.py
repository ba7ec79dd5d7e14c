"""The embedding table and LM head cut into row chunks, so that ZeRO-3 gathers one chunk at a time.

With a 50K vocabulary the token table and the LM head are GPT-2 small's largest tensors,
5.5 transformer layers each. ZeRO-3 gathers a unit whole and reduces its whole gradient,
so a rank would hold a gathered table plus its gradient (2 x 147 MiB) during its backward,
whatever the data-parallel size. :func:`chunk_vocabulary` replaces each by chunks of about
one layer's size: :class:`ChunkedEmbedding` sums masked lookups (exactly one chunk holds a
token, the others add exact zeros), :class:`ChunkedLinear` concatenates the chunks' logits.
Each chunk is its own ZeRO-3 unit, and its parameter keeps the one-process name with the
rows it holds (:class:`~shardwise.core.placement.Placement` ``bounds``), so checkpoints,
pretrained weights and exports see the whole tensors.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from torch import nn

from ....core.placement import Placement
from ....core.tp_rules import FamilyRules
from .module_paths import get_module, set_module
from .stages import embedding_tables
from .tp_apply import set_placement

__all__ = ["ChunkedEmbedding", "ChunkedLinear", "chunk_vocabulary", "chunk_bounds", "zero3_wrap"]


def chunk_bounds(rows: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """``chunks`` contiguous row ranges covering ``rows``, the first ``rows % chunks`` one row longer."""
    base, extra = divmod(rows, chunks)
    out, start = [], 0
    for i in range(chunks):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return tuple(out)


class ChunkedEmbedding(nn.Module):
    """An embedding table as row chunks; a lookup is the sum of each chunk's masked lookup."""

    def __init__(self, parts: list[nn.Embedding], bounds: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.parts, self.bounds = nn.ModuleList(parts), bounds

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: Optional[torch.Tensor] = None
        for (start, stop), part in zip(self.bounds, self.parts):
            inside = (ids >= start) & (ids < stop)
            y = part(torch.where(inside, ids - start, 0)) * inside.unsqueeze(-1).to(part.weight.dtype)
            out = y if out is None else out + y
        return out


class ChunkedLinear(nn.Module):
    """A bias-free linear whose output features are row chunks of the weight; outputs concatenated."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _cut_rows(weight: torch.Tensor, bounds: tuple[tuple[int, int], ...], name: str) -> list[nn.Parameter]:
    out = []
    for start, stop in bounds:
        piece = nn.Parameter(weight.detach()[start:stop].clone(), requires_grad=weight.requires_grad)
        set_placement(piece, Placement(name, tuple(weight.shape), 0, bounds=((start, stop),)))
        out.append(piece)
    return out


def _forward_reads_weight(model: nn.Module, embed_path: str) -> bool:
    """Whether the forward of the table's owner (or of ``model``) reads ``<table>.weight`` itself
    (Llama 4: ``input_ids.to(self.embed_tokens.weight.device)``), which a chunked table has not."""
    owner_path, _, attr = embed_path.rpartition(".")
    needle = f"{attr}.weight"
    for module in {id(m): m for m in (model, get_module(model, owner_path) if owner_path else model)}.values():
        try:
            if needle in inspect.getsource(type(module).forward):
                return True
        except (OSError, TypeError):
            continue
    return False


@torch.no_grad()
def chunk_vocabulary(model: nn.Module, rules: FamilyRules, unit_numel: int) -> int:
    """Cut ``model``'s token table and (untied, bias-free) LM head into chunks of about ``unit_numel``
    elements, at least two; returns the number of chunks (0 where nothing is cut: a tied head, or
    a table with a padding index, keep their single unit)."""
    embed_path, head_path = rules.embed[0], rules.final[-1]
    embed, head = get_module(model, embed_path), get_module(model, head_path)
    if type(embed) is not nn.Embedding or embed.padding_idx is not None or embed.max_norm is not None:
        return 0
    if not isinstance(head, nn.Linear) or head.bias is not None or head.weight is embed.weight:
        return 0
    if _forward_reads_weight(model, embed_path):
        return 0
    rows = embed.weight.shape[0]
    chunks = min(rows, max(2, math.ceil(embed.weight.numel() / max(unit_numel, 1))))
    bounds = chunk_bounds(rows, chunks)
    tables = []
    for piece in _cut_rows(embed.weight, bounds, f"{embed_path}.weight"):
        table = nn.Embedding(piece.shape[0], piece.shape[1], device="meta", dtype=piece.dtype)  # draws nothing
        table.weight = piece
        tables.append(table)
    linears = []
    for piece in _cut_rows(head.weight, bounds, f"{head_path}.weight"):
        linear = nn.Linear(piece.shape[1], piece.shape[0], bias=False, device="meta", dtype=piece.dtype)
        linear.weight = piece
        linears.append(linear)
    set_module(model, embed_path, ChunkedEmbedding(tables, bounds))
    set_module(model, head_path, ChunkedLinear(linears))
    return chunks


def zero3_wrap(stage: nn.Module) -> list[nn.Module]:
    """The modules that are ZeRO-3 units of one stage: each chunk of a chunked table or head, each
    table of an embedding stage, the head's norm, or else the whole stage."""
    if isinstance(stage, (ChunkedEmbedding, ChunkedLinear)):
        return list(stage.parts)
    tables = embedding_tables(stage)
    if tables:
        return [unit for table in tables for unit in zero3_wrap(table)]
    if isinstance(stage, nn.Sequential) and any(isinstance(m, ChunkedLinear) for m in stage):
        return [unit for m in stage for unit in zero3_wrap(m)]
    return [stage]
