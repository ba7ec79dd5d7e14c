"""``hvd.elastic`` for Keras 3: ``import shardwise.keras as hvd`` then ``@hvd.elastic.run``.

Typical use (Horovod's)::

    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)
"""

from shardwise.adapters.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,
                                              UpdateEpochStateCallback, run)
from shardwise.core.errors import CollectiveMismatchError as HorovodInternalError
from shardwise.core.errors import HostsUpdatedInterrupt, WorkerLostError
from shardwise.elastic.state import ObjectState, State

__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "HostsUpdatedInterrupt", "HorovodInternalError", "WorkerLostError"]
