"""ZeRO: per-rank model-state memory and step time, shardwise vs torch and DeepSpeed.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/zero.py
(DeepSpeed is optional: DS_BUILD_OPS=0 pip install deepspeed; its first run
JIT-compiles a shared-memory op, which is warmed up before any timing.)

Every contender trains the same ~21M-parameter MLP with Adam on the same data in
the same job, one after the other, with the same DeepSpeed JSON config:
  shardwise stage 1/2/3 (mpi backend)     vs torch ZeroRedundancyOptimizer + DDP (stage 1),
  FSDP2 fully_shard (stage 3), DeepSpeed ZeRO 1/2/3 (gloo).
Memory is the bytes of every live torch tensor on the rank after a step (params,
grads, optimizer state and any flat buffers a framework keeps), measured the same
way for all; time is the median step over several rounds, slowest rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Callable

import torch
from mpi4py import MPI
from torch import nn

import shardwise
from shardwise.adapters.torch.zero import ZeroOptimizer
from shardwise.core.config import TrainingConfig
from shardwise.core.memory import model_state_bytes

DS_CONFIG = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
WIDTH, DEPTH, BATCH = 2048, 5, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(1024, WIDTH)]
    for _ in range(DEPTH - 1):
        layers += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    layers += [nn.ReLU(), nn.Linear(WIDTH, 1024)]
    return nn.Sequential(*layers)


def live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if key and key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
        except Exception:  # noqa: BLE001 - some objects refuse inspection
            continue
    return total


def run(name: str, build: Callable[[], tuple[Callable[[torch.Tensor], None], Callable[[], None]]],
        steps: int, rounds: int, comm) -> tuple[float, int]:
    x = torch.randn(BATCH, 1024)
    base = live_tensor_bytes()
    train_step, teardown = build()
    train_step(x)  # warm-up (lazy optimizer state, JIT ops)
    memory = live_tensor_bytes() - base
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            comm.Barrier()
            t0 = time.perf_counter()
            train_step(x)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    teardown()
    seconds = comm.allreduce(statistics.median(medians), op=MPI.MAX)
    return seconds, comm.allreduce(memory, op=MPI.MAX)


def shardwise_zero(stage: int, world) -> Callable:
    def build():
        cfg = TrainingConfig.from_deepspeed(dict(DS_CONFIG, zero_optimization={"stage": stage}))
        model = make_model()
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=cfg.zero.stage, comm=world, lr=1e-3)

        def step(x):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return step, lambda: None
    return build


def torch_zero_redundancy() -> Callable:
    def build():
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(make_model())
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)

        def step(x):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return step, lambda: None
    return build


def torch_fsdp2() -> Callable:
    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (MPI.COMM_WORLD.size,))
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(x):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return step, lambda: None
    return build


def deepspeed_zero(stage: int) -> Callable:
    def build():
        import deepspeed

        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                               config=dict(DS_CONFIG, zero_optimization={"stage": stage}))

        def step(x):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        return step, lambda: None
    return build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // MPI.COMM_WORLD.size))
    world = shardwise.init(backend="mpi").world
    comm = MPI.COMM_WORLD
    url = comm.bcast(f"tcp://127.0.0.1:{29700 + os.getpid() % 200}" if comm.rank == 0 else None)
    os.environ.update(RANK=str(comm.rank), WORLD_SIZE=str(comm.size), LOCAL_RANK=str(comm.rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=url.rsplit(":", 1)[1])
    torch.distributed.init_process_group("gloo", init_method=url, rank=comm.rank, world_size=comm.size)
    contenders = [("shardwise ZeRO-1", 1, shardwise_zero(1, world)), ("shardwise ZeRO-2", 2, shardwise_zero(2, world)),
                  ("shardwise ZeRO-3", 3, shardwise_zero(3, world)),
                  ("torch ZeroRedundancyOptimizer", 1, torch_zero_redundancy()), ("torch FSDP2", 3, torch_fsdp2())]
    have_ds = False
    if not args.no_deepspeed:
        try:
            import deepspeed  # noqa: F401

            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            have_ds = True
            contenders += [(f"DeepSpeed ZeRO-{s}", s, deepspeed_zero(s)) for s in (1, 2, 3)]
        except ImportError:
            pass
    results = {}
    for name, stage, build in contenders:
        results[name] = (stage,) + run(name, build, args.steps, args.rounds, comm)
    if comm.rank == 0:
        psi = sum(p.numel() for p in make_model().parameters())
        print(f"# ZeRO, {comm.size} ranks, {psi / 1e6:.1f}M params, Adam fp32, batch {BATCH}/rank, "
              f"median of {args.rounds} rounds x {args.steps} steps{'' if have_ds else ' (DeepSpeed not installed)'}")
        print("| contender | stage | step (ms) | model states (MB) | core model (MB) | memory/model |")
        print("|---|---|---|---|---|---|")
        for name, (stage, seconds, memory) in results.items():
            expect = model_state_bytes(psi, comm.size, stage, "adam", "fp32").total
            print(f"| {name} | {stage} | {seconds * 1e3:.1f} | {memory / 1e6:.1f} | {expect / 1e6:.1f} | "
                  f"{memory / expect:.2f} |")
        ratios = [("ZeRO-3 step time vs FSDP2", "shardwise ZeRO-3", "torch FSDP2"),
                  ("ZeRO-1 step time vs ZeroRedundancyOptimizer", "shardwise ZeRO-1", "torch ZeroRedundancyOptimizer")]
        ratios += [(f"ZeRO-{s} step time vs DeepSpeed", f"shardwise ZeRO-{s}", f"DeepSpeed ZeRO-{s}") for s in (1, 2, 3)]
        for label, ours, peer in ratios:
            if ours in results and peer in results:
                print(f"{label}: {results[ours][1] / results[peer][1]:.2f}x (lower is better)")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
