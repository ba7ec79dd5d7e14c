"""ZeRO-3 peak memory per rank with the process's own allocator, against FSDP2 on the same model and ranks.

    python benchmarks/zero3_allocator.py                 # 8 ranks, both allocators, both libraries
    python benchmarks/zero3_allocator.py --np 4 --rows shardwise

The model of issue 55: GPT-2 with n_embd 1024, 12 layers, 16 heads, GPT-2's vocabulary and its
token table tied to the head, built on the meta device; 2 AdamW steps of a causal-LM loss on
``--batch`` x ``--seq-len`` tokens per rank with activation checkpointing (each transformer block
recomputed in backward, as ``benchmarks/memory.py`` runs), under ``shardwise run -np N`` (MPI
launch). Rows:

* ``shardwise``: ``parallelize(model, AdamW, ParallelLayout(dp=N, zero_stage=3))`` on the mpi backend;
* ``FSDP2``: ``fully_shard`` on every transformer block and the root over a gloo group of the same
  ranks (``shardwise.init(backend="torch")`` makes it), ``to_empty`` then HF's own initialisation.

Each row runs with glibc's **default** allocator settings (what a training process has), and again
with the 64 KiB mmap threshold the other memory benchmarks set (``_peak.return_freed_memory``):
freed blocks of 64 KiB or more go back to the system at once, so that peak is what the tensors
alive at one time need. Every rank imports torch, transformers and shardwise and starts its
backend before the baseline; peak = ``VmHWM`` - baseline (``VmRSS`` after a barrier), the largest
rank's. The activations of a contender are measured as ``benchmarks/memory.py`` does, with the
64 KiB threshold: the same job with twice the batch, the difference of the peaks.

Floor (issue 55): the sharded model state, 16 B x P / N, plus what ZeRO-3 holds whole while it runs:
two units' parameters (one in use, one prefetched) and one unit's gradient, of the largest units.
The target: peak <= 1.15 x (floor + activations), and below the whole fp32 model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory import _run as _run_job  # noqa: E402 - one `shardwise run -np N` job, its rank 0's RESULT

ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
MODEL = {"n_layer": 12, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 1024,
         "tie_word_embeddings": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(**MODEL)


def worker(spec: dict[str, Any]) -> None:
    """One rank of one row; rank 0 prints ``RESULT {peak, loss}``."""
    import torch
    from transformers import GPT2LMHeadModel  # before the baseline: its lazy import is ~130 MiB

    import shardwise
    import shardwise.adapters.torch.parallel.parallelize  # noqa: F401 - imported before the baseline
    from _peak import reset_peak, return_freed_memory, status

    torch.set_num_threads(1)
    world = shardwise.init(backend="torch" if spec["row"] == "FSDP2" else "mpi").world
    if spec["allocator"] == "mmap64k":
        return_freed_memory()
    import gc

    gc.collect()
    world.barrier()
    reset_peak()
    base = status("VmRSS")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(_config())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, MODEL["vocab_size"], (spec["batch"] * world.size, spec["seq_len"]), generator=gen)
               for _ in range(2)]
    losses = _shardwise(model, batches, world) if spec["row"] == "shardwise" else _fsdp2(model, batches, world)
    peak = status("VmHWM") - base
    every = world.allgather_object((peak, _heap()))
    if world.rank == 0:
        worst = max(every)
        print("RESULT " + json.dumps({"peak": worst[0], "heap": worst[1], "losses": losses}), flush=True)


def _heap() -> dict[str, int]:
    """glibc's ``mallinfo2`` after the steps: heap bytes in use and free (kept, not returned), mmapped bytes."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"in_use": info.uordblks, "free_kept": info.fordblks, "mmapped": info.hblkhd}


def _shardwise(model: Any, batches: list, world: Any) -> list[float]:
    import torch

    from shardwise.torch import ParallelLayout, parallelize

    pm = parallelize(model, torch.optim.AdamW,
                     ParallelLayout(dp=world.size, zero_stage=3, activation_checkpointing=True), lr=1e-4)
    return [pm.train_step(pm.shard_batch(ids)) for ids in batches]


def _fsdp2(model: Any, batches: list, world: Any) -> list[float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world.size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.apply(model._init_weights)  # HF's own initialisation, on each rank's shards
        model.tie_weights()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for ids in batches:
        mine = ids.chunk(world.size)[world.rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor([float(loss.detach())])
        torch.distributed.all_reduce(total)
        losses.append(float(total[0]) / world.size)
    return losses


def _sizes() -> tuple[int, int, int]:
    """Parameters, the largest transformer block's and the token table's (elements)."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(_config())
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    return sum(p.numel() for p in model.parameters()), block, model.transformer.wte.weight.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="samples per rank")
    parser.add_argument("--rows", nargs="*", default=["shardwise", "FSDP2"], choices=["shardwise", "FSDP2"])
    parser.add_argument("--allocators", nargs="*", default=["default", "mmap64k"], choices=["default", "mmap64k"])
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    params, block, table = _sizes()
    n = args.np
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # the default allocator: no override from outside either

    def _run(np_: int, spec: dict[str, Any]) -> dict[str, Any]:
        return _run_job(np_, spec, __file__)

    model_mib = 4 * params / MIB
    states = 16 * params / n / MIB
    floor_blocks = states + 3 * 4 * block / MIB  # two blocks' parameters and one block's gradient
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    results = []
    activations: dict[str, float] = {}
    for row in args.rows:
        twice = _run(n, {"row": row, "allocator": "mmap64k", "seq_len": args.seq_len, "batch": 2 * args.batch})
        for allocator in args.allocators:
            one = _run(n, {"row": row, "allocator": allocator, "seq_len": args.seq_len, "batch": args.batch})
            if allocator == "mmap64k" or row not in activations:
                activations[row] = max(twice["peak"] - one["peak"], 0) / MIB
            results.append((row, allocator, one["peak"] / MIB, one["losses"]))
            print(f"{row} {allocator}: peak {one['peak'] / MIB:.0f} MiB, losses {one['losses']}", flush=True)
    results = [(row, allocator, peak, activations[row], losses) for row, allocator, peak, losses in results]
    print()
    print(f"# ZeRO-3 peak per rank, GPT-2 {params / 1e6:.1f}M (n_embd {MODEL['n_embd']}, {MODEL['n_layer']} layers, "
          f"tied head; fp32 model {model_mib:.0f} MiB; block {4 * block / MIB:.0f} MiB, token table "
          f"{4 * table / MIB:.0f} MiB), meta build, {n} ranks (MPI launch; FSDP2 on gloo), AdamW, 2 steps, "
          f"{args.batch} x {args.seq_len} tokens per rank; commit {commit}")
    print(f"# floor = 16 B x P / N ({states:.0f} MiB) + two blocks' parameters + one block's gradient = "
          f"{floor_blocks:.0f} MiB; bound = 1.15 x (floor + activations)")
    print()
    print("| contender | allocator | peak MiB | activations MiB | bound MiB | peak / bound | peak / fp32 model |"
          " vs FSDP2 (same allocator) |")
    print("|---|---|---|---|---|---|---|---|")
    fsdp = {a: p for r, a, p, _, _ in results if r == "FSDP2"}
    for row, allocator, peak, act, _ in results:
        bound = 1.15 * (floor_blocks + act)
        ratio = f"{peak / fsdp[allocator]:.2f}x" if allocator in fsdp and row != "FSDP2" else "-"
        print(f"| {row} | {allocator} | {peak:.0f} | {act:.0f} | {bound:.0f} | {peak / bound:.2f}x | "
              f"{peak / model_mib:.2f}x | {ratio} |")


if __name__ == "__main__":
    main()
