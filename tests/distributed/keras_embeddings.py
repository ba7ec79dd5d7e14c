"""Keras 3 sharded embedding bags (torch and JAX backends) against one process with whole tables (mpirun).

The model is :class:`shardwise.keras.ShardedEmbeddingBag` followed by a dense head
(Dense(4, tanh), Dense(1)), MSE loss, trained with ``model.fit`` on each rank's slice of
every global batch, the head through ``DistributedOptimizer(SGD)``. The reference is the same
model written out in numpy (float64) over the whole tables, from ``full_table``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from keras_dp import _setup

SEED, PER_RANK, STEPS, LR, MAX_IDS, HIDDEN = 5, 4, 4, 0.05, 3, 4
TABLE_LR = {"sgd": 1.0, "adagrad": 0.05}  # SGD's table gradients are small: a larger rate shows the rows move


def _tables() -> list:
    from shardwise.core.embedding_plan import TableConfig

    return [
        TableConfig(name="t0", num_embeddings=97, embedding_dim=8),
        TableConfig(name="t1", num_embeddings=50, embedding_dim=8, pooling="mean", feature_names=("f1a", "f1b")),
        TableConfig(name="t2", num_embeddings=31, embedding_dim=4),
        TableConfig(name="t3", num_embeddings=203, embedding_dim=8, pooling="mean"),
    ]


TABLES = _tables()
FEATURES = [f for t in TABLES for f in t.feature_names]
TABLE_OF = {f: t for t in TABLES for f in t.feature_names}
MIXED = {"t0": "row_wise", "t1": "column_wise", "t2": "table_wise", "t3": "row_wise"}


def _ids(step: int, samples: int) -> dict[str, np.ndarray]:
    """The global batch of a step: per feature ``[samples, MAX_IDS]`` ids, 0-3 per bag, padded with -1."""
    rng = np.random.default_rng(1000 + step)
    out = {}
    for f in FEATURES:
        lengths = rng.integers(0, MAX_IDS + 1, samples)
        ids = rng.integers(0, TABLE_OF[f].num_embeddings, (samples, MAX_IDS))
        ids[np.arange(MAX_IDS)[None, :] >= lengths[:, None]] = -1
        out[f] = ids.astype("int32")
    return out


def _target(step: int, samples: int) -> np.ndarray:
    return np.random.default_rng(2000 + step).normal(size=(samples, 1)).astype("float32")


def _model(layer):
    import keras

    keras.utils.set_random_seed(7)
    inputs = {f: keras.Input((MAX_IDS,), dtype="int32", name=f) for f in FEATURES}
    hidden = keras.layers.Dense(HIDDEN, activation="tanh", name="hidden")(layer(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))


def _dense_weights(model) -> list[np.ndarray]:
    return [np.asarray(w) for name in ("hidden", "head") for w in model.get_layer(name).get_weights()]


def _reference(kind: str, samples: int, dense: list[np.ndarray]) -> tuple[dict, list]:
    """One process, float64: whole tables from ``full_table``, the head in numpy, ``STEPS`` SGD/Adagrad steps."""
    from shardwise.adapters.torch.embedding import full_table

    tables = {t.name: full_table(t, SEED).double().numpy() for t in TABLES}
    acc = {name: np.zeros_like(w) for name, w in tables.items()}
    w1, b1, w2, b2 = (w.astype(np.float64) for w in dense)
    for step in range(STEPS):
        ids, y = _ids(step, samples), _target(step, samples).astype(np.float64)
        pooled, masks = [], {}
        for f in FEATURES:
            t, a = TABLE_OF[f], ids[f]
            mask = a >= 0
            masks[f] = (mask, np.maximum(mask.sum(1), 1)[:, None])
            p = (tables[t.name][np.where(mask, a, 0)] * mask[..., None]).sum(1)
            pooled.append(p / masks[f][1] if t.pooling == "mean" else p)
        x = np.concatenate(pooled, axis=1)
        h = np.tanh(x @ w1 + b1)
        d_out = 2 * (h @ w2 + b2 - y) / samples
        dz = (d_out @ w2.T) * (1 - h ** 2)
        grads = [x.T @ dz, dz.sum(0), h.T @ d_out, d_out.sum(0)]
        dx = dz @ w1.T
        table_grads = {name: np.zeros_like(w) for name, w in tables.items()}
        col = 0
        for f in FEATURES:
            t, (mask, n) = TABLE_OF[f], masks[f]
            g = dx[:, col:col + t.embedding_dim]
            col += t.embedding_dim
            if t.pooling == "mean":
                g = g / n
            np.add.at(table_grads[t.name], ids[f][mask], np.repeat(g, mask.sum(1), axis=0))
        for name, g in table_grads.items():
            if kind == "sgd":
                tables[name] -= TABLE_LR[kind] * g
            else:
                acc[name] += g * g
                tables[name] -= TABLE_LR[kind] * g / (np.sqrt(acc[name]) + 1e-10)
        w1, b1, w2, b2 = (w - LR * g for w, g in zip((w1, b1, w2, b2), grads))
    return tables, [w1, b1, w2, b2]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> float:
    """Assert ``got`` is ``want`` to rtol 1e-5, atol 1e-6; return the largest share of that tolerance used."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
    return float((np.abs(got - want) / (1e-6 + 1e-5 * np.abs(want))).max()) if got.size else 0.0


def equivalence(kind: str = "sgd", constraints: Optional[dict] = None, backend: str = "mpi") -> None:
    """``STEPS`` fit steps of the sharded model (plan of ``constraints``, the mixed plan by default) end
    with the dense weights and table values of the one-process reference (shardwise ``backend``)."""
    import keras

    from shardwise.adapters.torch.embedding import full_table
    from shardwise.core.embedding_plan import plan_tables
    from shardwise.keras import DistributedOptimizer, ShardedEmbeddingBag

    comm = _setup(backend)
    size, rank = comm.size, comm.rank
    plan = plan_tables(TABLES, size, optimizer=kind, memory_per_rank=10**9, constraints=constraints or MIXED)
    layer = ShardedEmbeddingBag(TABLES, plan, seed=SEED, optimizer=kind, learning_rate=TABLE_LR[kind])
    model = _model(layer)
    dense0 = _dense_weights(model)
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    samples = PER_RANK * size
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    batches = [_ids(s, samples) for s in range(STEPS)]
    x = {f: np.concatenate([b[f][mine] for b in batches]) for f in FEATURES}
    y = np.concatenate([_target(s, samples)[mine] for s in range(STEPS)])
    model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    want_tables, want_dense = _reference(kind, samples, dense0)
    worst = 0.0
    for key, shard in layer.shards.items():
        table, s = layer.shard_of(key)
        worst = max(worst, _close(shard, want_tables[table.name][s.row_start:s.row_end, s.col_start:s.col_end],
                                  f"{key} on rank {rank} after {STEPS} steps"))
    for i, (got, want) in enumerate(zip(_dense_weights(model), want_dense)):
        worst = max(worst, _close(got, want, f"dense weight {i} on rank {rank}"))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(_dense_weights(model), dense0))
    rows = 0.0
    for key, shard in layer.shards.items():
        table, s = layer.shard_of(key)
        start = full_table(table, SEED).numpy()[s.row_start:s.row_end, s.col_start:s.col_end]
        rows = max(rows, float(np.abs(shard - start).max()))
    worst, rows = (max(v) for v in zip(*comm.allgather_object((worst, rows))))
    if rank == 0:
        kinds = "+".join(sorted({p.sharding.value for p in plan.placements}))
        print(f"OK {kinds} {kind} on {size} ranks ({keras.backend.backend()}, {comm.backend} collectives): "
              f"{worst:.0%} of the tolerance used, "
              f"dense moved {moved:.2e}, tables moved {rows:.2e}, jit_compile={model.jit_compile}", flush=True)


def cases(cases: list[dict]) -> None:
    """:func:`equivalence` for each case (keyword arguments); rank 0 prints one line per case."""
    for case in cases:
        equivalence(**case)


def bad_ids() -> None:
    """An id outside its table on the last rank fails ``model.fit`` on every rank, never hangs."""
    import keras

    from shardwise.core.embedding_plan import plan_tables
    from shardwise.keras import DistributedOptimizer, ShardedEmbeddingBag

    comm = _setup()
    size, rank = comm.size, comm.rank
    plan = plan_tables(TABLES, size, memory_per_rank=10**9, constraints=MIXED)
    layer = ShardedEmbeddingBag(TABLES, plan, seed=SEED, learning_rate=LR)
    model = _model(layer)
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    x = {f: v[mine].copy() for f, v in _ids(0, PER_RANK * size).items()}
    if rank == size - 1:
        x["t0"][0, 0] = 10_000
    try:
        model.fit(x, _target(0, PER_RANK * size)[mine], batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    except Exception as exc:  # JAX wraps the callback's error in its runtime error
        text = str(exc)
        if f"embedding lookup refused on every rank: bad input on rank(s) [{size - 1}]" not in text:
            raise
        if rank == size - 1 and "feature 't0': id 10000 is outside table 't0'" not in text:
            raise
        refused = comm.allgather_object(True)
        if rank == 0:
            print(f"OK refused on every rank ({keras.backend.backend()}, {sum(refused)} of {size}): "
                  f"bad input on rank(s) [{size - 1}]", flush=True)
        return
    raise AssertionError("an out-of-range id was accepted")
