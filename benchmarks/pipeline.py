"""Pipeline parallelism: measured bubble vs the closed form, and step time vs torch.distributed.pipelining.

One pipeline stage per rank (``--stages`` must equal the number of ranks)::

    mpirun -np 2 python benchmarks/pipeline.py --stages 2
    mpirun -np 4 python benchmarks/pipeline.py --stages 4

(add ``--allow-run-as-root --oversubscribe`` where mpirun needs them). With more
ranks than cores the job is oversubscribed; the output says so.

Part 1, bubble. Every model stage is a small Linear followed by a fixed-duration
wait (``--fwd-ms`` forward, twice that backward, per micro-batch and rank; an
interleaved chunk waits ``1/v`` of it), so each rank's compute per micro-batch is
constant and does not depend on how many processes share a core. Busy time is the
time spent in the executor's forward and backward actions; the measured bubble is
``1 - sum(busy) / (p * step wall time)`` (the definition of ``core.pipeline.simulate``),
median over steps, next to ``(p-1)/(m+p-1)`` and, interleaved, ``(p-1)/(v*m+p-1)``.

Part 2, step time (forward + backward of one batch). The same stage modules (a
stack of Linear+ReLU per model stage, real compute), micro-batches and data, run by
shardwise's PipelineExecutor (mpi backend; torch backend over the gloo group) and by
``torch.distributed.pipelining`` (PipelineStage + ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B, gloo). Median step time of the slowest rank; the ratio is
shardwise / torch (target <= 1.0x). The first step's gradients are checked equal.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Callable, Optional

import torch
from torch import nn

import shardwise
from shardwise.adapters.torch.parallel import PipelineExecutor, split_sequential_chunks
from shardwise.backends.torch import TorchCommunicator
from shardwise.core.comm import Communicator
from shardwise.core.pipeline import bubble_fraction, build_schedule, simulate

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))
LABEL = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}
TORCH_SCHEDULE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class TimedExecutor(PipelineExecutor):
    """A PipelineExecutor that adds the wall time of its forward and backward actions to ``busy``."""

    busy = 0.0

    def _forward(self, *args) -> None:
        t0 = time.perf_counter()
        try:
            super()._forward(*args)
        finally:
            self.busy += time.perf_counter() - t0

    def _backward(self, *args) -> None:
        t0 = time.perf_counter()
        try:
            super()._backward(*args)
        finally:
            self.busy += time.perf_counter() - t0


class _Wait(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class FixedCost(nn.Module):
    """A model-stage tail costing ``fwd_s`` forward and ``bwd_s`` backward, whatever the CPU load."""

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(x, self.fwd_s, self.bwd_s)


def fixed_cost_model(stages: int, width: int, fwd_s: float) -> nn.Sequential:
    """``stages`` model stages of Linear + a fixed wait (backward twice the forward)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), FixedCost(fwd_s, 2 * fwd_s))
                           for _ in range(stages)])


def linear_model(stages: int, width: int, layers: int) -> nn.Sequential:
    """``stages`` model stages of ``layers`` x (Linear + ReLU): equal real compute per stage."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
                           for _ in range(stages)])


def time_steps(step: Callable[[], None], comm: Communicator, steps: int,
               busy: Optional[Callable[[], float]] = None) -> tuple[float, Optional[float]]:
    """Median step wall time (slowest rank) and median measured bubble over ``steps`` (after one warm-up)."""
    walls, bubbles = [], []
    for i in range(steps + 1):
        comm.barrier()
        before = busy() if busy else 0.0
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
        every = comm.allgather_object((wall, (busy() - before) if busy else 0.0))
        if i == 0:
            continue  # warm-up: shape headers, torch shape inference, allocator
        slowest = max(w for w, _ in every)
        walls.append(slowest)
        bubbles.append(1.0 - sum(b for _, b in every) / (len(every) * slowest))
    return statistics.median(walls), (statistics.median(bubbles) if busy else None)


def shardwise_runner(model: nn.Sequential, comm: Communicator, name: str, v: int, m: int,
                     x: torch.Tensor, y: torch.Tensor) -> tuple[Callable[[], None], TimedExecutor]:
    """A step function running ``name`` on this rank's chunks with the PipelineExecutor."""
    p = comm.size
    chunks = split_sequential_chunks(model, p, comm.rank, v, costs=[1.0] * len(model))
    width = x.shape[1]
    executor = TimedExecutor(chunks, build_schedule(name, p, m, v), comm, nn.functional.mse_loss,
                             activation_shape=(x.shape[0] // m, width), activation_dtype=x.dtype)

    def step() -> None:
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        executor.step(x, y)
    return step, executor


def torch_runner(model: nn.Sequential, name: str, v: int, m: int, x: torch.Tensor,
                 y: torch.Tensor) -> tuple[Callable[[], None], list[nn.Module]]:
    """A step function running the torch.distributed.pipelining schedule on copies of the same chunks."""
    from torch.distributed import pipelining

    rank, p = torch.distributed.get_rank(), torch.distributed.get_world_size()
    chunks = [copy.deepcopy(c) for c in split_sequential_chunks(model, p, rank, v, costs=[1.0] * len(model))]
    stages = [pipelining.PipelineStage(c, k * p + rank, p * v, torch.device("cpu")) for k, c in enumerate(chunks)]
    cls = getattr(pipelining, TORCH_SCHEDULE[name])
    sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=nn.functional.mse_loss)
    first, last = rank == 0, rank == p - 1

    def step() -> None:
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        args = (x,) if first else ()
        sched.step(*args, target=y if last else None, losses=[] if last else None)
    return step, chunks


def first_grads(step: Callable[[], None], chunks: list[nn.Module]) -> list[torch.Tensor]:
    """The gradients one step leaves (step functions zero them first, not after)."""
    step()
    return [q.grad.clone() for c in chunks for q in c.parameters()]


def bubble_table(comm: Communicator, args: argparse.Namespace) -> list[str]:
    p, rows = comm.size, []
    for m in args.microbatches:
        for name, v in SCHEDULES:
            model = fixed_cost_model(p * v, args.bubble_width, args.fwd_ms / 1e3 / v)
            x, y = torch.randn(m * 4, args.bubble_width), torch.randn(m * 4, args.bubble_width)
            step, ex = shardwise_runner(model, comm, name, v, m, x, y)
            _, measured = time_steps(step, comm, args.steps, busy=lambda: ex.busy)
            closed = bubble_fraction(name, p, m, v)
            sim = simulate(build_schedule(name, p, m, v), 1.0, 2.0).bubble_fraction
            rows.append(f"| {LABEL[name]} | {p} | {m} | {v} | {closed:.3f} | {sim:.3f} | {measured:.3f} | "
                        f"{measured - closed:+.3f} |")
    return rows


def step_time_table(comm: Communicator, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    p, m = comm.size, max(args.microbatches)
    torch_comm = None if args.no_torch_backend else TorchCommunicator()
    rows, ratios = [], []
    for name, v in SCHEDULES:
        model = linear_model(p * v, args.width, max(1, args.layers // v))
        torch.manual_seed(1)
        x, y = torch.randn(m * args.mb_rows, args.width), torch.randn(m * args.mb_rows, args.width)
        results = {}
        ours, ex = shardwise_runner(model, comm, name, v, m, x, y)
        theirs, their_chunks = torch_runner(model, name, v, m, x, y)
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in
                   zip(first_grads(ours, ex.chunks), first_grads(theirs, their_chunks)))
        agree = all(comm.allgather_object(same))
        results["shardwise (mpi)"] = time_steps(ours, comm, args.steps, busy=lambda: ex.busy)
        if torch_comm is not None:
            ours_t, ex_t = shardwise_runner(model, torch_comm, name, v, m, x, y)
            results["shardwise (torch/gloo)"] = time_steps(ours_t, comm, args.steps, busy=lambda: ex_t.busy)
        results[f"torch {TORCH_SCHEDULE[name]} (gloo)"] = time_steps(theirs, comm, args.steps)
        peer = results[f"torch {TORCH_SCHEDULE[name]} (gloo)"][0]
        for who, (wall, bubble) in results.items():
            idle = "n/a" if bubble is None else f"{bubble:.3f}"
            rows.append(f"| {who} | {LABEL[name]} | {v} | {wall * 1e3:.1f} | {idle} | {wall / peer:.2f}x |")
        for who in [k for k in results if k.startswith("shardwise")]:
            ratios.append(f"{LABEL[name]}: {who} / torch.distributed.pipelining = {results[who][0] / peer:.2f}x "
                          f"(target <= 1.0x); first-step gradients equal: {'yes' if agree else 'NO'}")
    return rows, ratios


def init_torch_distributed(comm: Communicator) -> None:
    """A gloo process group over the same ranks (rank 0's port broadcast through the world)."""
    port = comm.broadcast_object(29500 + os.getpid() % 400 if comm.rank == 0 else None, 0)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=comm.rank, world_size=comm.size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages (= number of ranks)")
    parser.add_argument("--microbatches", type=lambda s: [int(t) for t in s.split(",")], default=[4, 8])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after 1 warm-up)")
    parser.add_argument("--fwd-ms", type=float, default=10.0, help="fixed forward cost per micro-batch (part 1)")
    parser.add_argument("--bubble-width", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024, help="Linear width (part 2)")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU per rank and micro-batch (part 2)")
    parser.add_argument("--mb-rows", type=int, default=32, help="rows per micro-batch (part 2)")
    parser.add_argument("--no-torch-backend", action="store_true", help="skip shardwise on the torch backend")
    parser.add_argument("--mpi-yield", action="store_true",
                        help="OMPI_MCA_mpi_yield_when_idle=1: MPI waits yield the core instead of spinning "
                             "(helps on shared or loaded CPUs; Open MPI turns it on itself when oversubscribed)")
    args = parser.parse_args()
    if args.mpi_yield:
        os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1"  # read by MPI_Init, which has not run yet
    world = shardwise.init(backend="mpi").world
    if args.stages != world.size:
        raise SystemExit(f"--stages {args.stages} needs exactly {args.stages} ranks, got {world.size}")
    if any(m % world.size for m in args.microbatches):
        raise SystemExit(f"--microbatches must be multiples of {world.size} (interleaved 1F1B)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", world.size))
    torch.set_num_threads(max(1, cores // local))
    init_torch_distributed(world)
    bubble_rows = bubble_table(world, args)
    step_rows, ratios = step_time_table(world, args)
    if world.rank == 0:
        p, m = world.size, max(args.microbatches)
        load = (f"{local} ranks on {cores} cores: OVERSUBSCRIBED, step times include CPU contention "
                "(part 1 uses fixed-duration waits, which contention barely affects)"
                if local > cores else f"{local} ranks on {cores} cores")
        print(f"# Pipeline benchmark, p={p} stages; {load}; torch {torch.__version__}"
              f"{'; mpi_yield_when_idle=1' if args.mpi_yield else ''}")
        print(f"\n## Bubble: fixed-cost stages ({args.fwd_ms:g} ms forward, {2 * args.fwd_ms:g} ms backward "
              f"per micro-batch and rank), median of {args.steps} steps")
        print("| schedule | p | m | v | closed form | simulated | measured | measured - closed |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(bubble_rows))
        print(f"\n## Step time (forward + backward): m={m} micro-batches of {args.mb_rows}x{args.width}, "
              f"{args.layers} x (Linear {args.width} + ReLU) per rank, median of {args.steps} steps, slowest rank")
        print("| runtime | schedule | v | step (ms) | measured bubble | vs torch |")
        print("|---|---|---|---|---|---|")
        print("\n".join(step_rows))
        print()
        print("\n".join(ratios))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
