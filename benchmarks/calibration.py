"""The planner's predictions against measurement: per-rank peak memory and step time per layout.

    python benchmarks/calibration.py                 # every layout at 2 and 4 ranks, then the table
    python benchmarks/calibration.py --np 2          # one rank count
    python benchmarks/calibration.py --only "tp2 sp" --only "tp2 vp v8k"   # some layouts

Each layout runs in its own ``mpirun`` job training ``examples/hf_causal_lm.py``'s
GPT-2 through ``parallelize``. Memory is measured the same way for every layout:
the process's resident-set high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` once the model is parallelized) minus the resident set
after a warm-up run of the same layout on a tiny model, with glibc returning every
large block to the system at once (``MALLOC_MMAP_THRESHOLD_``), so freed tensors
leave the resident set. The prediction is :func:`shardwise.core.cost_model.estimate`
for the same model, layout and batch, on this machine as measured: one core's
matmul rate, the allreduce bandwidth and latency of the job's ranks (medians), and
its cores as the compute units the ranks share. Every layout runs ``--rounds``
times, interleaved; the table shows medians over rounds of the largest rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# (name, layout fields[, model changes]) per rank count; micro_batches are pipeline micro-batches or
# accumulation steps. Rows named "v8k" use an 8192-token vocabulary, where the table, head and logits
# weigh enough to show vocabulary parallelism.
V8K = {"vocab": 8192}
LAYOUTS: dict[int, list[tuple]] = {
    2: [("dp2", {"dp": 2}), ("dp2 zero1", {"dp": 2, "zero_stage": 1}), ("dp2 zero3", {"dp": 2, "zero_stage": 3}),
        ("tp2", {"tp": 2}), ("pp2 m8", {"pp": 2, "micro_batches": 8}), ("pp2 m2", {"pp": 2, "micro_batches": 2}),
        ("dp2 ckpt", {"dp": 2, "activation_checkpointing": True}),
        ("tp2 sp", {"tp": 2, "sequence_parallel": True}),
        ("tp2 sp ckpt", {"tp": 2, "sequence_parallel": True, "activation_checkpointing": True}),
        ("tp2 v8k", {"tp": 2}, V8K), ("tp2 vp v8k", {"tp": 2, "vocab_parallel": True}, V8K),
        ("dp2 bf16", {"dp": 2, "precision": "bf16"})],
    4: [("dp4", {"dp": 4}), ("dp4 zero2", {"dp": 4, "zero_stage": 2}), ("dp2 tp2", {"dp": 2, "tp": 2}),
        ("dp2 pp2 m8", {"dp": 2, "pp": 2, "micro_batches": 8}),
        ("tp2 pp2 m2", {"tp": 2, "pp": 2, "micro_batches": 2}), ("pp4 m8", {"pp": 4, "micro_batches": 8}),
        ("dp4 ckpt", {"dp": 4, "activation_checkpointing": True}),
        ("dp2 pp2 zero1 m8", {"dp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 8}),
        ("dp2 pp2 zero2 m8", {"dp": 2, "pp": 2, "zero_stage": 2, "micro_batches": 8}),
        ("dp2 tp2 sp vp v8k", {"dp": 2, "tp": 2, "sequence_parallel": True, "vocab_parallel": True}, V8K)],
}
from _peak import reset_peak as _reset_peak  # noqa: E402 - the same VmHWM method as every benchmark
from _peak import status as _status  # noqa: E402

MODEL = {"layers": 8, "hidden": 256, "heads": 8, "seq_len": 256, "batch": 16, "vocab": 256}


def _matmul_rate() -> float:
    """FLOP/s of one fp32 thread on a 512 x 512 matmul (median of 5), measured with nothing else running."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    torch.mm(a, a)
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, a)
        rates.append(10 * 2 * 512 ** 3 / (time.perf_counter() - t0))
    return statistics.median(rates)


def _measure_links(world: Any) -> dict[str, float]:
    """The world's allreduce bus bandwidth (bytes/s) on 4 MiB and latency (s) on one float."""
    import torch

    buf = torch.zeros(1 << 20)
    world.allreduce(buf, "sum", inplace=True)
    t0 = time.perf_counter()
    for _ in range(5):
        world.allreduce(buf, "sum", inplace=True)
    per = (time.perf_counter() - t0) / 5
    small = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(20):
        world.allreduce(small, "sum", inplace=True)
    latency = (time.perf_counter() - t0) / 20
    n = world.size
    bandwidth = 2 * (n - 1) / n * buf.nbytes / max(per - 2 * (n - 1) * latency, 1e-9)
    rates = world.allgather_object((bandwidth, latency))
    return {"bandwidth": min(r[0] for r in rates), "latency": max(r[1] for r in rates)}


def run_one(fields: dict[str, Any], steps: int, vocab: int) -> None:
    """Under mpirun: warm up, measure this layout, print one JSON line from rank 0."""
    import torch

    import hf_causal_lm
    import shardwise
    from shardwise.core.layout import ParallelLayout
    from shardwise.core.model_spec import ModelSpec
    from shardwise.torch import parallelize

    torch.set_num_threads(1)
    world = shardwise.init().world
    layout = ParallelLayout(**fields)
    data = hf_causal_lm.corpus()
    gen = torch.Generator().manual_seed(0)
    m = MODEL

    def batch(seq: int, size: int) -> torch.Tensor:
        starts = torch.randint(0, data.numel() - seq, (size,), generator=gen).tolist()
        return torch.stack([data[s:s + seq] for s in starts])

    # warm-up: the same code paths on a tiny model, so library pages and buffers are in the baseline
    torch.manual_seed(0)
    tiny = parallelize(hf_causal_lm.build_model("gpt2", max(2, layout.pp * layout.virtual_stages), 8 * layout.tp,
                                                layout.tp, 16), torch.optim.AdamW, layout, lr=1e-3)
    for _ in range(2):
        tiny.train_step(tiny.shard_batch(batch(16, m["batch"])))
    tiny.groups.free()
    del tiny
    gc.collect()
    hardware = _measure_links(world)
    baseline = _status("VmRSS")

    torch.manual_seed(0)
    model = hf_causal_lm.build_model("gpt2", m["layers"], m["hidden"], m["heads"], m["seq_len"], vocab)
    spec = ModelSpec.from_hf_config(model.config.to_dict(), seq_len=m["seq_len"])
    pm = parallelize(model, torch.optim.AdamW, layout, lr=1e-3)
    del model
    gc.collect()
    _reset_peak()
    times = []
    for _ in range(steps):
        ids = pm.shard_batch(batch(m["seq_len"], m["batch"]))
        world.barrier()
        t0 = time.perf_counter()
        pm.train_step(ids)
        times.append(time.perf_counter() - t0)
    peak = _status("VmHWM") - baseline
    peaks = world.allgather_object(peak)
    step_times = world.allgather_object(sorted(times[1:])[len(times[1:]) // 2])
    if world.rank == 0:
        print("RESULT " + json.dumps({
            "layout": layout.to_dict(), "describe": layout.describe(), "np": world.size, "peaks": peaks,
            "step": max(step_times), "hardware": hardware, "spec": dataclasses.asdict(spec)}), flush=True)
    pm.groups.free()


def _launch(np_: int, fields: dict[str, Any], steps: int, vocab: int) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [str(Path(sys.executable).with_name("shardwise")), "run", "-np", str(np_), "--", sys.executable, __file__,
           "--run", json.dumps(fields), "--steps", str(steps), "--vocab", str(vocab)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{fields} on {np_} ranks failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def predict(run: dict[str, Any], hardware: dict[str, float], cores: int) -> Any:
    """The cost model's candidate for one measured run, on the common measured hardware."""
    from shardwise.core.cost_model import estimate
    from shardwise.core.hardware import Hardware
    from shardwise.core.model_spec import ModelSpec

    spec = dict(run["spec"])
    spec["saved_activations"] = tuple(spec["saved_activations"])
    lay, n = run["layout"], run["np"]
    hw = Hardware(num_devices=n, devices_per_node=n, memory_per_device=2 ** 40,
                  intra_node_bandwidth=hardware["bandwidth"], intra_node_latency=min(hardware["latency"], 0.5),
                  peak_flops=hardware["flops"], efficiency=1.0,
                  compute_units_per_node=cores if cores < n else None)
    m = lay["micro_batches"] if lay["pp"] > 1 else lay["gradient_accumulation_steps"]
    return estimate(ModelSpec(**spec), hw, dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], zero=lay["zero_stage"],
                    micro_batches=m, checkpointing=lay["activation_checkpointing"],
                    sequence_parallel=lay["sequence_parallel"], vocab_parallel=lay["vocab_parallel"],
                    global_batch=MODEL["batch"], optimizer="adam", precision=lay["precision"],
                    bucket_bytes=lay["bucket_bytes"])


def _concordance(pred: list[float], meas: list[float], names: list[str], margin: float) -> tuple[int, int, list]:
    """Pairs whose predicted times differ by more than ``margin``: (ordered as measured, total, the others)."""
    good, total, wrong = 0, 0, []
    for i in range(len(pred)):
        for j in range(i + 1, len(pred)):
            if abs(pred[i] - pred[j]) <= margin * min(pred[i], pred[j]):
                continue
            total += 1
            if (pred[i] < pred[j]) == (meas[i] < meas[j]):
                good += 1
            else:
                wrong.append((names[i], names[j]))
    return good, total, wrong


def table(np_: int, runs: dict[str, list[dict[str, Any]]], cores: int, flops: float) -> None:
    """Print one rank count's table (medians over rounds) and the step-time order check."""
    hw_runs = [r["hardware"] for rs in runs.values() for r in rs]
    hardware = {k: statistics.median(h[k] for h in hw_runs) for k in ("bandwidth", "latency")}
    hardware["flops"] = flops
    print(f"\n{np_} ranks on {cores} cores; hardware (medians): {hardware['flops'] / 1e9:.1f} GFLOP/s per rank, "
          f"allreduce {hardware['bandwidth'] / 1e9:.2f} GB/s, latency {hardware['latency'] * 1e6:.0f} us\n"
          "| layout | predicted peak MiB | measured peak MiB | error | predicted step s | measured step s |\n"
          "|---|---|---|---|---|---|")
    names, pred, meas = [], [], []
    for name, rs in runs.items():
        cand = predict(rs[0], hardware, cores)
        peak = statistics.median(max(r["peaks"]) for r in rs)
        step = statistics.median(r["step"] for r in rs)
        names.append(name)
        pred.append(cand.step_time)
        meas.append(step)
        vocab = rs[0]["spec"]["vocab_size"]
        label = rs[0]["describe"] + (f" (vocab {vocab})" if vocab != MODEL["vocab"] else "")
        print(f"| {label} | {cand.memory.total / 2**20:.1f} | {peak / 2**20:.1f} | "
              f"{cand.memory.total / peak - 1:+.1%} | {cand.step_time:.2f} | {step:.2f} |")
    print(f"predicted order: {[names[i] for i in _order(pred)]}")
    print(f"measured order:  {[names[i] for i in _order(meas)]}")
    for margin in (0.0, 0.1):
        good, total, wrong = _concordance(pred, meas, names, margin)
        print(f"pairs predicted more than {margin:.0%} apart: {good}/{total} ordered as measured"
              + (f"; not: {wrong}" if wrong else ""))


def _order(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=values.__getitem__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, action="append", help="rank counts (default 2 and 4)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (the first is not counted)")
    p.add_argument("--rounds", type=int, default=2, help="runs of every layout, interleaved")
    p.add_argument("--only", action="append", help="run only this layout (by name; repeatable)")
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=MODEL["vocab"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        run_one(json.loads(args.run), args.steps, args.vocab)
        return
    cores = len(os.sched_getaffinity(0))
    flops = _matmul_rate()
    print(f"model: GPT-2 {MODEL['layers']} layers x {MODEL['hidden']}, {MODEL['heads']} heads, seq {MODEL['seq_len']}, "
          f"vocab {MODEL['vocab']} (8192 in the v8k rows), global batch {MODEL['batch']}, AdamW, fp32 unless the "
          f"row says bf16; {args.rounds} rounds x {args.steps} steps")
    for np_ in args.np or [2, 4]:
        rows = [(row[0], row[1], {**MODEL, **(row[2] if len(row) > 2 else {})}) for row in LAYOUTS[np_]
                if not args.only or row[0] in args.only]
        if not rows:
            continue
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in rows}
        for _ in range(args.rounds):
            for name, fields, model in rows:
                runs[name].append(_launch(np_, fields, args.steps, model["vocab"]))
        table(np_, runs, cores, flops)


if __name__ == "__main__":
    main()
