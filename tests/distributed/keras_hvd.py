"""Horovod's ``horovod.tensorflow.keras`` names on ``shardwise.keras``: collectives, partial data
parallelism, load_model, the broadcast callback's local variables. Run on every rank (2 ranks).
"""

from __future__ import annotations

import os

import numpy as np

from keras_backends import check_broadcast_callback_keeps_local_variables, check_load_model_wraps_optimizer

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def keras_api() -> None:
    import keras
    import tensorflow as tf

    import shardwise.keras as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    assert hvd.is_initialized() and (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.mpi_built() and not hvd.ccl_built() and not hvd.ddl_built()
    assert isinstance(hvd.gloo_enabled(), bool) and isinstance(hvd.mpi_threads_supported(), bool)

    # collectives, through the coordinator: values in, tensors out
    np.testing.assert_allclose(hvd.allreduce(np.array([r, 1.0])).numpy(), [(p - 1) / 2, 1.0])
    np.testing.assert_allclose(hvd.allreduce([2], op=hvd.Sum, prescale_factor=0.5).numpy(), [p])
    assert hvd.allgather(np.full((r + 1, 2), r)).shape == (p * (p + 1) // 2, 2)
    assert int(hvd.broadcast(np.array([r]), root_rank=p - 1).numpy()[0]) == p - 1
    np.testing.assert_allclose(hvd.reducescatter(np.ones((2 * p, 3)), op=hvd.Sum).numpy(), np.full((2, 3), p))
    out, received = hvd.alltoall(np.arange(p, dtype=np.float32) + 10 * r, splits=[1] * p)
    np.testing.assert_allclose(out.numpy(), [10 * k + r for k in range(p)])
    assert received.numpy().tolist() == [1] * p
    hvd.barrier()
    assert hvd.broadcast_object({"r": r}, root_rank=p - 1) == {"r": p - 1}
    assert hvd.allgather_object(r) == list(range(p))
    try:
        hvd.allreduce(np.ones(3 + r))
        raise AssertionError("mismatched shapes did not raise")
    except tf.errors.FailedPreconditionError as exc:
        assert "Mismatched" in str(exc), exc
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum).numpy(), [p, p])  # still in step
    assert int(hvd.join()) == p - 1 or p == 1
    pair = hvd.add_process_set([0, 1])
    np.testing.assert_allclose(hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=pair).numpy(), [2.0])
    assert hvd.remove_process_set(pair)

    # PartialDistributedOptimizer: the local layer's gradient stays local (scaled by 1/size)
    keras.utils.set_random_seed(7)
    shared, local = keras.layers.Dense(2, name="shared"), keras.layers.Dense(1, name="local")
    model = keras.Sequential([keras.Input((3,)), shared, local])
    hvd.broadcast_variables(model.variables, root_rank=0)
    before = [v.numpy().copy() for v in model.trainable_variables]
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    x = tf.constant(np.full((4, 3), r + 1.0, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply(grads, model.trainable_variables)
    everyone = hvd.allgather_object([g.numpy() for g in grads])
    for k, v in enumerate(model.trainable_variables):
        if "local" in v.path:
            want = before[k] - grads[k].numpy() / p
        else:
            want = before[k] - np.mean([g[k] for g in everyone], axis=0)
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-5, err_msg=v.path)

    check_broadcast_callback_keeps_local_variables(hvd, r)
    check_load_model_wraps_optimizer(hvd, r)
    hvd.shutdown()
