"""Data-parallel training step: shardwise vs torch DDP on gloo; shardwise vs raw mpi4py on MPI.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/torch_dp.py
(the memory phase and the allocator settings of the timing after it: benchmarks/_peak.py).

Per model (``--models``, default the 11.5M-parameter MLP and the small GPT of
benchmarks/_models.py), two tables, each one transport, never a ratio across them:

* gloo (torch.distributed, one process group shared by all rows): shardwise
  ``DistributedOptimizer`` and ``DistributedDataParallel`` on the torch backend vs
  ``torch.nn.parallel.DistributedDataParallel`` (25 MiB buckets);
* MPI (shardwise on the mpi backend, the gloo group shut down): shardwise
  ``DistributedOptimizer`` vs a plain mpi4py data-parallel step (all gradients copied
  into one flat buffer, one in-place ``Allreduce``, copied back).
  Horovod's own ``DistributedOptimizer`` is the other MPI peer: benchmarks/horovod.py.

Each table also has a floor row: one rank's own step with no communication at all.

All rows train the same model from the same weights with SGD-momentum on the same
per-rank synthetic batch. Timing: contenders interleaved round by round, median step of
the slowest rank per round, median over rounds. Memory: benchmarks/_peak.py, every table's
memory phase before any timing (``_common.run_transports``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _common import Transport, print_results, run_transports, set_threads  # noqa: E402
from _peak import timing_allocator  # noqa: E402
from _models import WORKLOADS, Workload  # noqa: E402
from shardwise.core.launch_env import detect_launch  # noqa: E402


def _trainer(w: Workload, x: torch.Tensor, y: torch.Tensor, wrap):
    """A build function: fresh model + SGD-momentum, made distributed by ``wrap(model, opt)``."""
    def build():
        model = w.model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        model, opt, after_backward = wrap(model, opt)

        def step():
            opt.zero_grad()
            w.loss(model(x), y).backward()
            if after_backward is not None:
                after_backward()
            opt.step()
        return step
    return build


def shardwise_optimizer(model, opt):
    """shardwise.torch.DistributedOptimizer over the world of the backend shardwise runs on now."""
    import shardwise.torch as swt

    return model, swt.DistributedOptimizer(opt, named_parameters=model.named_parameters()), None


def shardwise_ddp(model, opt):
    import shardwise.torch as swt

    return swt.DistributedDataParallel(model), opt, None


def torch_ddp(model, opt):
    return nn.parallel.DistributedDataParallel(model), opt, None


FLOOR = "one rank's own step, no communication (floor)"


def local_only(model, opt):
    """No synchronisation at all: the step time no data-parallel library can go under."""
    return model, opt, None


def mpi4py_allreduce(model, opt):
    """The plain MPI data-parallel step: one flat gradient buffer, one blocking in-place Allreduce."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params))
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()

    def reduce():
        for v, p in zip(views, params):
            v.copy_(p.grad)
        comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
        flat.div_(comm.size)
        for v, p in zip(views, params):
            p.grad.copy_(v)
    return model, opt, reduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp-dp,gpt", help="comma-separated: " + ",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPI tables")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    args = parser.parse_args()
    threads = set_threads()
    launch = detect_launch()
    if launch.rank == 0:
        print(f"# data parallel, {launch.size} ranks, {threads} thread(s)/rank, torch {torch.__version__}, "
              f"SGD-momentum; median of {args.rounds} rounds x {args.steps} steps (slowest rank per round); "
              f"{timing_allocator(not args.no_memory)}")
    workloads = [WORKLOADS[key] for key in args.models.split(",")]
    what = {w.name: f"{w.label}, {w.params() / 1e6:.1f}M params, batch {w.batch}/rank" for w in workloads}

    def tables(rows: dict):
        """``world -> {model: {row: build}}`` for rows ``label -> wrap``, each model on this rank's batch."""
        def make(world) -> dict:
            out = {}
            for w in workloads:
                x, y = w.data(world.rank, w.batch, torch.device("cpu"))
                out[w.name] = {label: _trainer(w, x, y, wrap) for label, wrap in rows.items()}
            return out
        return make

    gloo_tables = tables({  # every row on the one torch.distributed process group
        "shardwise DistributedOptimizer (torch backend, gloo)": shardwise_optimizer,
        "shardwise DistributedDataParallel (torch backend, gloo)": shardwise_ddp,
        "torch DDP (gloo)": torch_ddp,
        FLOOR: local_only})
    mpi_tables = tables({
        "shardwise DistributedOptimizer (mpi backend)": shardwise_optimizer,
        "mpi4py Allreduce, one flat buffer (MPI)": mpi4py_allreduce,
        FLOOR: local_only})

    def report(transport: str, pairs: list[tuple[int, int]]):
        def show(world, results: dict) -> None:
            if world.rank != 0:
                return
            for w in workloads:
                res = results[w.name]
                names = list(res)
                print_results(f"## {what[w.name]} - transport: {transport}", res,
                              [(names[a], names[b]) for a, b in pairs], items=w.batch * world.size, floor=FLOOR)
                sys.stdout.flush()
        return show

    transports = [Transport("torch", gloo_tables, report("gloo", [(0, 2), (1, 2)]))]
    if not args.no_mpi:
        transports.append(Transport("mpi", mpi_tables, report("MPI (Open MPI shared memory)", [(0, 1)])))
    run_transports(transports, args.rounds, args.steps, memory=not args.no_memory)


if __name__ == "__main__":
    main()
