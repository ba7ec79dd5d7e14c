"""Embedding tables sharded over the ranks, for recommendation models: ``from shardwise.torch.embedding import ...``.

:func:`plan_tables` places each :class:`TableConfig` (table-, row-, column- or table-row-wise) in an
:class:`EmbeddingPlan`; :class:`ShardedEmbeddingBagCollection` looks up :class:`KeyedJaggedTensor`
batches with all-to-alls; :class:`SparseOptimizer` steps only the rows looked up;
:func:`save_embedding_checkpoint`/:func:`load_embedding_checkpoint` write and read the tables alone
(``shardwise.checkpoint.save`` takes them with the rest of the model, and a :class:`CombinedOptimizer`
with all it steps); :func:`full_table` gives a table's whole initial values, the same for every plan
and world size, :func:`full_tables` the current ones; :class:`ShardedEmbeddingCollection` gives
unpooled rows (sequence features); ``as_table_configs``/``as_kjt``/``load_torchrec_state_dict``/
``torchrec_state_dict`` move a TorchRec model in and out.

A thin re-export of ``shardwise.adapters.torch.embedding``.
"""

from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint, save_embedding_checkpoint
from shardwise.adapters.torch.embedding import (CombinedOptimizer, EmbeddingPlan, JaggedTensor, KeyedJaggedTensor,
                                                ShardedEmbeddingBagCollection, ShardedEmbeddingCollection,
                                                ShardingType, SparseOptimizer, TableConfig, as_kjt, as_table_configs,
                                                full_table, full_tables, init_rows, load_full_tables,
                                                load_torchrec_state_dict, plan_tables, torchrec_state_dict)

__all__ = ["ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection", "KeyedJaggedTensor", "JaggedTensor",
           "SparseOptimizer", "CombinedOptimizer", "TableConfig", "EmbeddingPlan", "ShardingType", "plan_tables",
           "full_table", "init_rows", "full_tables", "load_full_tables", "save_embedding_checkpoint",
           "load_embedding_checkpoint", "as_table_configs", "as_kjt", "load_torchrec_state_dict",
           "torchrec_state_dict"]
