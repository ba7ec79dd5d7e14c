"""Hybrid sharding: shardwise ZeRO-3 (shard x replicate) vs FSDP2 HSDP, traffic crossing "nodes" counted.

Run on 4 ranks as 2 "nodes" of 2:  shardwise run -np 4 -- python benchmarks/hybrid_shard.py
(or ``torchrun --nproc_per_node 4 benchmarks/hybrid_shard.py``).

One gloo process group for every row (shardwise on its torch backend, built by
``shardwise.init(backend="torch")``; FSDP2 on the same default group), the same GPT (the
TinyGPT of benchmarks/_models.py, 6 layers x 256, vocabulary 8192), the same weights (seed 0),
the same batches (rank r's batch from seed 1000 + r), AdamW fp32, lr 1e-3:

* shardwise ``ZeroOptimizer`` stage 3, hybrid: ``comm=groups.dp_shard`` (ranks {0,1} and
  {2,3}), ``replicate_comm=groups.dp_replicate`` ({0,2} and {1,3}) from
  ``shardwise.build_groups(world, dp=4, dp_shard=2)``; and flat, ``comm=world``;
* torch FSDP2 ``fully_shard`` per transformer block + root: HSDP on
  ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`` (shard groups
  {0,1} and {2,3}, as shardwise's), and flat on a 1-D mesh of 4;
* a floor row: one rank's own AdamW step, no communication.
Both libraries shard per transformer block (shardwise ``wrap=model.layers``), the rest in a root unit.

Timing and memory as benchmarks/_common.py: memory phase first (peak VmHWM above the resident
set before the build, 3 steps, largest rank, one contender at a time), then the contenders
interleaved round by round, median over rounds of the slowest rank's median step.

Traffic (after the timing, one contender at a time): ranks ``r // node_size`` form the "nodes"
(default {0,1} = node A, {2,3} = node B). Every collective of one step (the 4th; the first
ones take the lazy set-up) is counted per rank, by kind, and as *crossing* when its group has
ranks on both nodes, else *inside*. Bytes moved per rank follow the ring algorithm, the same
for every row: allgather and reduce-scatter ``(n-1)/n x B``, allreduce ``2(n-1)/n x B``, with B
the full (gathered / unreduced) buffer and n the group size. shardwise is counted by wrapping
the communicators handed to ``ZeroOptimizer``; FSDP2 by wrapping the three ``torch.distributed``
functions its collectives module calls (``all_gather_single``, ``reduce_scatter_single``,
``all_reduce``), for the counted step only. The same steps check the losses: every row's loss
(mean over the ranks) at each of the 4 steps against one process training on the 4 ranks'
batches together.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import shardwise  # noqa: E402
from _common import Transport, print_results, run_transports, set_threads  # noqa: E402
from _models import TinyGPT, Workload, _lm_loss, _tokens  # noqa: E402
from _peak import timing_allocator  # noqa: E402
from shardwise.core.comm import Communicator, Handle, ReduceOp  # noqa: E402
from shardwise.core.launch_env import detect_launch  # noqa: E402

VOCAB, WIDTH, LAYERS, HEADS, SEQ = 8192, 256, 6, 4, 128
LR = 1e-3
CHECK_STEPS = 4  # the last one is counted

HYBRID = "shardwise ZeRO-3 hybrid (shard 2 x replicate 2, torch backend)"
FLAT = "shardwise ZeRO-3 flat (4 ranks, torch backend)"
HSDP = "torch FSDP2 HSDP (2-D mesh replicate 2 x shard 2)"
FSDP_FLAT = "torch FSDP2 flat (1-D mesh of 4)"
FLOOR = "one rank's own step with AdamW, no communication (floor)"
PAIRS = [(HYBRID, HSDP), (FLAT, FSDP_FLAT), (HYBRID, FLAT)]


def workload(batch: int) -> Workload:
    return Workload("gpt6", f"GPT {LAYERS} x {WIDTH}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}",
                    lambda: TinyGPT(VOCAB, WIDTH, LAYERS, HEADS, SEQ), batch, _tokens(VOCAB, SEQ), _lm_loss,
                    lambda m: list(m.layers))


# -- traffic ledger ------------------------------------------------------------------------------
KINDS = ("allgather", "reduce-scatter", "allreduce", "other")


def ring_bytes(kind: str, n: int, buffer: int) -> float:
    """Bytes one rank sends in a ring collective over ``n`` ranks of a ``buffer``-byte full buffer."""
    if n <= 1:
        return 0.0
    return (2 if kind == "allreduce" else 1) * (n - 1) / n * buffer


class Ledger:
    """Bytes moved by this rank, per (kind, crossing); counting only while ``on``."""

    def __init__(self, node_size: int) -> None:
        self.node_size, self.on = node_size, False
        self.bytes: dict[tuple[str, bool], float] = defaultdict(float)
        self.calls: dict[tuple[str, bool], int] = defaultdict(int)

    def crosses(self, global_ranks: Sequence[int]) -> bool:
        return len({r // self.node_size for r in global_ranks}) > 1

    def add(self, kind: str, global_ranks: Sequence[int], buffer: int) -> None:
        if self.on:
            key = (kind, self.crosses(global_ranks))
            self.bytes[key] += ring_bytes(kind, len(global_ranks), buffer)
            self.calls[key] += 1


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


class CountingCommunicator(Communicator):
    """Delegates every call to ``inner`` and notes each collective's bytes in ``ledger``.

    Collective at construction (learns the group's global ranks): build it on every member.
    """

    def __init__(self, inner: Communicator, ledger: Ledger) -> None:
        self.inner, self.ledger, self.backend = inner, ledger, inner.backend
        self.global_ranks = inner.allgather_object(dist.get_rank())

    def __getattr__(self, item: str) -> Any:  # backend extras (process_group, ...)
        if item.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(item)
        return getattr(self.inner, item)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _note(self, kind: str, buffer: int) -> None:
        self.ledger.add(kind, self.global_ranks, buffer)

    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, inplace: bool = False,
                  name: Optional[str] = None) -> Any:
        self._note("allreduce", _nbytes(tensor))
        return self.inner.allreduce(tensor, op, inplace=inplace, name=name)

    def allreduce_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        self._note("allreduce", _nbytes(tensor))
        return self.inner.allreduce_async(tensor, op, inplace=inplace, name=name)

    def reduce_scatter(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *, name: Optional[str] = None) -> Any:
        self._note("reduce-scatter", _nbytes(tensor))
        return self.inner.reduce_scatter(tensor, op, name=name)

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                             name: Optional[str] = None) -> Handle:
        self._note("reduce-scatter", _nbytes(tensor))
        return self.inner.reduce_scatter_async(tensor, op, name=name)

    def reduce_scatter_in_place_async(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, *,
                                      name: Optional[str] = None) -> Handle:
        self._note("reduce-scatter", _nbytes(tensor))
        return self.inner.reduce_scatter_in_place_async(tensor, op, name=name)

    def allgather(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Any:
        self._note("allgather", _nbytes(tensor) * self.size)  # uneven first dims: near enough, never on this path
        return self.inner.allgather(tensor, name=name, uniform=uniform)

    def allgather_async(self, tensor: Any, *, name: Optional[str] = None, uniform: bool = False) -> Handle:
        self._note("allgather", _nbytes(tensor) * self.size)
        return self.inner.allgather_async(tensor, name=name, uniform=uniform)

    def allgather_into(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Any:
        self._note("allgather", _nbytes(out))
        return self.inner.allgather_into(out, tensor, name=name)

    def allgather_into_async(self, out: Any, tensor: Any, *, name: Optional[str] = None) -> Handle:
        self._note("allgather", _nbytes(out))
        return self.inner.allgather_into_async(out, tensor, name=name)

    def broadcast(self, tensor: Any, root: int = 0, *, inplace: bool = False, name: Optional[str] = None) -> Any:
        self._note("other", _nbytes(tensor))
        return self.inner.broadcast(tensor, root, inplace=inplace, name=name)

    def broadcast_async(self, tensor: Any, root: int = 0, *, inplace: bool = False,
                        name: Optional[str] = None) -> Handle:
        self._note("other", _nbytes(tensor))
        return self.inner.broadcast_async(tensor, root, inplace=inplace, name=name)

    def alltoall(self, tensor: Any, splits: Optional[Sequence[int]] = None, *, name: Optional[str] = None) -> Any:
        self._note("other", _nbytes(tensor))
        return self.inner.alltoall(tensor, splits, name=name)

    def alltoall_async(self, tensor: Any, splits: Optional[Sequence[int]] = None, *,
                       name: Optional[str] = None) -> Handle:
        self._note("other", _nbytes(tensor))
        return self.inner.alltoall_async(tensor, splits, name=name)

    def send_async(self, tensor: Any, dest: int, tag: int = 0) -> Handle:
        self._note("other", _nbytes(tensor))
        return self.inner.send_async(tensor, dest, tag)

    def recv_async(self, tensor: Any, source: int, tag: int = 0) -> Handle:
        return self.inner.recv_async(tensor, source, tag)

    def barrier(self) -> None:
        self.inner.barrier()

    def split(self, color: Optional[int] = None, key: Optional[int] = None, *,
              ranks: Optional[Sequence[int]] = None) -> Optional[Communicator]:
        sub = self.inner.split(color, key, ranks=ranks)
        return None if sub is None else CountingCommunicator(sub, self.ledger)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root)

    def abort(self, code: int = 1) -> None:
        self.inner.abort(code)


@contextlib.contextmanager
def counting_fsdp2(ledger: Ledger) -> Iterator[None]:
    """FSDP2's collectives module sees a ``torch.distributed`` whose three collectives note their bytes.

    Only that module's name ``dist`` is replaced (shardwise's backend keeps the real module), and
    only inside the ``with``.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    real = collectives.dist

    def counted(fn: Callable, kind: str, buffer_arg: str) -> Callable:
        sig = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            ledger.add(kind, real.get_process_group_ranks(group or real.group.WORLD),
                       _nbytes(bound.arguments[buffer_arg]))
            return fn(*args, **kwargs)
        return call

    class _Dist:
        all_gather_single = staticmethod(counted(real.all_gather_single, "allgather", "output_tensor"))
        reduce_scatter_single = staticmethod(counted(real.reduce_scatter_single, "reduce-scatter", "input"))
        all_reduce = staticmethod(counted(real.all_reduce, "allreduce", "tensor"))

        def __getattr__(self, item: str) -> Any:
            return getattr(real, item)

    collectives.dist = _Dist()
    try:
        yield
    finally:
        collectives.dist = real


# -- contenders -------------------------------------------------------------------------------------
def _loop(model: nn.Module, opt: Any, w: Workload, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = w.loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def shardwise_zero3(w: Workload, x, y, comm: Communicator, replicate: Optional[Communicator] = None):
    def build(ledger: Optional[Ledger] = None):
        from shardwise.adapters.torch.zero import ZeroOptimizer

        c, r = comm, replicate
        if ledger is not None:
            c = CountingCommunicator(comm, ledger)
            r = None if replicate is None else CountingCommunicator(replicate, ledger)
        model = w.model()
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=3, comm=c, replicate_comm=r, wrap=w.units(model), lr=LR)
        return _loop(model, opt, w, x, y)
    return build


def torch_fsdp2(w: Workload, x, y, mesh: Any):
    def build(ledger: Optional[Ledger] = None):
        from torch.distributed.fsdp import fully_shard

        model = w.model()
        for unit in w.units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        step = _loop(model, torch.optim.AdamW(model.parameters(), lr=LR), w, x, y)
        if ledger is None:
            return step

        def counted_step() -> torch.Tensor:
            with counting_fsdp2(ledger):
                return step()
        return counted_step
    return build


def local_only(w: Workload, x, y):
    def build(ledger: Optional[Ledger] = None):
        model = w.model()
        return _loop(model, torch.optim.AdamW(model.parameters(), lr=LR), w, x, y)
    return build


def one_process_losses(w: Workload, world_size: int, steps: int) -> list[float]:
    """The reference: one process, the ranks' batches together (each rank's mean loss averaged)."""
    data = [w.data(r, w.batch, torch.device("cpu")) for r in range(world_size)]
    x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    step = local_only(w, x, y)()
    return [float(step()) for _ in range(steps)]


# -- the check phase: losses and traffic ---------------------------------------------------------
def check_phase(builds: dict[str, Callable], world: Communicator, node_size: int) -> dict[str, dict]:
    """Per contender: its mean loss over the ranks at each step, and every rank's ledger of the last step."""
    out = {}
    for name, build in builds.items():
        ledger = Ledger(node_size)
        step = build(ledger)
        losses = []
        for i in range(CHECK_STEPS):
            world.barrier()
            ledger.on = i == CHECK_STEPS - 1
            losses.append(float(step()))
            ledger.on = False
        del step
        every = world.allgather_object((losses, dict(ledger.bytes), dict(ledger.calls)))
        out[name] = {"losses": [sum(e[0][i] for e in every) / len(every) for i in range(CHECK_STEPS)],
                     "bytes": [e[1] for e in every], "calls": [e[2] for e in every]}
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def print_traffic(checks: dict[str, dict], psi: int, shard: int, replicate: int, node_size: int) -> None:
    size = shard * replicate
    print(f"\ntraffic of one step per rank (the largest rank; MiB moved, ring algorithm: allgather and "
          f"reduce-scatter (n-1)/n x buffer, allreduce 2(n-1)/n x buffer; 'crossing' = the collective's "
          f"group has ranks on both nodes, nodes = ranks // {node_size}; calls in brackets):")
    head = ["contender"] + [f"{k} {where}" for k in KINDS[:3] for where in ("inside", "crossing")] \
        + ["other", "total inside", "total crossing"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, c in checks.items():
        if not any(c["bytes"]):
            continue

        def cell(keys: Sequence[tuple[str, bool]]) -> str:
            b = _largest(c, lambda k: k in keys)
            n = max(sum(r.get(k, 0) for k in keys) for r in c["calls"])
            return f"{_mib(b)} ({n})"
        cells = [name] + [cell([(k, where)]) for k in KINDS[:3] for where in (False, True)]
        cells += [cell([("other", False), ("other", True)]),
                  cell([(k, False) for k in KINDS]), cell([(k, True) for k in KINDS])]
        print("| " + " | ".join(cells) + " |")
    hybrid_ar = 2 * (replicate - 1) / replicate * 4 * psi / shard
    flat = 3 * (size - 1) / size * 4 * psi
    print(f"\nexpected from the parameter count (psi = {psi:,} fp32 parameters): hybrid crossing = the "
          f"gradient-shard allreduce over the replicate group alone, 2(r-1)/r x 4 B x psi/s = "
          f"{_mib(hybrid_ar)} MiB (r = {replicate}, s = {shard}); flat ZeRO-3, every collective crossing: "
          f"allgather in forward + allgather in backward + reduce-scatter, 3 x (N-1)/N x 4 B x psi = "
          f"{_mib(flat)} MiB (N = {size}; less where a unit is not gathered again in backward)")
    crossing = {name: _largest(checks[name], lambda k: k[1]) for name in (HYBRID, FLAT) if name in checks}
    for name, got in crossing.items():
        gathers = _largest(checks[name], lambda k: k == ("allgather", True))
        print(f"- {name}: crossing {_mib(got)} MiB/step, of which parameter allgathers {_mib(gathers)} MiB"
              + (f" ({'OK' if gathers == 0 else 'FAIL'}: none may cross); crossing / expected gradient "
                 f"allreduce = {got / hybrid_ar:.4f} (above 1 only by the shards' padding)" if name == HYBRID else ""))
    if len(crossing) == 2:
        print(f"- crossing bytes per step, hybrid / flat ZeRO-3: {crossing[HYBRID] / crossing[FLAT]:.3f}x")


def _largest(check: dict, keep: Callable[[tuple[str, bool]], bool]) -> float:
    """The largest rank's bytes over the ledger keys ``keep`` selects."""
    return max(sum(v for k, v in rank.items() if keep(k)) for rank in check["bytes"])


def print_losses(checks: dict[str, dict], reference: list[float]) -> None:
    print(f"\nlosses of {CHECK_STEPS} AdamW steps (mean over the ranks), against one process on the 4 ranks' "
          "batches together:")
    head = ["contender"] + [f"step {i + 1}" for i in range(CHECK_STEPS)] + ["max abs diff"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    print("| one process (reference) | " + " | ".join(f"{v:.6f}" for v in reference) + " | - |")
    for name, c in checks.items():
        if name == FLOOR:
            continue
        diff = max(abs(a - b) for a, b in zip(c["losses"], reference))
        print(f"| {name} | " + " | ".join(f"{v:.6f}" for v in c["losses"]) + f" | {diff:.2e} |")


def _git_commit() -> str:
    """HEAD, and "+local changes" where shardwise/ or this script differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "shardwise", "benchmarks/hybrid_shard.py"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" +local changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--node-size", type=int, default=2, help="ranks per 'node' (and per shard group)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument("--no-floor", action="store_true")
    args = parser.parse_args()
    launch = detect_launch()
    threads = set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))))
    if launch.size % args.node_size or launch.size == args.node_size:
        raise SystemExit(f"needs at least 2 nodes of --node-size={args.node_size} ranks, got {launch.size} ranks")
    shard, replicate = args.node_size, launch.size // args.node_size
    w = workload(args.batch)

    def tables(world) -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        groups = shardwise.build_groups(world, dp=world.size, dp_shard=shard)
        hsdp = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
        flat = init_device_mesh("cpu", (world.size,))
        x, y = w.data(world.rank, w.batch, torch.device("cpu"))
        builds = {HYBRID: shardwise_zero3(w, x, y, groups.dp_shard, groups.dp_replicate),
                  FLAT: shardwise_zero3(w, x, y, world),
                  HSDP: torch_fsdp2(w, x, y, hsdp),
                  FSDP_FLAT: torch_fsdp2(w, x, y, flat)}
        if not args.no_floor:
            builds[FLOOR] = local_only(w, x, y)
        return {w.name: builds}

    def report(world, results: dict) -> None:
        checks = check_phase(tables(world)[w.name], world, args.node_size)
        reference = one_process_losses(w, world.size, CHECK_STEPS) if world.rank == 0 else []
        if world.rank != 0:
            return
        psi = w.params()
        print_results(f"## {w.label}, {psi / 1e6:.1f}M params, batch {w.batch}/rank, AdamW fp32 - transport: gloo",
                      results[w.name], PAIRS,
                      items=w.batch * world.size, floor=FLOOR if not args.no_floor else None)
        rows = results[w.name]
        print("CPU per step (all threads, busiest rank), shardwise / peer: " + "; ".join(
            f"{a.split(' (')[0]} / {b.split(' (')[0]} {rows[a].cpu / rows[b].cpu:.2f}x" for a, b in PAIRS
            if a in rows and b in rows and rows[a].cpu and rows[b].cpu))
        print_traffic(checks, psi, shard, replicate, args.node_size)
        print_losses(checks, reference)
        sys.stdout.flush()

    if launch.rank == 0:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"# Hybrid sharding, {launch.size} ranks as {replicate} nodes of {shard}; shardwise commit "
              f"{_git_commit()}; transport gloo (one torch.distributed group for every row); host "
              f"{os.uname().nodename} ({len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.1f}); {when}; "
              f"{threads} thread(s)/rank, torch {torch.__version__}; median of {args.rounds} rounds x "
              f"{args.steps} steps (slowest rank per round); {timing_allocator(not args.no_memory)}")
    run_transports([Transport("torch", tables, report)], args.rounds, args.steps, memory=not args.no_memory)


if __name__ == "__main__":
    main()
