"""Elastic training, framework-neutral: state that survives lost and added workers.

Framework front ends: :mod:`shardwise.torch.elastic` (``TorchState``, ``ElasticSampler``)
and :mod:`shardwise.keras.elastic` (``KerasState`` and callbacks). Engines that run
elastic jobs: :mod:`shardwise.ray` and torchrun's elastic agent.
"""

from ..core.errors import HostsUpdatedInterrupt, RendezvousError, WorkerLostError
from .run import reset, run_fn
from .state import ObjectState, State

__all__ = ["State", "ObjectState", "run_fn", "reset", "HostsUpdatedInterrupt", "WorkerLostError",
           "RendezvousError"]
