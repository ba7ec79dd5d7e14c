"""Initial table values that any shard can draw alone, equal to those of the whole table drawn at once.

Rows are drawn in blocks of :data:`BLOCK_ROWS`, each from a generator seeded by the seed, the
table's name and the block index, uniform in ``±sqrt(1 / num_embeddings)`` (TorchRec's default).
A shard draws only the blocks its rows touch, so no rank ever holds a whole table it does not own,
and one process building the unsharded ``nn.EmbeddingBag`` from :func:`full_table` starts from
the same values.
"""

from __future__ import annotations

import zlib

import torch

from ....core.embedding_plan import TableConfig

__all__ = ["BLOCK_ROWS", "init_rows", "full_table"]

BLOCK_ROWS = 4096


def _block(table: TableConfig, seed: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    rows = min(BLOCK_ROWS, table.num_embeddings - index * BLOCK_ROWS)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(table.name.encode()) * 65_537 + index)
                                        % (2 ** 63))
    bound = (1.0 / table.num_embeddings) ** 0.5
    return torch.empty(rows, table.embedding_dim, dtype=dtype).uniform_(-bound, bound, generator=gen)


def init_rows(table: TableConfig, seed: int, rows: tuple[int, int], cols: tuple[int, int],
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``[rows[0], rows[1])`` and columns ``[cols[0], cols[1])`` of the table's initial values."""
    out = torch.empty(rows[1] - rows[0], cols[1] - cols[0], dtype=dtype)
    first, last = rows[0] // BLOCK_ROWS, (rows[1] - 1) // BLOCK_ROWS if rows[1] > rows[0] else -1
    for index in range(first, last + 1):
        block = _block(table, seed, index, dtype)
        lo, hi = max(rows[0], index * BLOCK_ROWS), min(rows[1], index * BLOCK_ROWS + block.shape[0])
        out[lo - rows[0]:hi - rows[0]] = block[lo - index * BLOCK_ROWS:hi - index * BLOCK_ROWS, cols[0]:cols[1]]
    return out


def full_table(table: TableConfig, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole table's initial values (for a one-process reference or a replicated model)."""
    return init_rows(table, seed, (0, table.num_embeddings), (0, table.embedding_dim), dtype)
