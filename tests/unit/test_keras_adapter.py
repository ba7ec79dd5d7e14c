"""Keras adapter in one process: a fake two-rank communicator stands in for MPI (mean of equal copies = identity)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import shardwise  # noqa: E402
from shardwise.adapters.keras.ops import Compression, allreduce_gradients  # noqa: E402
from shardwise.backends.local import LocalCommunicator  # noqa: E402
from shardwise.core.errors import ConfigError  # noqa: E402
from shardwise.keras import DistributedOptimizer, callbacks  # noqa: E402


class TwoRanks(LocalCommunicator):
    """Pretends to be two identical ranks; counts allreduce calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @property
    def size(self) -> int:
        return 2

    def allreduce(self, tensor, op="sum", *, inplace=False, name=None):
        self.calls += 1
        return np.array(tensor, copy=True)


@pytest.fixture(autouse=True)
def local_context():
    shardwise.init(backend="local")
    yield
    shardwise.shutdown()


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 5)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def test_rejects_bad_arguments() -> None:
    sgd = keras.optimizers.SGD(0.1)
    for kwargs in ({"backward_passes_per_step": 0}, {"compression": "int8"}, {"bucket_cap_bytes": 0}):
        with pytest.raises(ConfigError):
            DistributedOptimizer(sgd, **kwargs)
    with pytest.raises(ConfigError):
        DistributedOptimizer(object())
    with pytest.raises(ConfigError):
        DistributedOptimizer(DistributedOptimizer(sgd))
    with pytest.raises(ConfigError):
        DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2)
    with pytest.raises(ConfigError):
        callbacks.BestModelCheckpoint("best.txt")
    assert DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)).momentum == 0.9


@pytest.mark.parametrize("cap, per_step", [(None, 1), (1, 4)])
def test_fused_buckets_and_same_result(cap, per_step) -> None:
    x, y = _data()
    ref, dist, comm = _model(), _model(), TwoRanks()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    kwargs = {"comm": comm} if cap is None else {"comm": comm, "bucket_cap_bytes": cap}
    dist.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam(0.01), **kwargs), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    dist.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(ref.get_weights(), dist.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert comm.calls == 8 * per_step
    assert int(dist.optimizer.iterations.numpy()) == 8


def test_xla_is_refused_or_turned_off() -> None:
    x, y = _data()
    # fit() turns XLA off by itself (the optimizer installed that), with no callback.
    model = _model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), comm=TwoRanks()), loss="mse",
                  jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, verbose=0)
    assert model.jit_compile is False and any("jit_compile" in str(w.message) for w in caught)
    # An XLA function of the user's own is refused with a clear message.
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), comm=TwoRanks())
    opt.build(model.trainable_variables)
    step = tf.function(lambda: opt.apply([tf.zeros_like(v) for v in model.trainable_variables]), jit_compile=True,
                       autograph=False)
    with pytest.raises(ConfigError, match="jit_compile=False"):
        step()
    model = _model()
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), comm=TwoRanks()), loss="mse",
                  jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[callbacks.MetricAverageCallback(comm=TwoRanks())])
    assert model.jit_compile is False and any("jit_compile" in str(w.message) for w in caught)
    one_rank = _model()  # a single rank needs no collective, so XLA stays on
    one_rank.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    one_rank.fit(x, y, batch_size=8, verbose=0, callbacks=[callbacks.MetricAverageCallback()])
    assert one_rank.jit_compile is True


def test_gradients_keep_none_dtype_and_densify() -> None:
    comm = TwoRanks()
    sparse = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]), tf.constant([4, 3]))
    grads = [tf.ones([3], tf.float32), None, sparse, tf.fill([2], tf.constant(2.0, tf.float64))]
    out = allreduce_gradients(grads, comm=comm, compression=Compression.fp16)
    assert out[1] is None and comm.calls == 1  # float16 everywhere after compression: one bucket
    assert [o.dtype for o in (out[0], out[2], out[3])] == [tf.float32, tf.float32, tf.float64]
    np.testing.assert_array_equal(out[2].numpy(), tf.convert_to_tensor(sparse).numpy())


def test_config_round_trip(tmp_path) -> None:
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), compression=Compression.fp16,
                               backward_passes_per_step=2, average_aggregated_gradients=True)
    again = DistributedOptimizer.from_config(opt.get_config())
    assert again.compression is Compression.fp16 and again.backward_passes_per_step == 2
    assert again.average_aggregated_gradients and again.inner_optimizer.momentum == 0.5
    model = _model()
    model.compile(optimizer=opt, loss="mse")
    model.fit(*_data(), batch_size=8, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, DistributedOptimizer)
    assert int(loaded.optimizer.iterations.numpy()) == 4


def test_zero_has_a_public_home() -> None:
    import shardwise.keras as hvd
    from shardwise.keras import zero

    assert zero is hvd.zero
    for name in zero.__all__:
        assert getattr(zero, name) is getattr(hvd, name), name
