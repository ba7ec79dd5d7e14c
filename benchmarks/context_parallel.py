"""Context parallelism: attention memory per rank at 16k tokens, and ring vs Ulysses step time.

    python benchmarks/context_parallel.py      # launches its own `shardwise run -np N` jobs (mpi backend)

* **Attention memory.** One attention layer of the tiny Llama (4 query heads over 2
  key/value heads, head dim 16, grouped-query attention) on a ``--mem-seq`` (16384) token
  sequence, forward and backward. One process: transformers' own ``sdpa`` attention
  function (flash attention on the CPU, memory linear in the sequence) on the whole
  sequence; cp = N: shardwise's ring and Ulysses attention functions, each rank on its head
  and tail chunks. Measured the same way for both: a ``TorchDispatchMode`` counts the bytes
  of every tensor storage allocated inside the call (forward and backward, communication
  buffers included) and still alive, and keeps three figures: the forward's peak, what is
  alive after the forward (the activations kept for backward, and the output), and the
  peak over forward and backward. q, k and v are made inside the measured region (as the
  rotary embedding makes them) and dropped by the caller after the call, so they count
  while the attention keeps them (for backward, or copies of them); the output gradient is
  made before and is not counted. Independent of the allocator; scratch memory an ATen kernel
  allocates inside itself (the flash kernels' per-thread buffers) is not seen, on either side. The figure per rank is the largest rank's.
* **Step time.** The tiny Llama (hidden 64, 2 layers, 4/2 heads, vocabulary 256) trained by
  ``parallelize`` with ``ParallelLayout(dp=N, cp=N, cp_attention=...)`` (one sample of
  ``--seq-len`` tokens per step, SGD), ring and Ulysses built in one job and alternated round
  by round; median over rounds of the slowest rank's mean step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from typing import Any

from memory import _run

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class AllocationPeak:
    """Bytes of tensor storage allocated while active and still alive: ``live`` and ``peak``."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._keys: set[int] = set()
        self._mode: Any = None

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._keys.discard(key)

    def __enter__(self) -> "AllocationPeak":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    # a view allocates nothing (and may be of a tensor made before: not counted)
                    if isinstance(t, torch.Tensor) and t.device.type != "meta" and not t._is_view():
                        storage = t.untyped_storage()
                        key, nbytes = storage.data_ptr(), storage.nbytes()
                        if nbytes and key not in tracker._keys:
                            tracker._keys.add(key)
                            tracker.live += nbytes
                            tracker.peak = max(tracker.peak, tracker.live)
                            weakref.finalize(storage, tracker._free, key, nbytes)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _qkv(seq: int, positions: Any = None) -> tuple[Any, ...]:
    """q, k, v as transformers hands them to the attention function (``[b, h, s, d]`` views of the
    projections' ``[b, s, h, d]``), and the gradient of the output (``[b, s, h, d]``)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(1, seq, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(1, seq, KV_HEADS, HEAD_DIM, generator=gen)
    dout = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen)
    if positions is not None:
        q, k, v, dout = (t[:, positions].contiguous() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_().transpose(1, 2) for t in (q, k, v))
    return q, k, v, dout


class _Module:
    """What an attention function reads of its module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True
    training = True


def _attention_peak(fn: Any, seq: int, positions: Any = None) -> dict[str, int]:
    """Bytes allocated inside one attention call: the forward's peak, what is alive after it (kept for
    backward, with the output), and the peak over forward and backward."""
    import gc

    leaves = _qkv(seq, positions)
    dout = leaves[3]
    gc.collect()
    with AllocationPeak() as tracker:
        # q, k, v made inside: counted, and alive after the forward only where the attention keeps them
        q, k, v = (t.clone() for t in leaves[:3])
        out, _ = fn(_Module(), q, k, v, None, dropout=0.0, scaling=HEAD_DIM ** -0.5, is_causal=True)
        del q, k, v
        forward, kept = tracker.peak, tracker.live
        out.backward(dout)
        del out
    return {"forward": forward, "kept": kept, "peak": tracker.peak}


def worker(spec: dict[str, Any]) -> None:
    import torch

    import shardwise

    torch.set_num_threads(1)
    world = shardwise.init(backend="mpi").world
    if spec["mode"] == "one":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        peak = _attention_peak(sdpa_attention_forward, spec["seq"])
        t0 = time.perf_counter()
        _attention_peak(sdpa_attention_forward, spec["seq"])
        print("RESULT " + json.dumps(dict(peak, seconds=time.perf_counter() - t0)), flush=True)
        return
    from shardwise.adapters.torch.parallel.context import ContextParallel

    if spec["mode"] == "memory":
        result = {}
        for mode in ("ring", "ulysses"):
            context = ContextParallel(world, mode)
            positions = context.positions(spec["seq"])
            world.barrier()
            t0 = time.perf_counter()
            peak = _attention_peak(context.attention, spec["seq"], positions)
            seconds = time.perf_counter() - t0
            result[mode] = {key: max(world.allgather_object(value)) for key, value in peak.items()}
            result[mode]["seconds"] = max(world.allgather_object(seconds))
        if world.rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.layout import ParallelLayout

    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                               use_cache=False, max_position_embeddings=spec["seq"])
    models = {}
    for mode in ("ring", "ulysses"):
        torch.manual_seed(0)
        models[mode] = parallelize(AutoModelForCausalLM.from_config(cfg), torch.optim.SGD,
                                   ParallelLayout(dp=world.size, cp=world.size, cp_attention=mode), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 256, (1, spec["seq"]), generator=gen)
    for pm in models.values():
        pm.train_step(batch)  # warm-up
    times: dict[str, list[float]] = {mode: [] for mode in models}
    for _ in range(spec["rounds"]):
        for mode, pm in models.items():
            world.barrier()
            t0 = time.perf_counter()
            for _ in range(spec["steps"]):
                pm.train_step(batch)
            times[mode].append(max(world.allgather_object((time.perf_counter() - t0) / spec["steps"])))
    if world.rank == 0:
        print("RESULT " + json.dumps(times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mem-seq", type=int, default=16384, help="tokens of the attention-memory sequence")
    parser.add_argument("--mem-cp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per step of the step-time rows")
    parser.add_argument("--cp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    mib = float(1 << 20)
    one = _run(1, {"mode": "one", "seq": args.mem_seq}, __file__)
    print(f"\nAttention memory: one attention layer (4 query / 2 key-value heads, head dim 16, fp32) on "
          f"{args.mem_seq} tokens, forward + backward; peak bytes of tensors allocated inside the attention call "
          "(TorchDispatchMode, allocator-independent), largest rank; mpi backend\n")
    print("| attention | ranks | tokens per rank | forward peak MiB | kept for backward MiB | forward+backward peak MiB "
          "| peak vs one process (fwd / kept / fwd+bwd) | fwd+bwd s |")
    print("|---|---|---|---|---|---|---|---|")

    def row(label: str, ranks: int, got: dict[str, float]) -> None:
        ratios = " / ".join(f"{got[key] / one[key]:.2f}x" for key in ("forward", "kept", "peak"))
        print(f"| {label} | {ranks} | {args.mem_seq // ranks} | {got['forward'] / mib:.1f} | {got['kept'] / mib:.1f} "
              f"| {got['peak'] / mib:.1f} | {ratios} | {got['seconds']:.2f} |")

    row("one process, transformers sdpa (flash)", 1, one)
    for cp in args.mem_cp:
        got = _run(cp, {"mode": "memory", "seq": args.mem_seq}, __file__)
        for mode in ("ring", "ulysses"):
            row(f"{mode}, cp={cp}", cp, got[mode])
    print(f"\nStep time: tiny Llama (hidden 64, 2 layers, 4/2 heads, vocabulary 256), one sample of {args.seq_len} "
          f"tokens per step, ParallelLayout(dp=N, cp=N), SGD; median over {args.rounds} rounds of the slowest rank's "
          f"mean of {args.steps} steps; mpi backend, 2 cores shared by N ranks\n")
    print("| cp | ring s | Ulysses s | ring / Ulysses | per-round ratios |")
    print("|---|---|---|---|---|")
    for cp in args.cp:
        times = _run(cp, {"mode": "time", "seq": args.seq_len, "steps": args.steps, "rounds": args.rounds}, __file__)
        ratios = sorted(r / u for r, u in zip(times["ring"], times["ulysses"]))
        ring, uly = statistics.median(times["ring"]), statistics.median(times["ulysses"])
        print(f"| {cp} | {ring:.3f} | {uly:.3f} | {ring / uly:.2f}x | {' '.join(f'{r:.2f}' for r in ratios)} |")


if __name__ == "__main__":
    main()
