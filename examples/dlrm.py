"""A DLRM-style click model: 26 sparse features in sharded embedding tables, 13 dense features, dot interactions.

Synthetic data, generated here: ids drawn from a Zipf distribution per feature (a few ids are
very frequent, as in click logs), clicks drawn from a hidden logistic model of the features,
so the loss falls when the model learns. The tables are split over the ranks by
``plan_tables`` (printed: what each table got and why); the dense bottom and top MLPs are data
parallel.

    shardwise run -np 4 -- python examples/dlrm.py
    shardwise run -np 2 -- python examples/dlrm.py --steps 100 --rows 200000
    mpirun -np 4 python examples/dlrm.py --optimizer adagrad
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import shardwise
import shardwise.checkpoint
import shardwise.torch as swt
from shardwise.torch.embedding import (KeyedJaggedTensor, ShardedEmbeddingBagCollection, SparseOptimizer,
                                       TableConfig, plan_tables)

SPARSE, DENSE, DIM = 26, 13, 16


def tables(max_rows: int) -> list[TableConfig]:
    """26 tables from ``max_rows`` rows down to 1/1000 of it (Criteo's features are that uneven)."""
    out = []
    for i in range(SPARSE):
        rows = max(10, int(max_rows * 10 ** (-3 * i / (SPARSE - 1))))
        out.append(TableConfig(name=f"c{i}", num_embeddings=rows, embedding_dim=DIM,
                               ids_per_sample=1.0 + (i % 3)))
    return out


def batch(tabs: list[TableConfig], size: int, gen: torch.Generator, truth: torch.Tensor) -> tuple:
    """Zipf ids (1-3 per bag), dense features and clicks from the hidden model ``truth``."""
    lengths, values, signal = [], [], torch.zeros(size)
    for i, t in enumerate(tabs):
        lens = torch.randint(1, 2 + (i % 3), (size,), generator=gen)
        n = int(lens.sum())
        ranks = torch.rand(n, generator=gen).pow(-1 / 1.2).floor().long() - 1  # Zipf-like, exponent 1.2
        ids = ranks.clamp(max=t.num_embeddings - 1)
        lengths.append(lens)
        values.append(ids)
        sample = torch.repeat_interleave(torch.arange(size), lens)
        signal.index_add_(0, sample, torch.where(ids % 7 == i % 7, 1.0, -0.3))
    dense = torch.randn(size, DENSE, generator=gen)
    logit = 0.5 * signal / SPARSE * 4 + dense @ truth
    clicks = (torch.rand(size, generator=gen) < torch.sigmoid(logit)).float()
    kjt = KeyedJaggedTensor.from_lengths([t.name for t in tabs], torch.cat(values), torch.cat(lengths))
    return kjt, dense, clicks


class DLRM(nn.Module):
    """Bottom MLP on the dense features, pairwise dot products with the pooled embeddings, top MLP."""

    def __init__(self, tables_: ShardedEmbeddingBagCollection) -> None:
        super().__init__()
        self.tables = tables_
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM), nn.ReLU())
        pairs = (SPARSE + 1) * SPARSE // 2
        self.top = nn.Sequential(nn.Linear(DIM + pairs, 64), nn.ReLU(), nn.Linear(64, 1))
        self.upper = torch.triu_indices(SPARSE + 1, SPARSE + 1, offset=1)

    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.tables(kjt)
        vectors = torch.stack([x] + [pooled[f] for f in self.tables.features], dim=1)  # [B, 27, DIM]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.upper[0], self.upper[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    p.add_argument("--rows", type=int, default=100_000, help="rows of the largest table")
    p.add_argument("--optimizer", default="rowwise_adagrad", choices=["sgd", "adagrad", "rowwise_adagrad"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", default="", help="a directory: save the whole model and its optimizers there at the end")
    args = p.parse_args()

    torch.set_num_threads(1)
    ctx = shardwise.init()
    world = ctx.world
    tabs = tables(args.rows)
    plan = plan_tables(tabs, world.size, local_size=ctx.local_size if world.size % ctx.local_size == 0 else None,
                       global_batch=args.batch * world.size, optimizer=args.optimizer)
    if world.rank == 0:
        print(plan.explain(), flush=True)
    torch.manual_seed(0)  # the same dense weights on every rank
    model = DLRM(ShardedEmbeddingBagCollection(tabs, plan, comm=world, seed=0))
    dense_opt = swt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                         named_parameters=model.named_parameters())
    sparse_opt = SparseOptimizer(model.tables, args.optimizer, lr=args.lr)
    optim = swt.CombinedOptimizer([dense_opt, sparse_opt])  # one object steps both
    gen = torch.Generator().manual_seed(100 + world.rank)
    truth = torch.randn(DENSE, generator=torch.Generator().manual_seed(7)) * 0.5
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        kjt, dense, clicks = batch(tabs, args.batch, gen, truth)
        loss = nn.functional.binary_cross_entropy_with_logits(model(kjt, dense), clicks)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(swt.allreduce(loss.detach(), name="loss")))
        if world.rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = step * args.batch * world.size / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({rate:,.0f} samples/s)", flush=True)
    if args.checkpoint:  # the dense weights, the tables' shards and both optimizers' state, in one call
        where = shardwise.checkpoint.save(args.checkpoint, args.steps, {"model": model, "optim": optim})
        if world.rank == 0:
            print(f"saved {where}", flush=True)
    if world.rank == 0:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"done: mean loss of the first 5 steps {first:.4f}, of the last 5 {last:.4f}", flush=True)
        # One machine-readable line for scripts and tests (the lines above are for people).
        shardings = [p.sharding.value for p in plan.placements]
        print("SHARDWISE_RESULT " + json.dumps({
            "example": "dlrm", "ranks": world.size, "tables": len(tabs), "planned_tables": len(plan.placements),
            "plan_ranks": plan.world_size, "shardings": {k: shardings.count(k) for k in sorted(set(shardings))},
            "optimizer": args.optimizer, "steps": args.steps, "first5_loss": first, "last5_loss": last,
            "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
