"""Keras elastic state in one process (Keras backend from ``KERAS_BACKEND``): commit/restore, callbacks, reset."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import shardwise  # noqa: E402
import shardwise.keras as hvd  # noqa: E402
from shardwise.core.comm import CompletedHandle, Handle  # noqa: E402
from shardwise.core.errors import ConfigError, HostsUpdatedInterrupt  # noqa: E402

BATCH, SAMPLES = 4, 32  # 8 steps per epoch


@pytest.fixture(autouse=True)
def local_context():
    shardwise.init(backend="local")
    yield
    shardwise.shutdown()


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(SAMPLES, 5)).astype("float32"), rng.normal(size=(SAMPLES, 1)).astype("float32")


def _model(optimizer=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    return model


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


def _fit(model, steps, callbacks=(), epochs=1, **kwargs):
    x, y = _data()
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks), **kwargs)


def _assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


class Recording(hvd.elastic.KerasState):
    """Remembers (epoch, batch) at every commit."""

    def __init__(self, *args, **kwargs):
        self.commits = []
        super().__init__(*args, **kwargs)

    def commit(self):
        self.commits.append((self.epoch, self.batch))
        super().commit()


def test_commit_restore_round_trip_of_weights_and_optimizer_state() -> None:
    model = _model()
    _fit(model, 3)
    state = hvd.elastic.KerasState(model, epoch=0)
    state.commit()
    committed = _values(model.weights), _values(model.optimizer.variables)
    _fit(model, 3)
    after_first = _values(model.weights)
    assert not all(np.array_equal(a, b) for a, b in zip(after_first, committed[0]))
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    state.epoch = 5
    state.restore()
    assert state.epoch == 0
    _assert_same(_values(model.weights), committed[0])
    _assert_same(_values(model.optimizer.variables), committed[1])
    _fit(model, 3)  # the same steps from the same weights *and* Adam moments give the same weights
    _assert_same(_values(model.weights), after_first)


def test_sync_on_one_rank_keeps_the_values_and_commits_them() -> None:
    model = _model()
    state = hvd.elastic.KerasState(model, batch=0)
    _fit(model, 2)
    state.batch = 4
    trained = _values(model.weights)
    state.sync()
    _assert_same(_values(model.weights), trained)
    _fit(model, 2)
    state.restore()  # back to what sync committed, not to the construction-time weights
    _assert_same(_values(model.weights), trained)
    assert state.batch == 0  # plain attributes are synced from the last commit (Horovod's ObjectState)


def test_state_needs_a_built_model_and_an_optimizer() -> None:
    with pytest.raises(ConfigError):
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(1)]))
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    with pytest.raises(ConfigError):
        hvd.elastic.KerasState(model)
    state = hvd.elastic.KerasState(model, optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    assert state.optimizer.built and len(state._saved_optimizer) == len(state.optimizer.variables) > 0


def test_callbacks_track_epoch_and_batch_and_commit_every_n_batches() -> None:
    model = _model()
    state = Recording(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=3)]
    _fit(model, 8, callbacks, epochs=2)
    # Horovod's count runs on over the epoch's end (after 3, 6, 9, 12, 15 batches), plus each epoch's end.
    assert state.commits == [(0, 3), (0, 6), (1, 0), (1, 1), (1, 4), (1, 7), (2, 0)]
    assert (state.epoch, state.batch) == (2, 0)
    state.commits.clear()
    callbacks[-1] = hvd.elastic.CommitStateCallback(state, batches_per_commit=4)
    _fit(model, 8, callbacks, epochs=2)
    assert state.commits == [(2, 4), (3, 0), (3, 4), (4, 0)]  # those due on an epoch's last batch: at its end
    state.epoch, state.batch = 9, 9
    state.restore()
    assert (state.epoch, state.batch) == (4, 0)
    with pytest.raises(ConfigError):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_the_resumed_epoch_is_shortened_by_the_batches_already_done() -> None:
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=1, batch=3)
    steps: list[int] = []
    count = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: steps.append(0),
                                           on_train_batch_end=lambda b, logs: steps.__setitem__(-1, steps[-1] + 1))
    callbacks = [count, hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state)]
    _fit(model, 8, callbacks, epochs=3 - state.epoch)
    assert steps == [5, 8]
    assert (state.epoch, state.batch) == (3, 0) and not model.stop_training
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 13


def test_epoch_state_with_fits_initial_epoch() -> None:
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=2, batch=0)
    _fit(model, 2, [hvd.elastic.UpdateEpochStateCallback(state)], epochs=4, initial_epoch=state.epoch)
    assert state.epoch == 4


def test_run_re_forms_on_hosts_updated_and_retraces_the_train_step() -> None:
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    calls: list[bool] = []

    @hvd.elastic.run
    def train(state):
        calls.append(model.train_function is None)
        _fit(model, 2, [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.CommitStateCallback(state)])
        if len(calls) == 1:
            raise HostsUpdatedInterrupt(skip_sync=False)
        return state.epoch

    assert train(state) == 2  # an interrupt keeps the committed epoch: the second attempt trains the next one
    assert resets == [1] and calls == [True, True]  # the second attempt traced a new train step
    assert shardwise.is_initialized()


def _tf_op_error(message: str) -> Exception:
    """What TensorFlow raises when a Python error escapes a tf.numpy_function: its own class, the text only."""
    error = type("UnknownError", (Exception,), {"__module__": "tensorflow.python.framework.errors_impl"})
    return error(f"Graph execution error: {message}")


def test_run_restores_the_commit_after_a_worker_lost_inside_a_tensorflow_graph() -> None:
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0)
    committed = _values(model.weights)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        if not resets:
            _fit(model, 2)  # trained past the commit, then the step's allreduce finds a peer gone
            raise _tf_op_error("WorkerLostError: allreduce: a rank left the job (Connection reset by peer)")
        return _values(model.weights)

    _assert_same(train(state), committed)
    assert resets == [1]

    @hvd.elastic.run
    def failing(state):
        raise _tf_op_error("InvalidArgumentError: shapes differ")

    with pytest.raises(Exception, match="shapes differ"):
        failing(state)


class _Broken(Handle):
    def wait(self, timeout=None):
        raise RuntimeError("Connection reset by peer")

    def done(self) -> bool:
        return False


def _fake_world(broken: bool):
    from shardwise.backends.local import LocalCommunicator

    class TwoRanks(LocalCommunicator):
        """Two identical ranks; counts the allreduces; ``broken``: a group whose peer died."""

        calls = 0

        @property
        def size(self) -> int:
            return 2

        def allreduce_async(self, tensor, op="sum", *, inplace=False, name=None):
            TwoRanks.calls += 1
            return _Broken() if broken else CompletedHandle(tensor)

    return TwoRanks()


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the backward overlap is Keras-on-torch's")
def test_restore_drops_the_torch_overlap_without_collectives_and_reset_rebuilds_it(monkeypatch) -> None:
    ctx = shardwise.current()
    broken = _fake_world(broken=True)
    monkeypatch.setattr(ctx, "world", broken)
    model = _model(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
    state = hvd.elastic.KerasState(model)
    dist = model.optimizer
    assert dist._overlap is not None and dist._overlap.comm is broken
    x, _ = _data()
    keras.ops.mean(model(x[:BATCH]) ** 2).backward()  # a step in flight on the dead group
    launched = type(broken).calls
    assert launched > 0 and dist._overlap.launched
    model.make_train_function()
    state.restore()  # must not wait on the dead group
    assert dist._overlap is None
    keras.ops.mean(model(x[:BATCH]) ** 2).backward()
    assert type(broken).calls == launched  # the hooks are gone
    fresh = _fake_world(broken=False)
    monkeypatch.setattr(ctx, "world", fresh)
    state.reset()
    assert dist._overlap is not None and dist._overlap.comm is fresh and model.train_function is None
    for p in model.trainable_variables:
        p.value.grad = None
    keras.ops.mean(model(x[:BATCH]) ** 2).backward()
    assert type(fresh).calls > 0


def test_reset_gives_the_shared_loss_scale_check_the_new_world(monkeypatch) -> None:
    from shardwise.adapters.keras.hooks import share_finite_check

    ctx = shardwise.current()
    old = _fake_world(broken=False)
    monkeypatch.setattr(ctx, "world", old)
    outer = keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    model = _model(outer)
    state = hvd.elastic.KerasState(model)
    assert share_finite_check(model)
    new = _fake_world(broken=False)
    monkeypatch.setattr(ctx, "world", new)
    state.reset()
    before = type(old).calls
    grads = [keras.ops.zeros(v.shape) for v in model.trainable_variables]
    assert bool(keras.ops.convert_to_numpy(outer.check_finite(grads)))
    assert type(new).calls == 1 and type(old).calls == before
