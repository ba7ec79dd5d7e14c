"""Embedding tables bigger than one rank for recommendation models (TorchRec's sharded EmbeddingBagCollection).

:class:`ShardedEmbeddingBagCollection` splits tables over ranks by a
:class:`~shardwise.core.embedding_plan.EmbeddingPlan` (table-, row-, column- or
table-row-wise) and looks up :class:`KeyedJaggedTensor` batches with all-to-alls;
:class:`SparseOptimizer` steps only the rows looked up. The dense part of the model stays
data parallel (:class:`~shardwise.adapters.torch.optimizer.DistributedOptimizer`).
"""

from ....core.embedding_plan import EmbeddingPlan, ShardingType, TableConfig, plan_tables
from .collection import ShardedEmbeddingBagCollection
from .jagged import KeyedJaggedTensor
from .sparse_optim import SparseOptimizer
from .table_init import full_table, init_rows

__all__ = ["ShardedEmbeddingBagCollection", "KeyedJaggedTensor", "SparseOptimizer", "TableConfig", "EmbeddingPlan",
           "ShardingType", "plan_tables", "full_table", "init_rows"]
