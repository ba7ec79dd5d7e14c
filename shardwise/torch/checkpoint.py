"""PyTorch checkpoints: ``from shardwise.torch.checkpoint import save_training, ...``.

* :func:`save_training`/:func:`restore_training`: a model, its optimizer and the step, atomically;
* :func:`save_zero_checkpoint`/:func:`load_zero_checkpoint` (any world size) and
  :func:`consolidate_zero_checkpoint` (one full fp32 state dict);
* :func:`save_embedding_checkpoint`/:func:`load_embedding_checkpoint`: sharded embedding tables;
* :func:`export_hf`, :func:`to_dcp`, :func:`from_dcp`: a ``parallelize`` checkpoint to a Hugging Face
  directory, to ``torch.distributed.checkpoint`` and back (what ``shardwise checkpoint export`` runs).

Any mix of state in one call is :mod:`shardwise.checkpoint` (``save``/``load``, framework-neutral).
A thin re-export of ``shardwise.adapters.torch.checkpoint``.
"""

from shardwise.adapters.torch.checkpoint.convert import export_hf, from_dcp, to_dcp
from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint, save_embedding_checkpoint
from shardwise.adapters.torch.checkpoint.training import restore_training, save_training
from shardwise.adapters.torch.checkpoint.zero import (consolidate_zero_checkpoint, load_zero_checkpoint,
                                                      save_zero_checkpoint)

__all__ = ["save_training", "restore_training", "save_zero_checkpoint", "load_zero_checkpoint",
           "consolidate_zero_checkpoint", "save_embedding_checkpoint", "load_embedding_checkpoint",
           "export_hf", "to_dcp", "from_dcp"]
