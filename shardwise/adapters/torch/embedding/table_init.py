"""Initial table values as torch tensors: :mod:`shardwise.core.table_init`'s, which any shard draws
alone and every framework shares."""

from __future__ import annotations

import torch

from ....core import table_init
from ....core.embedding_plan import TableConfig

__all__ = ["BLOCK_ROWS", "init_rows", "full_table"]

BLOCK_ROWS = table_init.BLOCK_ROWS


def init_rows(table: TableConfig, seed: int, rows: tuple[int, int], cols: tuple[int, int],
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``[rows[0], rows[1])`` and columns ``[cols[0], cols[1])`` of the table's initial values."""
    return torch.from_numpy(table_init.init_rows(table, seed, rows, cols)).to(dtype)


def full_table(table: TableConfig, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole table's initial values (for a one-process reference or a replicated model)."""
    return init_rows(table, seed, (0, table.num_embeddings), (0, table.embedding_dim), dtype)
