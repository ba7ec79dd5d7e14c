"""Initial embedding-table values that any shard draws alone, equal to those of the whole table drawn
at once, the same under every framework.

Rows are drawn in blocks of :data:`BLOCK_ROWS`. Block ``i`` of a table comes from a counter-based
generator (Philox, numpy's) keyed by the seed, the table's name and ``i``, uniform in
``±sqrt(1 / num_embeddings)`` (TorchRec's default). A shard draws only the blocks its rows touch,
so no rank holds a whole table it does not own, and the torch and Keras tables (on any Keras
backend) start from the same values.
"""

from __future__ import annotations

import zlib

import numpy as np

from .embedding_plan import TableConfig

__all__ = ["BLOCK_ROWS", "init_rows", "full_table"]

BLOCK_ROWS = 4096


def _block(table: TableConfig, seed: int, index: int) -> np.ndarray:
    rows = min(BLOCK_ROWS, table.num_embeddings - index * BLOCK_ROWS)
    key = ((seed % 2 ** 64) << 64) | (zlib.crc32(table.name.encode()) << 32) | (index % 2 ** 32)
    bound = (1.0 / table.num_embeddings) ** 0.5
    return np.random.Generator(np.random.Philox(key=key)).uniform(-bound, bound, (rows, table.embedding_dim))


def init_rows(table: TableConfig, seed: int, rows: tuple[int, int], cols: tuple[int, int],
              dtype: np.dtype = np.float32) -> np.ndarray:
    """Rows ``[rows[0], rows[1])`` and columns ``[cols[0], cols[1])`` of the table's initial values."""
    out = np.empty((rows[1] - rows[0], cols[1] - cols[0]), dtype=dtype)
    first, last = rows[0] // BLOCK_ROWS, (rows[1] - 1) // BLOCK_ROWS if rows[1] > rows[0] else -1
    for index in range(first, last + 1):
        block = _block(table, seed, index)
        lo, hi = max(rows[0], index * BLOCK_ROWS), min(rows[1], index * BLOCK_ROWS + block.shape[0])
        out[lo - rows[0]:hi - rows[0]] = block[lo - index * BLOCK_ROWS:hi - index * BLOCK_ROWS, cols[0]:cols[1]]
    return out


def full_table(table: TableConfig, seed: int, dtype: np.dtype = np.float32) -> np.ndarray:
    """The whole table's initial values (for a one-process reference or a replicated model)."""
    return init_rows(table, seed, (0, table.num_embeddings), (0, table.embedding_dim), dtype)
