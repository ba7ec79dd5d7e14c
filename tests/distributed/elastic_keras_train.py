"""An elastic Keras training (Keras on torch, shardwise torch backend) and its one-process replay.

``train(config)`` runs on every worker under ``hvd.elastic.run``: a small float64
Dense model, a :class:`~shardwise.keras.DistributedOptimizer` around SGD with
momentum, and ``model.fit`` on a generator with Horovod's three elastic callbacks
(commit every ``COMMIT_EVERY`` batches). The global batch is ``GLOBAL_BATCH``
samples whatever the world size (rank ``r`` of ``n`` takes ``batch[r::n]``), so a
batch index means the same samples before and after a reset and ``state.batch``
resumes an epoch exactly. The committed state carries a log of every step
(epoch, world size, the global batch's sample indices); ``replay(log)`` trains
the same model on those steps in one process and must give the same weights.
One worker (rank ``kill_rank`` of the first generation) SIGKILLs itself before
batch ``kill_step`` of epoch 0; the job then goes on with the survivors and waits
for ``final_size`` workers before its last epoch.

Keras on torch computes float64 matmuls in float32 (``keras.ops.matmul`` casts to
``result_type``, which maps float64 to float32 off TensorFlow), so a gradient
depends on how the batch was split over ranks at the float32 level. The replay
therefore computes each rank's share's gradient as that rank did and averages
them in float64, as the allreduce does.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import numpy as np

N, FEATURES, GLOBAL_BATCH, EPOCHS, COMMIT_EVERY, LR = 192, 6, 6, 3, 3, 0.05
STEPS = N // GLOBAL_BATCH


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, FEATURES))
    return x, np.sin(x @ rng.standard_normal(FEATURES))[:, None]


def initial_weights() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal((FEATURES, 8)) * 0.4, np.zeros(8), rng.standard_normal((8, 1)) * 0.4, np.zeros(1)]


def float64_keras() -> Any:
    """Keras, with float64 as the default float type (set before any optimizer or layer is made)."""
    import keras

    keras.config.set_floatx("float64")
    return keras


def model(optimizer: Any) -> Any:
    import keras

    net = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(1)])
    net.set_weights(initial_weights())
    net.compile(optimizer=optimizer, loss="mse")
    return net


def global_batch(epoch: int, batch: int) -> list[int]:
    """The sample indices of global batch ``batch`` of ``epoch`` (a seeded shuffle per epoch)."""
    order = np.random.default_rng(11 + epoch).permutation(N)
    return [int(i) for i in order[batch * GLOBAL_BATCH:(batch + 1) * GLOBAL_BATCH]]


def batches(epoch: int, batch: int, rank: int, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """This rank's share of every global batch from (``epoch``, ``batch``) on, endlessly."""
    x, y = data()
    while True:
        for b in range(batch, STEPS):
            mine = global_batch(epoch, b)[rank::size]
            yield x[mine], y[mine]
        epoch, batch = epoch + 1, 0


def train(config: dict) -> dict:
    """One worker's elastic training; returns the committed log and the final weights."""
    import torch

    import shardwise
    import shardwise.keras as hvd

    keras = float64_keras()
    torch.set_num_threads(1)
    hvd.init()
    net = model(hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)))
    state = hvd.elastic.KerasState(net, epoch=0, batch=0, log=[])
    resets: list[int] = []
    recovered: list[float] = []
    state.register_reset_callbacks([lambda: (resets.append(hvd.size()), recovered.append(time.time()))])
    overlaps: list[bool] = []
    executed: list[int] = []  # every step this worker ran, committed or rolled back

    class Steps(keras.callbacks.Callback):
        """Logs each step's global batch; the chosen worker dies before its step; the last epoch waits to grow."""

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if state.epoch == EPOCHS - 1:
                while hvd.size() < config.get("final_size", 0):
                    time.sleep(0.2)
                    state.check_host_updates()

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            overlaps.append(net.optimizer._overlap is not None)
            if (config.get("kill_rank") == hvd.rank() and state.epoch == 0 and state.batch == config.get(
                    "kill_step", 7) and shardwise.current().owned.get("elastic_generation") == 0):
                if config.get("stamp"):
                    with open(config["stamp"], "w") as f:
                        f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            executed.append(1)
            state.log.append((state.epoch, hvd.size(), global_batch(state.epoch, state.batch)))
            time.sleep(config.get("step_sleep", 0.0))

    callbacks = [Steps(), hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY)]

    @hvd.elastic.run
    def loop(state: Any) -> None:
        if GLOBAL_BATCH % hvd.size():
            raise RuntimeError(f"the global batch {GLOBAL_BATCH} does not split over {hvd.size()} workers")
        if state.epoch < EPOCHS:
            state.model.fit(batches(state.epoch, state.batch, hvd.rank(), hvd.size()), steps_per_epoch=STEPS,
                            epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0)

    loop(state)
    return {"log": state.log, "weights": net.get_weights(), "size": hvd.size(), "resets": resets,
            "recovered_at": recovered[0] if recovered else None, "overlapped": overlaps[-1] if overlaps else None,
            "executed": len(executed),
            "generation": shardwise.current().owned.get("elastic_generation")}


def replay(log: list) -> list[np.ndarray]:
    """The logged steps in one process (Keras on torch): each rank's share's gradient, averaged; SGD with momentum."""
    import torch

    keras = float64_keras()
    torch.set_num_threads(1)
    x, y = data()
    net = model(keras.optimizers.SGD(LR, momentum=0.9))
    variables = net.trainable_variables
    for _, world, idx in log:
        total = [torch.zeros_like(v.value) for v in variables]
        for r in range(world):
            share = idx[r::world]
            for v in variables:
                v.value.grad = None
            xs, ys = keras.ops.convert_to_tensor(x[share]), keras.ops.convert_to_tensor(y[share])
            net.compute_loss(x=xs, y=ys, y_pred=net(xs, training=True), training=True).backward()
            for t, v in zip(total, variables):
                t.add_(v.value.grad * (1.0 / world))
        net.optimizer.apply(total, variables)
    return net.get_weights()


def check_epochs(log: list) -> None:
    """Every epoch trained on its global batches once each, in order (so on every sample once)."""
    for epoch in range(EPOCHS):
        steps = [idx for e, _, idx in log if e == epoch]
        if steps != [global_batch(epoch, b) for b in range(STEPS)]:
            raise AssertionError(f"epoch {epoch} did not run its {STEPS} global batches once each, in order")
