"""Saves that do not stop training: shardwise ``async_save=True`` vs torch DCP ``async_save``, one gloo group.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/checkpoint_async.py
Quick try:       shardwise run -np 2 -- python benchmarks/checkpoint_async.py --layers 1 --hidden 64 \
                     --vocab 512 --rounds 1

One model state, two libraries, the same default gloo process group (the one
``shardwise.init(backend="torch")`` creates), as ``checkpoint.py`` builds them:

* shardwise: a GPT-2 (default n_layer=12, n_embd=1024, n_head=16, vocabulary 10752, tied head:
  163.2M parameters) built on the meta device, ``parallelize(..., AdamW,
  ParallelLayout(dp=2, zero_stage=3))``. Async save = ``pm.save_checkpoint(dir, step,
  async_save=True)`` (planning, then a copy of the rank's pieces into host buffers kept across
  saves; a background thread writes, hashes and fsyncs the rank's file and commits over a gloo
  group of its own), finished with ``handle.wait()``.
* torch DCP: the same GPT-2 built normally after the same seed, FSDP2 ``fully_shard`` on every
  block and the root, AdamW. Async save = ``get_state_dict`` + ``dcp.async_save(...,
  process_group=<a gloo group of its own>)`` in its default thread mode (staging: a copy of the
  state dict to CPU, then ``dcp.save`` on a background thread; a separate gloo group as
  torchtitan's ``async_mode="async"`` gives it), finished with ``future.result()``.

Before timing: each library's async round trip is checked once (async save, a training step while
it is in flight, wait, load: every local shard and optimizer state tensor must be back to its value
at the save call, bit for bit), and then the peak memory of a sync and of an async save (save
and wait, no training step) is measured per rank, the same way for both: glibc set to hand freed
blocks back at once, high-water mark reset, peak ``VmHWM`` minus the ``VmRSS`` before the save
(largest rank); the async figures start before each library's first async save, so they include
shardwise's staging buffers, which stay allocated afterwards ("held after").

Timing, ``--rounds`` interleaved rounds; in each: shardwise sync save, DCP sync save, shardwise
load, DCP load (as ``checkpoint.py``); ``--steps`` training steps of each library with no save in
flight; then, for each library (the order alternating by round), an async save followed by
training steps until the save is done on every rank (at most ``--steps``; the ranks agree after
each step) and the wait. Figures: every operation's and every step's time is the
slowest rank's (a barrier before each); (a) blocking time = the async save call; (b) step-time
slowdown = median time of the steps that started while that library's save was in flight (on
every rank) / median step time with no save in flight, each library against its own steps; and
the training time a save costs in all: the call, plus the steps after it and the final wait,
minus as many steps with no save; (c) sync save and load time as in ``checkpoint.py``. Medians
over rounds (steps: over all rounds' steps).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

warnings.filterwarnings("ignore", message=r".*(is deprecated|TypedStorage).*")

from _common import init_gloo, paired_ratios  # noqa: E402
from _peak import reset_peak, restore_allocator, return_freed_memory, status  # noqa: E402
from checkpoint import (build_fsdp2, build_shardwise, check_round_trip, dcp_load, dcp_save, dir_bytes,  # noqa: E402
                        fs_type, fsdp2_snapshot, shardwise_snapshot, timed)

SW, DCP = "shardwise", "torch DCP"


def gpt2_config(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                      n_positions=args.positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      use_cache=False, bos_token_id=0, eos_token_id=0)


class DcpAsync:
    """DCP's async save on a gloo group of its own (made once), thread mode."""

    def __init__(self, model: Any, opt: Any) -> None:
        import torch.distributed as dist

        self.model, self.opt = model, opt
        self.pg = dist.new_group(backend="gloo")

    def start(self, path: Path) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=self.pg)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def peak_of(world: Any, fn: Callable[[], Any]) -> tuple[int, int]:
    """This rank's peak resident memory above the resident set before ``fn``, and what stays after."""
    gc.collect()
    return_freed_memory()
    world.barrier()
    reset_peak()
    base = status("VmRSS")
    fn()
    world.barrier()
    peak = status("VmHWM") - base
    gc.collect()
    return peak, status("VmRSS") - base


def in_flight_steps(world: Any, step: Callable[[], Any], steps: int, done: Callable[[], bool],
                    finish: Callable[[], Any]) -> tuple[list[float], list[bool], float]:
    """Timed training steps after a save call, until the save is done on every rank (at most ``steps``),
    whether the save was in flight at the start of each (this rank), then the time ``finish()`` (the
    wait) takes."""
    times, flying = [], []
    for _ in range(steps):
        flying.append(not done())
        times.append(timed(world, step)[0])
        if all(world.allgather_object(done())):
            break
    rest = timed(world, finish)[0]
    return times, flying, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=10752)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample of a training step")
    parser.add_argument("--batch", type=int, default=1, help="samples per rank of a training step")
    parser.add_argument("--steps", type=int, default=2, help="training steps per round with no save in flight, "
                        "and at most after each async save call (fewer once it is done on every rank)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(), help="where both write their checkpoints")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = init_gloo()
    rank = world.rank
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = gpt2_config(args)
    batch = torch.randint(args.vocab, (args.batch * world.size, args.seq),
                          generator=torch.Generator().manual_seed(1234))
    pm = build_shardwise(cfg, world, batch)
    model, opt, fsdp_step = build_fsdp2(cfg, world, batch)
    n_params = sum(p.numel() for p in model.parameters())
    dcp_async = DcpAsync(model, opt)

    def sw_step() -> None:
        pm.train_step(pm.shard_batch(batch))

    root = Path(world.broadcast_object(tempfile.mkdtemp(prefix="shardwise-async-bench-", dir=args.tmpdir)
                                       if rank == 0 else None))
    if rank == 0:
        load = os.getloadavg()
        print(f"# Async checkpoint save, transport: gloo (one default process group; each library's background "
              f"save on a gloo group of its own), {world.size} ranks, {torch.get_num_threads()} thread(s)/rank, "
              f"torch {torch.__version__}, transformers {transformers.__version__}; GPT-2 n_layer={args.layers} "
              f"n_embd={args.hidden} n_head={args.heads} vocab {args.vocab} n_positions {args.positions} (tied head), "
              f"{n_params / 1e6:.1f}M params, AdamW fp32; shardwise dp{world.size} ZeRO-3 vs FSDP2; training steps "
              f"of {args.batch}x{args.seq} tokens/rank; checkpoints under {args.tmpdir} ({fs_type(args.tmpdir)}); "
              f"{args.rounds} rounds x {args.steps} steps; load average at start {load[0]:.2f} {load[1]:.2f} "
              f"{load[2]:.2f}")
        sys.stdout.flush()
    step_no = 1
    try:
        # --- correctness of the async round trips (also takes first-time costs off the timing)
        saved: dict[str, Any] = {}
        lines = [check_round_trip(
            "shardwise async", world, lambda: shardwise_snapshot(pm),
            lambda: saved.__setitem__("a", pm.save_checkpoint(root / "check-sw", step_no, async_save=True)),
            lambda: (sw_step(), saved["a"].wait()),
            lambda: pm.load_checkpoint(saved["a"].path))]
        lines.append(check_round_trip(
            "torch DCP async", world, lambda: fsdp2_snapshot(model, opt),
            lambda: saved.__setitem__("b", dcp_async.start(root / "check-dcp")),
            lambda: (fsdp_step(), saved["b"].result()),
            lambda: dcp_load(model, opt, root / "check-dcp")))
        if rank == 0:
            print("\n".join(f"# check: {line}" for line in lines))
            print(f"# shardwise background commit: {pm.checkpoint_saver.mode}")
            sys.stdout.flush()
            for old in ("check-sw", "check-dcp"):
                shutil.rmtree(root / old, ignore_errors=True)

        # --- peak memory of a save, the same way for both (largest rank)
        pm.checkpoint_saver.staging.release()  # the async figures include making the staging buffers
        memory: dict[str, tuple[int, int]] = {}
        memory[f"{SW} sync"] = peak_of(world, lambda: pm.save_checkpoint(root / "mem-sw-sync", step_no))
        memory[f"{DCP} sync"] = peak_of(world, lambda: dcp_save(model, opt, root / "mem-dcp-sync"))
        memory[f"{SW} async"] = peak_of(world, lambda: pm.save_checkpoint(root / "mem-sw-async", step_no,
                                                                          async_save=True).wait())
        memory[f"{DCP} async"] = peak_of(world, lambda: dcp_async.start(root / "mem-dcp-async").result())
        gathered = world.allgather_object(memory)
        memory = {k: (max(g[k][0] for g in gathered), max(g[k][1] for g in gathered)) for k in memory}
        restore_allocator()
        world.barrier()
        if rank == 0:
            for old in ("mem-sw-sync", "mem-dcp-sync", "mem-sw-async", "mem-dcp-async"):
                shutil.rmtree(root / old, ignore_errors=True)

        # --- timing
        ops: dict[str, list[float]] = {k: [] for k in ("sw_sync", "dcp_sync", "sw_load", "dcp_load",
                                                      "sw_block", "dcp_block", "sw_rest", "dcp_rest")}
        steps: dict[str, list[tuple[float, bool]]] = {"sw_idle": [], "dcp_idle": [], "sw_fly": [], "dcp_fly": []}
        written: dict[str, int] = {}
        after: dict[str, list[list[float]]] = {"sw": [], "dcp": []}
        for r in range(args.rounds):
            dirs = {k: root / f"{k}-{r}" for k in ("sw-sync", "dcp-sync", "sw-async", "dcp-async")}
            out: dict[str, Any] = {}
            ops["sw_sync"].append(timed(world, lambda: out.__setitem__("a", pm.save_checkpoint(dirs["sw-sync"],
                                                                                               step_no)))[0])
            ops["dcp_sync"].append(timed(world, lambda: dcp_save(model, opt, dirs["dcp-sync"]))[0])
            ops["sw_load"].append(timed(world, lambda: pm.load_checkpoint(out["a"]))[0])
            ops["dcp_load"].append(timed(world, lambda: dcp_load(model, opt, dirs["dcp-sync"]))[0])
            for _ in range(args.steps):
                steps["sw_idle"].append((timed(world, sw_step)[0], False))
            for _ in range(args.steps):
                steps["dcp_idle"].append((timed(world, fsdp_step)[0], False))
            order = ("sw", "dcp") if r % 2 == 0 else ("dcp", "sw")
            for side in order:
                if side == "sw":
                    block = timed(world, lambda: out.__setitem__(
                        "h", pm.save_checkpoint(dirs["sw-async"], step_no, async_save=True)))[0]
                    times, flying, rest = in_flight_steps(world, sw_step, args.steps, out["h"].done, out["h"].wait)
                else:
                    block = timed(world, lambda: out.__setitem__("f", dcp_async.start(dirs["dcp-async"])))[0]
                    times, flying, rest = in_flight_steps(world, fsdp_step, args.steps, out["f"].done,
                                                          out["f"].result)
                ops[f"{side}_block"].append(block)
                ops[f"{side}_rest"].append(rest)
                steps[f"{side}_fly"] += list(zip(times, flying))
                after[side].append(times)
            world.barrier()
            if rank == 0:
                for k in ("sw-sync", "dcp-sync", "sw-async", "dcp-async"):
                    written[k] = dir_bytes(dirs[k])
                for d in dirs.values():
                    shutil.rmtree(d, ignore_errors=True)
            world.barrier()
        every = world.allgather_object((ops, steps, after))
        if rank == 0:
            report(args, n_params, every, memory, written)
            sys.stdout.flush()
    finally:
        world.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    pm.groups.free()
    import shardwise

    shardwise.shutdown()


def report(args: argparse.Namespace, n_params: int, every: list, memory: dict[str, tuple[int, int]],
           written: dict[str, int]) -> None:
    """Print the tables (rank 0): slowest rank per operation and per step."""
    ops = {k: [max(rk[0][k][i] for rk in every) for i in range(args.rounds)] for k in every[0][0]}
    steps: dict[str, list[float]] = {}
    for k in every[0][1]:
        n = len(every[0][1][k])
        # a step counts as "in flight" when the save was running at its start on every rank
        steps[k] = [max(rk[1][k][i][0] for rk in every) for i in range(n)
                    if k.endswith("idle") or all(rk[1][k][i][1] for rk in every)]
    steps_after = {}  # per round, the steps after its async save call, slowest rank, in flight or not
    for side in ("sw", "dcp"):
        steps_after[side] = [[max(rk[2][side][r][i] for rk in every) for i in range(len(every[0][2][side][r]))]
                             for r in range(args.rounds)]
    med = statistics.median
    print(f"\n## GPT-2 {n_params / 1e6:.1f}M params + AdamW state, dp2 ZeRO-3 (shardwise) vs FSDP2 (DCP), "
          f"2 ranks - transport: gloo")
    print("| measure | shardwise | torch DCP | shardwise / DCP | per-round ratio: median (range), rounds lower |")
    print("|---|---|---|---|---|")

    def row(label: str, a: str, b: str) -> None:
        x, y = ops[a], ops[b]
        if med(y) < 1e-3:  # nothing left to wait for: no ratio
            print(f"| {label} | {med(x):.3f} s | {med(y):.3f} s | | |")
            return
        print(f"| {label} | {med(x):.3f} s | {med(y):.3f} s | {med(x) / med(y):.2f}x | {paired_ratios(x, y)} |")

    row("(a) async save: training blocked (the save call)", "sw_block", "dcp_block")
    row("async save: rest of the wait after the steps", "sw_rest", "dcp_rest")
    row("(c) sync save", "sw_sync", "dcp_sync")
    row("(c) load", "sw_load", "dcp_load")
    sw_idle, dcp_idle = med(steps["sw_idle"]), med(steps["dcp_idle"])
    sw_fly = med(steps["sw_fly"]) if steps["sw_fly"] else float("nan")
    dcp_fly = med(steps["dcp_fly"]) if steps["dcp_fly"] else float("nan")
    print(f"| training step, no save in flight | {sw_idle:.3f} s | {dcp_idle:.3f} s | {sw_idle / dcp_idle:.2f}x | |")
    print(f"| training step, save in flight ({len(steps['sw_fly'])} / {len(steps['dcp_fly'])} steps) | "
          f"{sw_fly:.3f} s | {dcp_fly:.3f} s | {sw_fly / dcp_fly:.2f}x | |")
    sw_slow, dcp_slow = sw_fly / sw_idle, dcp_fly / dcp_idle
    print(f"| (b) step slowdown while a save is in flight (in flight / none) | {sw_slow:.2f}x | {dcp_slow:.2f}x | "
          f"{sw_slow / dcp_slow:.2f}x | |")
    lost = {}
    for side, idle in (("sw", sw_idle), ("dcp", dcp_idle)):
        lost[side] = [b + sum(after) + r - len(after) * idle for b, after, r in
                      zip(ops[f"{side}_block"], steps_after[side], ops[f"{side}_rest"])]
    print(f"| training time lost per async save (the call + the steps until it is done + the wait - as many "
          f"steps with no save) | {med(lost['sw']):.3f} s | {med(lost['dcp']):.3f} s | "
          f"{med(lost['sw']) / med(lost['dcp']):.2f}x | {paired_ratios(lost['sw'], lost['dcp'])} |")
    for kind in ("sync", "async"):
        a, b = memory[f"{SW} {kind}"], memory[f"{DCP} {kind}"]
        print(f"| peak memory of a {kind} save, per rank (held after) | {_mib(a[0])} ({_mib(a[1])}) | "
              f"{_mib(b[0])} ({_mib(b[1])}) | {a[0] / b[0]:.2f}x | |")
    print(f"| checkpoint bytes (sync / async) | {_mib(written['sw-sync'])} / {_mib(written['sw-async'])} | "
          f"{_mib(written['dcp-sync'])} / {_mib(written['dcp-async'])} | "
          f"{written['sw-sync'] / written['dcp-sync']:.2f}x | |")
    block_ratio = med(ops["sw_block"]) / med(ops["sw_sync"])
    print(f"\nshardwise async blocking / shardwise sync save: {block_ratio:.2f}x")
    print("per round (s): " + "; ".join(f"{k} {' '.join(f'{v:.3f}' for v in vals)}" for k, vals in ops.items()))
    print("steps (s): " + "; ".join(f"{k} {' '.join(f'{v:.3f}' for v in vals)}" for k, vals in steps.items()))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
