"""Sharded sequence embeddings against one process with unsharded ``nn.Embedding``s (run under mpirun).

The model reads each feature's rows as a padded sequence, weighs every position by a learnt
weight, sums them and feeds a linear head: each id's row gets its own gradient (its position's
weight), not its bag's. Each rank feeds its slice of the global batch (slices may be empty);
the reference trains on the whole batch."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.optim.adagrad import adagrad
from torch.optim.sgd import sgd

import shardwise
from shardwise.adapters.torch.embedding import KeyedJaggedTensor, SparseOptimizer, TableConfig, full_table, plan_tables
from shardwise.adapters.torch.embedding.sequence import JaggedTensor, ShardedEmbeddingCollection
from shardwise.core.errors import ShapeMismatchError

SEED, PER_RANK, STEPS, LR, MAX_LEN = 7, 6, 10, 0.05, 4
TABLES = [
    TableConfig(name="t0", num_embeddings=97, embedding_dim=8),
    TableConfig(name="t1", num_embeddings=50, embedding_dim=8, pooling="mean", feature_names=("f1a", "f1b")),
    TableConfig(name="t2", num_embeddings=31, embedding_dim=4),
    TableConfig(name="t3", num_embeddings=203, embedding_dim=8),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
TABLE_OF = {f: t for t in TABLES for f in t.feature_names}
WIDTH = sum(TABLE_OF[f].embedding_dim for f in FEATURES)
#: samples per rank of a skewed step: one rank has none (the global batch is PER_RANK * world size)
SKEWED = {2: [0, 12], 4: [9, 0, 11, 4]}


def _batch(step: int, samples: int) -> KeyedJaggedTensor:
    """The global batch of a step: 0-5 ids per sequence (longer than MAX_LEN: cut; empty ones too),
    mostly low ids (repeats within and across samples, most of them rank 0's rows under row-wise)."""
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, MAX_LEN + 2, (len(FEATURES) * samples,), generator=gen)
    values = []
    for k, f in enumerate(FEATURES):
        n = int(lengths[k * samples:(k + 1) * samples].sum())
        rows = TABLE_OF[f].num_embeddings
        ids = torch.randint(0, rows, (n,), generator=gen)
        hot = torch.rand(n, generator=gen) < 0.5
        values.append(torch.where(hot, ids % max(1, rows // 10), ids))
    return KeyedJaggedTensor.from_lengths(FEATURES, torch.cat(values), lengths)


def _slice(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples ``[start, stop)`` of every feature (none where ``start == stop``)."""
    values, lengths = [], []
    for f in kjt.keys:
        v, lens, _ = kjt.feature(f)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)])
        values.append(v[int(offsets[start]):int(offsets[stop])])
        lengths.append(lens[start:stop])
    return KeyedJaggedTensor.from_lengths(kjt.keys, torch.cat(values), torch.cat(lengths))


class _Head(nn.Module):
    """Per feature, a learnt weight per position of the (padded, cut) sequence; the weighted sums of
    every feature side by side into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.position = nn.Parameter(torch.rand(len(FEATURES), MAX_LEN, 1) + 0.5)
        self.linear = nn.Linear(WIDTH, 1)

    def forward(self, rows: dict[str, JaggedTensor]) -> torch.Tensor:
        summed = [(rows[f].to_padded_dense(MAX_LEN) * self.position[k]).sum(dim=1) for k, f in enumerate(FEATURES)]
        return self.linear(torch.cat(summed, dim=1))


def _loss(head: _Head, rows: dict[str, JaggedTensor], target: torch.Tensor, scale: float) -> torch.Tensor:
    """Squared error summed over the samples given, times ``scale`` (1 / global batch in one process;
    world size / global batch on a rank, whose gradients are then averaged over the ranks)."""
    return ((head(rows) - target) ** 2).sum() * scale


def _target(step: int, samples: int) -> torch.Tensor:
    return torch.randn(samples, 1, generator=torch.Generator().manual_seed(2000 + step))


class _TorchOptimizer:
    """torch's SGD or Adagrad (``eps=1e-10``) over ``params``: the update functions that
    ``torch.optim.SGD`` / ``Adagrad`` step with. Not the classes themselves: building one imports
    ``torch._dynamo``, which costs each of 4 ranks on 2 cores about 13 s. ``rowwise_adagrad``:
    FBGEMM's, written out (one accumulator per row, the mean of its squared gradient)."""

    def __init__(self, params: list[nn.Parameter], kind: str) -> None:
        self.params, self.kind = list(params), kind
        self.sums = [torch.zeros_like(p) if kind != "rowwise_adagrad" else torch.zeros(p.shape[0])
                     for p in self.params]
        self.steps = [torch.tensor(0.0) for _ in self.params]

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params]
        if self.kind == "rowwise_adagrad":
            for p, g, acc in zip(self.params, grads, self.sums):
                acc += (g ** 2).mean(dim=1)
                p -= LR * g / (acc.sqrt() + 1e-10).unsqueeze(1)
        elif self.kind == "sgd":
            sgd(self.params, grads, [None] * len(grads), weight_decay=0.0, momentum=0.0, lr=LR, dampening=0.0,
                nesterov=False, maximize=False, foreach=False)
        else:
            adagrad(self.params, grads, self.sums, self.steps, lr=LR, weight_decay=0.0, lr_decay=0.0, eps=1e-10,
                    maximize=False, foreach=False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _reference(kind: str, samples: int) -> tuple[dict, _Head, dict, dict]:
    """One process: the whole tables as ``nn.Embedding``s; trained tables and head, step 0's rows and
    table gradients."""
    tables = nn.ModuleDict({t.name: nn.Embedding.from_pretrained(full_table(t, SEED), freeze=False) for t in TABLES})
    head = _Head()
    head_opt = _TorchOptimizer(head.parameters(), "sgd")
    table_opt = _TorchOptimizer(tables.parameters(), kind)
    first_rows, first_grads = {}, {}
    for step in range(STEPS):
        kjt = _batch(step, samples)
        rows = {}
        for f in FEATURES:
            v, lens, _ = kjt.feature(f)
            rows[f] = JaggedTensor(tables[TABLE_OF[f].name](v), lens)
        loss = _loss(head, rows, _target(step, samples), 1.0 / samples)
        head_opt.zero_grad()
        table_opt.zero_grad()
        loss.backward()
        if step == 0:
            first_rows = {f: (rows[f].values.detach().clone(), kjt.feature(f)[1]) for f in FEATURES}
            first_grads = {t.name: tables[t.name].weight.grad.clone() for t in TABLES}
        table_opt.step()
        head_opt.step()
    return {t.name: tables[t.name].weight.detach() for t in TABLES}, head, first_rows, first_grads


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3e}")
    return (got - want).abs().max().item() if got.numel() else 0.0


def _constraints(sharding: Optional[str], world_size: int) -> dict:
    if sharding:
        return {t.name: sharding for t in TABLES}
    return {"t0": "row_wise", "t1": "column_wise", "t2": "data_parallel",
            "t3": "table_row_wise" if world_size == 4 else "row_wise"}


def _average_grads(world, head: _Head) -> None:  # noqa: ANN001
    """The head's gradients averaged over the ranks (data parallelism), in one allreduce."""
    flat = torch.cat([p.grad.reshape(-1) for p in head.parameters()])
    flat = world.allreduce(flat) / world.size
    pos = 0
    for p in head.parameters():
        p.grad.copy_(flat[pos:pos + p.numel()].view_as(p))
        pos += p.numel()


def equivalence(backend: str, sharding: Optional[str] = None, kind: str = "sgd", skew: bool = False,
                local_size: Optional[int] = None) -> None:
    """``sharding`` for every table (None: a mixed plan, data_parallel included); step 0's rows and table
    gradients, and after 10 steps of ``kind`` on the tables and SGD on the head, tables and head equal one
    process. ``skew``: uneven slices of the global batch, one rank's empty."""
    torch.set_num_threads(1)
    world = shardwise.init(backend=backend).world
    samples = PER_RANK * world.size
    plan = plan_tables(TABLES, world.size, local_size=local_size, optimizer=kind, memory_per_rank=10**9,
                       constraints=_constraints(sharding, world.size))
    ec = ShardedEmbeddingCollection(TABLES, plan, comm=world, seed=SEED)
    head = _Head()
    head_opt = _TorchOptimizer(head.parameters(), "sgd")
    sparse_opt = SparseOptimizer(ec, kind, lr=LR)
    want_tables, want_head, want_rows, want_grads = _reference(kind, samples)
    sizes = SKEWED[world.size] if skew else [PER_RANK] * world.size
    start = sum(sizes[:world.rank])
    mine = slice(start, start + sizes[world.rank])
    for step in range(STEPS):
        kjt = _slice(_batch(step, samples), mine.start, mine.stop)
        rows = ec(kjt)
        head_opt.zero_grad()
        _loss(head, rows, _target(step, samples)[mine], world.size / samples).backward()
        if step == 0:
            for f in FEATURES:
                values, lengths = want_rows[f]
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
                _close(rows[f].values.detach(), values[int(offsets[mine.start]):int(offsets[mine.stop])], f"rows {f}")
                if not torch.equal(rows[f].lengths, lengths[mine]):
                    raise AssertionError(f"lengths of {f}: {rows[f].lengths.tolist()}, want {lengths[mine].tolist()}")
            grads = ec.sparse_grads()
            for name in ec.shard_names():
                table, shard = ec.shard_of(name)
                dense_grad = torch.zeros(shard.rows, shard.cols)
                if name in grads:
                    dense_grad.index_add_(0, *grads[name])
                want = want_grads[table.name][shard.row_start:shard.row_end, shard.col_start:shard.col_end]
                _close(dense_grad, want, f"gradient of {name}")
        _average_grads(world, head)
        head_opt.step()
        sparse_opt.step()
    worst = 0.0
    for name in ec.shard_names():
        table, shard = ec.shard_of(name)
        want = want_tables[table.name][shard.row_start:shard.row_end, shard.col_start:shard.col_end]
        worst = max(worst, _close(ec.shard(name), want, f"{name} after {STEPS} steps"))
    for (n, p), q in zip(head.named_parameters(), want_head.parameters()):
        worst = max(worst, _close(p.detach(), q.detach(), f"head {n} after {STEPS} steps"))
    worst = max(world.allgather_object(worst))
    kinds = sorted({p.sharding.value for p in plan.placements})
    if world.rank == 0:
        print(f"OK sequence {'+'.join(kinds)} {kind}{' skew' * skew} on {world.size} ranks ({backend}): "
              f"max diff {worst:.2e}", flush=True)


def refusals(backend: str) -> None:
    """An id outside its table on the last rank, a feature missing on rank 0, then one no table has on the
    last rank: each lookup fails on every rank, naming the rank and (there) the id or the feature; the
    collection works afterwards, and with ``ignore_unknown_features`` drops the unknown feature."""
    world = shardwise.init(backend=backend).world
    plan = plan_tables(TABLES, world.size, memory_per_rank=10**9, constraints=_constraints("row_wise", world.size))
    ec = ShardedEmbeddingCollection(TABLES, plan, comm=world, seed=SEED)
    good = _slice(_batch(0, PER_RANK * world.size), 0, PER_RANK)
    values = good.values.clone()
    values[0] = 10_000
    bad_id = KeyedJaggedTensor.from_lengths(good.keys, values, good.lengths)
    f0 = good.feature(FEATURES[0])
    kept = good.values.numel() - good.feature("t3")[0].numel()  # "t3" is the last feature
    no_t3 = KeyedJaggedTensor.from_lengths(FEATURES[:-1], good.values[:kept], good.lengths[:-PER_RANK])
    extra = KeyedJaggedTensor.from_lengths([*FEATURES, "bogus"], torch.cat([good.values, torch.tensor([3])]),
                                           torch.cat([good.lengths, torch.tensor([1] + [0] * (PER_RANK - 1))]))
    for culprit, batch, here in ((world.size - 1, bad_id, "id 10000 is outside table 't0'"),
                                 (0, no_t3, "features ['t3'] are missing from the batch"),
                                 (world.size - 1, extra, "features ['bogus'] are in no table")):
        try:
            ec(batch if world.rank == culprit else good)
        except ShapeMismatchError as exc:
            text = str(exc)
            if f"bad input on rank(s) [{culprit}]" not in text or (world.rank == culprit and here not in text):
                raise
        else:
            raise AssertionError(f"bad input on rank {culprit} was accepted")
    rows = ec(good)  # the exchanges still line up
    _close(rows[FEATURES[0]].values, full_table(TABLES[0], SEED)[f0[0]], "rows after the refusals")
    lenient = ShardedEmbeddingCollection(TABLES, plan, comm=world, seed=SEED, ignore_unknown_features=True)
    rows = lenient(extra if world.rank == world.size - 1 else good)
    _close(rows[FEATURES[0]].values, full_table(TABLES[0], SEED)[f0[0]], "rows with an unknown feature dropped")
    world.barrier()
    if world.rank == 0:
        print("OK sequence lookups refused on every rank", flush=True)


def torchrec_parity(backend: str) -> None:
    """A collection built from TorchRec's ``EmbeddingCollection`` (its configs) and fed TorchRec batches
    returns, on each rank, what that collection, unsharded and holding the whole tables, returns for the
    rank's samples: values, lengths and offsets. (TorchRec's collection takes tables of one width.)"""
    import torchrec

    world = shardwise.init(backend=backend).world
    tables = [t for t in TABLES if t.embedding_dim == 8]
    features = [f for t in tables for f in t.feature_names]
    configs = [torchrec.EmbeddingConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                        feature_names=list(t.feature_names)) for t in tables]
    theirs = torchrec.EmbeddingCollection(tables=configs)
    with torch.no_grad():
        for t in tables:
            theirs.embeddings[t.name].weight.copy_(full_table(t, SEED))
    plain = [TableConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                         feature_names=t.feature_names) for t in tables]  # as TorchRec's configs convert
    plan = plan_tables(plain, world.size, memory_per_rank=10**9,
                       constraints={"t0": "row_wise", "t1": "column_wise", "t3": "data_parallel"})
    ours = ShardedEmbeddingCollection(theirs, plan, comm=world, seed=SEED)
    kjt = _slice(_batch(0, PER_RANK * world.size), world.rank * PER_RANK, (world.rank + 1) * PER_RANK)
    parts = [kjt.feature(f) for f in features]
    batch = torchrec.KeyedJaggedTensor.from_lengths_sync(features, torch.cat([v for v, _, _ in parts]),
                                                         torch.cat([n for _, n, _ in parts]))
    got, want = ours(batch), theirs(batch)
    for f in features:
        _close(got[f].values, want[f].values(), f"rows of {f}")
        if not (torch.equal(got[f].lengths, want[f].lengths()) and torch.equal(got[f].offsets(), want[f].offsets())):
            raise AssertionError(f"lengths or offsets of {f} differ from TorchRec's")
    kinds = sorted({p.sharding.value for p in ours.plan.placements})
    world.barrier()
    if world.rank == 0:
        print(f"OK sequence rows equal TorchRec's EmbeddingCollection ({'+'.join(kinds)})", flush=True)


def cases(backend: str, cases: list[dict], refuse: bool = False, torchrec: bool = False) -> None:
    """:func:`equivalence` for each case (keyword arguments) in one job, then :func:`refusals` if ``refuse``
    and :func:`torchrec_parity` if ``torchrec``."""
    for case in cases:
        equivalence(backend, **case)
    if refuse:
        refusals(backend)
    if torchrec:
        torchrec_parity(backend)
