"""Data-parallel training throughput: shardwise vs torch DistributedDataParallel (gloo).

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/torch_dp.py
and for the scaling baseline the same script on 1 rank (it re-measures itself
single-process when --scaling is given: each rank alone, no communication).

All contenders train the same ~12M-parameter MLP on the same synthetic data in
the same job, interleaved round by round so that machine noise hits them alike:
  shardwise DistributedOptimizer on the mpi backend,
  shardwise DistributedOptimizer on the torch backend (gloo),
  torch.nn.parallel.DistributedDataParallel (gloo, 25 MiB buckets).
Throughput is global samples/s from the median step time (slowest rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from mpi4py import MPI
from torch import nn

from shardwise.adapters.torch.grad_sync import GradientSynchronizer
from shardwise.backends.mpi import MPICommunicator

BATCH = 32


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512))


class Contender:
    """A model, its optimizer and one training step."""

    def __init__(self, name: str, kind: str, comm=None) -> None:
        self.name = name
        model = make_model()
        if kind == "ddp":
            self.model = nn.parallel.DistributedDataParallel(model)
            self.sync = None
        else:
            self.model = model
            self.sync = GradientSynchronizer(model.named_parameters(), comm) if comm is not None else None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        nn.functional.mse_loss(self.model(x), y).backward()
        if self.sync is not None:
            self.sync.synchronize()
        self.opt.step()


def median_step(c: Contender, x, y, steps: int, barrier) -> float:
    times = []
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        c.step(x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scaling", action="store_true", help="also time one rank alone (1-rank baseline)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world.size))
    url = world.bcast(f"tcp://127.0.0.1:{29800 + os.getpid() % 150}" if world.rank == 0 else None)
    torch.distributed.init_process_group("gloo", init_method=url, rank=world.rank, world_size=world.size)
    from shardwise.backends.torch import TorchCommunicator

    mpi_comm, torch_comm = MPICommunicator(), TorchCommunicator()
    contenders = [Contender("shardwise (mpi)", "sw", mpi_comm), Contender("shardwise (torch/gloo)", "sw", torch_comm),
                  Contender("torch DDP (gloo)", "ddp")]
    g = torch.Generator().manual_seed(world.rank)
    x, y = torch.randn(BATCH, 1024, generator=g), torch.randn(BATCH, 512, generator=g)
    for c in contenders:  # warm-up: buckets built, optimizer state created
        c.step(x, y)
        c.step(x, y)
    results: dict[str, list[float]] = {c.name: [] for c in contenders}
    for _ in range(args.rounds):
        for c in contenders:
            results[c.name].append(median_step(c, x, y, args.steps, world.Barrier))
    med = {k: world.allreduce(statistics.median(v), op=MPI.MAX) for k, v in results.items()}
    single = None
    if args.scaling:
        alone = Contender("single", "local")
        alone.step(x, y)
        single = world.allreduce(statistics.median(
            [median_step(alone, x, y, args.steps, lambda: None) for _ in range(args.rounds)]), op=MPI.MAX)
    if world.rank == 0:
        params = sum(p.numel() for p in make_model().parameters())
        print(f"# data parallel, {world.size} ranks, {params / 1e6:.1f}M params, batch {BATCH}/rank, SGD-momentum, "
              f"median of {args.rounds} rounds x {args.steps} steps; {torch.get_num_threads()} threads/rank")
        print("| contender | step (ms) | samples/s | vs DDP |")
        print("|---|---|---|---|")
        ddp = med["torch DDP (gloo)"]
        for name, seconds in med.items():
            print(f"| {name} | {seconds * 1e3:.1f} | {BATCH * world.size / seconds:.0f} | {ddp / seconds:.2f}x |")
        if single is not None:
            best = min(med["shardwise (mpi)"], med["shardwise (torch/gloo)"])
            print(f"scaling 1 -> {world.size} ranks: single rank {BATCH / single:.0f} samples/s, "
                  f"shardwise best {BATCH * world.size / best:.0f} samples/s, "
                  f"efficiency {single / best:.2f} (ranks share {os.cpu_count()} cores)")
    mpi_comm.free()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
