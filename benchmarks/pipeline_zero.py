"""ZeRO-1 with a pipeline at dp2 x pp2: shardwise against DeepSpeed's PipelineEngine, one gloo group.

Run on 4 ranks:  shardwise run -np 4 -- python benchmarks/pipeline_zero.py
(needs DeepSpeed: bash benchmarks/setup.sh)

The same model, an ``nn.Sequential`` of ``--layers`` blocks (Linear ``--width`` x ``--width``,
GELU) and a Linear classifier, the same initial weights, Adam fp32, ``--micro-batches``
micro-batches of ``--micro-batch`` samples per data-parallel rank and step, cut into two
stages of equal layer counts:

* shardwise: ``parallelize(model, torch.optim.Adam, ParallelLayout(dp=2, pp=2, zero_stage=1,
  micro_batches=m, schedule="1f1b"), loss_fn=cross_entropy)`` on the torch backend (gloo);
* DeepSpeed: ``PipelineModule(layers, num_stages=2, partition_method="uniform", loss_fn=...)``
  and ``deepspeed.initialize`` with ``zero_optimization.stage = 1``, the same batch sizes,
  ``engine.train_batch`` (its 1F1B ``TrainSchedule``), on the same gloo group.

Before timing both run two steps on the same data; their losses are printed (the second after
one Adam update).
Timing: rounds interleave the two contenders, ``--steps`` steps each per round after a warm-up
step; a round's figure is the slowest rank's mean step; the median over rounds and the
per-round ratios are printed (ratio = shardwise / DeepSpeed, < 1: shardwise is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo, no oneCCL
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".venv", "torch_extensions"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _common import init_gloo, paired_ratios  # noqa: E402


def layers(args: argparse.Namespace) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(args.layers):
        out += [nn.Linear(args.width, args.width), nn.GELU()]
    out.append(nn.Linear(args.width, args.classes))
    return out


def data(args: argparse.Namespace, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's samples of one step (every micro-batch)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    n = args.micro_batch * args.micro_batches
    return torch.randn(n, args.width, generator=gen), torch.randint(0, args.classes, (n,), generator=gen)


def shardwise_step(args: argparse.Namespace) -> tuple[Callable[[int], float], int]:
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.layout import ParallelLayout

    pm = parallelize(nn.Sequential(*layers(args)), torch.optim.Adam,
                     ParallelLayout(dp=2, pp=2, zero_stage=1, micro_batches=args.micro_batches),
                     loss_fn=nn.functional.cross_entropy, lr=1e-3)

    def step(k: int) -> float:
        x, y = data(args, pm.groups.dp.rank, k)
        return pm.train_step(x, y)
    return step, pm.groups.dp.rank


def deepspeed_step(args: argparse.Namespace) -> Callable[[int], float]:
    import logging

    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group that is already up
    deepspeed.utils.logger.setLevel(logging.WARNING)
    module = PipelineModule(layers=layers(args), num_stages=2, partition_method="uniform",
                            loss_fn=nn.functional.cross_entropy)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.micro_batches,
              "train_batch_size": 2 * args.micro_batch * args.micro_batches, "zero_optimization": {"stage": 1},
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.Adam(module.parameters(), lr=1e-3),
                                           config=config)
    dp_rank = engine.grid.get_data_parallel_rank()

    def step(k: int) -> float:
        x, y = data(args, dp_rank, k)
        batches = iter(zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches)))
        return float(engine.train_batch(data_iter=batches))
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = init_gloo()
    if world.size != 4:
        raise SystemExit(f"run on 4 ranks (dp2 x pp2), not {world.size}")
    import deepspeed
    import shardwise

    ours, _ = shardwise_step(args)
    theirs = deepspeed_step(args)
    losses = world.allgather_object([(ours(k), theirs(k)) for k in range(2)])  # the second after one update
    times: dict[str, list[float]] = {"shardwise": [], "deepspeed": []}
    for r in range(args.rounds):
        for name, fn in (("shardwise", ours), ("deepspeed", theirs)):
            world.barrier()
            t0 = time.perf_counter()
            for k in range(args.steps):
                fn(2 + r * args.steps + k)
            times[name].append(max(world.allgather_object((time.perf_counter() - t0) / args.steps)))
    if world.rank == 0:
        params = sum(p.numel() for layer in layers(args) for p in layer.parameters())
        print(f"# ZeRO-1 x pipeline, dp2 x pp2 on 4 ranks, transport: gloo (one process group for both), torch "
              f"{torch.__version__}, DeepSpeed {deepspeed.__version__}; nn.Sequential of {args.layers} x "
              f"(Linear {args.width}, GELU) + Linear {args.classes}, {params / 1e6:.1f}M params, Adam fp32, "
              f"{args.micro_batches} micro-batches of {args.micro_batch} per dp rank, 1F1B; {args.rounds} rounds x "
              f"{args.steps} steps")
        print("# losses of the first two steps, rank 0 (shardwise, DeepSpeed): "
              f"{[tuple(round(v, 6) for v in pair) for pair in losses[0]]}")
        print("\n| contender | step time s (median, slowest rank) | per-round step times s |")
        print("|---|---|---|")
        labels = {"shardwise": "shardwise ZeRO-1, pp2 (torch backend, gloo)",
                  "deepspeed": "DeepSpeed PipelineEngine ZeRO-1, pp2 (gloo)"}
        for name, label in labels.items():
            print(f"| {label} | {statistics.median(times[name]):.4f} | "
                  f"{' '.join(f'{t:.4f}' for t in times[name])} |")
        ratio = statistics.median(times["shardwise"]) / statistics.median(times["deepspeed"])
        print(f"\nshardwise / DeepSpeed: {ratio:.2f}x"
              f" of the median step time; per round {paired_ratios(times['shardwise'], times['deepspeed'])}")
    world.barrier()
    shardwise.shutdown()


if __name__ == "__main__":
    main()
