"""Peak memory per rank of a Mixture-of-Experts model at expert parallelism, against issue 53's bound.

    python benchmarks/moe_memory.py                    # ep4 x dp4 ZeRO-3 on 4 ranks
    python benchmarks/moe_memory.py --zero 0 --np 4    # the same without ZeRO, for comparison

A Mixtral of about 200M parameters (16 experts, top-2, 8 layers, hidden 512) is built on the
meta device and ``parallelize``d at ``ParallelLayout(dp=N, ep=N, zero_stage=3)``: each rank holds
16 / N experts, the rest (attention, router, norms, embeddings) is sharded by ZeRO-3 over the N
data-parallel ranks. Measured as every memory benchmark here (``_peak.py``, see ``memory.py``):
each rank resets its resident-set high-water mark after the imports, then builds, parallelizes
and runs 2 AdamW steps; peak = ``VmHWM`` - baseline, the largest over ranks. The activations are
measured: the same job again at twice the per-rank batch, the difference of the two peaks.
Issue 53's bound: ``1.3 x 16 B x (expert params / N + dense params / N) + activations``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import MIB, _run, train_and_report  # noqa: E402

MODEL = {"vocab_size": 16000, "hidden_size": 512, "intermediate_size": 896, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2,
         "output_router_logits": True, "router_jitter_noise": 0.0, "tie_word_embeddings": False,
         "max_position_embeddings": 1024, "use_cache": False}


def _build(meta: bool = True) -> Any:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**MODEL)
    if meta:
        with torch.device("meta"):
            return MixtralForCausalLM(cfg)
    return MixtralForCausalLM(cfg)


def counts() -> tuple[int, int]:
    """(expert parameters, all other parameters) of the model."""
    model = _build()
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return expert, sum(p.numel() for p in model.parameters()) - expert


def worker(spec: dict[str, Any]) -> None:
    """One rank: meta build, parallelize, 2 AdamW steps; rank 0 prints the peaks as JSON."""
    import torch
    from transformers import MixtralForCausalLM  # noqa: F401 - imported before the baseline

    import shardwise
    import shardwise.adapters.torch.parallel.parallelize  # noqa: F401 - imported before the baseline
    from _peak import start_on_every_rank

    torch.set_num_threads(1)
    world = shardwise.init(backend="mpi").world
    base = start_on_every_rank(world)
    torch.manual_seed(0)
    train_and_report(world, base, _build(), spec, MODEL["vocab_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, default=4, help="ranks = dp = ep")
    parser.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="samples per data-parallel rank")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    expert, dense = counts()
    n = args.np
    layout = {"dp": n, "ep": n, "zero_stage": args.zero}
    one = _run(n, {"layout": layout, "batch": args.batch, "seq_len": args.seq_len}, script=__file__)
    two = _run(n, {"layout": layout, "batch": 2 * args.batch, "seq_len": args.seq_len}, script=__file__)
    peak, act = one["peak"] / MIB, max(two["peak"] - one["peak"], 0) / MIB
    ideal = 16 * (expert / n + dense / n) / MIB
    bound = 1.3 * ideal + act
    print(f"Mixtral {(expert + dense) / 1e6:.1f}M parameters ({expert / 1e6:.1f}M in 16 experts, {dense / 1e6:.1f}M "
          f"dense), AdamW fp32, 2 steps, per-rank batch {args.batch} x {args.seq_len} tokens; peak resident memory per "
          f"rank above the imports (largest rank), MPI, {n} ranks")
    print()
    print("| layout | peak MiB | after build MiB | activations MiB | 16 B x (E/N + D/N) MiB | bound MiB "
          "| peak / bound |")
    print("|---|---|---|---|---|---|---|")
    print(f"| dp{n} x ep{n} ZeRO-{args.zero} | {peak:.0f} | {one['built'] / MIB:.0f} | {act:.0f} | {ideal:.0f} | "
          f"{bound:.0f} | {peak / bound:.2f}x |")


if __name__ == "__main__":
    main()
