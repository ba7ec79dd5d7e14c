"""Checkpoint save and load time: shardwise's sharded checkpoint vs torch.distributed.checkpoint, one gloo group.

Run on 2 ranks:  shardwise run -np 2 -- python benchmarks/checkpoint.py
Quick try:       shardwise run -np 2 -- python benchmarks/checkpoint.py --layers 1 --hidden 64 --rounds 1

One model state, two libraries, the same default gloo process group (the one
``shardwise.init(backend="torch")`` creates):

* shardwise: a Hugging Face GPT-2 built on the meta device after ``torch.manual_seed(0)``,
  ``parallelize(model, torch.optim.AdamW, ParallelLayout(dp=world, zero_stage=3), lr=1e-4)``,
  one ``train_step`` (so AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` exist).
  save = ``pm.save_checkpoint(dir, step)`` (each rank writes one safetensors file of the pieces
  it holds, its ZeRO shard of each tensor, with no tensor moved between ranks; files fsynced,
  a CRC-32 per 1 MiB block hashed as the file is written, in the manifest, manifest last);
  load = ``pm.load_checkpoint(ckpt-<step>)`` (each rank reads only the element ranges it keeps,
  straight into its shards, and checks the CRC-32 of every block it reads).
* torch DCP: the same GPT-2 built normally after the same seed, FSDP2 ``fully_shard`` on each
  transformer block and the root (as ``zero.py`` does), AdamW, one step on the same batch.
  save = ``get_state_dict(model, optimizer)`` + ``dcp.save({"model", "optim"}, checkpoint_id=dir)``
  (each rank writes its own DTensor shards; ``FileSystemWriter`` defaults, fsync on);
  load = ``get_state_dict`` + ``dcp.load`` into those state dicts + ``set_state_dict``.

Before any timing, each library's round trip is checked once: save, take one more training
step (so the state moves), load, and every local parameter shard and optimizer state tensor
must equal what it was at the save, bit for bit; the run stops otherwise. The two states are
also compared with each other (the shardwise files against FSDP2's full tensors, informative).

Timing: ``--rounds`` rounds, each running shardwise save, DCP save, shardwise load, DCP load in
that order; every operation starts after a barrier, its figure is the slowest rank's wall time
(and the busiest rank's CPU time, ``time.process_time``: every thread of the process). Every
save goes to a fresh directory under one temporary directory (``--tmpdir``, default /tmp, the
same filesystem for both); the previous round's directories are deleted outside the timed
region. A load reads the checkpoint its library just wrote, so both read from the page cache.
The table gives the median over rounds, every round, the bytes each checkpoint occupies (sum
of file sizes), and the ratios shardwise / DCP (< 1: shardwise is faster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

warnings.filterwarnings("ignore", message=r".*(is deprecated|TypedStorage).*")

from _common import init_gloo, paired_ratios  # noqa: E402

SW_SAVE, DCP_SAVE = "shardwise save_checkpoint (ZeRO-3)", "torch DCP dcp.save (FSDP2)"
SW_LOAD, DCP_LOAD = "shardwise load_checkpoint (ZeRO-3)", "torch DCP dcp.load + set_state_dict (FSDP2)"


def gpt2_config(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                      n_positions=args.positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      use_cache=False)


# ----------------------------------------------------------------------------------------- contenders
def build_shardwise(cfg: Any, world: Any, batch: torch.Tensor) -> Any:
    from transformers import GPT2LMHeadModel

    from shardwise.adapters.torch.parallel.parallelize import parallelize
    from shardwise.core.layout import ParallelLayout

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    pm = parallelize(model, torch.optim.AdamW, ParallelLayout(dp=world.size, zero_stage=3), lr=1e-4)
    pm.train_step(pm.shard_batch(batch))
    return pm


def build_fsdp2(cfg: Any, world: Any, batch: torch.Tensor) -> tuple[Any, Any, Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    mesh = init_device_mesh("cpu", (world.size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mine = batch.chunk(world.size)[world.rank]

    def step() -> None:
        model(mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return model, opt, step


def dcp_save(model: Any, opt: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def dcp_load(model: Any, opt: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


# -------------------------------------------------------------------------------------- correctness
def _local(t: Any) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _opt_state(opt: Any, params: list) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": _local(v) if torch.is_tensor(v) else torch.tensor(v)
            for i, p in enumerate(params) for k, v in sorted(opt.state.get(p, {}).items())}


def shardwise_snapshot(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's master shards and AdamW state, and every full parameter (collective)."""
    opt = pm.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    out = {f"master/{i}": _local(p) for i, p in enumerate(params)}
    out.update({f"state/{k}": v for k, v in _opt_state(opt, params).items()})
    out.update({f"full/{n}": t for n, t in opt.full_parameters().items()})
    return out


def fsdp2_snapshot(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """This rank's DTensor shards of every parameter and of its AdamW state."""
    named = list(model.named_parameters())
    out = {f"param/{n}": _local(p) for n, p in named}
    out.update({f"state/{k}": v for k, v in _opt_state(opt, [p for _, p in named]).items()})
    return out


def _compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """Keys whose tensors differ (or are missing), and how many keys were equal."""
    bad = sorted(set(before) ^ set(after))
    same = 0
    for k in sorted(set(before) & set(after)):
        a, b = before[k], after[k]
        if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b):
            same += 1
        else:
            bad.append(k)
    return bad, same


def check_round_trip(name: str, world: Any, snapshot: Callable[[], dict], save: Callable[[], None],
                     perturb: Callable[[], None], load: Callable[[], None]) -> str:
    """Save, move the state by a training step, load: the state must be back to what was saved, bit for bit."""
    before = snapshot()
    save()
    perturb()
    moved, _ = _compare(before, snapshot())
    load()
    bad, same = _compare(before, snapshot())
    every = world.allgather_object((len(moved), bad[:5], len(bad), same))
    if any(n_bad for _, _, n_bad, _ in every) or not any(n_moved for n_moved, _, _, _ in every):
        detail = "; ".join(f"rank {r}: {n_bad} differ (e.g. {ex}), {n_moved} moved by the extra step, {ok} equal"
                           for r, (n_moved, ex, n_bad, ok) in enumerate(every))
        raise SystemExit(f"{name}: a load did not restore the saved state: {detail}")
    return (f"{name}: the load restored all {sum(s for *_, s in every)} tensors (per-rank shards, optimizer "
            f"state{', full parameters' if 'shardwise' in name else ''}) bit for bit, after an extra step had moved "
            f"{sum(m for m, *_ in every)} of them")


def cross_check(world: Any, ckpt: Path, model: Any, opt: Any) -> str:
    """Max |shardwise - FSDP2| over the tensors both hold (the shardwise files against FSDP2's full tensors)."""
    from shardwise.adapters.torch.checkpoint.pieces import PiecesSource
    from shardwise.checkpoint.store import load_checkpoint

    source = PiecesSource.from_metadata(load_checkpoint(ckpt).metadata, ckpt) if world.rank == 0 else None
    worst: dict[str, float] = {}
    compared = 0
    for n, p in model.named_parameters():
        pieces = [("param", n, p)] + [(f"optimizer/{k}", f"optimizer/{k}/{n}", v)
                                      for k, v in sorted(opt.state.get(p, {}).items()) if k != "step"]
        for kind, key, value in pieces:
            full = value.full_tensor() if hasattr(value, "full_tensor") else value  # collective: every rank
            if source is not None and key in source.files:
                diff = (source.read_whole(key).to(full.dtype) - full).abs().max().item()
                worst[kind.split("/")[-1]] = max(worst.get(kind.split("/")[-1], 0.0), diff)
                compared += 1
    if source is not None:
        source.close()
    return world.broadcast_object(
        f"shardwise vs FSDP2 after the same step, over {compared} tensors both hold: max |difference| "
        + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + " (informative, not checked)")


# ------------------------------------------------------------------------------------------ timing
def timed(world: Any, fn: Callable[[], Any]) -> tuple[float, float]:
    """This rank's wall and CPU seconds of ``fn``, every rank starting together."""
    world.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                mount = parts[1]
                if os.path.realpath(path).startswith(mount) and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n:,} B)"


def print_table(title: str, results: dict[str, list[tuple[float, float]]], written: dict[str, int]) -> None:
    print(f"\n{title}")
    head = ["operation", "contender", "time (s, slowest rank)", "CPU s (busiest rank)", "checkpoint bytes",
            "per-round time (s)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, per in results.items():
        walls, cpus = [w for w, _ in per], [c for _, c in per]
        op = "save" if "save" in name else "load"
        print(f"| {op} | {name} | {statistics.median(walls):.3f} | {statistics.median(cpus):.3f} | "
              f"{_mib(written[name]) if name in written else ''} | {' '.join(f'{w:.3f}' for w in walls)} |")
    print("\n| operation | shardwise | peer (same transport) | time ratio | "
          "per-round ratio: median (range), rounds faster | bytes ratio |")
    print("|---|---|---|---|---|---|")
    for op, ours, peer in (("save", SW_SAVE, DCP_SAVE), ("load", SW_LOAD, DCP_LOAD)):
        a, b = [w for w, _ in results[ours]], [w for w, _ in results[peer]]
        size = f"{written[ours] / written[peer]:.2f}x" if op == "save" else ""
        print(f"| {op} | {ours} | {peer} | {statistics.median(a) / statistics.median(b):.2f}x | "
              f"{paired_ratios(a, b)} | {size} |")
    print("(ratio = shardwise / DCP: < 1 means shardwise is faster / writes less; the time ratio divides the two "
          "medians, the per-round ratio pairs the rounds, which ran interleaved)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample of the one training step")
    parser.add_argument("--batch", type=int, default=2, help="samples per rank of the one training step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tmpdir", default=tempfile.gettempdir(), help="where both write their checkpoints")
    parser.add_argument("--keep", action="store_true", help="leave the last round's checkpoints on disk")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = init_gloo()
    rank = world.rank
    import transformers

    transformers.logging.set_verbosity_error()  # "loss_type=None ... unrecognized", once per rank and model
    cfg = gpt2_config(args)
    batch = torch.randint(args.vocab, (args.batch * world.size, args.seq),
                          generator=torch.Generator().manual_seed(1234))
    pm = build_shardwise(cfg, world, batch)
    model, opt, fsdp_step = build_fsdp2(cfg, world, batch)
    n_params = sum(p.numel() for p in model.parameters())  # FSDP2's DTensors report the global size

    root = Path(world.broadcast_object(tempfile.mkdtemp(prefix="shardwise-ckpt-bench-", dir=args.tmpdir)
                                       if rank == 0 else None))
    if rank == 0:
        print(f"# Checkpoint save and load, transport: gloo (one default process group for both), {world.size} "
              f"ranks, {torch.get_num_threads()} thread(s)/rank, torch {torch.__version__}, transformers "
              f"{transformers.__version__}; GPT-2 n_layer={args.layers} n_embd={args.hidden} n_head={args.heads} "
              f"vocab {args.vocab} n_positions {args.positions}, {n_params / 1e6:.1f}M params, AdamW fp32 (params + "
              f"exp_avg + exp_avg_sq + step), one step on {args.batch}x{args.seq} tokens/rank; checkpoints under "
              f"{args.tmpdir} ({fs_type(args.tmpdir)}); median of {args.rounds} rounds (slowest rank per round)")
        sys.stdout.flush()
    try:
        # --- correctness, once, before timing (also takes every first-time cost off the rounds)
        step = 1
        check_dir_a, check_dir_b = root / "check-shardwise", root / "check-dcp"
        saved: dict[str, Path] = {}
        lines = [check_round_trip(
            "shardwise", world, lambda: shardwise_snapshot(pm),
            lambda: saved.__setitem__("a", pm.save_checkpoint(check_dir_a, step)),
            lambda: pm.train_step(pm.shard_batch(batch)),
            lambda: pm.load_checkpoint(saved["a"]))]
        lines.append(check_round_trip(
            "torch DCP", world, lambda: fsdp2_snapshot(model, opt), lambda: dcp_save(model, opt, check_dir_b),
            fsdp_step, lambda: dcp_load(model, opt, check_dir_b)))
        lines.append(cross_check(world, saved["a"], model, opt))
        if rank == 0:
            print("\n".join(f"# check: {line}" for line in lines))
            sys.stdout.flush()

        # --- timing
        mine: dict[str, list[tuple[float, float]]] = {n: [] for n in (SW_SAVE, DCP_SAVE, SW_LOAD, DCP_LOAD)}
        written: dict[str, list[int]] = {SW_SAVE: [], DCP_SAVE: []}
        previous: list[Path] = [check_dir_a, check_dir_b]
        for r in range(args.rounds):
            if rank == 0:
                for old in previous:
                    shutil.rmtree(old, ignore_errors=True)
            dir_a, dir_b = root / f"shardwise-{r}", root / f"dcp-{r}"
            previous = [dir_a, dir_b]
            out: dict[str, Path] = {}
            mine[SW_SAVE].append(timed(world, lambda: out.__setitem__("a", pm.save_checkpoint(dir_a, step))))
            mine[DCP_SAVE].append(timed(world, lambda: dcp_save(model, opt, dir_b)))
            mine[SW_LOAD].append(timed(world, lambda: pm.load_checkpoint(out["a"])))
            mine[DCP_LOAD].append(timed(world, lambda: dcp_load(model, opt, dir_b)))
            world.barrier()
            if rank == 0:
                written[SW_SAVE].append(dir_bytes(dir_a))
                written[DCP_SAVE].append(dir_bytes(dir_b))
        every = world.allgather_object(mine)
        if rank == 0:
            results = {name: [(max(rk[name][i][0] for rk in every), max(rk[name][i][1] for rk in every))
                              for i in range(args.rounds)] for name in mine}
            sizes = {name: max(v) for name, v in written.items()}
            if any(max(v) - min(v) > 4096 for v in written.values()):  # the manifest's JSON may vary by a byte
                print(f"# note: checkpoint sizes varied between rounds: {written}")
            print_table(f"## GPT-2 {n_params / 1e6:.1f}M params + AdamW state, {world.size} ranks - transport: gloo",
                        results, sizes)
            sys.stdout.flush()
    finally:
        world.barrier()
        if rank == 0:
            if args.keep:
                print(f"# checkpoints left under {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
    import shardwise

    shardwise.shutdown()


if __name__ == "__main__":
    main()
