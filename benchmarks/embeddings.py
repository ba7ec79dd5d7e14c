"""Sharded embedding tables against data parallelism with replicated tables: step time and peak memory.

    shardwise run -np 4 -- python benchmarks/embeddings.py --peers hooks   # 8 tables of 256 MiB: 2 GiB in all
    shardwise run -np 2 -- python benchmarks/embeddings.py --rows 100000 --rounds 3

One gloo group for every contender (shardwise on the torch backend): shardwise's
``ShardedEmbeddingBagCollection`` (the plan of ``plan_tables``, sparse SGD on the rows looked up,
the dense MLP data parallel through ``DistributedOptimizer``) against the same model with every
table an ``nn.EmbeddingBag`` on every rank and dense gradients allreduced, SGD, in two forms:
torch ``DistributedDataParallel`` (``--peers ddp``; ``gradient_as_bucket_view`` so that the
buckets are the gradients; its first backward holds three copies of the tables per rank) and
each dense gradient allreduced in place by a post-accumulate hook (``--peers hooks``: two
copies, the least a replicated model with dense gradients can hold; 2 GiB at 4 ranks fits this
machine only this way). The same ids (Zipf-distributed, ``--ids`` per bag on average) and
targets feed all. Memory is the peak resident set per rank above the baseline (``_peak.py``),
contender by contender; times are interleaved rounds (``_common.time_interleaved``). The
all-to-all share is the time the sharded contender's rank spends inside its all-to-alls over its
step time (slowest rank).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from torch import nn

from _common import Transport, print_results, run_transports, set_threads

FEATURE_DIM = 13
OURS = "shardwise sharded tables (all-to-all)"
PEERS = {"ddp": "torch DDP, replicated tables", "hooks": "torch all_reduce in grad hooks, replicated tables"}


class _TimedComm:
    """The world communicator, with the seconds spent in ``alltoall`` added up."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.alltoall(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _data(args: argparse.Namespace, tables: list, world: Any) -> tuple:
    from shardwise.adapters.torch.embedding import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(10 + world.rank)
    lengths = torch.poisson(torch.full((len(tables) * args.batch,), float(args.ids)), generator=gen).long()
    values = []
    for k, t in enumerate(tables):
        n = int(lengths[k * args.batch:(k + 1) * args.batch].sum())
        zipf = torch.rand(n, generator=gen).pow(-1 / 1.1).floor().long() - 1
        values.append((zipf * 7919) % t.num_embeddings)  # hot ids spread over the table
    kjt = KeyedJaggedTensor.from_lengths([t.name for t in tables], torch.cat(values), lengths)
    dense = torch.randn(args.batch, FEATURE_DIM, generator=gen)
    target = torch.randn(args.batch, 1, generator=gen)
    return kjt, dense, target


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))


def _builds(args: argparse.Namespace, world: Any, timers: dict) -> dict[str, Callable[[], Callable[[], Any]]]:
    import shardwise.torch as swt
    from shardwise.adapters.torch.embedding import (ShardedEmbeddingBagCollection, SparseOptimizer, TableConfig,
                                                    full_table, plan_tables)

    tables = [TableConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, ids_per_sample=args.ids)
              for i in range(args.tables)]
    kjt, dense_x, target = _data(args, tables, world)
    width = FEATURE_DIM + args.tables * args.dim

    def sharded() -> Callable[[], Any]:
        comm = _TimedComm(world)
        plan = plan_tables(tables, world.size, global_batch=args.batch * world.size)
        ebc = ShardedEmbeddingBagCollection(tables, plan, comm=comm, seed=0)
        mlp = _mlp(width)
        dense_opt = swt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.01),
                                             named_parameters=mlp.named_parameters())
        sparse_opt = SparseOptimizer(ebc, "sgd", lr=0.01)
        timers["plan"] = plan

        def step() -> None:
            out = ebc(kjt)
            x = torch.cat([dense_x] + [out[t.name] for t in tables], dim=1)
            loss = nn.functional.mse_loss(mlp(x), target)
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()

        timers["a2a"] = comm
        return step

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bags = nn.ModuleList(nn.EmbeddingBag.from_pretrained(full_table(t, 0), mode="sum",
                                                                      freeze=False) for t in tables)
            self.mlp = _mlp(width)

        def forward(self) -> torch.Tensor:
            pooled = []
            for bag, t in zip(self.bags, tables):
                values, lengths, _ = kjt.feature(t.name)
                pooled.append(bag(values, torch.cumsum(lengths, 0) - lengths))
            return self.mlp(torch.cat([dense_x] + pooled, dim=1))

    def dense_step(model: nn.Module) -> Callable[[], Any]:
        """One SGD step of a replicated model whose gradients the wrapper or its hooks average."""
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            loss = nn.functional.mse_loss(model(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()

        return step

    def replicated() -> Callable[[], Any]:
        return dense_step(nn.parallel.DistributedDataParallel(Model(), gradient_as_bucket_view=True))

    def hooks() -> Callable[[], Any]:
        import torch.distributed as dist

        def allreduce(param: torch.Tensor) -> None:  # in place, the moment the gradient is whole
            param.grad.div_(world.size)
            dist.all_reduce(param.grad)

        model = Model()  # every rank draws the same tables from seed 0: nothing to broadcast
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(allreduce)
        return dense_step(model)

    builds = {OURS: sharded, PEERS["ddp"]: replicated, PEERS["hooks"]: hooks}
    return {name: build for name, build in builds.items() if name == OURS or name in args.peer_names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512, help="samples per rank")
    p.add_argument("--ids", type=float, default=4.0, help="mean ids per bag")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--peers", nargs="+", choices=sorted(PEERS), default=sorted(PEERS),
                   help="replicated contenders: torch DDP (dense gradients in DDP's buckets) and/or hooks "
                        "(each dense gradient allreduced in place by a post-accumulate hook: no bucket copy)")
    args = p.parse_args()
    args.peer_names = [PEERS[k] for k in args.peers]
    set_threads()
    timers: dict[str, Any] = {}

    def tables_of(world: Any) -> dict:
        return {"embeddings": _builds(args, world, timers)}

    def report(world: Any, results: dict) -> None:
        res = results["embeddings"]
        comm = timers["a2a"]
        calls = 2 + args.rounds * args.steps  # warm-up steps, then the timed ones
        share = world.allgather_object(comm.seconds / calls)
        total = args.tables * args.rows * args.dim * 4
        if world.rank == 0:
            print(timers["plan"].explain())
            print_results(f"# Embedding tables {args.tables} x {args.rows:,} x {args.dim} fp32 = "
                          f"{total / 2**30:.2f} GiB, {world.size} ranks, {args.batch} samples/rank, "
                          f"~{args.ids:g} ids per bag (Zipf), SGD; transport: gloo (one process group for both)",
                          res, pairs=[(OURS, peer) for peer in args.peer_names], items=args.batch * world.size)
            step = res[OURS][0]
            print(f"\nall-to-all time per sharded step (max rank, mean over the run's steps): "
                  f"{max(share) * 1e3:.1f} ms = {max(share) / step:.0%} of its median step")

    run_transports([Transport("torch", tables_of, report)], rounds=args.rounds, steps=args.steps)


if __name__ == "__main__":
    main()
