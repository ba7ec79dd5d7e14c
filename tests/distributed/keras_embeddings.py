"""Keras 3 sharded embedding bags (torch and JAX backends) against one process with whole tables (mpirun).

The model is :class:`shardwise.keras.ShardedEmbeddingBag` followed by a dense head
(Dense(4, tanh), Dense(1)), MSE loss, trained with ``model.fit`` on each rank's slice of
every global batch, the head through ``DistributedOptimizer(SGD)``. The reference is the same
model written out in numpy (float64) over the whole tables, from the core's ``full_table``
(SGD, element-wise Adagrad, or row-wise Adagrad with one accumulator per row and column block;
per-id weights on the sum-pooled features). :func:`resume_save` / :func:`resume_load` checkpoint
the model and its tables at one step on one backend, plan and rank count and resume on others.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from keras_dp import _setup

SEED, PER_RANK, STEPS, LR, MAX_IDS, HIDDEN = 5, 4, 4, 0.05, 3, 4
# SGD's table gradients are small: a larger rate shows the rows move
TABLE_LR = {"sgd": 1.0, "adagrad": 0.05, "rowwise_adagrad": 0.05}


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
WEIGHTED = [f for f in FEATURES if TABLE_OF[f].pooling == "sum"]  # per-id weights need sum pooling


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


def _weights(step: int, samples: int) -> dict[str, np.ndarray]:
    """Per-id weights of a step's global batch for the :data:`WEIGHTED` features (padding weighs anything)."""
    rng = np.random.default_rng(3000 + step)
    return {f: rng.uniform(0.5, 1.5, (samples, MAX_IDS)).astype("float32") for f in WEIGHTED}


def _target(step: int, samples: int) -> np.ndarray:
    return np.random.default_rng(2000 + step).normal(size=(samples, 1)).astype("float32")


def _model(layer, weighted: bool = False, dense: Optional[list] = None):
    """The layer and the dense head; ``weighted``: inputs ``<feature>_w`` carry per-id weights of the
    :data:`WEIGHTED` features; ``dense``: the head's initial weights (else Keras's, of seed 7)."""
    import keras

    keras.utils.set_random_seed(7)
    inputs = {f: keras.Input((MAX_IDS,), dtype="int32", name=f) for f in FEATURES}
    weights = None
    if weighted:
        weights = {f: keras.Input((MAX_IDS,), dtype="float32", name=f"{f}_w") for f in WEIGHTED}
        inputs.update({f"{f}_w": w for f, w in weights.items()})
    pooled = layer({f: inputs[f] for f in FEATURES}, weights=weights)
    hidden = keras.layers.Dense(HIDDEN, activation="tanh", name="hidden")(pooled)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    if dense is not None:
        model.get_layer("hidden").set_weights(dense[:2])
        model.get_layer("head").set_weights(dense[2:])
    return model


def _fixed_dense() -> list[np.ndarray]:
    """Initial head weights the same on every backend (Keras's seeded initializers differ between them)."""
    rng = np.random.default_rng(7)
    width = sum(TABLE_OF[f].embedding_dim for f in FEATURES)
    return [rng.normal(0, 0.3, (width, HIDDEN)).astype("float32"), np.zeros(HIDDEN, "float32"),
            rng.normal(0, 0.3, (HIDDEN, 1)).astype("float32"), np.zeros(1, "float32")]


def _dense_weights(model) -> list[np.ndarray]:
    return [np.asarray(w) for name in ("hidden", "head") for w in model.get_layer(name).get_weights()]


def _col_blocks(plan) -> dict[str, list[tuple[int, int]]]:
    """Per table, the column blocks of its shards (row-wise Adagrad keeps one accumulator per row and block)."""
    return {p.table.name: sorted({(s.col_start, s.col_end) for s in p.shards}) for p in plan.placements}


def _reblock(state: dict[tuple[int, int], np.ndarray], blocks: list[tuple[int, int]],
             width: int) -> dict[tuple[int, int], np.ndarray]:
    """Row-wise Adagrad state of a table moved to other column ``blocks``, as a checkpoint loads it: a block's
    own, else the whole table's, else the mean of the saved blocks'."""
    out = {}
    for b in blocks:
        if b in state:
            out[b] = state[b].copy()
        elif (0, width) in state:
            out[b] = state[(0, width)].copy()
        else:
            out[b] = np.mean(list(state.values()), axis=0)
    return out


def _reference(kind: str, samples: int, dense: list[np.ndarray], steps: int = STEPS,
               col_blocks: Optional[dict] = None, weighted: bool = False,
               reblock: Optional[tuple[int, dict]] = None) -> tuple[dict, list]:
    """One process, float64: whole tables from the core's ``full_table``, the head in numpy, ``steps``
    SGD/Adagrad/row-wise Adagrad steps (``col_blocks``: per table its column blocks, whole by default;
    ``reblock``: ``(step, col_blocks)``, the blocks from that step on, as a resharded checkpoint resumes)."""
    from shardwise.core.table_init import full_table

    tables = {t.name: full_table(t, SEED).astype(np.float64) for t in TABLES}
    blocks = {t.name: (col_blocks or {}).get(t.name, [(0, t.embedding_dim)]) for t in TABLES}
    acc = {name: np.zeros_like(w) for name, w in tables.items()}
    row_acc = {name: {b: np.zeros(w.shape[0]) for b in blocks[name]} for name, w in tables.items()}
    w1, b1, w2, b2 = (w.astype(np.float64) for w in dense)
    for step in range(steps):
        if reblock is not None and step == reblock[0]:
            row_acc = {name: _reblock(row_acc[name], reblock[1].get(name, [(0, w.shape[1])]), w.shape[1])
                       for name, w in tables.items()}
        ids, y = _ids(step, samples), _target(step, samples).astype(np.float64)
        per_id = _weights(step, samples) if weighted else {}
        pooled, masks = [], {}
        for f in FEATURES:
            t, a = TABLE_OF[f], ids[f]
            mask = a >= 0
            scale = np.where(mask, per_id[f], 0.0) if f in per_id else mask.astype(np.float64)
            masks[f] = (mask, np.maximum(mask.sum(1), 1)[:, None], scale)
            p = (tables[t.name][np.where(mask, a, 0)] * scale[..., None]).sum(1)
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
            t, (mask, n, scale) = TABLE_OF[f], masks[f]
            g = dx[:, col:col + t.embedding_dim]
            col += t.embedding_dim
            if t.pooling == "mean":
                g = g / n
            rows = np.repeat(g, mask.sum(1), axis=0) * scale[mask][:, None]
            np.add.at(table_grads[t.name], ids[f][mask], rows)
        for name, g in table_grads.items():
            if kind == "sgd":
                tables[name] -= TABLE_LR[kind] * g
            elif kind == "adagrad":
                acc[name] += g * g
                tables[name] -= TABLE_LR[kind] * g / (np.sqrt(acc[name]) + 1e-10)
            else:
                for (c0, c1), state in row_acc[name].items():
                    state += (g[:, c0:c1] ** 2).mean(1)
                    tables[name][:, c0:c1] -= TABLE_LR[kind] * g[:, c0:c1] / (np.sqrt(state) + 1e-10)[:, None]
        w1, b1, w2, b2 = (w - LR * g for w, g in zip((w1, b1, w2, b2), grads))
    return tables, [w1, b1, w2, b2]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> float:
    """Assert ``got`` is ``want`` to rtol 1e-5, atol 1e-6; return the largest share of that tolerance used."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
    return float((np.abs(got - want) / (1e-6 + 1e-5 * np.abs(want))).max()) if got.size else 0.0


def equivalence(kind: str = "sgd", constraints: Optional[dict] = None, backend: str = "mpi",
                weighted: bool = False) -> None:
    """``STEPS`` fit steps of the sharded model (plan of ``constraints``, the mixed plan by default) end
    with the dense weights and table values of the one-process reference (shardwise ``backend``);
    ``weighted``: the sum-pooled features carry per-id weights."""
    import keras

    from shardwise.core.embedding_plan import plan_tables
    from shardwise.core.table_init import full_table
    from shardwise.keras import DistributedOptimizer, ShardedEmbeddingBag

    comm = _setup(backend)
    size, rank = comm.size, comm.rank
    plan = plan_tables(TABLES, size, optimizer=kind, memory_per_rank=10**9, constraints=constraints or MIXED)
    layer = ShardedEmbeddingBag(TABLES, plan, seed=SEED, optimizer=kind, learning_rate=TABLE_LR[kind])
    model = _model(layer, weighted)
    dense0 = _dense_weights(model)
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    samples = PER_RANK * size
    x, y = _data(range(STEPS), samples, rank, PER_RANK, weighted)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    want_tables, want_dense = _reference(kind, samples, dense0, col_blocks=_col_blocks(plan), weighted=weighted)
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
        start = full_table(table, SEED)[s.row_start:s.row_end, s.col_start:s.col_end]
        rows = max(rows, float(np.abs(shard - start).max()))
    worst, rows = (max(v) for v in zip(*comm.allgather_object((worst, rows))))
    if rank == 0:
        kinds = "+".join(sorted({p.sharding.value for p in plan.placements}))
        print(f"OK {kinds} {kind}{' weighted' if weighted else ''} on {size} ranks "
              f"({keras.backend.backend()}, {comm.backend} collectives): "
              f"{worst:.0%} of the tolerance used, "
              f"dense moved {moved:.2e}, tables moved {rows:.2e}, jit_compile={model.jit_compile}", flush=True)


def _data(steps: range, samples: int, rank: int, per_rank: int, weighted: bool) -> tuple[dict, np.ndarray]:
    """This rank's slices of the global batches of ``steps`` (ids, and weights as ``<feature>_w``), and targets."""
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [_ids(s, samples) for s in steps]
    x = {f: np.concatenate([b[f][mine] for b in batches]) for f in FEATURES}
    if weighted:
        per_id = [_weights(s, samples) for s in steps]
        x.update({f"{f}_w": np.concatenate([w[f][mine] for w in per_id]) for f in WEIGHTED})
    y = np.concatenate([_target(s, samples)[mine] for s in steps])
    return x, y


def cases(cases: list[dict]) -> None:
    """:func:`equivalence` for each case (keyword arguments); rank 0 prints one line per case, then its time."""
    import time

    for case in cases:
        start = time.perf_counter()
        equivalence(**case)
        if _setup().rank == 0:
            print(f"   case {case} took {time.perf_counter() - start:.1f} s", flush=True)


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


# -- checkpoints: save on one backend, plan and rank count, resume on others -------------------------------

GLOBAL = 16  # samples per global batch, the same at 2 and 4 ranks, so a resumed run is the uninterrupted one
RESHARDED = {"t0": "column_wise", "t1": "row_wise", "t2": "row_wise", "t3": "table_wise"}


def _resume_model(kind: str, constraints: dict, seed: int, tables: Optional[list] = None):
    import keras

    from shardwise.core.embedding_plan import plan_tables
    from shardwise.keras import DistributedOptimizer, ShardedEmbeddingBag

    comm = _setup()
    tables = tables or TABLES
    plan = plan_tables(tables, comm.size, optimizer=kind, memory_per_rank=10**9, constraints=constraints)
    layer = ShardedEmbeddingBag(tables, plan, seed=seed, optimizer=kind, learning_rate=TABLE_LR[kind])
    model = _model(layer, dense=_fixed_dense())
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    return comm, plan, layer, model


def resume_save(directory: str, kind: str = "rowwise_adagrad", at: int = 2) -> None:
    """Train the first ``at`` steps (mixed plan, this job's ranks and backend), then save the model with its
    tables (``shardwise.keras.save_checkpoint``: the checkpoint door) at step ``at``."""
    import time

    import keras

    from shardwise.keras import save_checkpoint

    began = time.perf_counter()

    comm, plan, layer, model = _resume_model(kind, MIXED, SEED)
    per_rank = GLOBAL // comm.size
    x, y = _data(range(at), GLOBAL, comm.rank, per_rank, False)
    model.fit(x, y, batch_size=per_rank, epochs=1, shuffle=False, verbose=0)
    path = save_checkpoint(model, directory)  # the model's entry and its tables' (embeddings-0), step = iterations
    if comm.rank == 0:
        kinds = "+".join(p.sharding.value for p in plan.placements)
        print(f"OK saved {kind} tables ({kinds}) at step {at} on {comm.size} ranks ({keras.backend.backend()}) "
              f"in {path.name} ({time.perf_counter() - began:.1f} s)", flush=True)


def resume_load(directory: str, kind: str = "rowwise_adagrad", at: int = 2, saved_on: int = 4) -> None:
    """Load :func:`resume_save`'s checkpoint (written on ``saved_on`` ranks) on another plan
    (:data:`RESHARDED`), rank count and backend, with tables first drawn from another seed, train the
    remaining steps and end equal to the uninterrupted one-process reference (tables, dense weights, the
    optimizer's iterations; row-wise Adagrad's column blocks change at the resharding as the load's rule
    says); loading it into other tables is refused on every rank, changing nothing."""
    import time

    import keras

    from shardwise import checkpoint
    from shardwise.core.embedding_plan import TableConfig, plan_tables
    from shardwise.core.errors import CheckpointError
    from shardwise.keras import ShardedEmbeddingBag, load_checkpoint

    began = time.perf_counter()

    comm, plan, layer, model = _resume_model(kind, RESHARDED, SEED + 1)
    rank, size = comm.rank, comm.size
    info = load_checkpoint(model, directory)  # the model and its tables, on this plan
    per_rank = GLOBAL // size
    x, y = _data(range(at, STEPS), GLOBAL, rank, per_rank, False)
    model.fit(x, y, batch_size=per_rank, epochs=1, shuffle=False, verbose=0)
    saved_plan = plan_tables(TABLES, saved_on, optimizer=kind, memory_per_rank=10**9, constraints=MIXED)
    want_tables, want_dense = _reference(kind, GLOBAL, _fixed_dense(), col_blocks=_col_blocks(saved_plan),
                                         reblock=(at, _col_blocks(plan)))
    worst = 0.0
    for key, shard in layer.shards.items():
        table, s = layer.shard_of(key)
        worst = max(worst, _close(shard, want_tables[table.name][s.row_start:s.row_end, s.col_start:s.col_end],
                                  f"{key} on rank {rank} after resuming at step {at}"))
    for i, (got, want) in enumerate(zip(_dense_weights(model), want_dense)):
        worst = max(worst, _close(got, want, f"dense weight {i} on rank {rank} after resuming"))
    iterations = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    if iterations != STEPS:
        raise AssertionError(f"the optimizer's iterations are {iterations} after resuming, expected {STEPS}")
    other = [TableConfig(name=t.name, num_embeddings=t.num_embeddings + (t.name == "t0"),
                         embedding_dim=t.embedding_dim, pooling=t.pooling, feature_names=t.feature_names)
             for t in TABLES]
    stranger = ShardedEmbeddingBag(other, plan_tables(other, size, optimizer=kind, memory_per_rank=10**9,
                                                      constraints=RESHARDED), seed=SEED, optimizer=kind)
    before = {k: v.copy() for k, v in stranger.shards.items()}
    try:
        checkpoint.load(directory, {"embeddings-0": stranger})
    except CheckpointError as exc:
        if "holds other embedding tables: t0: saved (97, 8), here (98, 8)" not in str(exc):
            raise
        if any(not np.array_equal(before[k], v) for k, v in stranger.shards.items()):
            raise AssertionError("a refused load changed the tables") from exc
    else:
        raise AssertionError("a checkpoint of other tables was loaded")
    worst = max(v for v in comm.allgather_object(worst))
    if rank == 0:
        kinds = "+".join(p.sharding.value for p in plan.placements)
        print(f"OK resumed {kind} tables at step {info.step} on {size} ranks ({keras.backend.backend()}, "
              f"{kinds}): {worst:.0%} of the tolerance used after {STEPS} steps; other tables refused on every rank "
              f"({time.perf_counter() - began:.1f} s)",
              flush=True)


class _NoTorch:
    """A meta-path finder and loader under which importing ``torch`` (or a submodule) fails as if it were not
    installed, remembering who imported it (a ``find_spec`` look-up alone is no import and is not counted)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, name: str, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            import importlib.machinery

            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        import traceback

        caller = next((f"{f.filename}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-1])
                       if "importlib" not in f.filename and "<frozen" not in f.filename), "?")
        self.asked.append(f"{spec.name} from {caller}")
        raise ModuleNotFoundError(f"No module named {spec.name!r} (torch is blocked in this process)", name=spec.name)

    def exec_module(self, module) -> None:  # never reached: create_module raises
        raise ModuleNotFoundError(module.__name__)


def block_torch() -> None:
    """Make every later ``import torch`` fail in this process (call before anything imports keras)."""
    import sys

    if "torch" in sys.modules:
        raise AssertionError("torch is already imported")
    sys.meta_path.insert(0, _NoTorch())


def _refusals(tables: list, comm, ids: dict) -> str:
    """A data_parallel plan is refused when the layer is built; per-id weights on a mean-pooled feature, or
    none on a ``weighted=True`` table, when it is called."""
    import dataclasses

    from shardwise.core.embedding_plan import plan_tables
    from shardwise.core.errors import ConfigError
    from shardwise.keras import ShardedEmbeddingBag

    replicated = plan_tables(tables, comm.size, memory_per_rank=10**9, constraints={"t2": "data_parallel"})
    try:
        ShardedEmbeddingBag(tables, replicated, comm=comm)
    except ConfigError as exc:
        if "not ['t2 (data_parallel)']" not in str(exc):
            raise
    else:
        raise AssertionError("a data_parallel plan was taken")
    strict = [dataclasses.replace(t, weighted=True) if t.name == "t0" else t for t in tables]
    for layer, weights, want in (
            (ShardedEmbeddingBag(tables, comm=comm), {"f1a": np.ones(ids["f1a"].shape, "float32")},
             "per-id weights need sum pooling"),
            (ShardedEmbeddingBag(strict, comm=comm), None, "is weighted (weighted=True), but no per-id weights")):
        try:
            layer(ids, weights=weights)
        except Exception as exc:  # JAX wraps the callback's error in its runtime error
            if want not in str(exc):
                raise
        else:
            raise AssertionError(f"a call that should fail with {want!r} went through")
    return "data_parallel plans, weights on mean pooling and missing weights on weighted=True refused"


def jax_without_torch(directory: str) -> None:
    """One process on the JAX backend with ``import torch`` made to fail (:func:`block_torch` first): a
    weighted, row-wise Adagrad layer trains, saves and loads its tables, and the layer's refusals
    (:func:`_refusals`) hold; no module of torch (or of shardwise's torch adapters) is loaded at the end,
    and shardwise never asked for torch."""
    import sys

    import keras

    import shardwise
    from shardwise import checkpoint
    from shardwise.adapters.keras.embedding import SHARDING_TYPES
    from shardwise.core.embedding_plan import plan_tables
    from shardwise.keras import DistributedOptimizer, ShardedEmbeddingBag

    blocker = next((f for f in sys.meta_path if isinstance(f, _NoTorch)), None)
    if keras.backend.backend() != "jax" or blocker is None:
        raise AssertionError("run with KERAS_BACKEND=jax after block_torch()")
    comm = shardwise.init(backend="local").world
    kind = "rowwise_adagrad"
    plan = plan_tables(TABLES, comm.size, optimizer=kind, memory_per_rank=10**9,
                       sharding_types=list(SHARDING_TYPES))
    layer = ShardedEmbeddingBag(TABLES, plan, seed=SEED, optimizer=kind, learning_rate=TABLE_LR[kind])
    model = _model(layer, weighted=True, dense=_fixed_dense())
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    x, y = _data(range(2), PER_RANK, 0, PER_RANK, True)
    model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    want_tables, _ = _reference(kind, PER_RANK, _fixed_dense(), steps=2, col_blocks=_col_blocks(plan), weighted=True)
    worst = max(_close(shard, want_tables[layer.shard_of(k)[0].name], f"{k} without torch")
                for k, shard in layer.shards.items())
    checkpoint.save(directory, 2, {"model": model, "tables": layer})
    saved = {k: v.copy() for k, v in layer.shards.items()}
    for v in layer.shards.values():
        v[...] = 0
    checkpoint.load(directory, {"model": model, "tables": layer})
    if any(not np.array_equal(saved[k], v) for k, v in layer.shards.items()):
        raise AssertionError("the tables did not come back from the checkpoint")
    refusals = _refusals(TABLES, comm, {f: x[f][:PER_RANK] for f in FEATURES})
    loaded = sorted(m for m, mod in sys.modules.items() if mod is not None and
                    (m == "torch" or m.startswith("torch.") or m.startswith("shardwise.adapters.torch")))
    ours = [a for a in blocker.asked if "/shardwise/" in a]
    if loaded or ours:
        raise AssertionError(f"the JAX path loaded torch modules {loaded[:10]}, shardwise asked for {ours[:10]}")
    print(f"OK jax without torch: weighted rowwise_adagrad trained ({worst:.0%} of the tolerance used), "
          f"saved and loaded; {refusals}; no torch module loaded; torch asked for {len(blocker.asked)} time(s), "
          f"never by shardwise {sorted(set(a.split(' from ')[1] for a in blocker.asked))[:5]}", flush=True)
