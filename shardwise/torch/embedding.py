"""Embedding tables sharded over the ranks, for recommendation models: ``from shardwise.torch.embedding import ...``.

:func:`plan_tables` places each :class:`TableConfig` (table-, row-, column- or table-row-wise) in an
:class:`EmbeddingPlan`; :class:`ShardedEmbeddingBagCollection` looks up :class:`KeyedJaggedTensor`
batches with all-to-alls; :class:`SparseOptimizer` steps only the rows looked up;
:func:`save_embedding_checkpoint`/:func:`load_embedding_checkpoint` write and read the tables alone
(``shardwise.checkpoint.save`` takes them with the rest of the model); :func:`full_table` gives a
table's whole initial values, the same for every plan and world size.

A thin re-export of ``shardwise.adapters.torch.embedding``.
"""

from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint, save_embedding_checkpoint
from shardwise.adapters.torch.embedding import (EmbeddingPlan, KeyedJaggedTensor, ShardedEmbeddingBagCollection,
                                                ShardingType, SparseOptimizer, TableConfig, full_table, init_rows,
                                                plan_tables)

__all__ = ["ShardedEmbeddingBagCollection", "KeyedJaggedTensor", "SparseOptimizer", "TableConfig", "EmbeddingPlan",
           "ShardingType", "plan_tables", "full_table", "init_rows", "save_embedding_checkpoint",
           "load_embedding_checkpoint"]
