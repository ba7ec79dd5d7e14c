"""Sharded embedding-bag collections against one process with unsharded ``nn.EmbeddingBag``s (run under mpirun)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import shardwise
import shardwise.checkpoint
import shardwise.torch as swt
from shardwise.adapters.torch.embedding import (KeyedJaggedTensor, ShardedEmbeddingBagCollection, SparseOptimizer,
                                                TableConfig, full_table, plan_tables)
from shardwise.core.errors import ShapeMismatchError

SEED, PER_RANK, STEPS, LR = 5, 6, 10, 0.05
TABLES = [
    TableConfig(name="t0", num_embeddings=97, embedding_dim=8),
    TableConfig(name="t1", num_embeddings=50, embedding_dim=8, pooling="mean", feature_names=("f1a", "f1b")),
    TableConfig(name="t2", num_embeddings=31, embedding_dim=4),
    TableConfig(name="t3", num_embeddings=203, embedding_dim=8, pooling="mean"),
]
FEATURES = [f for t in TABLES for f in t.feature_names]


def _tables(weighted: "bool | str", uniform: bool = False) -> list[TableConfig]:
    """The tables. ``weighted``: sum-pooled throughout with per-id weights (torch pools weighted bags by
    sum only); ``"mixed"``: as they are (t1 and t3 pool by mean, so the batch's weights pass them by),
    with t2 unweighted by choice, so only t0 is weighted. ``uniform``: t2 as wide as the others, so that
    every table-wise block lands on the output in one copy."""
    if uniform:
        return [TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=8,
                            feature_names=t.feature_names, pooling=t.pooling) for t in _tables(weighted)]
    if weighted == "mixed":
        return [TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                            feature_names=t.feature_names, pooling=t.pooling, weighted=False if t.name == "t2"
                            else None) for t in TABLES]
    if not weighted:
        return TABLES
    return [TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                        feature_names=t.feature_names) for t in TABLES]


def _uses_weights(table: TableConfig) -> bool:
    return bool(table.weighted) or (table.weighted is None and table.pooling == "sum")


TABLE_OF = {f: t for t in TABLES for f in t.feature_names}
WIDTH = sum(TABLE_OF[f].embedding_dim for f in FEATURES)


def _batch(step: int, samples: int, skew: bool, weighted: bool) -> KeyedJaggedTensor:
    """The global batch of a step: 0-3 ids per bag (empty bags included); ``skew``: mostly the lowest ids."""
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 4, (len(FEATURES) * samples,), generator=gen)
    values = []
    for k, f in enumerate(FEATURES):
        n = int(lengths[k * samples:(k + 1) * samples].sum())
        rows = TABLE_OF[f].num_embeddings
        ids = torch.randint(0, rows, (n,), generator=gen)
        if skew:  # nine in ten ids among the first 5% of rows: rank 0's under row-wise sharding
            hot = torch.rand(n, generator=gen) < 0.9
            ids = torch.where(hot, ids % max(1, rows // 20), ids)
        values.append(ids)
    weights = torch.rand(int(lengths.sum()), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths(FEATURES, torch.cat(values), lengths, weights)


def _slice(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples ``[start, stop)`` of every feature."""
    values, lengths, weights = [], [], []
    for f in kjt.keys:
        v, lens, w = kjt.feature(f)
        offsets = torch.cumsum(lens, 0) - lens
        a, b = int(offsets[start]), int(offsets[stop - 1] + lens[stop - 1])
        values.append(v[a:b])
        lengths.append(lens[start:stop])
        if w is not None:
            weights.append(w[a:b])
    return KeyedJaggedTensor.from_lengths(kjt.keys, torch.cat(values), torch.cat(lengths),
                                          torch.cat(weights) if weights else None)


def _dense(seed: int, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 6), nn.ReLU(), nn.Linear(6, 1))


def _width(tables: list[TableConfig]) -> int:
    return sum(t.embedding_dim * len(t.feature_names) for t in tables)


def _target(step: int, samples: int) -> torch.Tensor:
    return torch.randn(samples, 1, generator=torch.Generator().manual_seed(2000 + step))


def _reference(kind: str, skew: bool, weighted: bool, samples: int,
               uniform: bool = False) -> tuple[dict, nn.Module, list, list]:
    """One process: the whole tables as ``nn.EmbeddingBag``s; pooled outputs and table grads of step 0."""
    bags = nn.ModuleDict({t.name: nn.EmbeddingBag.from_pretrained(full_table(t, SEED), mode=t.pooling,
                                                                  freeze=False) for t in _tables(weighted, uniform)})
    dense = _dense(1, _width(_tables(weighted, uniform)))
    dense_opt = torch.optim.SGD(dense.parameters(), lr=LR)
    table_opt = torch.optim.SGD(bags.parameters(), lr=LR) if kind == "sgd" else \
        torch.optim.Adagrad(bags.parameters(), lr=LR, eps=1e-10)
    row_sums = {t.name: torch.zeros(t.num_embeddings) for t in TABLES}
    first_pooled, first_grads = None, None
    uses = {t.name: _uses_weights(t) for t in _tables(weighted, uniform)}
    for step in range(STEPS):
        kjt = _batch(step, samples, skew, bool(weighted))
        pooled = []
        for f in FEATURES:
            v, lens, w = kjt.feature(f)
            pooled.append(bags[TABLE_OF[f].name](v, torch.cumsum(lens, 0) - lens,
                                                 per_sample_weights=w if uses[TABLE_OF[f].name] else None))
        loss = nn.functional.mse_loss(dense(torch.cat(pooled, dim=1)), _target(step, samples))
        dense_opt.zero_grad()
        table_opt.zero_grad()
        loss.backward()
        if step == 0:
            first_pooled = [p.detach().clone() for p in pooled]
            first_grads = {t.name: bags[t.name].weight.grad.clone() for t in TABLES}
        if kind == "rowwise_adagrad":  # FBGEMM's row-wise Adagrad, written out
            for t in TABLES:
                weight, acc = bags[t.name].weight, row_sums[t.name]
                acc += (weight.grad ** 2).mean(dim=1)
                with torch.no_grad():
                    weight -= LR * weight.grad / (acc.sqrt() + 1e-10).unsqueeze(1)
        else:
            table_opt.step()
        dense_opt.step()
    return {t.name: bags[t.name].weight.detach() for t in TABLES}, dense, first_pooled, first_grads


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3e}")
    return (got - want).abs().max().item() if got.numel() else 0.0


def _constraints(sharding: Optional[str], mixed: bool, world_size: int) -> Optional[dict]:
    if sharding:
        return {t.name: sharding for t in TABLES}
    if mixed:
        return {"t0": "row_wise", "t1": "column_wise", "t2": "table_wise",
                "t3": "table_row_wise" if world_size == 4 else "row_wise"}
    return None


def _check_trained(ebc: ShardedEmbeddingBagCollection, dense: nn.Module, want_tables: dict,
                   want_dense: nn.Module) -> float:
    worst = 0.0
    for name in ebc.shard_names():
        table, shard = ebc.shard_of(name)
        want = want_tables[table.name][shard.row_start:shard.row_end, shard.col_start:shard.col_end]
        worst = max(worst, _close(ebc.shard(name), want, f"{name} after {STEPS} steps"))
    for (n, p), q in zip(dense.named_parameters(), want_dense.parameters()):
        worst = max(worst, _close(p.detach(), q.detach(), f"dense {n} after {STEPS} steps"))
    return worst


def _build(world, tables: list[TableConfig], kind: str, sharding: Optional[str], mixed: bool,  # noqa: ANN001
           local_size: Optional[int]) -> tuple:
    """The plan, the sharded tables, the dense model and both optimizers."""
    plan = plan_tables(tables, world.size, local_size=local_size, optimizer=kind, memory_per_rank=10**9,
                       constraints=_constraints(sharding, mixed, world.size))
    ebc = ShardedEmbeddingBagCollection(tables, plan, comm=world, seed=SEED)
    dense = _dense(1, _width(tables))
    dense_opt = swt.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=LR),
                                         named_parameters=dense.named_parameters())
    return plan, ebc, dense, dense_opt, SparseOptimizer(ebc, kind, lr=LR)


def equivalence(backend: str, sharding: Optional[str] = None, mixed: bool = False, kind: str = "sgd",
                skew: bool = False, weighted: bool = False, local_size: Optional[int] = None,
                compiled: bool = False, uniform: bool = False) -> None:
    """``sharding`` for every table, or a ``mixed`` plan; pooled outputs, table gradients and, after
    10 steps of ``kind`` on the tables and SGD on the dense part, tables and dense weights equal one process.

    ``compiled``: the lookups, the dense model and the backward run in one function compiled by
    ``torch.compile`` (the lookups' all-to-alls break its graph; they and their backward run eagerly)."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    samples = PER_RANK * world.size
    plan, ebc, dense, dense_opt, sparse_opt = _build(world, _tables(weighted, uniform), kind, sharding, mixed,
                                                     local_size)
    want_tables, want_dense, want_pooled, want_grads = _reference(kind, skew, weighted, samples, uniform)
    mine = slice(world.rank * PER_RANK, (world.rank + 1) * PER_RANK)

    def forward_backward(kjt: KeyedJaggedTensor, target: torch.Tensor) -> dict:
        out = ebc(kjt)
        nn.functional.mse_loss(dense(torch.cat([out[f] for f in FEATURES], dim=1)), target).backward()
        return out

    run = torch.compile(forward_backward) if compiled else forward_backward
    if compiled:
        from compile_scenarios import CompiledFrames

        CompiledFrames.start()
    for step in range(STEPS):
        kjt = _slice(_batch(step, samples, skew, bool(weighted)), mine.start, mine.stop)
        dense_opt.zero_grad()
        out = run(kjt, _target(step, samples)[mine])
        if step == 0:
            for f, want in zip(FEATURES, want_pooled):
                _close(out[f].detach(), want[mine], f"pooled {f}")
            grads = ebc.sparse_grads()
            for name in ebc.shard_names():
                table, shard = ebc.shard_of(name)
                dense_grad = torch.zeros(shard.rows, shard.cols)
                if name in grads:
                    dense_grad.index_add_(0, *grads[name])
                want = want_grads[table.name][shard.row_start:shard.row_end, shard.col_start:shard.col_end]
                _close(dense_grad, want, f"gradient of {name}")
        dense_opt.step()
        sparse_opt.step()
    worst = _check_trained(ebc, dense, want_tables, want_dense)
    if compiled:
        CompiledFrames.check("sharded tables in a compiled function")
    kinds = sorted({p.sharding.value for p in plan.placements})
    if world.rank == 0:
        weights = {False: "", True: " weighted", "mixed": " weighted+unweighted"}[weighted]
        extras = f"{' skew' * skew}{weights}{' compiled' * compiled}{' uniform' * uniform}"
        print(f"OK {'+'.join(kinds)} {kind}{extras} on {world.size} ranks ({backend}): max diff {worst:.2e}",
              flush=True)


def bad_ids(backend: str) -> None:
    """An id outside its table on one rank fails the lookup on every rank, naming the feature and the id."""
    world = shardwise.init(backend=backend).world
    plan = plan_tables(TABLES, world.size, memory_per_rank=10**9, constraints={t.name: "row_wise" for t in TABLES})
    ebc = ShardedEmbeddingBagCollection(TABLES, plan, comm=world, seed=SEED)
    kjt = _slice(_batch(0, PER_RANK * world.size, False, False), 0, PER_RANK)
    if world.rank == world.size - 1:
        values = kjt.values.clone()
        values[0] = 10_000
        kjt = KeyedJaggedTensor.from_lengths(kjt.keys, values, kjt.lengths)
    try:
        ebc(kjt)
    except ShapeMismatchError as exc:
        text = str(exc)
        if f"bad input on rank(s) [{world.size - 1}]" not in text:
            raise
        if world.rank == world.size - 1 and "id 10000 is outside table 't0'" not in text:
            raise
        world.barrier()
        if world.rank == 0:
            print(f"OK refused on every rank: {text}", flush=True)
        return
    raise AssertionError("an out-of-range id was accepted")


def unknown_features(backend: str) -> None:
    """A batch with a feature no table has, on one rank only: refused on every rank, naming it (and, for a
    misspelt feature, the one it lacks); with ``ignore_unknown_features`` it is dropped, and the lookup
    equals that of the batch without it."""
    world = shardwise.init(backend=backend).world
    plan = plan_tables(TABLES, world.size, memory_per_rank=10**9)
    kjt = _slice(_batch(0, PER_RANK * world.size, False, False), 0, PER_RANK)
    bogus = torch.tensor([1, 2, 3])
    extra = KeyedJaggedTensor.from_lengths(kjt.keys + ("bogus",), torch.cat([kjt.values, bogus]),
                                           torch.cat([kjt.lengths, torch.tensor([3] + [0] * (PER_RANK - 1))]))
    misspelt = KeyedJaggedTensor.from_lengths(tuple("t3x" if k == "t3" else k for k in kjt.keys), kjt.values,
                                              kjt.lengths)
    last = world.rank == world.size - 1
    strict = ShardedEmbeddingBagCollection(TABLES, plan, comm=world, seed=SEED)
    for bad, words in ((extra, ["'bogus'"]), (misspelt, ["'t3x'", "features ['t3'] are missing"])):
        try:
            strict(bad if last else kjt)
        except ShapeMismatchError as exc:
            text = str(exc)
            if f"bad input on rank(s) [{world.size - 1}]" not in text or (last and not all(w in text for w in words)):
                raise
        else:
            raise AssertionError(f"a batch with features {bad.keys} was accepted")
    lenient = ShardedEmbeddingBagCollection(TABLES, plan, comm=world, seed=SEED, ignore_unknown_features=True)
    got, want = lenient(extra if last else kjt), lenient(kjt)
    for f in FEATURES:
        _close(got[f], want[f], f"pooled {f} with an unknown feature dropped")
    world.barrier()
    if world.rank == 0:
        print("OK unknown features refused on every rank, or dropped on request", flush=True)


def other_tables(backend: str) -> None:
    """The last rank builds the collection with a table of another size: a ConfigError on every rank when
    the collection is built (not a lookup that parses another rank's packets wrongly, or hangs)."""
    from shardwise.core.embedding_plan import TableConfig
    from shardwise.core.errors import ConfigError

    world = shardwise.init(backend=backend).world
    tables = list(TABLES)
    if world.rank == world.size - 1:
        t = tables[0]
        tables[0] = TableConfig(name=t.name, num_embeddings=t.num_embeddings + 1, embedding_dim=t.embedding_dim,
                                feature_names=t.feature_names, pooling=t.pooling)
    try:
        ShardedEmbeddingBagCollection(tables, comm=world, seed=SEED)
    except ConfigError as exc:
        assert f"rank(s) [{world.size - 1}]" in str(exc), str(exc)
        world.barrier()
        if world.rank == 0:
            print(f"OK refused on every rank: {exc}", flush=True)
        return
    raise AssertionError("ranks with different tables built a collection")


def cases(backend: str, cases: list[dict]) -> None:
    """:func:`equivalence` for each case (keyword arguments) in one job; rank 0 prints one line per case."""
    for case in cases:
        equivalence(backend, **case)


def example(argv: list[str]) -> None:
    """Run ``examples/dlrm.py`` with ``argv``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import dlrm

    sys.argv = ["dlrm.py", *argv]
    dlrm.main()


RESUME_SAMPLES = 24  # the global batch, the same at 2 and 4 ranks


class _Recommender(nn.Module):
    """Sharded tables and a dense head in one model, as a user writes it."""

    def __init__(self, ebc: ShardedEmbeddingBagCollection, dense: nn.Module) -> None:
        super().__init__()
        self.sparse, self.dense = ebc, dense


def resume(backend: str, directory: str, phase: str, kind: str = "adagrad", sharding: Optional[str] = None,
           mixed: bool = False, local_size: Optional[int] = None, door: bool = False) -> None:
    """``phase`` "save": 5 steps, then a checkpoint of the tables, their optimizer state and the dense
    weights; "load": another plan (or world size) loads it and runs steps 5-9, ending equal to one process
    that ran all 10 steps. ``door``: the tables and dense head are one model, the two optimizers one
    :class:`CombinedOptimizer`, and one ``shardwise.checkpoint.save``/``load`` call takes both."""
    torch.set_num_threads(1)
    from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint, save_embedding_checkpoint

    world = shardwise.init(backend=backend).world
    per = RESUME_SAMPLES // world.size
    plan, ebc, dense, dense_opt, sparse_opt = _build(world, TABLES, kind, sharding, mixed, local_size)
    model, optim = _Recommender(ebc, dense), swt.CombinedOptimizer([dense_opt, sparse_opt])
    first = 0
    if phase == "load":
        if door:
            info = shardwise.checkpoint.load(directory, {"model": model, "optim": optim})
        else:
            info = load_embedding_checkpoint(ebc, directory, optimizer=sparse_opt)
            dense.load_state_dict(torch.load(f"{directory}/dense.pt"))
        first = info["step"]
    mine = slice(world.rank * per, (world.rank + 1) * per)
    for step in range(first, 5 if phase == "save" else STEPS):
        kjt = _slice(_batch(step, RESUME_SAMPLES, False, False), mine.start, mine.stop)
        out = ebc(kjt)
        loss = nn.functional.mse_loss(dense(torch.cat([out[f] for f in FEATURES], dim=1)),
                                      _target(step, RESUME_SAMPLES)[mine])
        dense_opt.zero_grad()
        loss.backward()
        optim.step()
    if phase == "save":
        if door:
            shardwise.checkpoint.save(directory, 5, {"model": model, "optim": optim}, extra={"position": 5})
        else:
            save_embedding_checkpoint(ebc, directory, 5, optimizer=sparse_opt, extra={"position": 5})
            if world.rank == 0:
                torch.save(dense.state_dict(), f"{directory}/dense.pt")
        world.barrier()
        if world.rank == 0:
            print(f"OK saved {sorted({p.sharding.value for p in plan.placements})} on {world.size} ranks", flush=True)
        return
    want_tables, want_dense, _, _ = _reference(kind, False, False, RESUME_SAMPLES)
    worst = _check_trained(ebc, dense, want_tables, want_dense)
    if world.rank == 0:
        print(f"OK resumed on {world.size} ranks as {sorted({p.sharding.value for p in plan.placements})}, "
              f"position {info['position']}: max diff vs one process {worst:.2e}", flush=True)


def wrong_tables(backend: str, directory: str) -> None:
    """A checkpoint of other tables is refused on every rank, naming the table that differs."""
    from shardwise.adapters.torch.checkpoint.embedding import load_embedding_checkpoint
    from shardwise.core.errors import CheckpointError

    world = shardwise.init(backend=backend).world
    other = [TableConfig(name=t.name, num_embeddings=t.num_embeddings + (t.name == "t2"),
                         embedding_dim=t.embedding_dim, pooling=t.pooling, feature_names=t.feature_names)
             for t in TABLES]
    ebc = ShardedEmbeddingBagCollection(other, plan_tables(other, world.size, memory_per_rank=10**9), comm=world)
    try:
        load_embedding_checkpoint(ebc, directory)
    except CheckpointError as exc:
        if "t2: saved (31, 4), here (32, 4)" not in str(exc):
            raise
        world.barrier()
        if world.rank == 0:
            print(f"OK refused: {exc}", flush=True)
        return
    raise AssertionError("a checkpoint of other tables was loaded")
