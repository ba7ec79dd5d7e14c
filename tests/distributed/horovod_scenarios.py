"""Scenarios for the horovod backend, run on every rank (see test_horovod_mp.py).

``data_parallel``: torch data-parallel training on ``backend="horovod"`` equals
single-process training on the whole batch (fp32, rtol 1e-5), through
``shardwise.torch.DistributedOptimizer``, and so does Horovod's own
``horovod.torch.DistributedOptimizer`` in the same process.
``engine``: the backend's Horovod specifics (init flag, names, process sets, timeout).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shardwise

LOCAL_BATCH, STEPS = 4, 5
RTOL, ATOL = 1e-5, 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(LOCAL_BATCH * size, 8, generator=g)
    return x, torch.randint(0, 3, (LOCAL_BATCH * size,), generator=g)


def _reference(size: int, make_opt) -> nn.Module:
    """Single-process training on every rank's data at once."""
    ref = _model()
    opt = make_opt(ref.parameters())
    for step in range(STEPS):
        x, y = _global_batch(step, size)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    return ref


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, size: int) -> None:
    for step in range(STEPS):
        x, y = _global_batch(step, size)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()  # mean over the local batch
        opt.step()


def _same(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} {name}: {m}")


def _shardwise_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """shardwise.torch's DistributedOptimizer, or a plain gradient allreduce when it is missing."""
    try:
        import shardwise.torch as swt
    except ImportError:  # the adapter is optional here: allreduce the gradients ourselves
        return _AllreduceGrads(model, opt)
    return swt.DistributedOptimizer(opt, named_parameters=model.named_parameters())


class _AllreduceGrads:
    """Average gradients over the world communicator before each step."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        world = shardwise.current().world
        handles = [world.allreduce_async(p.grad, "average", inplace=True, name=f"grad.{n}")
                   for n, p in self.model.named_parameters() if p.grad is not None]
        for h in handles:
            h.wait()
        self.opt.step()


def data_parallel(backend: str = "horovod") -> None:
    ctx = shardwise.init(backend=backend)
    world = ctx.world
    assert ctx.backend == "horovod" and world.backend == "horovod", (ctx.backend, world.backend)
    rank, size = world.rank, world.size
    for opt_name, make_opt in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                               ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01))):
        ref = _reference(size, make_opt)
        model = _model()
        _train(model, _shardwise_optimizer(model, make_opt(model.parameters())), rank, size)
        _same(model, ref, f"shardwise DistributedOptimizer on horovod ({opt_name})")

        import horovod.torch as hvd

        native = _model()
        opt = hvd.DistributedOptimizer(make_opt(native.parameters()), named_parameters=native.named_parameters(),
                                       op=hvd.Average)
        _train(native, opt, rank, size)
        _same(native, ref, f"horovod.torch.DistributedOptimizer ({opt_name})")
    shardwise.shutdown()


def engine(backend: str = "horovod") -> None:
    """Horovod specifics: the dynamic process-set flag, sub-groups, caller names, timeouts."""
    import horovod.torch as hvd

    world = shardwise.init(backend=backend).world
    assert os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
    assert hvd.is_initialized() and hvd.size() == world.size and hvd.rank() == world.rank
    # The same caller name on successive steps (Horovod's response cache) and on two ops in flight.
    for step in range(3):
        a = world.allreduce_async(torch.full((5,), float(world.rank)), name="same")
        b = world.allgather_async(np.array([world.rank]), name="same")
        assert torch.equal(a.wait(), torch.full((5,), float(sum(range(world.size)))))
        assert b.wait().tolist() == list(range(world.size))
    # Splitting twice into the same members reuses Horovod's process set.
    subs = [world.split(color=world.rank % 2) for _ in range(2)]
    for sub in subs:
        got = sub.allreduce(np.array([world.rank], dtype=np.int64))
        assert int(got[0]) == sum(r for r in range(world.size) if r % 2 == world.rank % 2)
    if world.size > 2:
        assert subs[0].process_set.process_set_id == subs[1].process_set.process_set_id
        try:
            subs[0].split(color=0)
        except NotImplementedError as exc:
            assert "world communicator" in str(exc)
        else:
            raise AssertionError("a split of a sub-communicator should say it is not supported")
    # An op only some ranks join times out with a clear error instead of hanging.
    if world.rank == 0:
        h = world.allreduce_async(torch.ones(3), name="lonely")
        try:
            h.wait(timeout=0.5)
        except shardwise.CollectiveTimeoutError as exc:
            assert "allreduce" in str(exc)
        else:
            raise AssertionError("a collective joined by one rank should time out")
    world.barrier()
    if world.rank != 0:
        world.allreduce(torch.ones(3), name="lonely")  # completes rank 0's pending op
    world.barrier()
    shardwise.shutdown()
