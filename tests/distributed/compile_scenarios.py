"""``torch.compile`` with data parallelism, ZeRO 1/2/3 and ``parallelize``, against eager one-process training.

Every rank builds the same model, trains a copy of it eagerly in one process on the
whole global batch, then trains the model compiled (the whole model, or each block
as torchtitan does) on its slice of the batch through a shardwise wrapper, and checks
each step's loss (averaged over the ranks) and the final parameters against the
one-process run. ZeRO's weight-gradient fusion cannot be compiled: where it was on
and the model ran compiled, exactly one warning must say it turned itself off, and
nowhere else.

The compiler is the default (inductor, C++ on the CPU). Inductor fuses the
elementwise work and may reorder the reductions of layer norm and of the loss, so
its results differ from eager ones by fp32 rounding; :data:`RTOL` and :data:`ATOL`
bound that drift over :data:`STEPS` steps.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.torch import DistributedDataParallel, DistributedOptimizer, ParallelLayout, ZeroOptimizer, parallelize

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
LR, MOMENTUM = 0.1, 0.9
FUSION_OFF = "weight-gradient fusion is off"


class Block(nn.Module):
    """A pre-norm MLP block with a residual, the unit a per-block compile compiles."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, two blocks, a head and a buffer (which DistributedDataParallel broadcasts)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.head = nn.Linear(16, 5)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.shift


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)


def _local(t: torch.Tensor, comm: Any) -> torch.Tensor:
    return t.chunk(comm.size)[comm.rank]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager training in one process on the whole batch: each step's loss and the final parameters."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _compile(model: nn.Module, how: str) -> nn.Module:
    """``model`` to call, compiled ``how``.

    ``whole``: ``torch.compile(model)``; ``fullgraph``: the same with ``fullgraph=True``;
    ``blocks``: each block compiled in place (``block.compile()``); ``titan``: each block
    replaced by ``torch.compile(block, fullgraph=True)``, as torchtitan does; ``eager`` and
    ``late`` (compiled later, by the scenario) and ``step`` (the whole train step is compiled,
    see :func:`_train`): not compiled here.
    """
    if how in ("whole", "fullgraph"):
        return torch.compile(model, fullgraph=how == "fullgraph")
    if how == "blocks":
        for block in model.blocks:
            block.compile()
    elif how == "titan":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    elif how not in ("eager", "late", "step"):
        raise ValueError(f"unknown compile mode {how!r}")
    return model


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        raise AssertionError(f"{what}: differs from eager one-process training by {diff:.3g} "
                             f"(shape {tuple(got.shape)} vs {tuple(want.shape)})")
    return diff


def _train(comm: Any, run: Callable[[torch.Tensor], torch.Tensor], opt: Any,
           before_step: Callable[[int], None] = lambda step: None, whole_step: bool = False) -> list[float]:
    """STEPS steps on this rank's slice; each step's loss averaged over the ranks.

    ``whole_step``: zero_grad, forward, backward and the optimizer step run in one
    function compiled by ``torch.compile``, so the gradient hooks fire inside a compiled frame.
    """
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    train = torch.compile(step) if whole_step else step
    losses = []
    for i in range(STEPS):
        before_step(i)
        x, y = _batch(i)
        loss = train(_local(x, comm), _local(y, comm))
        losses.append(float(comm.allreduce(loss.reshape(1), "average")[0]))
    return losses


def _check(comm: Any, what: str, losses: list[float], params: dict[str, torch.Tensor], caught: list,
           fusion_warning: bool, graphs: int) -> None:
    want_losses, want_params = _reference()
    worst = _close(f"{what}: losses", torch.tensor(losses), torch.tensor(want_losses))
    params = {name.replace("_orig_mod.", ""): p for name, p in params.items()}  # names under torch.compile's wrapper
    for name, want in want_params.items():
        worst = max(worst, _close(f"{what}: {name}", params[name].detach(), want))
    offs = [w for w in caught if FUSION_OFF in str(w.message)]
    if len(offs) != int(fusion_warning):
        raise AssertionError(f"{what}: expected {int(fusion_warning)} fusion warning(s), got "
                             f"{[str(w.message) for w in offs]}")
    if graphs == 0 and " eager " not in what:
        raise AssertionError(f"{what}: nothing was compiled")
    CompiledFrames.check(what)
    if comm.rank == 0:
        print(f"OK {what}: {graphs} graph(s) compiled, max diff vs eager one process {worst:.2e}", flush=True)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


#: Where shardwise's collectives live: dynamo must never compile a frame there (it would trace
#: mpi4py, ctypes and numpy calls, break the graph at each, and on a sub-group with shapes made
#: dynamic, fail outright). Compiled user code calls them through a graph break instead.
_NEVER_COMPILED = tuple(f"/shardwise/{d}/" for d in ("backends", "core", "adapters/torch/ops"))


class CompiledFrames:
    """The source files of the frames dynamo converted since :meth:`start` (a bytecode hook)."""

    files: list[str] = []
    _hook: Any = None

    @classmethod
    def start(cls) -> None:
        import torch._dynamo.convert_frame as convert_frame

        cls.files = []
        if cls._hook is None:
            cls._hook = convert_frame.register_bytecode_hook(lambda code, new_code: cls.files.append(code.co_filename))

    @classmethod
    def check(cls, what: str) -> None:
        inside = sorted({f for f in cls.files if any(d in f for d in _NEVER_COMPILED)})
        if inside:
            raise AssertionError(f"{what}: dynamo compiled frames of shardwise's collectives: {inside}")


def _setup(backend: str) -> Any:
    torch.set_num_threads(1)
    comm = shardwise.init(backend=backend).world
    torch._dynamo.reset()  # every case compiles its own graphs (the compiled code is cached on disk)
    CompiledFrames.start()
    return comm


def data_parallel(backend: str, wrapper: str, how: str) -> None:
    """``wrapper``: ``optimizer`` (DistributedOptimizer) or ``ddp`` (DistributedDataParallel, compiled around)."""
    comm = _setup(backend)
    model = _model()
    before = _graphs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapper == "ddp":
            run = _compile(DistributedDataParallel(model), how) if how == "whole" else \
                DistributedDataParallel(_compile(model, how))
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        else:
            run = _compile(model, how)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                       named_parameters=model.named_parameters())
        losses = _train(comm, run, opt, whole_step=how == "step")
    params = dict(model.named_parameters())
    _check(comm, f"{wrapper} {how} ({backend})", losses, params, caught, False, _graphs() - before)


def zero(backend: str, stage: int, how: str, fuse: bool, wrap_compiled: bool = False) -> None:
    """ZeRO ``stage`` around a model compiled ``how``; ``fuse`` is ``fuse_weight_grads`` (the default: True).

    ``wrap_compiled``: the optimizer is given ``torch.compile(model)`` itself. ``how="late"``:
    the blocks are compiled after the first (eager, fused) step.
    """
    comm = _setup(backend)
    model = _model()
    before = _graphs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        def shard(target: nn.Module) -> ZeroOptimizer:
            return ZeroOptimizer(target, torch.optim.SGD, stage=stage, comm=comm, fuse_weight_grads=fuse, lr=LR,
                                 momentum=MOMENTUM)

        if wrap_compiled:
            run = _compile(model, how)
            opt = shard(run)
        elif how in ("blocks", "titan"):  # torchtitan's order: compile the blocks, then shard
            run = _compile(model, how)
            opt = shard(model)
        else:
            opt = shard(model)
            run = _compile(model, how)

        def before_step(step: int) -> None:
            if how == "late" and step == 1:
                _compile(model, "blocks")

        losses = _train(comm, run, opt, before_step, whole_step=how == "step")
    params = opt.full_parameters()
    turned_off = fuse and stage > 1 and how != "eager"  # the fusion was on and met a compiled model
    _check(comm, f"zero{stage} {how}{' given the compiled model' * wrap_compiled} fuse_weight_grads={fuse} "
           f"({backend})", losses, params, caught, turned_off, _graphs() - before)


def parallel_gpt2(backend: str, layout: dict, seq_lens: tuple = ()) -> None:
    """``parallelize`` with ``layout`` on a small GPT-2 whose blocks were compiled before.

    ``seq_lens``: the steps' sequence lengths (cut from the usual batches), so that dynamo
    recompiles with dynamic shapes.
    """
    from hf_parallel import OPT_ARGS, OPTIMIZER, _batches, _check_params, _reference as hf_reference, build

    comm = _setup(backend)
    batches = _batches()
    if seq_lens:
        batches = [ids[:, :n] for ids, n in zip(batches, seq_lens)]
    model = build("gpt2")
    want = hf_reference(copy.deepcopy(model), batches)
    before = _graphs()
    zero_stage = layout.get("zero_stage", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in model.transformer.h:
            block.compile()
        pm = parallelize(model, OPTIMIZER, ParallelLayout(**layout), **OPT_ARGS)
        losses = [pm.train_step(pm.shard_batch(ids)) for ids in batches]
    what = f"parallelize {pm.layout.describe()} gpt2 blocks{f' seq {seq_lens}' * bool(seq_lens)} ({backend})"
    worst = _close(f"{what}: losses", torch.tensor(losses), torch.tensor(want))
    offs = [w for w in caught if FUSION_OFF in str(w.message)]
    if len(offs) != int(zero_stage > 1):
        raise AssertionError(f"{what}: expected {int(zero_stage > 1)} fusion warning(s), got {len(offs)}")
    graphs = _graphs() - before
    if graphs == 0:
        raise AssertionError(f"{what}: nothing was compiled")
    CompiledFrames.check(what)
    if zero_stage != 3:  # this rank holds whole parameters (or whole shards and stages): compare them too
        trained = build("gpt2")
        hf_reference(trained, batches)
        worst = max(worst, _check_params(pm, trained))
    pm.groups.free()
    if comm.rank == 0:
        print(f"OK {what}: {graphs} graph(s) compiled, max diff vs eager one process {worst:.2e}", flush=True)


def _ops_step(x: torch.Tensor) -> torch.Tensor:
    """Horovod-style collectives between tensor ops, as a user's compiled function calls them."""
    import shardwise.torch as hvd

    total = hvd.allreduce(x * 2, op=hvd.Sum)
    rows = hvd.allgather(total[None] + 1)
    parts = hvd.reducescatter(rows.repeat(2, 1), op=hvd.Sum)
    return (rows.sum() + parts.square().sum() + hvd.broadcast(x, 0).sum()) / x.numel()


def _ops_value_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ops_step` and its gradient, the backward run inside the same (compiled) function."""
    x = x.detach().requires_grad_()
    value = _ops_step(x)
    value.backward()
    return value.detach(), x.grad


def collectives_in_compiled_code(backend: str) -> None:
    """``shardwise.torch`` collectives, and a :class:`SyncBatchNorm` model, in compiled functions that
    also run the backward give the eager values and gradients: dynamo breaks its graph at the forward
    collectives, and their backward runs with dynamo off, as ZeRO-3's hooks do."""
    import shardwise.torch as hvd

    comm = _setup(backend)
    what = f"collectives in compiled code ({backend})"
    before = _graphs()
    x = torch.arange(6.0) + comm.rank
    (got, got_grad), (want, want_grad) = torch.compile(_ops_value_and_grad)(x), _ops_value_and_grad(x)
    worst = max(_close(f"{what}: value", got, want), _close(f"{what}: input gradient", got_grad, want_grad))

    def bn_model() -> nn.Module:
        torch.manual_seed(3)
        plain = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 5))
        return hvd.SyncBatchNorm.convert_sync_batchnorm(plain)

    def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x), y).backward()

    compiled, eager = bn_model(), bn_model()
    compiled_step = torch.compile(forward_backward)
    for step in range(STEPS):
        x, y = _batch(step)
        compiled_step(compiled, _local(x, comm), _local(y, comm))
        forward_backward(eager, _local(x, comm), _local(y, comm))
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        worst = max(worst, _close(f"{what}: SyncBatchNorm model {name}.grad", p.grad, q.grad))
    for (name, b), c in zip(compiled.named_buffers(), eager.buffers()):
        worst = max(worst, _close(f"{what}: SyncBatchNorm model {name}", b.to(torch.float64), c.to(torch.float64)))
    graphs = _graphs() - before
    if graphs == 0:
        raise AssertionError(f"{what}: nothing was compiled")
    CompiledFrames.check(what)
    if comm.rank == 0:
        print(f"OK {what}: {graphs} graph(s) compiled, max diff vs eager {worst:.2e}", flush=True)
