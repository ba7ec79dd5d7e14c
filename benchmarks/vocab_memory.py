"""Peak memory per rank of the vocabulary part of a GPT-2 at tp2: replicated vs split by vocabulary.

    python benchmarks/vocab_memory.py            # 32k vocabulary, tp2, 2 ranks
    python benchmarks/vocab_memory.py --vocab 50257 --seq-len 512

A GPT-2 (tied embedding, ``--layers`` blocks of hidden 768) at ``ParallelLayout(tp=2)``,
built on the meta device, AdamW, 2 steps of ``--batch`` x ``--seq-len`` tokens. Each row
is its own ``shardwise run -np 2`` job, measured like every benchmark here (``_peak.py``:
peak resident memory above the imports, largest rank). The memory of the vocabulary
(token table, LM head, their gradients and AdamW state, the logits and their gradient) is
the peak of the model with the real vocabulary minus the peak of the same model with a
vocabulary of 64 tokens, once with the table and head replicated on both tp ranks and
once with ``vocab_parallel=True``. Issue 37 asks for at most 0.55x.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from memory import MIB, _run


def worker(spec: dict[str, Any]) -> None:
    """One rank of one row: build, parallelize, 2 AdamW steps; rank 0 prints the peak as JSON."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import shardwise
    from _peak import start_on_every_rank, status
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.layout import ParallelLayout

    torch.set_num_threads(1)
    world = shardwise.init(backend="mpi").world
    base = start_on_every_rank(world)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=spec["layers"], n_embd=768, n_head=12, vocab_size=spec["vocab"],
                     n_positions=spec["seq_len"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    pm = parallelize(model, torch.optim.AdamW, ParallelLayout(tp=2, vocab_parallel=spec["vocab_parallel"]), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        pm.train_step(torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=gen))
    peak = status("VmHWM") - base
    every = world.allgather_object(peak)
    if world.rank == 0:
        print("RESULT " + json.dumps({"peak": max(every)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    base = {"layers": args.layers, "seq_len": args.seq_len, "batch": args.batch}
    peaks: dict[tuple[bool, int], float] = {}
    for split in (False, True):
        for vocab in (64, args.vocab):
            peaks[split, vocab] = _run(2, dict(base, vocab=vocab, vocab_parallel=split), __file__)["peak"] / MIB
            print(f"vocab_parallel={split} vocab {vocab}: peak {peaks[split, vocab]:.1f} MiB", flush=True)
    table = 4 * args.vocab * 768 / MIB
    logits = 4 * args.batch * args.seq_len * args.vocab / MIB
    print(f"\nGPT-2 {args.layers} blocks, hidden 768, tied embedding of {args.vocab} tokens ({table:.0f} MiB fp32; one "
          f"fp32 copy of the logits of a step: {logits:.0f} MiB), tp2 on 2 ranks, AdamW, 2 steps of {args.batch} x "
          f"{args.seq_len} tokens; peak resident memory per rank above the imports (largest rank), MPI\n")
    print("| layout | peak MiB | peak with a 64-token vocabulary MiB | vocabulary part MiB | vs replicated |")
    print("|---|---|---|---|---|")
    part = {split: peaks[split, args.vocab] - peaks[split, 64] for split in (False, True)}
    for split, label in ((False, "tp2, table and head replicated"), (True, "tp2, vocab_parallel=True")):
        print(f"| {label} | {peaks[split, args.vocab]:.0f} | {peaks[split, 64]:.0f} | {part[split]:.0f} | "
              f"{part[split] / part[False]:.2f}x |")


if __name__ == "__main__":
    main()
