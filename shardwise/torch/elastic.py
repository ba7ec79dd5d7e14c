"""``hvd.elastic`` for PyTorch: ``import shardwise.torch as hvd`` then ``@hvd.elastic.run``."""

from shardwise.adapters.torch.elastic import ElasticSampler, TorchState, run
from shardwise.core.errors import CollectiveMismatchError as HorovodInternalError
from shardwise.core.errors import HostsUpdatedInterrupt, WorkerLostError
from shardwise.elastic.state import ObjectState, State

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt",
           "HorovodInternalError", "WorkerLostError"]
