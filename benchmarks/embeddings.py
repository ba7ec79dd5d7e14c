"""Sharded embedding tables against TorchRec and against replicated tables: step time, peak memory, bytes sent.

    shardwise run -np 2 -- python benchmarks/embeddings.py                  # vs TorchRec DMP, each its own planner
    shardwise run -np 2 -- python benchmarks/embeddings.py --plan same      # both on TorchRec's placement
    shardwise run -np 4 -- python benchmarks/embeddings.py --plan same --force column_wise
    shardwise run -np 2 -- python benchmarks/embeddings.py --force row_wise   # TorchRec: not on the CPU
    shardwise run -np 4 -- python benchmarks/embeddings.py --peers hooks --tables 8 --rows 1048576

(``torchrun --nproc-per-node N benchmarks/embeddings.py ...`` runs it too.) The model is DLRM-like:
``--tables`` sparse features, one table each (default 26 x 163,840 x 64 fp32 = 1.02 GiB), Zipf ids
(``--ids`` per bag on average), ``--batch`` samples per rank, 13 dense features; the pooled rows and
the dense features feed a small MLP; SGD. One gloo group for every contender (shardwise on its torch
backend); the same tables, ids, batches and targets for all:

- shardwise: ``ShardedEmbeddingBagCollection`` + ``SparseOptimizer("sgd")`` (sparse SGD on the rows
  looked up), the MLP data parallel through ``DistributedOptimizer``;
- ``--peers torchrec`` (default): TorchRec's ``DistributedModelParallel`` (``EmbeddingBagCollection``
  sharded on the CPU, FBGEMM's fused kernel, exact SGD inside the backward through ``fused_params``,
  the MLP in DDP), planned by its ``EmbeddingShardingPlanner`` on a CPU ``Topology``;
- ``--peers ddp`` / ``hooks``: the same model with every table an ``nn.EmbeddingBag`` on every rank
  and dense gradients allreduced, by torch ``DistributedDataParallel`` (``gradient_as_bucket_view``;
  its first backward holds three copies of the tables per rank) or by a post-accumulate hook per
  gradient (two copies, the least a replicated model with dense gradients can hold).

Plans (``--plan``): ``own``, each library's own planner (shardwise's ``plan_tables``); ``same``,
shardwise on exactly TorchRec's placement (its ``ShardingPlan`` turned into an ``EmbeddingPlan``:
sharding type, ranks, row and column ranges of every shard). ``--force TYPE`` makes every table
``TYPE`` on both sides (TorchRec ``ParameterConstraints(sharding_types=[TYPE])``, shardwise
``plan_tables(constraints=...)``, or TorchRec's forced plan itself with ``--plan same``); a type
TorchRec's planner does not offer on the CPU (row_wise, table_row_wise) is named and left out, or,
with ``--torchrec-by-hand``, row_wise is planned by hand (``construct_module_sharding_plan``) and run.

Before the timing, a check phase builds shardwise and TorchRec side by side from the same initial
table values (shardwise's ``init_rows``, written into TorchRec's shards): the pooled outputs of both
must agree (max |difference| <= 1e-5 x max |value|) before and after one training step, and the
bytes that each rank's lookup collectives send to the other ranks during the second step are counted
by wrapping ``torch.distributed``'s all-to-all, reduce-scatter and all-gather functions, which both
libraries call (TorchRec's row-wise output goes by reduce-scatter, its gradient by all-gather). Memory is the
peak resident set per rank above the baseline (``_peak.py``), contender by contender, before any
timing; times are interleaved rounds (``_common.time_interleaved``), medians. The all-to-all share
is the time shardwise's rank spends inside its all-to-alls over its step time (slowest rank).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import _torchrec_peer as trp
from _common import Row, init_gloo, memory_phase, print_results, set_threads, time_interleaved

FEATURE_DIM = 13
OURS = "shardwise sharded tables (all-to-all)"
PEERS = {"torchrec": "TorchRec DMP (fused CPU kernel, exact SGD)", "ddp": "torch DDP, replicated tables",
         "hooks": "torch all_reduce in grad hooks, replicated tables"}
TOLERANCE = 1e-5


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


@dataclass
class Contender:
    """A built contender: one training step, and its pooled outputs ``{feature: [batch, dim]}`` (no gradient)."""

    step: Callable[[], None]
    pooled: Optional[Callable[[], dict[str, torch.Tensor]]] = None


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


def _tables(args: argparse.Namespace) -> list:
    from shardwise.adapters.torch.embedding import TableConfig

    return [TableConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, ids_per_sample=args.ids)
            for i in range(args.tables)]


def _plans(args: argparse.Namespace, world: Any, state: dict) -> None:
    """Both libraries' plans, once per process (TorchRec's planner is collective: rank 0 plans, all get it).

    Sets ``state["tr_plan"]`` (or ``state["tr_missing"]``, why TorchRec cannot run) and ``state["plan"]``.
    """
    from shardwise.adapters.torch.embedding import plan_tables

    tables = _tables(args)
    width = FEATURE_DIM + args.tables * args.dim
    if "torchrec" in args.peers and "tr_plan" not in state and "tr_missing" not in state:
        why = trp.cpu_unsupported(args.force, args.torchrec_by_hand)
        if why:
            state["tr_missing"] = why
        else:
            state["tr_plan"] = trp.plan(tables, _mlp(width), args.lr, args.batch, args.force,
                                        by_hand=args.torchrec_by_hand)
    if "plan" in state:
        return
    if args.plan == "same" and "tr_plan" in state:
        state["plan"] = trp.shardwise_plan(state["tr_plan"], tables, world.size)
    else:
        state["plan"] = plan_tables(tables, world.size, global_batch=args.batch * world.size,
                                    constraints={t.name: args.force for t in tables} if args.force else None)


def _makers(args: argparse.Namespace, world: Any, state: dict) -> dict[str, Callable[[], Contender]]:
    import shardwise.torch as swt
    from shardwise.adapters.torch.embedding import ShardedEmbeddingBagCollection, SparseOptimizer, full_table

    tables = _tables(args)
    kjt, dense_x, target = _data(args, tables, world)
    width = FEATURE_DIM + args.tables * args.dim
    _plans(args, world, state)
    features = [f for t in tables for f in t.feature_names]

    def sharded() -> Contender:
        comm = _TimedComm(world)
        ebc = ShardedEmbeddingBagCollection(tables, state["plan"], comm=comm, seed=0)
        mlp = _mlp(width)
        dense_opt = swt.DistributedOptimizer(torch.optim.SGD(mlp.parameters(), lr=args.lr),
                                             named_parameters=mlp.named_parameters())
        sparse_opt = SparseOptimizer(ebc, "sgd", lr=args.lr)

        def step() -> None:
            out = ebc(kjt)
            x = torch.cat([dense_x] + [out[f] for f in features], dim=1)
            loss = nn.functional.mse_loss(mlp(x), target)
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()

        @torch.no_grad()
        def pooled() -> dict[str, torch.Tensor]:
            return ebc(kjt)

        state["a2a"] = comm
        return Contender(step, pooled)

    def torchrec() -> Contender:
        dmp = trp.build(tables, _mlp(width), args.lr, state["tr_plan"], seed=0)
        tr_kjt = trp.torchrec_kjt(kjt)
        # the MLP, and any data_parallel table (DDP averages its gradient); the fused kernel's tables have no .grad
        dense_opt = torch.optim.SGD(dmp.parameters(), lr=args.lr)

        def step() -> None:
            loss = nn.functional.mse_loss(dmp(dense_x, tr_kjt), target)
            dense_opt.zero_grad()
            loss.backward()  # the fused kernel steps the tables' rows inside the backward
            dense_opt.step()

        @torch.no_grad()
        def pooled() -> dict[str, torch.Tensor]:
            return dmp.module.pooled(tr_kjt)

        return Contender(step, pooled)

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

    def dense_step(model: nn.Module) -> Contender:
        """One SGD step of a replicated model whose gradients the wrapper or its hooks average."""
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)

        def step() -> None:
            loss = nn.functional.mse_loss(model(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()

        return Contender(step)

    def replicated() -> Contender:
        return dense_step(nn.parallel.DistributedDataParallel(Model(), gradient_as_bucket_view=True))

    def hooks() -> Contender:
        import torch.distributed as dist

        def allreduce(param: torch.Tensor) -> None:  # in place, the moment the gradient is whole
            param.grad.div_(world.size)
            dist.all_reduce(param.grad)

        model = Model()  # every rank draws the same tables from seed 0: nothing to broadcast
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(allreduce)
        return dense_step(model)

    makers = {OURS: sharded, PEERS["torchrec"]: torchrec, PEERS["ddp"]: replicated, PEERS["hooks"]: hooks}
    wanted = [OURS] + [PEERS[k] for k in args.peers if not (k == "torchrec" and "tr_missing" in state)]
    return {name: makers[name] for name in wanted}


def _shardwise_source() -> str:
    """Which shardwise ran: its git commit (``+changes`` where its files differ from it), or its path."""
    import subprocess

    import shardwise

    where = os.path.dirname(os.path.dirname(os.path.abspath(shardwise.__file__)))
    try:
        commit = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--", "shardwise"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"from {where} (not a git checkout)"
    return commit + ("+changes" if dirty else "")


def _builds(makers: dict[str, Callable[[], Contender]]) -> dict[str, Callable[[], Callable[[], Any]]]:
    return {name: (lambda make=make: make().step) for name, make in makers.items()}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """max |a - b| over every feature, and max |a|."""
    if sorted(a) != sorted(b):
        raise RuntimeError(f"the contenders return other features: {sorted(a)} against {sorted(b)}")
    diff = max(float((a[f] - b[f]).abs().max()) for f in a)
    return diff, max(float(a[f].abs().max()) for f in a)


def check_phase(makers: dict[str, Callable[[], Contender]], world: Any) -> tuple[list[str], dict[str, str], bool]:
    """Build the sharded contenders side by side; compare their pooled outputs before and after one step;
    count the bytes each rank's lookup collectives send during the second step.

    Returns the lines to print, the bytes cell per contender and whether the outputs agree.
    """
    names = [n for n in (OURS, PEERS["torchrec"]) if n in makers]
    built = {n: makers[n]() for n in names}
    lines, ok = [], True
    if len(built) == 2:
        ours, peer = built[OURS], built[PEERS["torchrec"]]
        before = ours.pooled()
        for when in ("initial tables", "after one step"):
            if when != "initial tables":
                ours.step()
                peer.step()
            now = ours.pooled()
            diff, scale = _max_difference(now, peer.pooled())
            moved = _max_difference(now, before)[0]
            every = world.allgather_object((diff, scale, moved))
            diff, scale, moved = (max(e[i] for e in every) for i in range(3))
            agree = diff <= TOLERANCE * scale
            ok &= agree
            lines.append(f"# check: pooled outputs shardwise vs TorchRec, {when} (shardwise's init_rows of seed 0 in "
                         f"both): max |difference| {diff:.2e} over every rank and feature (max |value| {scale:.2e}"
                         + (f"; the step moved them by up to {moved:.2e}" if when != "initial tables" else "")
                         + f"): {diff / scale:.1e} of the largest value, " + ("agree" if agree else "DIFFER")
                         + f" (tolerance {TOLERANCE:g} of it)")
    else:
        for c in built.values():
            c.step()
    cells = {}
    for name, c in built.items():
        counter = trp.CollectiveBytes()
        world.barrier()
        with counter.counting():
            c.step()
        every = world.allgather_object((counter.bytes, counter.calls))
        cells[name] = (f"{max(b for b, _ in every) / 2**10:,.1f} (" + " / ".join(f"{b / 2**10:,.1f}" for b, _ in every)
                       + f"), {every[0][1]} calls")
    built.clear()
    gc.collect()
    return lines, cells, ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26, help="sparse features, one table each")
    p.add_argument("--rows", type=int, default=163840)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512, help="samples per rank")
    p.add_argument("--ids", type=float, default=4.0, help="mean ids per bag")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (tables and MLP)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--peers", nargs="+", choices=sorted(PEERS), default=["torchrec"],
                   help="torchrec: TorchRec's DistributedModelParallel; ddp / hooks: replicated tables with dense "
                        "gradients allreduced by torch DDP (in its buckets) or by a post-accumulate hook per gradient")
    p.add_argument("--plan", choices=("own", "same"), default="own",
                   help="own: each library's own planner; same: shardwise on TorchRec's placement, shard for shard")
    p.add_argument("--force", choices=trp.SHARDING_TYPES, default=None,
                   help="every table this sharding type, on both sides")
    p.add_argument("--torchrec-by-hand", action="store_true",
                   help=f"with --force {'/'.join(trp.BY_HAND)} where TorchRec's planner does not offer it on the CPU "
                        "(row_wise): write TorchRec's plan by hand (construct_module_sharding_plan, fused kernel) "
                        "and run it anyway; the check phase shows whether it computes what shardwise does")
    p.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    args = p.parse_args()
    if args.plan == "same" and "torchrec" not in args.peers:
        p.error("--plan same takes TorchRec's plan: add --peers torchrec")
    set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)  # torchrun's ranks per node; mpirun's by itself
    trp.quiet()
    state: dict[str, Any] = {}
    load_at_start = " ".join(f"{x:.2f}" for x in os.getloadavg())

    peaks: dict[str, int] = {}
    if not args.no_memory:
        world = init_gloo()
        peaks = memory_phase(_builds(_makers(args, world, state)), world)
        import shardwise
        shardwise.shutdown()
    world = init_gloo()
    makers = _makers(args, world, state)
    checks, a2a, ok = check_phase(makers, world)
    timed = time_interleaved(_builds(makers), world, args.rounds, args.steps)
    results = {name: Row(t, per, peaks.get(name), cpu) for name, (t, per, cpu) in timed.items()}
    comm = state["a2a"]
    calls = 2 + args.rounds * args.steps  # the timed build's warm-up steps, then the timed ones
    share = world.allgather_object(comm.seconds / calls)
    total = args.tables * args.rows * args.dim * 4
    if world.rank == 0:
        print(f"# {' '.join(sys.argv)}")
        print(f"# shardwise {_shardwise_source()}, torch {torch.__version__}, {trp.torchrec_version()}; "
              f"{world.size} ranks, {torch.get_num_threads()} thread(s)/rank; host {os.uname().nodename}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average at start {load_at_start}, "
              "at the end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        print("# shardwise plan (" + ("TorchRec's, shard for shard" if args.plan == "same" and "tr_plan" in state
                                      else "plan_tables" + (f", forced {args.force}" if args.force else "")) + "):")
        print("\n".join("#   " + line for line in state["plan"].explain().splitlines()))
        if "tr_plan" in state:
            how = "its own planner"
            if args.force:
                how = f"forced {args.force}" + (", written by hand: its CPU sharder does not offer it"
                                                if trp.cpu_unsupported(args.force) else "")
            print(f"# TorchRec plan ({how}): "
                  + trp.describe(state["tr_plan"]))
        missing = {PEERS["torchrec"]: f"not run: {state['tr_missing']}"} if "tr_missing" in state else None
        for line in checks:
            print(line)
        print_results(f"# Embedding tables {args.tables} x {args.rows:,} x {args.dim} fp32 = "
                      f"{total / 2**30:.2f} GiB, {world.size} ranks, {args.batch} samples/rank, "
                      f"~{args.ids:g} ids per bag (Zipf), SGD; plan: {args.plan}"
                      + (f", forced {args.force}" if args.force else "")
                      + "; transport: gloo for every contender (one torch.distributed process group; shardwise "
                        "on its torch backend)",
                      results, pairs=[(OURS, name) for name in results if name != OURS],
                      items=args.batch * world.size, extra=a2a,
                      extra_header="KiB sent to other ranks/step (all-to-all, reduce-scatter, all-gather): "
                                   "max rank (per rank), calls", missing=missing)
        step = results[OURS][0]
        print(f"\nall-to-all time per shardwise step (max rank, mean over the run's steps): "
              f"{max(share) * 1e3:.1f} ms = {max(share) / step:.0%} of its median step")
    import shardwise
    shardwise.shutdown()
    if not ok:
        raise SystemExit("the pooled outputs of shardwise and TorchRec differ (see the check lines)")


if __name__ == "__main__":
    main()
