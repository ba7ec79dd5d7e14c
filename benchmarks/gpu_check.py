"""Single-rank device check: shardwise's torch paths on one device against plain torch on the same device.

    python benchmarks/gpu_check.py                  # --device cuda (what benchmarks/gpu_check.sh runs)
    python benchmarks/gpu_check.py --device cpu     # the same paths on the CPU

One process, a shardwise world of one rank on the torch backend (``--backend``: ``torch``,
with a ``cpu:gloo,cuda:nccl`` process group of one; ``mpi``, a singleton MPI world whose
collectives stage CUDA tensors through pinned host buffers; or ``local``). Paths, each a few
training steps of a small model from the same weights on the same batch:

* DP: ``shardwise.torch.DistributedOptimizer`` (SGD-momentum) over the size-1 group;
* ZeRO stage 1, 2, 3: ``ZeroOptimizer`` (Adam) over a group of one;
* pipeline: ``PipelineExecutor`` on one rank (p=1, every model stage local), GPipe and 1F1B
  with 4 micro-batches, and interleaved 1F1B with 2 local chunks.

Each path's losses are compared step by step with plain torch (same optimizer, no
shardwise); PASS when they agree within ``--rtol``. Also printed: the median step time
(after 2 warm-up steps, device synchronised) and the peak memory of the path
(``_peak.peak_bytes``: max_memory_allocated on CUDA, VmHWM on the CPU). Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peak import peak_bytes  # noqa: E402


import torch  # noqa: E402
from torch import nn  # noqa: E402

WIDTH, BATCH, MICRO = 512, 64, 4


def make_model(device: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 64)).to(device)


def _trainer(model: nn.Module, opt, x, y) -> Callable[[], torch.Tensor]:
    """One training step (MSE) of ``model`` with ``opt``; returns the loss."""
    def step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def plain(device: str, opt_cls, x, y, **kw) -> Callable[[], Callable[[], float]]:
    def build():
        model = make_model(device)
        opt = opt_cls(model.parameters(), **kw)

        return _trainer(model, opt, x, y)
    return build


def dp(device: str, x, y) -> Callable:
    def build():
        import shardwise.torch as swt

        model = make_model(device)
        opt = swt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())

        return _trainer(model, opt, x, y)
    return build


def zero(device: str, stage: int, x, y) -> Callable:
    def build():
        import shardwise
        from shardwise.torch import ZeroOptimizer

        model = make_model(device)
        opt = ZeroOptimizer(model, torch.optim.Adam, stage=stage, comm=shardwise.current().world, lr=1e-3)

        return _trainer(model, opt, x, y)
    return build


def pipeline(device: str, schedule: str, v: int, x, y) -> Callable:
    def build():
        import shardwise
        from shardwise.adapters.torch.parallel import PipelineExecutor, split_sequential_chunks
        from shardwise.core.pipeline import build_schedule

        model = make_model(device)
        chunks = split_sequential_chunks(model, 1, 0, v)  # p=1: every model stage on this rank
        ex = PipelineExecutor(chunks, build_schedule(schedule, 1, MICRO, v), shardwise.current().world,
                              nn.functional.mse_loss)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step():
            opt.zero_grad()
            loss = ex.step(x, y)
            opt.step()
            return loss.detach()
        return step
    return build


def run(build: Callable, steps: int, sync: Callable[[], None]) -> tuple[list[float], float]:
    step = build()
    losses, times = [], []
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, statistics.median(times[2:] or times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--backend", default="torch", choices=("torch", "mpi", "local"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    dev = args.device
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("FAIL: --device cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(torch.device(dev))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import shardwise

    if args.backend == "torch":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        group = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(group, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    world = shardwise.init(backend=args.backend).world
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 256, generator=g).to(dev), torch.randn(BATCH, 64, generator=g).to(dev)
    sgd = plain(dev, torch.optim.SGD, x, y, lr=0.05, momentum=0.9)
    adam = plain(dev, torch.optim.Adam, x, y, lr=1e-3)
    paths = [("DP DistributedOptimizer (SGD)", dp(dev, x, y), sgd)]
    paths += [(f"ZeRO stage {s} (Adam)", zero(dev, s, x, y), adam) for s in (1, 2, 3)]
    paths += [(f"pipeline p=1 {name} m={MICRO}" + (f" v={v}" if v > 1 else ""), pipeline(dev, name, v, x, y), sgd)
              for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))]
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    print(f"# gpu_check: device {dev} ({name}), backend {world.backend if hasattr(world, 'backend') else args.backend},"
          f" world size {world.size}, torch {torch.__version__}, {args.steps} steps, rtol {args.rtol:g}")
    print(f"{'path':<42} {'result':<6} {'max rel diff':>12} {'step ms':>9} {'plain ms':>9} {'peak MiB':>9}")
    failed = 0
    for label, ours, ref in paths:
        try:
            got, t_ours = run(ours, args.steps, sync)
            want, t_ref = run(ref, args.steps, sync)
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
            ok = diff <= args.rtol and all(a == a for a in got)
            peak = peak_bytes(ours, 3, dev) / 2**20
            print(f"{label:<42} {'PASS' if ok else 'FAIL':<6} {diff:12.2e} {t_ours * 1e3:9.2f} {t_ref * 1e3:9.2f} "
                  f"{peak:9.1f}")
        except Exception as exc:  # noqa: BLE001 - report the path as failed and go on with the others
            ok = False
            print(f"{label:<42} FAIL   {type(exc).__name__}: {str(exc)[:200]}")
        failed += not ok
        sys.stdout.flush()
    print(f"{len(paths) - failed}/{len(paths)} paths PASS")
    shardwise.shutdown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
