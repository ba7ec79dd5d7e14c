"""Keras 3 ZeRO stage 3 scenarios on the torch Keras backend, run on every rank (mpi backend).

The reference is one process on the global batch from the same initial weights
(every rank computes it locally), or, where callbacks are involved,
``DistributedOptimizer`` on the same per-rank data.
"""

from __future__ import annotations

import gc
import os
import tempfile
import weakref

import numpy as np

from keras_dp import _data, _iterations, _rank_rows, _same_on_all_ranks, _setup
from keras_nonfinite import HUGE, OVERFLOW_STEP
from keras_zero import _make_opt, _model

RTOL, ATOL = 1e-5, 1e-6


def _close(ref_weights, got_weights, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert len(ref_weights) == len(got_weights), what
    for w_ref, w in zip(ref_weights, got_weights):
        assert w.shape == w_ref.shape, (what, w.shape, w_ref.shape)
        np.testing.assert_allclose(w, w_ref, rtol=rtol, atol=atol, err_msg=what)


def _sharded_between_uses(model, what: str) -> None:
    """No whole trainable variable stays anywhere: every Keras Parameter is empty, no .grad is left."""
    for v in model.trainable_variables:
        p = v._value
        assert p.numel() == 0 and p.grad is None, (what, v.path, tuple(p.shape))


def _zero3(kind: str, **kwargs):
    from shardwise.keras import ZeroOptimizer

    return ZeroOptimizer(_make_opt(kind), stage=3, **kwargs)


def equivalence(optimizers: list[str], extras: bool = True) -> None:
    """fit with ZeRO-3 on N ranks == one-process fit on the global batch; evaluate/predict/get_weights whole."""
    from shardwise.keras import DistributedOptimizer

    comm = _setup()
    size, b, steps, epochs = comm.size, 4, 6, 2
    x, y = _data(steps * size * b, seed=21)
    rows = _rank_rows(steps, size, comm.rank, b)
    for kind in optimizers:
        what = f"ZeRO-3 {kind} on {size} ranks"
        ref = _model()
        ref.compile(optimizer=_make_opt(kind), loss="mse")
        ref.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0)
        model = _model()
        model.compile(optimizer=_zero3(kind), loss="mse")
        model.fit(x[rows], y[rows], batch_size=b, epochs=epochs, shuffle=False, verbose=0)
        opt = model.optimizer
        assert _iterations(opt) == steps * epochs, (what, _iterations(opt))
        assert len(opt.units) == 3, (what, len(opt.units))  # one unit per Dense layer
        # The inner optimizer's slots are shard-sized: about 1/N of the model each.
        numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        shard_numel = sum(int(np.prod(u.shard.shape)) for u in opt.units)
        assert shard_numel <= numel // size + 3 * size, (what, shard_numel, numel)
        _sharded_between_uses(model, what)
        weights = model.get_weights()
        # The sums over ranks round differently from one process's (and a reduce-scatter's from an
        # allreduce's), which Adam's 1/sqrt(v) magnifies where v is tiny: 2.5e-6 on a -1.3e-3 weight at
        # 4 ranks against one process, 1e-6 against DistributedOptimizer; hence the absolute tolerances.
        _close(ref.get_weights(), weights, what, atol=1e-5)
        dp = _model()
        dp.compile(optimizer=DistributedOptimizer(_make_opt(kind)), loss="mse")
        dp.fit(x[rows], y[rows], batch_size=b, epochs=epochs, shuffle=False, verbose=0)
        _close(dp.get_weights(), weights, what + " vs DistributedOptimizer", atol=2e-6)
        _same_on_all_ranks(comm, weights, what)
        _sharded_between_uses(model, what + ", after get_weights")
        got, want = model.evaluate(x, y, batch_size=8, verbose=0), ref.evaluate(x, y, batch_size=8, verbose=0)
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=what + " evaluate")
        np.testing.assert_allclose(model.predict(x[:9], verbose=0), ref.predict(x[:9], verbose=0), rtol=RTOL,
                                   atol=ATOL, err_msg=what + " predict")
        _sharded_between_uses(model, what + ", after evaluate and predict")
        if comm.rank == 0:
            print(f"{what}: equal to one process after {steps * epochs} steps; shards {shard_numel} of "
                  f"{numel} elements", flush=True)
    if extras:
        _weights_io(comm)
        _callbacks(comm, x[rows], y[rows], b)
        _refusals(comm)
        _jit_compiled(x, y, rows, b, epochs)


def _jit_compiled(x, y, rows, b: int, epochs: int) -> None:
    """``jit_compile=True``: Keras runs the step under ``torch.compile``, whose backward fires the gather
    and reduce-scatter hooks from inside a compiled frame; the fit still equals one process."""
    size = len(x) // len(rows)
    ref = _model()
    ref.compile(optimizer=_make_opt("sgd"), loss="mse")
    ref.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0)
    model = _model()
    model.compile(optimizer=_zero3("sgd"), loss="mse", jit_compile=True)
    model.fit(x[rows], y[rows], batch_size=b, epochs=epochs, shuffle=False, verbose=0)
    assert model.jit_compile is True
    _close(ref.get_weights(), model.get_weights(), "ZeRO-3 with jit_compile=True (torch.compile)")


def _weights_io(comm) -> None:
    """set_weights, save_weights / load_weights and full_weights on a trained ZeRO-3 model."""
    import keras

    from shardwise.keras import full_weights

    x, y = _data(16, seed=5)  # the same rows on every rank: the reference is one process on them
    ref = _model()
    ref.compile(optimizer=_make_opt("adam"), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = _model()
    model.compile(optimizer=_zero3("adam"), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    trained = model.get_weights()
    _close(ref.get_weights(), trained, "before weight I/O")
    # Every rank saves (the gather is collective), each to a file of its own.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"rank{comm.rank}.weights.h5")
        model.save_weights(path)
        plain = _model(seed=99)
        plain.load_weights(path)
        _close(trained, plain.get_weights(), "save_weights of a ZeRO-3 model, loaded into a plain one")
        model.set_weights([np.zeros_like(w) for w in trained])
        _close([np.zeros_like(w) for w in trained], model.get_weights(), "set_weights")
        model.load_weights(path)
        _close(trained, model.get_weights(), "load_weights into a ZeRO-3 model")
    _sharded_between_uses(model, "after weight I/O")
    with full_weights(model):
        kernel = model.layers[0].kernel.numpy()  # a direct read: whole inside the block
        model.layers[0].kernel.assign(kernel * 2)
    _close([kernel * 2], [model.get_weights()[0]], "full_weights writes back")
    _sharded_between_uses(model, "after full_weights")
    # Training goes on from the values written (the Adam state kept in the shards' slots).
    ref.layers[0].kernel.assign(kernel * 2)
    ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _close(ref.get_weights(), model.get_weights(), "training after weight I/O")
    # Dropped, the model goes: the hooks on its Parameters (held on torch's C++ side, where the
    # garbage collector sees no cycle) must not keep it, its optimizer and its shards alive.
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None, "a ZeRO-3 model dropped after fit stays alive"
    if comm.rank == 0:
        print("ZeRO-3 weight I/O: get/set_weights, save/load_weights, full_weights; the dropped model freed",
              flush=True)


def _callbacks(comm, xr, yr, b: int) -> None:
    """Broadcast (rank-dependent seeds), metric average and LR warm-up: as DistributedOptimizer with them."""
    import keras

    from shardwise.keras import DistributedOptimizer, callbacks

    def run(opt):
        model = _model(seed=100 + comm.rank)
        model.compile(optimizer=opt, loss="mse")
        cbs = [callbacks.BroadcastGlobalVariablesCallback(0), callbacks.MetricAverageCallback(),
               callbacks.LearningRateWarmupCallback(initial_lr=0.01, warmup_epochs=2, steps_per_epoch=len(xr) // b)]
        hist = model.fit(xr, yr, batch_size=b, epochs=2, shuffle=False, verbose=0, callbacks=cbs)
        model.fit(xr, yr, batch_size=b, epochs=1, shuffle=False, verbose=0,
                  callbacks=[callbacks.BroadcastGlobalVariablesCallback(0)])
        return model, hist.history["loss"]

    ref, ref_loss = run(DistributedOptimizer(keras.optimizers.Adam(0.01)))
    got, loss = run(_zero3("adam"))
    _close(ref.get_weights(), got.get_weights(), "ZeRO-3 with callbacks")
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, err_msg="averaged loss")
    _same_on_all_ranks(comm, [np.array(loss)], "metric average")
    if comm.rank == 0:
        print(f"ZeRO-3 with broadcast, metric average and LR warm-up callbacks: losses {np.round(loss, 5)}",
              flush=True)


def _refusals(comm) -> None:
    """Inputs a stage-3 shard cannot honour are refused with a ConfigError naming the problem."""
    import keras
    import torch

    import shardwise
    from shardwise.keras import ZeroOptimizer

    def expect(make, needle: str) -> None:
        try:
            make()
        except shardwise.ConfigError as exc:
            assert needle in str(exc), (needle, exc)
        else:
            raise AssertionError(f"expected a ConfigError mentioning {needle!r}")

    x, y = _data(8 * comm.size, seed=3)

    def fit_with(model, opt):
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    def constrained():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, kernel_constraint="non_neg")])

    expect(lambda: fit_with(constrained(), _zero3("sgd")), "constraint")

    expect(lambda: fit_with(_model(), ZeroOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                                                    stage=3)), "gradient_accumulation_steps")
    expect(lambda: ZeroOptimizer(keras.optimizers.SGD(0.1, global_clipnorm=1.0), stage=3), "global_clipnorm")
    model = _model()
    fit_with(model, _zero3("sgd"))
    full = [torch.ones(tuple(v.shape)) for v in model.trainable_variables]
    expect(lambda: model.optimizer.apply(full, model.trainable_variables), "loss.backward()")


def divergence() -> None:
    """Ranks whose model runs its layers in a different order: DivergenceError on every rank, no hang."""
    import keras

    import shardwise

    comm = _setup()

    class Branchy(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(8, activation="tanh")
            self.b = keras.layers.Dense(8, activation="tanh")
            self.head = keras.layers.Dense(1)
            self.swap = False

        def call(self, x):
            return self.head(self.a(self.b(x)) if self.swap else self.b(self.a(x)))

    keras.utils.set_random_seed(3)
    model = Branchy()
    model(np.zeros((1, 8), "float32"))
    model.compile(optimizer=_zero3("sgd"), loss="mse")
    x, y = _data(32, dim=8, seed=4)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.swap = comm.rank == comm.size - 1
    try:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    except shardwise.DivergenceError as exc:
        assert "diverged" in str(exc), exc
        if comm.rank == 0:
            print(f"ZeRO-3 divergence caught on every rank: {str(exc)[:160]}", flush=True)
    else:
        raise AssertionError("expected a DivergenceError")


def mixed_precision() -> None:
    """mixed_float16 with one rank overflowing at one step: every rank skips it, as one process does."""
    import keras

    comm = _setup()
    size, b, steps = comm.size, 4, 6
    x, y = _data(steps * size * b, seed=31)
    x, y = x * 0.25, y * 0.25
    x[(OVERFLOW_STEP * size + size - 1) * b] = HUGE  # one row of the last rank's batch
    rows = _rank_rows(steps, size, comm.rank, b)

    def train(opt, xs, ys, batch):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            keras.utils.set_random_seed(7)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(1, dtype="float32")])
            model.compile(optimizer=opt, loss="mse")
            lso = model.optimizer
            assert isinstance(lso, keras.optimizers.LossScaleOptimizer), type(lso)
            model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return model, float(keras.ops.convert_to_numpy(lso.dynamic_scale)), _iterations(lso.inner_optimizer)

    from shardwise.keras import DistributedOptimizer

    ref, ref_scale, ref_steps = train(keras.optimizers.SGD(0.05, momentum=0.9), x, y, size * b)
    dp, dp_scale, _ = train(DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), x[rows], y[rows], b)
    got, scale, got_steps = train(_zero3("sgd"), x[rows], y[rows], b)
    assert (ref_scale, ref_steps) == (2.0 ** 14, steps - 1), ("reference", ref_scale, ref_steps)
    assert (scale, got_steps) == (ref_scale, ref_steps), (scale, got_steps)
    weights = got.get_weights()
    _same_on_all_ranks(comm, weights + [np.array(scale)], "mixed precision")
    for w in weights:
        assert np.isfinite(w).all()
    # float16 layers: the one-process reference sums 2x as many rows per product, so not bitwise.
    _close(ref.get_weights(), weights, "mixed precision vs one process", rtol=1e-3, atol=1e-4)
    _close(dp.get_weights(), weights, "mixed precision vs DistributedOptimizer")
    _sharded_between_uses(got, "mixed precision")
    if comm.rank == 0:
        print(f"ZeRO-3 mixed_float16 on {size} ranks: step {OVERFLOW_STEP} skipped on every rank, "
              f"loss scale {scale:g}, {got_steps} steps applied", flush=True)


def regularized(epochs: int = 2, jit: bool = True) -> None:
    """Weight regularizers, and a layer adding a loss on its own kernel: fit equals one process.

    A penalty needs the whole variable, which exists only while its layer runs: its
    value is computed there, and its gradient added to the layer's before the layer's
    gradient is reduce-scattered. Also under mixed_float16, where the penalty's gradient
    is scaled with the loss's. ``jit``: also with ``jit_compile=True`` (the step under torch.compile).
    """
    import keras

    from shardwise.keras import DistributedOptimizer

    comm = _setup()
    size, b, steps = comm.size, 4, 5
    x, y = _data(steps * size * b, seed=37)
    rows = _rank_rows(steps, size, comm.rank, b)

    class Penalized(keras.layers.Dense):
        def call(self, inputs, training=None):
            self.add_loss(0.05 * keras.ops.sum(keras.ops.square(self.kernel)))
            return super().call(inputs, training=training)

    def regularized_model(own_loss: bool, penalize: bool = True, branch: bool = False):
        keras.utils.set_random_seed(7)
        first = (Penalized if own_loss and penalize else keras.layers.Dense)(
            33, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05) if penalize else None,
            bias_regularizer=keras.regularizers.L1(0.05) if penalize else None)
        second = keras.layers.Dense(33, activation="tanh",
                                    kernel_regularizer=keras.regularizers.L1L2(0.01, 0.05) if penalize else None)
        body = keras.Sequential([keras.Input((6,)), first, second, keras.layers.Dense(1, dtype="float32")])
        if not branch:
            return body
        aux = keras.layers.Dense(5, kernel_regularizer=keras.regularizers.L2(0.05) if penalize else None)
        return WithUnusedBranch(body, aux)

    class WithUnusedBranch(keras.Model):
        """A layer whose output reaches no loss (only its penalty gives it a gradient), and a regularized
        variable of the model itself."""

        def __init__(self, body, aux):
            super().__init__()
            self.body, self.aux = body, aux
            self.gain = self.add_weight(shape=(1,), initializer="ones",
                                        regularizer=keras.regularizers.L2(0.05) if aux.kernel_regularizer else None)

        def call(self, inputs):
            self.aux(inputs)
            return self.body(inputs) * self.gain

    cases = ((False, "float32", False, False), (True, "float32", False, False), (False, "float32", True, False),
             (False, "mixed_float16", False, False)) + (((False, "float32", False, True),) if jit else ())
    for own_loss, policy, branch, compiled in cases:
        what = (f"ZeRO-3 on {size} ranks, {'a loss added in call' if own_loss else 'weight regularizers'}"
                f"{' and an unused branch' if branch else ''}, {policy}{', jit_compile=True' if compiled else ''}")
        keras.mixed_precision.set_global_policy(policy)
        try:
            ref = regularized_model(own_loss, branch=branch)
            ref.compile(optimizer=_make_opt("adam"), loss="mse")
            ref_history = ref.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0).history
            model = regularized_model(own_loss, branch=branch)
            model.compile(optimizer=_zero3("adam"), loss="mse", jit_compile=compiled)
            history = model.fit(x[rows], y[rows], batch_size=b, epochs=epochs, shuffle=False, verbose=0).history
            assert model.jit_compile is compiled, what
            _sharded_between_uses(model, what)
            if policy == "float32":
                _close(ref.get_weights(), model.get_weights(), what)
            else:  # float16 products over 4 rows here, 8 in one process: equal to DistributedOptimizer
                dp = regularized_model(own_loss, branch=branch)
                dp.compile(optimizer=DistributedOptimizer(_make_opt("adam")), loss="mse")
                dp.fit(x[rows], y[rows], batch_size=b, epochs=epochs, shuffle=False, verbose=0)
                # a reduce-scatter rounds unlike an allreduce, which Adam's 1/sqrt(v) magnifies where v is
                # tiny: the absolute tolerance of the comparison without penalties above (measured here
                # 1.97e-6 on 1 of 198 weights at 4 ranks, also on the code before block checksums)
                _close(dp.get_weights(), model.get_weights(), what + " vs DistributedOptimizer", atol=2e-6)
                _close(ref.get_weights(), model.get_weights(), what, rtol=1e-2, atol=1e-3)
            # evaluate's loss includes the penalties (or the added loss) on the whole weights
            np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0),
                                       ref.evaluate(x, y, batch_size=8, verbose=0),
                                       rtol=RTOL if policy == "float32" else 1e-3, err_msg=what)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        plain = regularized_model(own_loss, penalize=False, branch=branch)
        plain.compile(optimizer=_make_opt("adam"), loss="mse")
        plain_history = plain.fit(x, y, batch_size=size * b, epochs=epochs, shuffle=False, verbose=0).history
        if comm.rank == 0:
            print(f"{what}: equal to one process (first epoch's mean loss {history['loss'][0]:.4f} here, "
                  f"{ref_history['loss'][0]:.4f} in one process, {plain_history['loss'][0]:.4f} without "
                  "penalties)", flush=True)


def sharded_build(width: int = 1024, depth: int = 8) -> None:
    """A model built under sharded_build: one-process initial values; the build's peak well below the model."""
    import gc

    import keras
    import torch

    import shardwise.keras as hvd

    comm = _setup()
    torch.set_num_threads(1)
    keras.utils.set_random_seed(0)  # imports TensorFlow where it is installed: before the baseline

    def make():
        keras.utils.set_random_seed(11)
        return keras.Sequential([keras.Input((width,))]
                                + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
                                + [keras.layers.Dense(3)])

    ref = make()
    want = ref.get_weights()
    model_bytes = sum(w.nbytes for w in want)
    del ref
    _return_freed_memory()
    gc.collect()
    comm.barrier()
    _reset_peak()
    base = _status("VmRSS")
    with hvd.sharded_build():
        model = make()
    assert all(v._value is None for v in model.variables), "sharded_build initialized a variable"
    model.compile(optimizer=hvd.ZeroOptimizer(keras.optimizers.SGD(0.01), stage=3), loss="mse")
    model.optimizer.build(model.trainable_variables)
    peak = _status("VmHWM") - base
    _sharded_between_uses(model, "sharded build")
    got = model.get_weights()
    _close(want, got, "sharded build initial values", rtol=0, atol=0)
    # Param shards (1/N) plus one layer at a time being initialized (its values, the unit's flat copy,
    # the broadcast's buffers): below 1/N of the model + four layers.
    layer_bytes = 4 * width * width
    bound = model_bytes / comm.size + 4 * layer_bytes + (4 << 20)
    every = comm.allgather_object(peak)
    assert max(every) < min(bound, 0.9 * model_bytes), (every, bound, model_bytes)
    x, y = _data(8 * comm.size, dim=width, seed=2)
    model.fit(x[:, :width], y, batch_size=8, epochs=1, verbose=0)  # trains (replicated variables initialized)
    if comm.rank == 0:
        print(f"sharded build on {comm.size} ranks: initial values equal to one process; build peak "
              f"{max(every) / 2 ** 20:.1f} MiB for a {model_bytes / 2 ** 20:.1f} MiB model "
              f"(bound {bound / 2 ** 20:.1f} MiB)", flush=True)


def _return_freed_memory() -> None:
    """glibc: freed blocks of 64 KiB or more go back to the system at once (as benchmarks/_peak.py does)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 65536)
        libc.mallopt(-1, 65536)
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)
