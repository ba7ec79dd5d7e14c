"""Keras 3 ZeRO stages 1 and 2 scenarios, run on every rank (mpi backend).

The reference is plain data parallelism (``shardwise.keras.DistributedOptimizer``)
on the same per-rank data, from the same initial weights.
"""

from __future__ import annotations

import numpy as np

from keras_dp import _data, _iterations, _rank_rows, _same_on_all_ranks, _setup

SLOT_KIND = {"sgd": "momentum", "adam": "adam"}  # the memory model's name for each optimizer's slots


def _model(seed: int = 7, dim: int = 6):
    """1313 parameters: an odd count, so the flat buffer is padded on every world size > 1."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])


def _make_opt(kind: str):
    import keras

    return {"sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01)}[kind]()


def _counting(comm):
    """A fresh sub-communicator counting its allreduce, reduce_scatter and allgather calls."""
    sub = comm.split(color=0)
    sub.calls = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}
    for op in sub.calls:
        plain = getattr(sub, op)

        def counted(*args, _op=op, _plain=plain, **kwargs):
            sub.calls[_op] += 1
            return _plain(*args, **kwargs)

        setattr(sub, op, counted)
    return sub


def _slot_bytes(optimizer) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables)


def _close(ref, got, what: str) -> None:
    for w_ref, w in zip(ref.get_weights(), got.get_weights()):
        np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-7, err_msg=what)


def equivalence(optimizers: list[str], stages: list[int], extras: bool = True) -> None:
    """20 fit steps with ZeroOptimizer == DistributedOptimizer; slot bytes match the memory model."""
    from shardwise.keras import DistributedOptimizer, ZeroOptimizer

    comm = _setup()
    size, b, steps, epochs = comm.size, 4, 10, 2
    x, y = _data(steps * size * b, seed=21)
    rows = _rank_rows(steps, size, comm.rank, b)
    xr, yr = x[rows], y[rows]

    def run(make_opt, eager: bool = False):
        model = _model()
        model.compile(optimizer=make_opt(), loss="mse", run_eagerly=eager)
        model.fit(xr, yr, batch_size=b, epochs=epochs, shuffle=False, verbose=0)
        return model

    for kind in optimizers:
        dp = run(lambda: DistributedOptimizer(_make_opt(kind)))
        dp_bytes = _slot_bytes(dp.optimizer.inner_optimizer)
        for stage in stages:
            what = f"{kind} stage {stage} on {size} ranks"
            sub = _counting(comm)
            zero = run(lambda: ZeroOptimizer(_make_opt(kind), stage=stage, comm=sub))
            _close(dp, zero, what)
            _same_on_all_ranks(comm, zero.get_weights(), what)
            opt = zero.optimizer
            assert _iterations(opt) == steps * epochs, (what, _iterations(opt))
            units = len(opt.units)
            # Both stages reduce-scatter (each rank receives its shard's gradient only), never allreduce.
            want = {"allreduce": 0, "reduce_scatter": units * steps * epochs, "allgather": units * steps * epochs}
            assert sub.calls == want, f"{what}: collectives {sub.calls}, want {want}"
            measured = opt.slot_bytes()
            assert measured == _slot_bytes(opt.inner_optimizer)
            expected = opt.expected_state_bytes(SLOT_KIND[kind]).optimizer_states
            assert abs(measured - expected) <= 0.05 * expected, f"{what}: {measured} B of slots, model {expected}"
            assert measured < dp_bytes, f"{what}: {measured} B of slots, not fewer than DP's {dp_bytes}"
            if comm.rank == 0:
                print(f"{what}: slot bytes/rank {measured} (model {expected}, DP {dp_bytes}), {units} unit(s)")
    if extras:
        _extras(comm, xr, yr, b)


def _extras(comm, xr, yr, b: int) -> None:
    """Several units, eager mode, broadcast callback mid-training, refused configurations."""
    import keras

    import shardwise
    from shardwise.keras import DistributedOptimizer, ZeroOptimizer, callbacks

    def fit(model, opt_or_none, eager=False, cbs=(), epochs=1):
        if opt_or_none is not None:
            model.compile(optimizer=opt_or_none, loss="mse", run_eagerly=eager)
        model.fit(xr, yr, batch_size=b, epochs=epochs, shuffle=False, verbose=0, callbacks=list(cbs))
        return model

    # Small units (1 KiB cap) on stage 2 Adam, then stage 1 SGD run eagerly.
    dp = fit(_model(), DistributedOptimizer(_make_opt("adam")), epochs=2)
    multi = fit(_model(), ZeroOptimizer(_make_opt("adam"), stage=2, bucket_cap_bytes=1024), epochs=2)
    assert len(multi.optimizer.units) == 3, len(multi.optimizer.units)
    _close(dp, multi, "stage 2, several units")
    dp = fit(_model(), DistributedOptimizer(_make_opt("sgd")), eager=True, epochs=2)
    eager = fit(_model(), ZeroOptimizer(_make_opt("sgd"), stage=1), eager=True, epochs=2)
    _close(dp, eager, "stage 1 run eagerly")
    if keras.backend.backend() == "torch":  # jit_compile=True: Keras runs the step under torch.compile
        compiled = _model()
        compiled.compile(optimizer=ZeroOptimizer(_make_opt("sgd"), stage=2), loss="mse", jit_compile=True)
        fit(compiled, None, epochs=2)
        assert compiled.jit_compile is True
        _close(dp, compiled, "stage 2 with jit_compile=True (torch.compile)")

    # Broadcast callback at each fit's start: rank-dependent weights start equal; the per-rank
    # Adam shards survive the second broadcast (only replicated variables are broadcast).
    def two_fits(opt):
        model = _model(seed=100 + comm.rank)
        fit(model, opt, cbs=[callbacks.BroadcastGlobalVariablesCallback(0)])
        return fit(model, None, cbs=[callbacks.BroadcastGlobalVariablesCallback(0)])

    ref = two_fits(DistributedOptimizer(_make_opt("adam")))
    got = two_fits(ZeroOptimizer(_make_opt("adam"), stage=2))
    _close(ref, got, "broadcast callback, two fits")
    _same_on_all_ranks(comm, got.get_weights(), "broadcast callback")

    # Configurations a flat shard cannot honour are refused up front.
    for bad, needle in [(lambda: ZeroOptimizer(_make_opt("sgd"), stage=4), "stage"),
                        (lambda: ZeroOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0)), "clipnorm"),
                        (lambda: ZeroOptimizer(keras.optimizers.LossScaleOptimizer(_make_opt("sgd"))),
                         "LossScaleOptimizer"),
                        (lambda: ZeroOptimizer(DistributedOptimizer(_make_opt("sgd"))), "already")]:
        try:
            bad()
        except shardwise.ConfigError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError(f"expected a ConfigError mentioning {needle!r}")
    # Serialisation round trip keeps the stage and the inner optimizer.
    opt = ZeroOptimizer(_make_opt("adam"), stage=2, bucket_cap_bytes=4096)
    back = ZeroOptimizer.from_config(opt.get_config())
    assert (back.stage, back.bucket_cap_bytes, type(back.inner_optimizer).__name__) == (2, 4096, "Adam")
