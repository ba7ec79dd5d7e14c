"""Embedding tables bigger than one rank for recommendation models (TorchRec's sharded EmbeddingBagCollection).

:class:`ShardedEmbeddingBagCollection` splits tables over ranks by a
:class:`~shardwise.core.embedding_plan.EmbeddingPlan` (table-, row-, column- or
table-row-wise) and looks up :class:`KeyedJaggedTensor` batches with all-to-alls;
:class:`SparseOptimizer` steps only the rows looked up. The dense part of the model stays
data parallel (:class:`~shardwise.adapters.torch.optimizer.DistributedOptimizer`); :class:`CombinedOptimizer`
steps both. :class:`ShardedEmbeddingCollection` gives each id's row unpooled (sequence features);
:mod:`.torchrec_interop` takes TorchRec's configs, batches and state_dicts in and out.
"""

from ....core.embedding_plan import EmbeddingPlan, ShardingType, TableConfig, plan_tables
from .collection import ShardedEmbeddingBagCollection
from .combined_optim import CombinedOptimizer
from .jagged import KeyedJaggedTensor
from .sequence import JaggedTensor, ShardedEmbeddingCollection
from .sparse_optim import SparseOptimizer
from .table_init import full_table, init_rows
from .tables_io import full_tables, load_full_tables
from .torchrec_interop import as_kjt, as_table_configs, load_torchrec_state_dict, torchrec_state_dict

__all__ = ["ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection", "KeyedJaggedTensor", "JaggedTensor",
           "SparseOptimizer", "CombinedOptimizer", "TableConfig", "EmbeddingPlan", "ShardingType", "plan_tables",
           "full_table", "init_rows", "full_tables", "load_full_tables", "as_table_configs", "as_kjt",
           "load_torchrec_state_dict", "torchrec_state_dict"]
