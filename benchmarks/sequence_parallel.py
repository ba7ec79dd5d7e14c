"""Sequence parallelism at tp2: activation memory and step time against plain tensor parallelism.

    python benchmarks/sequence_parallel.py                 # Llama-style model, MPI, 2 ranks
    python benchmarks/sequence_parallel.py --family gpt2

A causal LM of ``--layers`` blocks (hidden 1024, 16 heads, sequence ``--seq-len``, a
vocabulary of 256 tokens so that the blocks dominate), ``ParallelLayout(tp=2)`` with and
without ``sequence_parallel=True``, AdamW, no activation checkpointing, on the mpi
backend (both contenders on the same transport).

* Memory: each cell is its own ``shardwise run -np 2`` job, measured like every benchmark
  here (``_peak.py``: peak resident memory above the imports, largest rank). The
  activations are the growth of the peak when the per-rank batch doubles (``--batch`` to
  ``2 x --batch``), divided by the number of blocks: the activation memory of a block.
* Time: one more job holds both models (same seed) and alternates them round by round,
  ``--steps`` timed steps each after a warm-up; the median over rounds of each, and the
  ratio sequence parallel / plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from memory import MIB, _run


def _model(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        if spec["family"] == "gpt2":
            return GPT2LMHeadModel(GPT2Config(n_layer=spec["layers"], n_embd=1024, n_head=16, vocab_size=256,
                                              n_positions=spec["seq_len"], resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0))
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=spec["layers"], hidden_size=1024,
                                            num_attention_heads=16, num_key_value_heads=16, intermediate_size=2816,
                                            vocab_size=256, max_position_embeddings=spec["seq_len"]))


def worker(spec: dict[str, Any]) -> None:
    import torch

    import shardwise
    from _peak import start_on_every_rank, status
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.layout import ParallelLayout

    torch.set_num_threads(1)
    world = shardwise.init(backend="mpi").world
    gen = torch.Generator().manual_seed(1)

    def batch(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, spec["seq_len"]), generator=gen)

    if spec["mode"] == "time":
        models = {sp: parallelize(_model(spec), torch.optim.AdamW, ParallelLayout(tp=2, sequence_parallel=sp),
                                  lr=1e-4) for sp in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for sp, pm in models.items():
            pm.train_step(batch(spec["batch"]))  # warm-up
        for _ in range(spec["rounds"]):
            for sp, pm in models.items():
                world.barrier()
                t0 = time.perf_counter()
                for _ in range(spec["steps"]):
                    pm.train_step(batch(spec["batch"]))
                times[sp].append(max(world.allgather_object((time.perf_counter() - t0) / spec["steps"])))
        if world.rank == 0:
            print("RESULT " + json.dumps({"plain": times[False], "sp": times[True]}), flush=True)
        return
    base = start_on_every_rank(world)
    pm = parallelize(_model(spec), torch.optim.AdamW, ParallelLayout(tp=2, sequence_parallel=spec["sp"]), lr=1e-4)
    for _ in range(2):
        pm.train_step(batch(spec["batch"]))
    every = world.allgather_object(status("VmHWM") - base)
    if world.rank == 0:
        print("RESULT " + json.dumps({"peak": max(every)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--family", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    base = {"family": args.family, "layers": args.layers, "seq_len": args.seq_len, "mode": "memory"}
    peak = {(sp, b): _run(2, dict(base, sp=sp, batch=b), __file__)["peak"] / MIB
            for sp in (False, True) for b in (args.batch, 2 * args.batch)}
    timing = _run(2, dict(base, mode="time", batch=args.batch, steps=args.steps, rounds=args.rounds), __file__)
    print(f"\n{args.family}-style model, {args.layers} blocks, hidden 1024, 16 heads, vocabulary 256, tp2 on 2 ranks "
          f"(mpi backend), AdamW, no activation checkpointing, {args.batch} x {args.seq_len} tokens per step; "
          "peak resident memory per rank above the imports (largest rank)\n")
    print("| layout | peak MiB | peak at 2x batch MiB | activations per block MiB | step time s (median) | "
          "per-round step times s |")
    print("|---|---|---|---|---|---|")
    act = {}
    for sp, label, key in ((False, "tp2", "plain"), (True, "tp2, sequence_parallel=True", "sp")):
        act[sp] = (peak[sp, 2 * args.batch] - peak[sp, args.batch]) / args.layers
        print(f"| {label} | {peak[sp, args.batch]:.0f} | {peak[sp, 2 * args.batch]:.0f} | {act[sp]:.1f} | "
              f"{statistics.median(timing[key]):.3f} | {' '.join(f'{t:.3f}' for t in timing[key])} |")
    ratios = sorted(s / p for s, p in zip(timing["sp"], timing["plain"]))
    print(f"\nactivations per block: plain / sequence parallel = {act[False] / act[True]:.2f}x; step time: sequence "
          f"parallel / plain = {statistics.median(timing['sp']) / statistics.median(timing['plain']):.2f}x "
          f"(per round {statistics.median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
