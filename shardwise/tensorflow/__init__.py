"""Horovod-style data parallelism for TensorFlow 2 custom loops: ``import shardwise.tensorflow as hvd``.

Typical use, under ``mpirun -np N python train.py``::

    import shardwise.tensorflow as hvd
    hvd.init()
    dataset = hvd.shard(dataset)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

    hvd.broadcast_variables(model.variables, root_rank=0)
"""

from ..adapters.tensorflow import (Compression, Detection, DistributedGradientTape, StrategyChoice,
                                   allgather, allreduce, broadcast, broadcast_variables, choose_strategy,
                                   detect, init, local_rank, local_size, rank, shard, shutdown, size,
                                   strategy, tf_config)

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "allreduce", "allgather",
           "broadcast", "broadcast_variables", "Compression", "DistributedGradientTape", "shard",
           "strategy", "choose_strategy", "detect", "Detection", "StrategyChoice", "tf_config"]
