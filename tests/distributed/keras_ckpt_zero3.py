"""Sharded Keras checkpoints at ZeRO stage 3 under mpirun: mixed precision across backends, sharded builds.

``mixed_save`` (one backend) trains with ``mixed_float16`` and a LossScaleOptimizer
around ``ZeroOptimizer(stage=3)``, checkpoints after ``SAVED`` epochs and goes on
uninterrupted; ``mixed_resume`` (another backend, same ranks) loads that checkpoint
into a fresh model and continues. One batch overflows float16 in the first epoch and
the scale grows every ``GROWTH`` finite steps, so the loss scale and its step
counter at the end depend on both crossing the checkpoint (a counter or a scale
reset by the load ends on another scale).

``sharded_save_load`` builds every model under ``sharded_build`` (no rank ever holds
a whole variable), saves, and loads into a fresh sharded-built model.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np

from keras_ckpt import GLOBAL_BATCH, MORE, SAVED, STEPS, _global_data, _model, _my_rows
from keras_dp import _iterations, _same_on_all_ranks, _setup
from keras_nonfinite import HUGE
from keras_zero3 import _reset_peak, _return_freed_memory, _sharded_between_uses, _status

GROWTH, OVERFLOW_STEP, INITIAL_SCALE = 4, 1, 2.0 ** 10
#: float16 products differ between torch's and XLA's kernels, and one process sums twice the rows per product:
#: measured 1.2e-4 to 5.5e-4 of (|ref| + atol / rtol) after 8 steps either way; Adam's moments halved at the
#: load give 99% of the elements outside this tolerance
MIXED_RTOL, MIXED_ATOL = 1e-3, 1e-4


def _mixed_data(epoch: int):
    """keras_ckpt's data, scaled down; in epoch 0 one row of the last rank's batch at step ``OVERFLOW_STEP``
    is too big for float16."""
    x, y = _global_data()
    x, y = x * 0.25, y * 0.25
    if epoch == 0:
        x[(OVERFLOW_STEP * GLOBAL_BATCH) + GLOBAL_BATCH - 1] = HUGE
    return x, y


def _mixed(distributed: bool, seed: int = 5):
    """keras_ckpt's model (numpy-initialised: the same on every backend) under mixed_float16, its last
    layer float32; Adam in ZeRO-3 (or alone) in a LossScaleOptimizer that grows every ``GROWTH`` steps."""
    import keras

    from shardwise.keras import ZeroOptimizer

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1, dtype="float32")])
        inner = keras.optimizers.Adam(0.01)
        lso = keras.optimizers.LossScaleOptimizer(ZeroOptimizer(inner, stage=3) if distributed else inner,
                                                  initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH)
        model.compile(optimizer=lso, loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.set_weights([w.astype("float32") for w in _model(seed).get_weights()])
    assert model.layers[0].compute_dtype == "float16" and model.layers[-1].compute_dtype == "float32"
    return model


def _scale_state(model) -> tuple[float, int, int]:
    """(loss scale, its step counter, the inner optimizer's iterations)."""
    import keras

    lso = model.optimizer
    return (float(keras.ops.convert_to_numpy(lso.dynamic_scale)),
            int(keras.ops.convert_to_numpy(lso.step_counter)), _iterations(lso))


def _fit(model, comm, epochs: int, initial_epoch: int = 0, callbacks=()) -> None:
    """Epochs ``[initial_epoch, epochs)`` on this rank's rows (all rows without ``comm``), one ``fit`` each
    (the data of epoch 0 differ)."""
    for epoch in range(initial_epoch, epochs):
        x, y = _mixed_data(epoch)
        rows = _my_rows(comm) if comm is not None else slice(None)
        model.fit(x[rows], y[rows], batch_size=GLOBAL_BATCH // (comm.size if comm is not None else 1),
                  epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0, callbacks=list(callbacks))


def _expected_scale(epochs: int) -> tuple[float, int, int]:
    """(loss scale, counter, steps applied) after ``epochs``: halved at the overflow, doubled after every
    ``GROWTH`` finite steps in a row."""
    scale, counter, applied = INITIAL_SCALE, 0, 0
    for step in range(epochs * STEPS):
        if step == OVERFLOW_STEP:
            scale, counter = scale / 2, 0
            continue
        applied, counter = applied + 1, counter + 1
        if counter == GROWTH:
            scale, counter = scale * 2, 0
    return scale, counter, applied


def mixed_save(directory: str) -> None:
    """Checkpoint after ``SAVED`` epochs, then go on uninterrupted; record both points in ``directory``."""
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    model = _mixed(True)
    _fit(model, comm, SAVED, callbacks=[hvd.callbacks.ShardedCheckpoint(os.path.join(directory, "ckpts"))])
    at_save = model.get_weights()
    state = _scale_state(model)
    assert state == _expected_scale(SAVED), state  # each overflowing step skipped
    _fit(model, comm, SAVED + MORE, initial_epoch=SAVED)
    at_end, end_state = model.get_weights(), _scale_state(model)
    _same_on_all_ranks(comm, at_end + [np.array(end_state)], "mixed uninterrupted")
    if comm.rank == 0:
        np.savez(os.path.join(directory, f"saved-{keras.backend.backend()}.npz"), *at_save, state=state)
        np.savez(os.path.join(directory, f"end-{keras.backend.backend()}.npz"), *at_end, state=end_state)
        print(f"mixed_float16 ZeRO-3 on {comm.size} {keras.backend.backend()} ranks: saved at (scale, counter, "
              f"iterations) = {state}, uninterrupted end {end_state}", flush=True)


def _stored(path: Path) -> tuple[list[np.ndarray], tuple]:
    with np.load(path) as f:
        weights = [f[f"arr_{i}"] for i in range(len(f.files) - 1)]
        return weights, tuple(f["state"].tolist())


def _diff(want, got) -> float:
    return max(float(np.max(np.abs(a - b) / (np.abs(a) + MIXED_ATOL / MIXED_RTOL))) for a, b in zip(want, got))


def mixed_resume(directory: str, saved_on: str) -> None:
    """Load the other backend's checkpoint into a fresh model and continue ``MORE`` epochs.

    The load is exact (float32 masters, loss scale, counter, iterations). The end is compared with
    three uninterrupted runs: the saving backend's (float16 kernels of another library), this
    backend's at the same ranks, and one process (twice the rows per float16 product): each is
    float16-close, not bitwise (``MIXED_RTOL``); the loss scale and its counter are equal exactly.
    """
    import keras

    import shardwise.keras as hvd

    comm = _setup()
    me = keras.backend.backend()
    what = f"mixed_float16 ZeRO-3 {saved_on} -> {me} on {comm.size} ranks"
    saved, saved_state = _stored(Path(directory, f"saved-{saved_on}.npz"))
    other_end, other_state = _stored(Path(directory, f"end-{saved_on}.npz"))

    model = _mixed(True, seed=100 + comm.rank)  # other initial values on every rank: all must be loaded
    info = hvd.load_checkpoint(model, os.path.join(directory, "ckpts"))
    assert (info.step, info.epoch) == (saved_state[2], SAVED), (what, info)
    assert _scale_state(model) == saved_state, (what, _scale_state(model), saved_state)
    for i, (a, b) in enumerate(zip(saved, model.get_weights())):
        np.testing.assert_array_equal(b, a, err_msg=f"{what}, loaded weight {i}")
    _fit(model, comm, SAVED + MORE, initial_epoch=SAVED)
    got, state = model.get_weights(), _scale_state(model)
    _same_on_all_ranks(comm, got + [np.array(state)], what)
    assert state == other_state == _expected_scale(SAVED + MORE), (what, state, other_state)

    here = _mixed(True)  # uninterrupted on this backend
    _fit(here, comm, SAVED + MORE)
    one = _mixed(False)  # one process, global batch
    _fit(one, None, SAVED + MORE)
    for ref, name in [(other_end, f"uninterrupted on {saved_on}"), (here.get_weights(), f"uninterrupted on {me}"),
                      (one.get_weights(), "one process")]:
        for i, (a, b) in enumerate(zip(ref, got)):
            np.testing.assert_allclose(b, a, rtol=MIXED_RTOL, atol=MIXED_ATOL, err_msg=f"{what} vs {name}: {i}")
        if comm.rank == 0:
            print(f"{what}: resumed vs {name}: max |diff| / (|ref| + {MIXED_ATOL / MIXED_RTOL:g}) = "
                  f"{_diff(ref, got):.2e}", flush=True)
    assert _scale_state(here) == _scale_state(one) == state, (what, _scale_state(here), _scale_state(one), state)
    if comm.rank == 0:
        print(f"{what}: loaded exactly (scale, counter, iterations) = {saved_state}; end {state} as uninterrupted",
              flush=True)


def _holds_only_shards(model, comm, what: str) -> None:
    """No rank holds a whole trainable variable: torch's Parameters are empty between uses, JAX's
    variables hold their unit's shard."""
    import keras

    if keras.backend.backend() == "torch":
        _sharded_between_uses(model, what)
        return
    engine = model.optimizer.stage3_engine
    for v, unit in zip(model.trainable_variables, engine.units):
        assert tuple(v.value.shape) == (unit.plan.shard_numel,), (what, v.path, tuple(v.value.shape))
        assert unit.plan.shard_numel * comm.size == unit.plan.padded_numel, what


def sharded_save_load(directory: str, width: int = 1024, depth: int = 8) -> None:
    """Models built under ``sharded_build``: one trains ``SAVED`` epochs with a ShardedCheckpoint and goes on;
    a fresh one (other seed) loads the checkpoint holding only its shards, its peak rising by less than
    one layer, and continues to the same weights. Rank 0 leaves ``probe.npy`` and the
    checkpointed model's predictions of it, ``expected.npy``, for the CLI's consolidation."""
    import keras

    import shardwise.keras as hvd
    from keras_dp import _data

    comm = _setup()
    keras.utils.set_random_seed(0)  # imports TensorFlow where it is installed: before the baseline
    backend = keras.backend.backend()
    x, y = _data(STEPS * GLOBAL_BATCH, dim=width, seed=41)
    rows, batch = _my_rows(comm), GLOBAL_BATCH // comm.size

    def layers():
        return ([keras.Input((width,))] + [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
                + [keras.layers.Dense(1)])

    def sharded(seed: int):
        keras.utils.set_random_seed(seed)
        with hvd.sharded_build():
            model = keras.Sequential(layers())
        assert all(v.__dict__.get("_value") is None for v in model.trainable_variables), "a variable was built"
        model.compile(optimizer=hvd.ZeroOptimizer(keras.optimizers.Adam(1e-3), stage=3), loss="mse")
        return model

    keras.utils.set_random_seed(11)
    ref = keras.Sequential(layers())
    ref.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    ref.fit(x, y, batch_size=GLOBAL_BATCH, epochs=SAVED + MORE, shuffle=False, verbose=0)
    want = ref.get_weights()
    model_bytes = sum(w.nbytes for w in want)
    del ref

    model = sharded(11)
    model.fit(x[rows], y[rows], batch_size=batch, epochs=SAVED, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.ShardedCheckpoint(os.path.join(directory, "ckpts"))])
    probe = x[:8]
    expected = model.predict(probe, verbose=0)
    model.fit(x[rows], y[rows], batch_size=batch, epochs=SAVED + MORE, initial_epoch=SAVED, shuffle=False,
              verbose=0)
    _holds_only_shards(model, comm, "uninterrupted")
    uninterrupted = model.get_weights()
    for i, (a, b) in enumerate(zip(want, uninterrupted)):
        # Sums over ranks round unlike one process's, which Adam's 1/sqrt(v) magnifies where v is tiny
        # (1.5e-6 on one of 1M weights here; keras_zero3.equivalence): an absolute tolerance, 1% of the step.
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"uninterrupted vs one process: {i}")
    del model
    gc.collect()
    _return_freed_memory()
    comm.barrier()
    _reset_peak()
    base = _status("VmRSS")

    fresh = sharded(12)  # other initial values: all must come from the checkpoint
    fresh.optimizer.build(fresh.trainable_variables)  # as fit would, unit by unit into the shards
    build_peak = _status("VmHWM") - base
    _reset_peak()
    before_load = _status("VmRSS")
    info = hvd.load_checkpoint(fresh, os.path.join(directory, "ckpts"))
    load_peak = _status("VmHWM") - before_load
    _holds_only_shards(fresh, comm, "loaded")
    assert (info.epoch, _iterations(fresh.optimizer)) == (SAVED, SAVED * STEPS), info
    fresh.fit(x[rows], y[rows], batch_size=batch, epochs=SAVED + MORE, initial_epoch=info.epoch, shuffle=False,
              verbose=0)
    _holds_only_shards(fresh, comm, "resumed")
    for i, (a, b) in enumerate(zip(uninterrupted, fresh.get_weights())):  # same ranks and layout: bitwise
        np.testing.assert_array_equal(b, a, err_msg=f"resumed vs uninterrupted: {i}")
    # The load writes into the shards the build made (that build's own peak is keras_zero3.sharded_build's
    # to bound; printed here), one stored piece at a time: its shard-sized buffer, the piece, the copy
    # into the variable (7-9 MiB measured on torch at 2 ranks). A whole model on a rank would add 32 MiB.
    # JAX's allocator keeps replaced shard arrays a while (10-28 MiB measured): printed, not bounded.
    layer_bytes = 4 * width * width
    load_bound = 2 * layer_bytes + (4 << 20)
    every = comm.allgather_object((build_peak, load_peak))
    if backend == "torch":
        assert max(p for _, p in every) < load_bound < model_bytes, (every, load_bound, model_bytes)
    if comm.rank == 0:
        np.save(os.path.join(directory, "probe.npy"), probe)
        np.save(os.path.join(directory, "expected.npy"), expected)
        mib = 2 ** 20
        print(f"sharded build -> checkpoint -> sharded build on {comm.size} {backend} ranks: resumed equal to the "
              f"uninterrupted run; a {model_bytes / mib:.1f} MiB model; per rank, build peak "
              f"{max(b for b, _ in every) / mib:.1f} MiB (Adam's shards: {3 * model_bytes / comm.size / mib:.1f}), then "
              f"load peak "
              f"{max(p for _, p in every) / mib:.1f} MiB more (torch's bound {load_bound / mib:.1f})", flush=True)
