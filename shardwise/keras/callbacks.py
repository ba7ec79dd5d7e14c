"""Keras 3 callbacks for data-parallel training (Horovod's ``horovod.keras.callbacks``)."""

from ..adapters.keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,
                                        LearningRateScheduleCallback, LearningRateWarmupCallback,
                                        MetricAverageCallback, ShardedCheckpoint)
from ..adapters.keras.monitor import CommMonitorCallback

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint", "CommMonitorCallback",
           "ShardedCheckpoint"]
