"""TorchRec models moved onto shardwise's sharded tables and back, against TorchRec's unsharded
``EmbeddingBagCollection`` and one process with ``nn.EmbeddingBag`` s (run under mpirun; needs torchrec)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.embedding import (ShardedEmbeddingBagCollection, SparseOptimizer, TableConfig, full_table,
                                                plan_tables)
from shardwise.adapters.torch.embedding.tables_io import full_tables, load_full_tables
from shardwise.adapters.torch.embedding.torchrec_interop import (as_kjt, as_table_configs, load_torchrec_state_dict,
                                                                 torchrec_state_dict)
from shardwise.core.errors import ConfigError, ShapeMismatchError

SEED, PER_RANK, STEPS, LR = 11, 5, 3, 0.5


def _configs(weighted: bool) -> list:
    """TorchRec tables: sum and mean pooled, two features on one table; weighted ones pool by sum only."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    if weighted:
        return [EmbeddingBagConfig(name="w0", num_embeddings=41, embedding_dim=6, feature_names=["g0", "g1"]),
                EmbeddingBagConfig(name="w1", num_embeddings=29, embedding_dim=4, feature_names=["g2"])]
    return [EmbeddingBagConfig(name="t0", num_embeddings=53, embedding_dim=8, feature_names=["f0", "f1"],
                               pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t1", num_embeddings=37, embedding_dim=4, feature_names=["f2"],
                               pooling=PoolingType.MEAN)]


class _Batch:
    """A step's global batch, per feature and sample: 0-3 ids (empty bags included) and their weights."""

    def __init__(self, step: int, tables: list[TableConfig], samples: int, weighted: bool) -> None:
        gen = torch.Generator().manual_seed(100 + step)
        self.features = [f for t in tables for f in t.feature_names]
        rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
        self.lengths = torch.randint(0, 4, (len(self.features), samples), generator=gen)
        self.ids = [[torch.randint(0, rows[f], (int(n),), generator=gen) for n in self.lengths[k]]
                    for k, f in enumerate(self.features)]
        self.weights = [[torch.rand(int(n), generator=gen) for n in self.lengths[k]]
                        for k in range(len(self.features))] if weighted else None
        self.target = torch.randn(samples, generator=gen)

    def torchrec(self, start: int, stop: int) -> Any:
        """Samples ``[start, stop)`` as a torchrec KeyedJaggedTensor (int32 lengths, as TorchRec's own)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        k_range = range(len(self.features))
        values = torch.cat([self.ids[k][i] for k in k_range for i in range(start, stop)])
        weights = None if self.weights is None else \
            torch.cat([self.weights[k][i] for k in k_range for i in range(start, stop)])
        lengths = self.lengths[:, start:stop].reshape(-1).to(torch.int32)
        return KeyedJaggedTensor(keys=self.features, values=values, lengths=lengths, weights=weights)

    def feature(self, k: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Feature ``k`` of every sample: values, offsets, weights (for ``nn.EmbeddingBag``)."""
        lens = self.lengths[k]
        return (torch.cat(self.ids[k]), torch.cumsum(lens, 0) - lens,
                None if self.weights is None else torch.cat(self.weights[k]))


def _projection(tables: list[TableConfig]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f: torch.randn(t.embedding_dim, generator=gen) for t in tables for f in t.feature_names}


def _loss(pooled: dict[str, torch.Tensor], proj: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(sum(pooled[f] @ proj[f] for f in proj), target)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-6, atol: float = 1e-7) -> float:
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
        raise AssertionError(f"{what}: shapes {tuple(got.shape)} / {tuple(want.shape)}, max diff {diff:.3e}")
    return (got - want).abs().max().item() if got.numel() else 0.0


def _case(world: Any, sharding: str, weighted: bool) -> None:
    """A TorchRec EBC's tables and weights onto shardwise (``sharding`` for every table): its pooled outputs
    on TorchRec batches equal the EBC's; after STEPS SGD steps the exported tables load into a new EBC
    (``strict=True``) whose outputs equal shardwise's, and equal one process's nn.EmbeddingBags."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(SEED)
    trc = EmbeddingBagCollection(_configs(weighted), is_weighted=weighted)
    tables = as_table_configs(trc.embedding_bag_configs(), weighted=weighted)
    if tables != as_table_configs(trc) or any(t.weighted is not weighted for t in tables):
        raise AssertionError(f"the EBC's tables {as_table_configs(trc)} are not its configs' {tables}")
    plan = plan_tables(tables, world.size, memory_per_rank=10**9, constraints={t.name: sharding for t in tables})
    ebc = ShardedEmbeddingBagCollection(tables, plan, comm=world, seed=SEED)
    load_torchrec_state_dict(ebc, trc.state_dict())
    opt = SparseOptimizer(ebc, "sgd", lr=LR)
    bags = nn.ModuleDict({t.name: nn.EmbeddingBag.from_pretrained(trc.state_dict()[f"embedding_bags.{t.name}.weight"]
                                                                  .clone(), mode=t.pooling, freeze=False)
                          for t in tables})
    ref_opt = torch.optim.SGD(bags.parameters(), lr=LR)
    table_of = {f: t.name for t in tables for f in t.feature_names}
    proj, samples = _projection(tables), PER_RANK * world.size
    start, stop = world.rank * PER_RANK, (world.rank + 1) * PER_RANK
    pooled_diff = 0.0
    for step in range(STEPS):
        batch = _Batch(step, tables, samples, weighted)
        out = ebc(as_kjt(batch.torchrec(start, stop)))
        ref = {f: bags[table_of[f]](*batch.feature(k)) for k, f in enumerate(batch.features)}
        if step == 0:  # the weights loaded from TorchRec: its own forward
            with torch.no_grad():
                want = trc(batch.torchrec(0, samples)).to_dict()
            for f in batch.features:
                pooled_diff = max(pooled_diff, _close(out[f].detach(), want[f][start:stop], f"pooled {f}"))
        for f in batch.features:  # trained: one process's
            _close(out[f].detach(), ref[f].detach()[start:stop], f"step {step} pooled {f} vs one process", 1e-5, 1e-6)
        _loss(out, proj, batch.target[start:stop]).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, proj, batch.target).backward()
        ref_opt.step()
    reference = {t.name: bags[t.name].weight.detach() for t in tables}

    exported = torchrec_state_dict(ebc)
    back = EmbeddingBagCollection(_configs(weighted), is_weighted=weighted)
    back.load_state_dict(exported, strict=True)
    batch = _Batch(STEPS, tables, samples, weighted)
    out = ebc(as_kjt(batch.torchrec(start, stop)))
    with torch.no_grad():
        want = back(batch.torchrec(0, samples)).to_dict()
    back_diff = max(_close(out[f].detach(), want[f][start:stop], f"exported EBC's pooled {f}") for f in batch.features)
    table_diff = max(_close(exported[f"embedding_bags.{n}.weight"], w, f"exported {n} vs one process", 1e-5, 1e-6)
                     for n, w in reference.items())

    whole = full_tables(ebc)
    if list(whole) != [t.name for t in tables]:
        raise AssertionError(f"full_tables gave {list(whole)}")
    for n, w in reference.items():
        _close(whole[n], w, f"full_tables {n} vs one process", 1e-5, 1e-6)
        if not torch.equal(whole[n], exported[f"embedding_bags.{n}.weight"]):
            raise AssertionError(f"full_tables {n} differs from torchrec_state_dict's")
    on_dst = full_tables(ebc, dst=world.size - 1)
    if world.rank == world.size - 1:
        for n in whole:
            if not torch.equal(on_dst[n], whole[n]):
                raise AssertionError(f"full_tables(dst={world.size - 1}) {n} differs from every rank's")
    elif on_dst != {}:
        raise AssertionError(f"full_tables(dst={world.size - 1}) gave rank {world.rank} {list(on_dst)}")
    on_dst = torchrec_state_dict(ebc, dst=0)
    if (world.rank == 0) != (sorted(on_dst) == sorted(exported)):
        raise AssertionError(f"torchrec_state_dict(dst=0) on rank {world.rank}: {sorted(on_dst)}")

    _loss(out, proj, batch.target[start:stop]).backward()  # pending gradients that a load must drop
    new = {n: w * 2 + 1 for n, w in reference.items()}
    load_full_tables(ebc, new)
    if ebc.pending:
        raise AssertionError("load_full_tables kept pending row gradients")
    again = full_tables(ebc)
    for n in new:
        if not torch.equal(again[n], new[n]):
            raise AssertionError(f"load_full_tables then full_tables: {n} differs")
    world.barrier()
    if world.rank == 0:
        kind = "weighted sum" if weighted else "sum+mean"
        print(f"OK torchrec {sharding} {kind}: pooled vs TorchRec EBC max diff {pooled_diff:.2e}; after {STEPS} "
              f"steps the exported EBC vs shardwise {back_diff:.2e}, tables vs one process {table_diff:.2e}; "
              "full_tables and load_full_tables round trip", flush=True)


def _replicated(world: Any) -> None:
    """A table held whole by every rank (as data parallel places it) is taken once, from its first shard;
    loading whole tables writes every replica."""
    rep = TableConfig(name="rep", num_embeddings=13, embedding_dim=4)
    rows = TableConfig(name="rows", num_embeddings=11, embedding_dim=4)
    plan = plan_tables([rep, rows], world.size, memory_per_rank=10**9,
                       constraints={"rep": "data_parallel", "rows": "row_wise"})
    if len(plan.placement("rep").shards) != world.size:
        raise AssertionError(f"data_parallel gave {plan.placement('rep').shards}")
    ebc = ShardedEmbeddingBagCollection([rep, rows], plan, comm=world, seed=SEED)
    with torch.no_grad():
        ebc.shard(f"rep__shard{world.rank}").add_(100.0 * world.rank)  # only rank 0's copy is the initial one
    for dst in (None, world.size - 1):
        got = full_tables(ebc, dst=dst)
        if dst is not None and world.rank != dst:
            continue
        if not torch.equal(got["rep"], full_table(rep, SEED)) or not torch.equal(got["rows"], full_table(rows, SEED)):
            raise AssertionError(f"full_tables(dst={dst}) of a replicated table is not its first replica")
    load_full_tables(ebc, {"rep": torch.full((13, 4), 3.0), "rows": torch.zeros(11, 4)})
    if not torch.equal(ebc.shard(f"rep__shard{world.rank}"), torch.full((13, 4), 3.0)):
        raise AssertionError(f"rank {world.rank}'s replica was not loaded")
    world.barrier()
    if world.rank == 0:
        print(f"OK replicated table taken once from {world.size} replicas; loaded into every one", flush=True)


def _expect(error: type, needles: list[str], fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except error as exc:
        text = str(exc)
        if not all(n in text for n in needles):
            raise AssertionError(f"{error.__name__} without {needles}: {text}") from exc
        return text
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised no {error.__name__} (expected {needles})")


def _refusals(world: Any) -> None:
    """What shardwise cannot express, and state_dicts of other tables, are refused naming the table and field."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    _expect(ConfigError, ["'u'", "pooling NONE"], as_table_configs,
            [EmbeddingBagConfig(name="u", num_embeddings=5, embedding_dim=2, pooling=PoolingType.NONE)])
    _expect(ConfigError, ["'h'", "data_type FP16"], as_table_configs,
            [EmbeddingBagConfig(name="h", num_embeddings=5, embedding_dim=2, data_type=DataType.FP16)])
    _expect(ConfigError, ["'t1'", "per-id weights need sum pooling"], as_table_configs, _configs(False),
            weighted=True)
    ragged = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.arange(5), lengths=torch.tensor([1, 1, 2, 1]),
                               stride_per_key_per_rank=[[1], [3]])
    _expect(ShapeMismatchError, ["variable stride per key"], as_kjt, ragged)

    torch.manual_seed(SEED)
    trc = EmbeddingBagCollection(_configs(False))
    tables = as_table_configs(trc.embedding_bag_configs())
    plan = plan_tables(tables, world.size, memory_per_rank=10**9, constraints={"t0": "row_wise", "t1": "table_wise"})
    ebc = ShardedEmbeddingBagCollection(tables, plan, comm=world, seed=SEED)
    before = {n: ebc.shard(n).clone() for n in ebc.shard_names()}
    good = trc.state_dict()
    missing = {k: v for k, v in good.items() if k != "embedding_bags.t1.weight"}
    _expect(ConfigError, ["missing 'embedding_bags.t1.weight'"], load_torchrec_state_dict, ebc, missing)
    extra = dict(good, **{"embedding_bags.t9.weight": torch.zeros(3, 2)})
    _expect(ConfigError, ["not tables of this collection: 'embedding_bags.t9.weight'"], load_torchrec_state_dict,
            ebc, extra)
    short = dict(good, **{"embedding_bags.t0.weight": good["embedding_bags.t0.weight"][:-1]})
    text = _expect(ShapeMismatchError, ["'embedding_bags.t0.weight' has shape (52, 8)", "(53, 8)"],
                   load_torchrec_state_dict, ebc, short)
    if any(not torch.equal(ebc.shard(n), v) for n, v in before.items()):
        raise AssertionError("a refused state_dict changed the tables")
    prefixed = {f"sparse.ebc.{k}": v for k, v in good.items()}
    prefixed["dense.weight"] = torch.zeros(2)
    load_torchrec_state_dict(ebc, prefixed, prefix="sparse.ebc.embedding_bags.")
    for n in ebc.shard_names():
        table, s = ebc.shard_of(n)
        if not torch.equal(ebc.shard(n), good[f"embedding_bags.{table.name}.weight"][s.row_start:s.row_end,
                                                                                     s.col_start:s.col_end]):
            raise AssertionError(f"{n} not loaded from a whole model's state_dict")
    world.barrier()
    if world.rank == 0:
        print(f"OK refused: pooling NONE, FP16, weighted mean, variable stride, missing/extra/mis-shaped tables ({text})", flush=True)


def interop(backend: str) -> None:
    """Every case in one job: table-, row- and column-wise plans, unweighted (sum and mean) and weighted tables;
    replicated tables; refusals. Rank 0 prints one ``OK`` line each."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    for sharding in ("table_wise", "row_wise", "column_wise"):
        for weighted in (False, True):
            _case(world, sharding, weighted)
    _replicated(world)
    _refusals(world)
