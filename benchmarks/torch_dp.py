"""Data-parallel training step: shardwise vs torch DDP on gloo; shardwise vs raw mpi4py on MPI.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/torch_dp.py
(timing uses the default allocator; the memory phase: benchmarks/_peak.py).

Per model (``--models``, default the 11.5M-parameter MLP and the small GPT of
benchmarks/_models.py), two tables, each one transport, never a ratio across them:

* gloo (torch.distributed, one process group shared by all rows): shardwise
  ``DistributedOptimizer`` and ``DistributedDataParallel`` on the torch backend vs
  ``torch.nn.parallel.DistributedDataParallel`` (25 MiB buckets);
* MPI (after every gloo table; shardwise is shut down and re-initialised on the mpi
  backend): shardwise ``DistributedOptimizer`` vs a plain mpi4py data-parallel step (all
  gradients copied into one flat buffer, one in-place ``Allreduce``, copied back).
  Horovod's own ``DistributedOptimizer`` is the other MPI peer: benchmarks/horovod.py.

Each table also has a floor row: one rank's own step with no communication at all.

All rows train the same model from the same weights with SGD-momentum on the same
per-rank synthetic batch. Timing: contenders interleaved round by round, median step of
the slowest rank per round, median over rounds. Memory: see benchmarks/_peak.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import shardwise  # noqa: E402
from _common import init_gloo, print_results, run_table, set_threads  # noqa: E402
from _models import WORKLOADS, Workload  # noqa: E402


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
    world = init_gloo()
    n = world.size
    if world.rank == 0:
        print(f"# data parallel, {n} ranks, {threads} thread(s)/rank, torch {torch.__version__}, SGD-momentum; "
              f"median of {args.rounds} rounds x {args.steps} steps (slowest rank per round); "
              "default allocator while timing, 64 KiB mmap threshold while measuring memory")
    workloads = [WORKLOADS[key] for key in args.models.split(",")]
    data = {w.name: w.data(world.rank, w.batch, torch.device("cpu")) for w in workloads}
    what = {w.name: f"{w.label}, {w.params() / 1e6:.1f}M params, batch {w.batch}/rank" for w in workloads}
    for w in workloads:  # gloo: every row on the one torch.distributed process group
        x, y = data[w.name]
        gloo = {"shardwise DistributedOptimizer (torch backend, gloo)": _trainer(w, x, y, shardwise_optimizer),
                "shardwise DistributedDataParallel (torch backend, gloo)": _trainer(w, x, y, shardwise_ddp),
                "torch DDP (gloo)": _trainer(w, x, y, torch_ddp),
                FLOOR: _trainer(w, x, y, local_only)}
        res = run_table(gloo, world, args.rounds, args.steps, memory=not args.no_memory)
        if world.rank == 0:
            names = list(gloo)
            print_results(f"## {what[w.name]} - transport: gloo", res, [(names[0], names[2]), (names[1], names[2])],
                          items=w.batch * n)
            sys.stdout.flush()
    shardwise.shutdown()  # the gloo group goes
    if args.no_mpi:
        return
    world = shardwise.init(backend="mpi").world
    for w in workloads:
        x, y = data[w.name]
        on_mpi = {"shardwise DistributedOptimizer (mpi backend)": _trainer(w, x, y, shardwise_optimizer),
                  "mpi4py Allreduce, one flat buffer (MPI)": _trainer(w, x, y, mpi4py_allreduce),
                  FLOOR: _trainer(w, x, y, local_only)}
        res = run_table(on_mpi, world, args.rounds, args.steps, memory=not args.no_memory)
        if world.rank == 0:
            names = list(on_mpi)
            print_results(f"## {what[w.name]} - transport: MPI (Open MPI shared memory)", res,
                          [(names[0], names[1])], items=w.batch * n)
            sys.stdout.flush()
    shardwise.shutdown()


if __name__ == "__main__":
    main()
