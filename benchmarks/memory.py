"""Peak memory per rank of a model bigger than one rank: ZeRO-3 on a meta-built GPT-2, and pretrained loads.

    python benchmarks/memory.py                      # N = 2, 4, 8 and the two weight loads
    python benchmarks/memory.py --np 2 --no-weights  # one rank count

Each row is its own ``shardwise run -np N`` job. Each rank imports torch, transformers
and shardwise, starts the backend (MPI), makes glibc hand every freed block of 64 KiB
or more back at once (``_peak.return_freed_memory``), resets its resident-set
high-water mark, and takes its resident set as the baseline; then it builds the
model, ``parallelize``s it and runs 2 AdamW steps; peak = ``VmHWM`` - baseline, the
largest over ranks. The same way as every benchmark here (``_peak.py``).

* ``meta``: the model is built under ``torch.device("meta")`` and each rank
  materializes its ZeRO-3 partition one unit at a time, from the replayed
  initialisation (:mod:`shardwise.adapters.torch.parallel.init_replay`).
* ``eager``: the model is built normally on every rank, then parallelized (how
  ``parallelize`` worked before meta builds): the peak the issue reported.
* ``weights``: a meta build loading a ``save_pretrained`` directory of the model.

The activations of a row are measured, not modelled: the same job is run again with
twice the per-rank batch, and the difference of the two peaks is the memory that
grows with the batch, i.e. the activations (and logits) of one batch. The bound of
issue 36 is ``1.3 x (16 bytes x parameters / N) + activations``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
#: GPT-2 small with untied input and output embeddings: 163M parameters, 622 MiB in fp32.
MODEL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
         "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(**MODEL)


def worker(spec: dict[str, Any]) -> None:
    """One rank of one row: build, parallelize, 2 AdamW steps; rank 0 prints the peaks as JSON."""
    import torch
    from transformers import GPT2LMHeadModel  # before the baseline: its lazy import is ~130 MiB

    import shardwise
    import shardwise.adapters.torch.parallel.parallelize  # noqa: F401 - imported before the baseline
    from _peak import start_on_every_rank

    torch.set_num_threads(1)
    world = shardwise.init(backend="mpi").world
    base = start_on_every_rank(world)
    torch.manual_seed(0)
    if spec["build"] == "eager":
        model = GPT2LMHeadModel(_config())
    else:
        with torch.device("meta"):
            model = GPT2LMHeadModel(_config())
    train_and_report(world, base, model, spec, MODEL["vocab_size"])


def train_and_report(world: Any, base: int, model: Any, spec: dict[str, Any], vocab: int) -> None:
    """``parallelize`` ``model`` at ``spec["layout"]`` (``weights=spec.get("weights")``), 2 AdamW steps;
    rank 0 prints the peaks above ``base`` (the largest rank's, after the build and after the steps)."""
    import torch

    from _peak import status
    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.layout import ParallelLayout

    pm = parallelize(model, torch.optim.AdamW, ParallelLayout(**spec["layout"]), weights=spec.get("weights"),
                     lr=1e-4)
    del model
    built = status("VmHWM") - base
    gen = torch.Generator().manual_seed(1)
    dp = pm.groups.dp.size
    for _ in range(2):
        ids = torch.randint(0, vocab, (spec["batch"] * dp, spec["seq_len"]), generator=gen)
        pm.train_step(pm.shard_batch(ids))
    peak = status("VmHWM") - base
    every = world.allgather_object((peak, built))
    if world.rank == 0:
        print("RESULT " + json.dumps({"peak": max(p for p, _ in every), "built": max(b for _, b in every)}),
              flush=True)


def _run(np_: int, spec: dict[str, Any], script: str = __file__) -> dict[str, int]:
    """``script --worker SPEC`` on ``np_`` ranks; the JSON its rank 0 printed after ``RESULT``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    cmd = [str(Path(sys.executable).with_name("shardwise")), "run", "-np", str(np_), "--", sys.executable, script,
           "--worker", json.dumps(spec)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{np_} ranks {spec}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _save_weights(directory: Path) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(_config()).save_pretrained(str(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--np", type=int, nargs="*", default=[2, 4, 8],
                        help="rank counts of the ZeRO-3 rows (none: only the pretrained-weights rows)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="samples per data-parallel rank")
    parser.add_argument("--no-eager", action="store_true", help="skip the rows that build the model on every rank")
    parser.add_argument("--no-weights", action="store_true", help="skip the pretrained-weights rows")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    from transformers import GPT2LMHeadModel

    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT2LMHeadModel(_config()).parameters())
    model_mib = 4 * params / MIB
    rows: list[tuple[str, int, dict, dict, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        plans: list[tuple[str, int, dict[str, Any]]] = []
        for n in args.np:
            plans.append(("meta, ZeRO-3", n, {"build": "meta", "layout": {"dp": n, "zero_stage": 3}}))
            if not args.no_eager:
                plans.append(("eager, ZeRO-3", n, {"build": "eager", "layout": {"dp": n, "zero_stage": 3}}))
        if not args.no_weights:
            weights = str(Path(tmp) / "gpt2")
            _save_weights(Path(weights))
            plans.append(("weights, dp4 ZeRO-3", 4, {"build": "meta", "weights": weights,
                                                      "layout": {"dp": 4, "zero_stage": 3}}))
            plans.append(("weights, tp2 x pp2", 4, {"build": "meta", "weights": weights,
                                                     "layout": {"tp": 2, "pp": 2, "micro_batches": 2}}))
        for label, n, spec in plans:
            layout = dict(spec["layout"], activation_checkpointing=True)
            batch = args.batch * layout.get("micro_batches", 1)  # a pipeline needs a sample per micro-batch
            one = _run(n, dict(spec, layout=layout, batch=batch, seq_len=args.seq_len))
            two = _run(n, dict(spec, layout=layout, batch=2 * batch, seq_len=args.seq_len))
            zero3 = layout.get("zero_stage") == 3
            ideal = 16 * params / n / MIB if zero3 else float("nan")
            rows.append((label, n, one, two, ideal))
            print(f"{label} N={n}: peak {one['peak'] / MIB:.1f} MiB (2x batch {two['peak'] / MIB:.1f})", flush=True)
    print()
    print(f"GPT-2 {params / 1e6:.1f}M parameters ({model_mib:.0f} MiB fp32), AdamW, 2 steps, per-rank batch "
          f"{args.batch} x {args.seq_len} tokens per micro-batch, activation checkpointing; peak resident memory "
          "per rank above the imports (largest rank), MPI")
    print()
    print("| build | N | peak MiB | after build MiB | x fp32 model | activations MiB | 16 B x P / N MiB "
          "| bound 1.3 x ideal + act. MiB | peak / bound | (peak - ideal) / model |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, n, one, two, ideal in rows:
        peak, act = one["peak"] / MIB, max(two["peak"] - one["peak"], 0) / MIB
        bound = 1.3 * ideal + act
        cells = [label, str(n), f"{peak:.0f}", f"{one['built'] / MIB:.0f}", f"{peak / model_mib:.2f}x", f"{act:.0f}"]
        if ideal == ideal:  # not NaN: a ZeRO-3 row
            cells += [f"{ideal:.0f}", f"{bound:.0f}", f"{peak / bound:.2f}x", f"{(peak - ideal) / model_mib:.2f}x"]
        else:
            cells += ["-", "-", "-", "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
