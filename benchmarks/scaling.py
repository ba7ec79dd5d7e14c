"""Scale on one host: DP, ZeRO-3 and a dp x tp layout, and the coordinator's negotiation, at 16-64 ranks.

Run:  python benchmarks/scaling.py                  (16, 32 and 64 ranks, oversubscribed)
      python benchmarks/scaling.py --ranks 16 --rows dp,zero3,negotiation   (what CI runs)

For each rank count N the script starts one ``mpirun --oversubscribe -np N`` job (the
``mpi`` backend; Open MPI's waits yield when the ranks crowd the cores) and measures:

* **start-up**: from the launch to every rank past ``shardwise.init()`` (imports
  included: torch, shardwise and, with a training row, transformers, which ``parallelize``
  imports), the slowest rank;
* **step** of three tiny trainings through ``parallelize``, each on a global batch of N
  rows: ``dp`` (an MLP, data parallel), ``zero3`` (the same MLP, ZeRO-3 over all N ranks)
  and ``dptp`` (a one-layer Llama of 4.7k parameters, dp N/2 x tp 2, when transformers
  is installed). A step's time is the slowest rank's (a barrier before it); the figure
  is the median over the timed steps. Every step's loss, the first untimed one included,
  is checked against one process training the same model on the whole batch
  (rtol 2e-5, atol 2e-6): the ``equal`` column;
* **negotiation**: a named ``shardwise.torch.allreduce`` of 4 floats through the
  Horovod-style coordinator (names cycling over 4, as gradients' names do each step),
  per request, with its result checked; and the coordinator's own traffic per request
  and per rank (:class:`~shardwise.adapters.horovod.coordinator.NegotiationStats`);
* the floor at the same N: raw mpi4py ``Barrier`` and ``Allreduce`` (4 floats, and the
  MLP's gradient size), timed the same way. Ratios are shardwise / mpi4py at the same N.

This host has 2 cores: at 64 ranks wall times mostly measure oversubscription (the
ratios to mpi4py at the same N, and the message and byte counts, are what carries over
to a cluster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("dp", "zero3", "dptp", "negotiation")
RTOL, ATOL = 2e-5, 2e-6
SEQ, VOCAB, FEATURES = 8, 64, 16


# -- the worker (every rank) ---------------------------------------------------------------------
def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        bos_token_id=0, eos_token_id=0))


def _batches(rows: int, steps: int, llama: bool) -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    if llama:
        return [(torch.randint(0, VOCAB, (rows, SEQ), generator=gen), None) for _ in range(steps)]
    return [(torch.randn(rows, FEATURES, generator=gen), torch.randn(rows, 4, generator=gen)) for _ in range(steps)]


def _one_process(model: Any, batches: list, llama: bool) -> list[float]:
    """Losses of one process training ``model`` on the whole batches (SGD lr 0.1)."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        loss = model(x, labels=x).loss if llama else F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _slowest_median(world: Any, fn: Callable[[], Any], reps: int, barrier: Callable[[], Any]) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn`` (a barrier before each)."""
    import numpy as np

    times = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(statistics.median(world.allreduce(np.array(times), "max")))


def _train_row(world: Any, row: str, steps: int) -> dict[str, Any]:
    import copy

    import numpy as np
    import torch
    import torch.nn.functional as F

    from shardwise.torch.parallel import ParallelLayout, parallelize

    llama = row == "dptp"
    model = _llama() if llama else _mlp()
    batches = _batches(world.size, steps + 1, llama)
    want = _one_process(copy.deepcopy(model), batches, llama)
    layout = {"dp": ParallelLayout(dp=world.size), "zero3": ParallelLayout(dp=world.size, zero_stage=3),
              "dptp": ParallelLayout(dp=world.size // 2, tp=2)}[row]
    pm = parallelize(model, torch.optim.SGD, layout, loss_fn=None if llama else F.mse_loss, lr=0.1)
    got, times = [], []
    for x, y in batches:
        xs = pm.shard_batch(x)
        ys = None if y is None else pm.shard_batch(y)
        world.barrier()
        start = time.perf_counter()
        got.append(pm.train_step(xs) if llama else pm.train_step(xs, ys))
        times.append(time.perf_counter() - start)
    worst = max(abs(g - w) / (ATOL + RTOL * abs(w)) for g, w in zip(got, want))
    slowest = world.allreduce(np.array(times[1:] + [worst]), "max")
    pm.groups.free()
    return {"step_s": float(statistics.median(slowest[:-1])), "equal": bool(slowest[-1] <= 1.0),
            "worst_over_tolerance": float(slowest[-1]), "params": sum(p.numel() for p in model.parameters())}


def _negotiation(world: Any, reps: int) -> dict[str, Any]:
    import numpy as np
    import torch

    import shardwise.torch as hvd
    from shardwise.adapters.horovod.process_sets import global_process_set

    x = torch.ones(4)
    ok = [True]

    def request(i: int) -> None:
        out = hvd.allreduce(x, name=f"grad.{i % 4}", op=hvd.Sum)
        ok[0] &= bool(torch.equal(out, torch.full((4,), float(world.size))))

    for i in range(4):  # the coordinator thread starts; every name is seen once
        request(i)
    stats = global_process_set.coordinator.stats
    before = dict(vars(stats))
    counter = iter(range(reps))
    step = _slowest_median(world, lambda: request(next(counter)), reps, world.barrier)
    spent = {k: getattr(stats, k) - before[k] for k in before}
    per = {k: v / max(spent["requests"], 1) for k, v in spent.items() if k != "requests"}
    worst = world.allreduce(np.array([per["messages"], per["bytes_sent"], per["bytes_received"], per["rounds"]]),
                            "max")
    equal = bool(world.allreduce(np.array([0.0 if ok[0] else 1.0]), "max")[0] == 0)
    return {"request_s": step, "equal": equal, "messages": float(worst[0]), "bytes_sent": float(worst[1]),
            "bytes_received": float(worst[2]), "rounds": float(worst[3])}


def worker(launched_at: float, rows: list[str], steps: int, reps: int) -> None:
    """One rank of the job: start-up, the rows, the mpi4py floor; rank 0 prints one JSON line."""
    import numpy as np
    import torch

    import shardwise
    import shardwise.torch  # noqa: F401 - the imports a training script pays are part of start-up
    if set(rows) & {"dp", "zero3", "dptp"}:
        from transformers import PreTrainedModel  # noqa: F401 - parallelize loads it (about 2.5 s a rank here)

    torch.set_num_threads(1)
    world = shardwise.init(backend="mpi").world
    world.barrier()
    ready = time.time()
    from mpi4py import MPI  # after shardwise.init: MPI started with its crowded-node settings

    comm = MPI.COMM_WORLD
    result: dict[str, Any] = {"ranks": world.size,
                              "startup_s": max(world.allgather_object(ready)) - launched_at}
    phases = result["phase_s"] = {}
    for row in rows:
        began = time.time()
        result[row] = _negotiation(world, reps) if row == "negotiation" else _train_row(world, row, steps)
        phases[row] = time.time() - began
    began = time.time()
    grads = sum(p.numel() for p in _mlp().parameters())
    small, big = np.ones(4, np.float32), np.ones(grads, np.float32)
    out_small, out_big = np.empty_like(small), np.empty_like(big)
    result["mpi4py"] = {
        "barrier_s": _slowest_median(world, comm.Barrier, reps, comm.Barrier),
        "allreduce4_s": _slowest_median(world, lambda: comm.Allreduce(small, out_small, MPI.SUM), reps, comm.Barrier),
        "allreduce_grads_s": _slowest_median(world, lambda: comm.Allreduce(big, out_big, MPI.SUM), reps, comm.Barrier),
        "grad_floats": grads}
    phases["mpi4py"] = time.time() - began
    if world.rank == 0:
        print("SCALING " + json.dumps(result), flush=True)
    shardwise.shutdown()


# -- the driver ------------------------------------------------------------------------------------
def _run_job(ranks: int, rows: list[str], steps: int, reps: int, timeout: float, cache: bool) -> dict[str, Any]:
    from shardwise.cli.launch import build_command, find_launcher, launch_env

    env = launch_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error",
                          PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    if not cache:
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    launched = time.time()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(launched), "--rows", ",".join(rows),
               "--steps", str(steps), "--reps", str(reps)]
    argv = build_command(find_launcher(), ranks, command, env=env)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SCALING ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{ranks} ranks failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    return json.loads(lines[-1][len("SCALING "):])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_tables(results: list[dict[str, Any]], rows: list[str], cache: bool = True) -> None:
    """The header, the times and equality table, and the ratios and negotiation table."""
    from mpi4py import MPI

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"transport: mpi backend ({MPI.Get_library_version().split(',')[0].strip()}), mpirun --oversubscribe; "
          f"host {socket.gethostname()} ({cores} cores, {platform.machine()}), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {_commit()}; coordinator response cache "
          f"{'on' if cache else 'off (HOROVOD_CACHE_CAPACITY=0)'}; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    train = [r for r in rows if r != "negotiation"]
    head = ["ranks", "start-up s"] + [f"{r} step ms" for r in train]
    if "negotiation" in rows:
        head.append("named allreduce ms/request")
    head += ["mpi4py barrier ms", "mpi4py allreduce(4) ms", "equal to 1 process"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for res in results:
        cells = [str(res["ranks"]), f"{res['startup_s']:.1f}"] + [_ms(res[r]["step_s"]) for r in train]
        if "negotiation" in rows:
            cells.append(_ms(res["negotiation"]["request_s"]))
        floor = res["mpi4py"]
        equal = all(res[r]["equal"] for r in rows)
        cells += [_ms(floor["barrier_s"]), _ms(floor["allreduce4_s"]), "yes" if equal else
                  "NO: " + ",".join(r for r in rows if not res[r]["equal"])]
        print("| " + " | ".join(cells) + " |")
    head = ["ranks"] + [f"{r} step / mpi4py allreduce(grads)" for r in train]
    if "negotiation" in rows:
        head += ["request / mpi4py allreduce(4)", "coordinator rounds/request", "messages/request/rank",
                 "bytes out/request/rank", "bytes in/request/rank", "log2 N"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for res in results:
        floor = res["mpi4py"]
        cells = [str(res["ranks"])] + [f"{res[r]['step_s'] / floor['allreduce_grads_s']:.1f}" for r in train]
        if "negotiation" in rows:
            neg = res["negotiation"]
            cells += [f"{neg['request_s'] / floor['allreduce4_s']:.1f}", f"{neg['rounds']:.2f}",
                      f"{neg['messages']:.2f}", f"{neg['bytes_sent']:.0f}", f"{neg['bytes_received']:.0f}",
                      f"{math.log2(res['ranks']):.0f}"]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per row (one more untimed)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions of each request and floor")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--no-cache", action="store_true",
                        help="HOROVOD_CACHE_CAPACITY=0: the coordinator exchanges whole announcements every round")
    parser.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.steps < 1 or args.reps < 1:
        parser.error(f"--steps and --reps must be positive, got {args.steps} and {args.reps}")
    if args.worker is not None:
        worker(args.worker, rows, args.steps, args.reps)
        return 0
    bad = [n for n in args.ranks if n < 2 or ("dptp" in rows and n % 2)]
    if bad:
        parser.error(f"rank counts {bad}: at least 2, and even for the dptp row")
    results = []
    for ranks in args.ranks:
        results.append(_run_job(ranks, rows, args.steps, args.reps, args.timeout, not args.no_cache))
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in results[-1].get("phase_s", {}).items())
        print(f"# {ranks} ranks done: start-up {results[-1]['startup_s']:.1f} s, {phases}", file=sys.stderr, flush=True)
    print_tables(results, rows, not args.no_cache)
    return 0 if all(res[r]["equal"] for res in results for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
