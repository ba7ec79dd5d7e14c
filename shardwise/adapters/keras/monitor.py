"""The Keras side of the comm/compute monitor: a callback that logs the communication share."""

from __future__ import annotations

from typing import Any, Optional

import keras

from shardwise.core.monitor import CommMonitor
from ... import context

__all__ = ["CommMonitorCallback"]


class CommMonitorCallback(keras.callbacks.Callback):
    """Time each training batch as a step and add ``comm_fraction`` to the epoch logs.

    ``comm_fraction`` is the share of step time spent waiting in collectives (the
    monitor warns above 20%). Needs ``shardwise.init(monitor=True)`` or
    ``SHARDWISE_MONITOR=1`` unless a ``monitor`` is given.
    """

    def __init__(self, monitor: Optional[CommMonitor] = None) -> None:
        super().__init__()
        self._monitor = monitor
        self._start = 0.0

    @property
    def monitor(self) -> CommMonitor:
        if self._monitor is None:
            self._monitor = context.current().monitor
            if self._monitor is None:
                raise RuntimeError("monitoring is off: call shardwise.init(monitor=True) "
                                   "or set SHARDWISE_MONITOR=1 / SHARDWISE_TIMELINE=trace.json")
        return self._monitor

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._start = self.monitor.now()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.monitor.record_step(self._start, self.monitor.now())

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            s = self.monitor.summary()
            logs["comm_fraction"] = round(float(s["fraction"]), 4)
            logs["step_ms"] = round(float(s["step_time_mean"]) * 1e3, 2)
