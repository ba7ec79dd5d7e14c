"""Multi-rank training paths on a chosen device, each against one process on the same device.

One file for two callers: CI runs :func:`run_cases` at 2 ranks with ``device="cpu"``
(``test_device_scenarios_mp.py``) and ``benchmarks/gpu_check.py`` runs the same functions with
``device="cuda"``, each rank on ``cuda:local_rank % device_count`` (2 ranks may share one GPU).
Every case builds its model and batches the way a user writes them for that device
(``model.to(device)``, ``batch.to(device)``), trains through one shardwise path, and compares
with the same training in this process on the global batch (each rank computes the reference
itself, on the same device). It returns an :class:`Outcome` (largest difference, median step
time, peak memory) or raises :class:`CaseFailure`.

Backends: ``mpi`` (CUDA tensors staged through host memory, or routed through NCCL, as
``SHARDWISE_DEVICE_ENGINE`` says); ``torch`` (the process group ``shardwise.init`` builds: gloo
on the CPU, NCCL with CUDA, which needs a GPU per rank); ``gloo`` (the torch backend on a gloo
group built here, CUDA tensors included: the torch choice when ranks share a GPU).
"""

from __future__ import annotations

import copy
import gc
import math
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
import shardwise.torch as hvd
from shardwise.adapters.torch.parallel import (PipelineExecutor, average_gradients, build_groups,
                                               split_sequential_chunks)
from shardwise.core.launch_env import detect_launch
from shardwise.core.pipeline import build_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _peak  # noqa: E402

WIDTH, DEPTH, ROWS = 64, 4, 16
SGD_ARGS = {"lr": 0.05, "momentum": 0.9}
#: Global-norm clip of the ZeRO cases: the reference's gradient norm is above it on some steps
#: and below it on others, so both the clipped and the unclipped step are compared.
CLIP = 0.3
BACKENDS = ("mpi", "torch", "gloo")


class CaseFailure(AssertionError):
    """A case's result differs from the one-process run (or its data left the device)."""


@dataclass(frozen=True)
class Outcome:
    """One case on one rank: largest difference from one process, median step times, peak bytes."""

    diff: float
    step_s: float
    reference_step_s: float
    peak_bytes: int
    detail: str = ""


@dataclass
class Env:
    """Where a case runs: the world, the device, how many training steps."""

    world: Any
    device: torch.device
    steps: int

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def local(self, batch: torch.Tensor, comm: Any = None) -> torch.Tensor:
        """This rank's equal slice (along dim 0) of a global batch, over ``comm`` (default the world)."""
        comm = comm or self.world
        return batch.chunk(comm.size)[comm.rank]


# -- set-up -------------------------------------------------------------------------------------
def pick_device(device: str) -> torch.device:
    """``cpu``, or this rank's GPU: ``cuda:local_rank % device_count`` (made current, TF32 off)."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' asked for, but torch.cuda.is_available() is False")
    index = detect_launch().local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is compared in fp32
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", index)


def _gloo_group() -> None:
    """A gloo process group over the MPI world (rank 0's address reaches the others through MPI)."""
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    url = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            url = f"tcp://{socket.gethostbyname(socket.gethostname())}:{s.getsockname()[1]}"
    dist.init_process_group("gloo", init_method=comm.bcast(url, root=0), rank=comm.Get_rank(),
                            world_size=comm.Get_size())


def start(backend: str, device: str, steps: int = 6) -> Env:
    """Bind this rank's device, then ``hvd.init`` on ``backend`` (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    dev = pick_device(device)
    torch.set_num_threads(1)
    if backend == "gloo":
        _gloo_group()
    hvd.init(backend="torch" if backend == "gloo" else backend)
    if dev.type == "cpu":
        _peak.return_freed_memory()  # peaks by VmHWM need freed blocks handed back
    return Env(shardwise.current().world, dev, steps)


def stop(backend: str) -> None:
    """Undo :func:`start`: the gloo group made here, and the allocator setting of the CPU's peaks."""
    _peak.restore_allocator()
    hvd.shutdown()
    if backend == "gloo":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# -- measuring and comparing ----------------------------------------------------------------------
class PeakMemory:
    """Peak bytes above the start of the block: ``max_memory_allocated`` on CUDA, ``VmHWM`` on the CPU."""

    def __init__(self, env: Env) -> None:
        self.env, self.bytes = env, 0

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        if self.env.device.type == "cuda":
            self.env.sync()
            torch.cuda.reset_peak_memory_stats(self.env.device)
            self.base = torch.cuda.memory_allocated(self.env.device)
        else:
            _peak.reset_peak()
            self.base = _peak.status("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.env.device.type == "cuda":
            self.env.sync()
            self.bytes = torch.cuda.max_memory_allocated(self.env.device) - self.base
        else:
            self.bytes = max(_peak.status("VmHWM") - self.base, 0)  # the resident set may shrink meanwhile


def _train(env: Env, step: Callable[[int], Optional[torch.Tensor]]) -> tuple[list[Optional[float]], float]:
    """Run ``step(i)`` for each step; its losses (None where a rank has none) and the median step time."""
    losses, times = [], []
    for i in range(env.steps):
        env.sync()
        t0 = time.perf_counter()
        loss = step(i)
        env.sync()
        times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
    return losses, statistics.median(times[1:] or times)


def _batches(env: Env, features: int = WIDTH, rows: int = ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, features, generator=gen).to(env.device),
             torch.randn(rows, features, generator=gen).to(env.device)) for _ in range(env.steps)]


def _mlp(env: Env, depth: int = DEPTH, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).to(device=env.device, dtype=dtype)


def _close_losses(got: Sequence[Optional[float]], want: Sequence[float], what: str, rtol: float) -> float:
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None:
            continue
        if not math.isfinite(g) or abs(g - w) > rtol * abs(w) + 1e-7:
            raise CaseFailure(f"{what}: loss at step {i} is {g!r}, one process {w!r}")
        worst = max(worst, abs(g - w))
    return worst


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Largest difference of ``got`` from ``want`` (values only: :func:`_on_device` checks placement)."""
    got, want = got.detach().to(want.device).float(), want.detach().float()
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
        raise CaseFailure(f"{what}: differs from one process by {diff:.3g} (shape {tuple(got.shape)})")
    return diff


def _close_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                  what: str, fraction: float) -> float:
    """Compare the training's total update with the one-process update: ``|got - want| <= fraction |want - start|``."""
    err = sum(float((got[k].to(want[k].device).float() - want[k].float()).pow(2).sum()) for k in want)
    moved = sum(float((want[k].float() - start[k].float()).pow(2).sum()) for k in want)
    rel = math.sqrt(err) / max(math.sqrt(moved), 1e-30)
    if sorted(got) != sorted(want) or not rel <= fraction:
        raise CaseFailure(f"{what}: parameters differ from one process by {rel:.3g} of the update (limit {fraction})")
    return rel


def _on_device(env: Env, tensors: Any, what: str) -> None:
    """Every parameter (and gradient) a shardwise path leaves in the user's model stays on the device."""
    for name, p in tensors:
        for kind, t in (("parameter", p), ("gradient", p.grad)):
            if t is not None and t.numel() and t.device != env.device:
                raise CaseFailure(f"{what}: {kind} {name} is on {t.device}, the model on {env.device}")


def _global_loss(env: Env, loss: torch.Tensor, comm: Any = None) -> torch.Tensor:
    return (comm or env.world).allreduce(loss.detach(), "average")


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


# -- data parallelism -----------------------------------------------------------------------------------
def _data_parallel(env: Env, wrap: str) -> Outcome:
    batches = _batches(env)
    ref = _mlp(env)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD_ARGS)
    want, ref_s = _train(env, lambda i: _plain_step(ref, ref_opt, *batches[i]))
    with PeakMemory(env) as mem:
        model = _mlp(env)
        if wrap == "ddp":
            net: nn.Module = hvd.DistributedDataParallel(model)
            opt = torch.optim.SGD(net.parameters(), **SGD_ARGS)
        else:
            net = model
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), **SGD_ARGS),
                                           named_parameters=model.named_parameters())

        def step(i: int) -> torch.Tensor:
            x, y = batches[i]
            return _global_loss(env, _plain_step(net, opt, env.local(x), env.local(y)))

        got, step_s = _train(env, step)
    _on_device(env, model.named_parameters(), wrap)
    diff = _close_losses(got, want, wrap, 1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        diff = max(diff, _close(p, q, f"{wrap} parameter {name}"))
    return Outcome(diff, step_s, ref_s, mem.bytes)


def dp(env: Env) -> Outcome:
    """``hvd.DistributedOptimizer`` (SGD with momentum) after ``broadcast_parameters``."""
    return _data_parallel(env, "dp")


def ddp(env: Env) -> Outcome:
    """``hvd.DistributedDataParallel`` around the model, a plain SGD optimizer."""
    return _data_parallel(env, "ddp")


# -- ZeRO ---------------------------------------------------------------------------------------------------
def _zero(env: Env, stage: int, dtype: torch.dtype) -> Outcome:
    """ZeRO ``stage`` with global-norm clipping; parameters in ``dtype`` with fp32 master weights."""
    # targets 4x larger on even steps: gradient norms above the clip there, below it on odd steps
    batches = [(x, y * (4.0 if i % 2 == 0 else 1.0)) for i, (x, y) in enumerate(_batches(env))]
    ref = _mlp(env, dtype=dtype)
    start = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    masters = {n: p.clone().requires_grad_() for n, p in start.items()}
    ref_opt = torch.optim.SGD(masters.values(), **SGD_ARGS)
    norms: list[float] = []

    def ref_step(i: int) -> torch.Tensor:
        x, y = batches[i]
        loss = F.mse_loss(ref(x.to(dtype)), y.to(dtype))
        loss.backward()
        for n, p in ref.named_parameters():
            masters[n].grad, p.grad = p.grad.float(), None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters.values(), CLIP)))
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(masters[n])
        return loss.detach()

    want, ref_s = _train(env, ref_step)
    if not min(norms) < CLIP < max(norms):
        raise CaseFailure(f"the case tests too little: gradient norms {norms} are not on both sides of "
                          f"the clip {CLIP}")
    with PeakMemory(env) as mem:
        model = _mlp(env, dtype=dtype)
        opt = hvd.ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=env.world, clip_grad_norm=CLIP,
                                **SGD_ARGS)

        def step(i: int) -> torch.Tensor:
            x, y = batches[i]
            opt.zero_grad()
            loss = F.mse_loss(model(env.local(x).to(dtype)), env.local(y).to(dtype))
            loss.backward()
            opt.step()
            return _global_loss(env, loss)

        got, step_s = _train(env, step)
    _on_device(env, model.named_parameters(), f"ZeRO-{stage}")
    fp32 = dtype == torch.float32
    what = f"ZeRO-{stage} {str(dtype).removeprefix('torch.')}"
    _close_losses(got, want, what, 1e-5 if fp32 else 2e-2)
    # the fp32 masters: bf16 parameters round a master's last bits away, differently on either side
    got_masters = opt.full_state_dict()["master"]
    diff = _close_update(got_masters, {n: m.detach() for n, m in masters.items()}, start, what,
                         1e-4 if fp32 else 2e-2)
    return Outcome(diff, step_s, ref_s, mem.bytes, f"norms {norms[0]:.2f}..{norms[-1]:.2f} clip {CLIP}")


def _zero_case(stage: int, dtype: torch.dtype) -> Callable[[Env], Outcome]:
    def case(env: Env) -> Outcome:
        return _zero(env, stage, dtype)
    case.__doc__ = f"ZeRO stage {stage}, clipping, {dtype} parameters (fp32 masters)"
    return case


# -- pipeline schedules ------------------------------------------------------------------------------------
def _pipeline(env: Env, schedule: str, v: int, *, fixed_shape: bool = False, checkpoint: bool = False) -> Outcome:
    """pp=2 (x dp) with ``schedule``, 4 micro-batches, an 8-layer MLP; every stage against one process."""
    batches, m = _batches(env), 4
    ref = _mlp(env, depth=8)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD_ARGS)
    want, ref_s = _train(env, lambda i: _plain_step(ref, ref_opt, *batches[i]))
    groups = build_groups(env.world, pp=2)
    try:
        with PeakMemory(env) as mem:
            chunks = split_sequential_chunks(_mlp(env, depth=8), 2, groups.pp.rank, v)
            local = ROWS // groups.dp.size
            pipe = PipelineExecutor(chunks, build_schedule(schedule, 2, m, v), groups.pp, F.mse_loss,
                                    activation_shape=(local // m, WIDTH) if fixed_shape else None,
                                    checkpoint=checkpoint)
            opt = torch.optim.SGD(pipe.parameters(), **SGD_ARGS)

            def step(i: int) -> Optional[torch.Tensor]:
                x, y = batches[i]
                opt.zero_grad()
                loss = pipe.step(env.local(x, groups.dp), env.local(y, groups.dp))
                average_gradients(pipe.parameters(), groups.dp)
                opt.step()
                return _global_loss(env, loss, groups.dp) if pipe.is_last else None

            got, step_s = _train(env, step)
        what = f"{schedule} pp=2 dp={groups.dp.size} v={v}"
        diff = _close_losses(got, want, what, 1e-5)
        for chunk in pipe.chunks:
            _on_device(env, chunk.named_parameters(), what)
            for name, p in chunk.named_parameters():
                diff = max(diff, _close(p, ref.get_parameter(name), f"{what} parameter {name}"))
    finally:
        groups.free()
    return Outcome(diff, step_s, ref_s, mem.bytes)


def pp_gpipe(env: Env) -> Outcome:
    """GPipe, receive buffers of a fixed activation shape."""
    return _pipeline(env, "gpipe", 1, fixed_shape=True)


def pp_1f1b(env: Env) -> Outcome:
    """1F1B with activation checkpointing."""
    return _pipeline(env, "1f1b", 1, checkpoint=True)


def pp_interleaved(env: Env) -> Outcome:
    """Interleaved 1F1B, 2 model chunks per rank."""
    return _pipeline(env, "interleaved", 2)


# -- parallelize on a small GPT-2 --------------------------------------------------------------------------
def _gpt2(env: Env, fields: dict[str, Any], meta: bool = False, compiled: bool = False) -> Outcome:
    from hf_parallel import build

    from shardwise.torch import ParallelLayout, parallelize

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (8, 16), generator=gen).to(env.device) for _ in range(env.steps)]
    model = build("gpt2").to(env.device)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)

    def ref_step(i: int) -> torch.Tensor:
        ref_opt.zero_grad()
        loss = ref(batches[i], labels=batches[i]).loss
        loss.backward()
        ref_opt.step()
        return loss.detach()

    want, ref_s = _train(env, ref_step)
    del ref, ref_opt
    extra = {}
    if meta:  # materialized by parallelize on env.device, with the values of the normal build above
        with torch.device("meta"):
            model = build("gpt2")
        torch.manual_seed(0)  # build's seed: the replay draws from rank 0's generator
        extra = {"device": env.device}
    if compiled:  # each block, as torchtitan does (inductor: Triton kernels on CUDA, C++ on the CPU)
        for block in model.transformer.h:
            block.compile()
    with PeakMemory(env) as mem:
        pm = parallelize(model, torch.optim.SGD, ParallelLayout(**fields), lr=0.5, momentum=0.9, **extra)
        got, step_s = _train(env, lambda i: pm.train_step(pm.shard_batch(batches[i])))
    what = f"gpt2 {pm.layout.describe()}" + (" built on meta" if meta else "") + (" compiled" if compiled else "")
    placed = [(f"#{i}", p) for i, p in enumerate(pm.parameters())] + list(pm.module.named_buffers())
    if meta:
        placed += [(f"unit {u.index} {k}", t) for u in pm.optimizer.units
                   for k, t in (("shard", u.shard), ("master", u.master))]
    _on_device(env, placed, what)
    diff = _close_losses(got, want, what, 1e-4)
    pm.groups.free()
    return Outcome(diff, step_s, ref_s, mem.bytes)


def gpt2_dp2(env: Env) -> Outcome:
    """``parallelize``, data parallel over every rank (overlapped gradient averaging)."""
    return _gpt2(env, {"dp": env.world.size})


def gpt2_tp2(env: Env) -> Outcome:
    """``parallelize`` with tp=2 (GPT-2's tensor-parallel rules), dp over the rest."""
    return _gpt2(env, {"tp": 2, "dp": env.world.size // 2})


def gpt2_meta_zero3(env: Env) -> Outcome:
    """``parallelize`` of a model built on the meta device, ZeRO-3 over every rank, materialized on the device."""
    return _gpt2(env, {"dp": env.world.size, "zero_stage": 3}, meta=True)


def gpt2_tp2_compiled(env: Env) -> Outcome:
    """``parallelize`` with tp=2 on a GPT-2 whose blocks were compiled (``block.compile()``); the step time
    after the first (compiling) step."""
    return _gpt2(env, {"tp": 2, "dp": env.world.size // 2}, compiled=True)


def gpt2_pp2(env: Env) -> Outcome:
    """``parallelize`` with pp=2, 2 micro-batches (1F1B, tied embedding on both stages), dp over the rest."""
    return _gpt2(env, {"pp": 2, "dp": env.world.size // 2, "micro_batches": 2})


# -- elastic state ---------------------------------------------------------------------------------------------
def _elastic(env: Env, stage: int) -> Outcome:
    """``TorchState``: commit, lose two steps of work, then restore, reset and sync as ``hvd.elastic.run``
    does after losing a worker; training on from the commit equals one process."""
    kept = env.steps
    env = Env(env.world, env.device, steps=2 * kept)
    batches = _batches(env)
    ref = _mlp(env)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD_ARGS)
    committed: dict[str, torch.Tensor] = {}

    def ref_step(i: int) -> torch.Tensor:
        loss = _plain_step(ref, ref_opt, *batches[i])
        if i == kept - 1:
            committed.update({n: p.detach().clone() for n, p in ref.named_parameters()})
        return loss

    want, ref_s = _train(env, ref_step)
    what = f"elastic {f'ZeRO-{stage}' if stage else 'DistributedOptimizer'}"
    with PeakMemory(env) as mem:
        model = _mlp(env)
        if stage:
            opt: Any = hvd.ZeroOptimizer(model, torch.optim.SGD, stage=stage, comm=env.world, **SGD_ARGS)
        else:
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), **SGD_ARGS),
                                           named_parameters=model.named_parameters())
        state = hvd.elastic.TorchState(model, opt, step=0)
        state.sync()  # what hvd.elastic.run does before its first attempt

        def step(i: int) -> torch.Tensor:
            x, y = batches[i]
            state.step = i + 1
            return _global_loss(env, _plain_step(model, opt, env.local(x), env.local(y)))

        first, step_s = _train(Env(env.world, env.device, kept), step)
        state.commit()
        for i in (kept, kept + 1):  # work that the loss of a worker undoes
            step(i)
        state.restore()
        state.on_reset()
        state.sync()
        if state.step != kept:
            raise CaseFailure(f"{what}: restored step {state.step}, committed step {kept}")
        full = opt.full_parameters() if stage else dict(model.named_parameters())
        diff = max(_close(full[n], w, f"{what}: restored {n}") for n, w in committed.items())
        rest = [float(step(i)) for i in range(kept, env.steps)]
    _on_device(env, model.named_parameters(), what)
    diff = max(diff, _close_losses(first + rest, want, what, 1e-5))
    full = opt.full_parameters() if stage else dict(model.named_parameters())
    for n, p in ref.named_parameters():
        diff = max(diff, _close(full[n], p, f"{what}: {n} after training on from the commit"))
    return Outcome(diff, step_s, ref_s, mem.bytes)


def elastic_dp(env: Env) -> Outcome:
    """Elastic state of a model and a ``DistributedOptimizer``."""
    return _elastic(env, 0)


def elastic_zero3(env: Env) -> Outcome:
    """Elastic state of a ZeRO-3 model and optimizer (full state gathered, re-split on reset)."""
    return _elastic(env, 3)


#: Every case, in the order they run.
CASES: dict[str, Callable[[Env], Outcome]] = {
    "dp": dp, "ddp": ddp,
    **{f"zero{s}": _zero_case(s, torch.float32) for s in (1, 2, 3)},
    **{f"zero{s}-bf16": _zero_case(s, torch.bfloat16) for s in (1, 2, 3)},
    "pp-gpipe": pp_gpipe, "pp-1f1b": pp_1f1b, "pp-interleaved": pp_interleaved,
    "gpt2-dp2": gpt2_dp2, "gpt2-tp2": gpt2_tp2, "gpt2-pp2": gpt2_pp2,
    "gpt2-meta-zero3": gpt2_meta_zero3, "gpt2-tp2-compiled": gpt2_tp2_compiled,
    "elastic-dp": elastic_dp, "elastic-zero3": elastic_zero3,
}


def run_cases(backend: str, device: str = "cpu", cases: Optional[Sequence[str]] = None, steps: int = 6,
              report: Optional[Callable[[str, dict], None]] = None) -> None:
    """Run ``cases`` (default all) in order at any even world size; rank 0 prints an ``OK <case>`` line for each.

    A case that fails raises on the rank that saw it (the caller then ends the job: its peers
    may be waiting in a collective). ``report(case, row)``, called on every rank instead of the
    printing, gets ``{"event": "start"}`` before each case and after it the row of the case: the
    largest difference from one process, the median step times and the peak memory (each the
    largest over the ranks).
    """
    names = list(CASES) if cases is None else list(cases)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; known: {list(CASES)}")
    env = start(backend, device, steps)
    for name in names:
        if report is not None:
            report(name, {"event": "start"})
        out = CASES[name](env)
        rows = env.world.allgather_object((out.diff, out.step_s, out.peak_bytes))
        row = {"event": "pass", "diff": max(r[0] for r in rows), "step_ms": 1e3 * max(r[1] for r in rows),
               "reference_ms": 1e3 * out.reference_step_s, "peak_mib": max(r[2] for r in rows) / 2**20,
               "detail": out.detail}
        if report is not None:
            report(name, row)
        elif env.world.rank == 0:
            print(f"OK {name} on {backend}/{env.device}: diff {row['diff']:.2e}, step {row['step_ms']:.1f} ms "
                  f"(one process {row['reference_ms']:.1f} ms), peak {row['peak_mib']:.1f} MiB", flush=True)
    stop(backend)  # not after a failure: the caller aborts the job instead (a peer may wait in a collective)
