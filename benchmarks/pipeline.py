"""Pipeline parallelism: step time and peak memory vs torch.distributed.pipelining; measured bubble.

One pipeline stage per rank (``--stages`` must equal the number of ranks)::

    shardwise run -np 2 -- python benchmarks/pipeline.py --stages 2
    shardwise run -np 4 -- python benchmarks/pipeline.py --stages 4

(the memory phase and the allocator settings of the timing after it: benchmarks/_peak.py).
With more ranks than cores the job is oversubscribed; the output says so.

Step time (forward + backward of one batch of m=8 micro-batches; ``--steps`` x
``--rounds``, interleaved, median of the slowest rank) and peak per-rank memory
(benchmarks/_peak.py: the stage copies, the runtime and 3 steps), per schedule
GPipe / 1F1B / interleaved 1F1B (v=2). The same stage modules (``--layers`` x
(Linear + ReLU) per model stage, real compute), micro-batches and data, two tables:

* gloo: shardwise ``PipelineExecutor`` on the torch backend vs ``torch.distributed.pipelining``
  (PipelineStage + ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B) on the same
  process group; ratio shardwise / torch. The first step's gradients are checked equal.
* MPI (shardwise on the mpi backend, the gloo group shut down): shardwise alone, absolute
  figures (no MPI pipeline runtime to compare with).

Every table's memory phase runs before any timing (``_common.run_transports``).

Bubble (``--no-bubble`` skips it; mpi backend). Every model stage is a small Linear followed
by a fixed-duration wait (``--fwd-ms`` forward, twice that backward, per micro-batch and
rank; an interleaved chunk waits ``1/v`` of it), so each rank's compute per micro-batch does
not depend on how many processes share a core. Busy time is the time in the executor's
forward and backward actions; the measured bubble is ``1 - sum(busy) / (p * step wall
time)`` (the definition of ``core.pipeline.simulate``), median over steps, next to
``(p-1)/(m+p-1)`` and, interleaved, ``(p-1)/(v*m+p-1)``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _common import Transport, print_results, run_transports, set_threads  # noqa: E402
from _peak import timing_allocator  # noqa: E402
from shardwise.adapters.torch.parallel import PipelineExecutor, split_sequential_chunks  # noqa: E402
from shardwise.core.comm import Communicator  # noqa: E402
from shardwise.core.launch_env import detect_launch  # noqa: E402
from shardwise.core.pipeline import bubble_fraction, build_schedule, simulate  # noqa: E402

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
    """A step function running ``name`` on copies of this rank's chunks with the PipelineExecutor."""
    p = comm.size
    chunks = [copy.deepcopy(c) for c in split_sequential_chunks(model, p, comm.rank, v, costs=[1.0] * len(model))]
    executor = TimedExecutor(chunks, build_schedule(name, p, m, v), comm, nn.functional.mse_loss,
                             activation_shape=(x.shape[0] // m, x.shape[1]), activation_dtype=x.dtype)

    def step() -> None:
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        executor.step(x, y)
    step.chunks = chunks
    return step, executor


def torch_runner(model: nn.Sequential, name: str, v: int, m: int, x: torch.Tensor,
                 y: torch.Tensor) -> Callable[[], None]:
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
    step.chunks = chunks
    return step


def first_grads(step) -> list[torch.Tensor]:
    """The gradients one step leaves (step functions zero them first, not after)."""
    step()
    return [q.grad.clone() for c in step.chunks for q in c.parameters()]


def _inputs(args: argparse.Namespace, p: int, name: str, v: int):
    model = linear_model(p * v, args.width, max(1, args.layers // v))
    torch.manual_seed(1)
    m = args.step_microbatches
    return model, torch.randn(m * args.mb_rows, args.width), torch.randn(m * args.mb_rows, args.width)


def _ours(model: nn.Sequential, world: Communicator, name: str, v: int, m: int, x: torch.Tensor, y: torch.Tensor):
    """The build of shardwise's executor for one schedule."""
    return lambda: shardwise_runner(model, world, name, v, m, x, y)[0]


def _theirs(model: nn.Sequential, name: str, v: int, m: int, x: torch.Tensor, y: torch.Tensor):
    return lambda: torch_runner(model, name, v, m, x, y)


def gloo_tables(world: Communicator, args: argparse.Namespace) -> dict[str, dict]:
    """Per schedule: shardwise (torch backend) vs torch.distributed.pipelining, on the same stages and data."""
    tables, m = {}, args.step_microbatches
    for name, v in SCHEDULES:
        model, x, y = _inputs(args, world.size, name, v)
        tables[name] = {f"shardwise PipelineExecutor {LABEL[name]}": _ours(model, world, name, v, m, x, y),
                        f"torch.distributed.pipelining {TORCH_SCHEDULE[name]}": _theirs(model, name, v, m, x, y)}
    return tables


def gradient_checks(world: Communicator, args: argparse.Namespace) -> list[str]:
    """Per schedule: do both runtimes' first steps leave the same gradients on every rank?"""
    checks = []
    for name, builds in gloo_tables(world, args).items():
        ours, theirs = builds.values()
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                   for a, b in zip(first_grads(ours()), first_grads(theirs())))
        checks.append(f"{LABEL[name]}: first-step gradients equal on every rank: "
                      f"{'yes' if all(world.allgather_object(same)) else 'NO'}")
    return checks


def mpi_tables(world: Communicator, args: argparse.Namespace) -> dict[str, dict]:
    tables, m = {}, args.step_microbatches
    for name, v in SCHEDULES:
        model, x, y = _inputs(args, world.size, name, v)
        tables[name] = {f"shardwise PipelineExecutor {LABEL[name]} (mpi backend)":
                        _ours(model, world, name, v, m, x, y)}
    return tables


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages (= number of ranks)")
    parser.add_argument("--step-microbatches", type=int, default=8, help="micro-batches m of the step-time tables")
    parser.add_argument("--microbatches", type=lambda s: [int(t) for t in s.split(",")], default=[4, 8],
                        help="micro-batch counts of the bubble table")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fwd-ms", type=float, default=10.0, help="fixed forward cost per micro-batch (bubble)")
    parser.add_argument("--bubble-width", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024, help="Linear width (step time)")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU per rank and micro-batch (step time)")
    parser.add_argument("--mb-rows", type=int, default=32, help="rows per micro-batch (step time)")
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPI table and the bubble table")
    parser.add_argument("--no-bubble", action="store_true", help="skip the bubble table")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument("--mpi-yield", action="store_true",
                        help="OMPI_MCA_mpi_yield_when_idle=1: MPI waits yield the core instead of spinning "
                             "(helps on shared or loaded CPUs; Open MPI turns it on itself when oversubscribed)")
    args = parser.parse_args()
    if args.mpi_yield:
        os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1"  # read by MPI_Init, which has not run yet
    threads = set_threads()
    launch = detect_launch()
    p, m = launch.size, args.step_microbatches
    if args.stages != p:
        raise SystemExit(f"--stages {args.stages} needs exactly {args.stages} ranks, got {p}")
    if any(k % p for k in args.microbatches + [m]):
        raise SystemExit(f"micro-batch counts must be multiples of {p} (interleaved 1F1B)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = launch.local_size
    what = (f"m={m} micro-batches of {args.mb_rows}x{args.width}, {args.layers} x (Linear {args.width} + ReLU) "
            f"per rank, forward + backward")
    if launch.rank == 0:
        load = (f"{local} ranks on {cores} cores: OVERSUBSCRIBED, step times include CPU contention"
                if local > cores else f"{local} ranks on {cores} cores")
        print(f"# Pipeline benchmark, p={p} stages; {load}; {threads} thread(s)/rank; torch {torch.__version__}; "
              f"median of {args.rounds} rounds x {args.steps} steps (slowest rank per round); "
              f"{timing_allocator(not args.no_memory)}"
              f"{'; mpi_yield_when_idle=1' if args.mpi_yield else ''}")
        sys.stdout.flush()

    def gloo_report(world: Communicator, results: dict) -> None:
        checks = gradient_checks(world, args)
        if world.rank == 0:
            rows = {row: r for table in results.values() for row, r in table.items()}
            names = list(rows)
            print_results(f"## Step time, p={p}, {what} - transport: gloo", rows,
                          list(zip(names[0::2], names[1::2])))
            print("\n".join(checks))
            sys.stdout.flush()

    def mpi_report(world: Communicator, results: dict) -> None:
        if world.rank == 0:
            rows = {row: r for table in results.values() for row, r in table.items()}
            print_results(f"## Step time, p={p}, {what} - transport: MPI (no MPI peer: absolute figures only)", rows)
            sys.stdout.flush()
        if not args.no_bubble:
            lines = bubble_table(world, args)
            if world.rank == 0:
                print(f"\n## Bubble (mpi backend): fixed-cost stages ({args.fwd_ms:g} ms forward, "
                      f"{2 * args.fwd_ms:g} ms backward per micro-batch and rank), median of {args.steps} steps")
                print("| schedule | p | m | v | closed form | simulated | measured | measured - closed |")
                print("|---|---|---|---|---|---|---|---|")
                print("\n".join(lines))

    transports = [Transport("torch", lambda world: gloo_tables(world, args), gloo_report)]
    if not args.no_mpi:
        transports.append(Transport("mpi", lambda world: mpi_tables(world, args), mpi_report))
    run_transports(transports, args.rounds, args.steps, memory=not args.no_memory)


if __name__ == "__main__":
    main()
